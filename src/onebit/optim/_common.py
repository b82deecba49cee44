"""What every onebit optimizer shares: argument checks, state creation, checkpoint loading."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from onebit.optim._sharding import ShardGroup, local_tensor


def check_max_grad_norm(max_grad_norm: float) -> None:
    if not (max_grad_norm >= 0.0 and math.isfinite(max_grad_norm)):
        raise ValueError(
            f"Invalid max_grad_norm={max_grad_norm}: it must be a finite number >= 0 "
            "(0: no clipping)"
        )


def clip_by_total_norm_(
    grads: list[Tensor], max_norm: float, shards: ShardGroup | None = None
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s rule on these tensors, in place: all scaled by
    ``min(1, max_norm / (||g|| + 1e-6))``, ``||g||`` the 2-norm of all of them together
    (summed as torch sums it: each tensor's norm, then the norm of the norms, so the result
    is torch's to the bit). With ``shards`` the tensors are local slices and ``||g||`` is
    that of the whole tensors (the slices' squared norms summed over the shard group).
    Returns ``||g||``; no host synchronisation without ``shards``."""
    if not grads and shards is None:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(g) for g in grads] or [torch.zeros(())]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if shards is not None:
        total = shards.sum_(total.square().reshape(1)).sqrt().reshape(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device))
    return total


def check_lr(lr: float) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate lr={lr}: it must be >= 0")


def check_betas(betas: tuple[float, float]) -> None:
    if len(betas) != 2:
        raise ValueError(f"Invalid betas={betas}: expected a pair (beta1, beta2)")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid betas[{index}]={beta}: it must be in [0, 1)")


def check_non_negative(name: str, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"Invalid {name}={value}: it must be >= 0")


def check_positive(name: str, value: float) -> None:
    if not value > 0.0:
        raise ValueError(f"Invalid {name}={value}: it must be > 0")


def check_bucket_cap_mb(name: str, value: float | None) -> None:
    """MiB per bucket of the bucketed exchange: a finite number > 0, or ``None`` (the whole
    buffer in one exchange)."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"Invalid {name}={value}: it must be a finite number of MiB > 0 (or None: the "
            "whole buffer in one exchange)"
        )


def check_positive_int(name: str, value: int, meaning: str) -> None:
    """``value`` an int >= 1 (not a bool); the error says what the argument ``means``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}={value!r}: it must be an int >= 1 ({meaning})")


def check_adam_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """The checks every onebit optimizer makes of its Adam-style arguments."""
    check_lr(lr)
    check_betas(betas)
    check_positive("eps", eps)
    check_non_negative("weight_decay", weight_decay)


def check_unit_interval(name: str, value: float) -> None:
    """``value`` in ``[0, 1)`` (an EMA factor)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid {name}={value}: it must be in [0, 1)")


def check_factor_bounds(factor_min: float, factor_max: float) -> None:
    """1-bit LAMB's factor bounds: ``0 < factor_min <= factor_max``."""
    check_positive("factor_min", factor_min)
    if not factor_min <= factor_max:
        raise ValueError(
            f"Invalid factor bounds: factor_min={factor_min} > factor_max={factor_max}"
        )


def check_coeff_bounds(min_coeff: float, max_coeff: float) -> None:
    check_positive("min_coeff", min_coeff)
    if not min_coeff <= max_coeff:
        raise ValueError(
            f"Invalid coefficient bounds: min_coeff={min_coeff} > max_coeff={max_coeff}"
        )


def state_dtype(param: Tensor) -> torch.dtype:
    """Optimizer state is float32, or float64 for float64 parameters."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def dense_grad(param: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``param.grad`` in state precision; sparse gradients are rejected with a clear error."""
    grad = param.grad
    if grad is None:
        return None
    grad = local_tensor(grad)
    if grad.is_sparse:
        raise RuntimeError(
            f"parameter of shape {tuple(param.shape)} has a sparse gradient; onebit optimizers "
            "need dense gradients (e.g. nn.Embedding(sparse=False))"
        )
    return grad.to(dtype)


def trainable_params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


#: Per-parameter state of the parameter's shape (checked against it when a checkpoint loads).
PER_ELEMENT_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "master_param", "synced_param", "local_param"}
)


def validate_checkpoint(optimizer: Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first thing in ``state_dict`` that does not fit.

    Checked before anything is loaded, so a bad checkpoint leaves the optimizer untouched.
    """
    if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
        raise ValueError("not an optimizer state_dict: it has no 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved_groups)} parameter groups, this optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    saved_state = state_dict.get("state", {})
    for group_index, (group, saved) in enumerate(
        zip(optimizer.param_groups, saved_groups, strict=True)
    ):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                f"parameter group {group_index}: checkpoint has {len(saved['params'])} "
                f"parameters, this optimizer has {len(group['params'])}"
            )
        for param, key in zip(group["params"], saved["params"], strict=True):
            for name, value in saved_state.get(key, {}).items():
                shape = tuple(local_tensor(param).shape)
                if name in PER_ELEMENT_STATE and tuple(value.shape) != shape:
                    raise ValueError(
                        f"parameter {key} (group {group_index}): checkpoint's {name} has shape "
                        f"{tuple(value.shape)}, the parameter (on this rank) has shape {shape}"
                    )


def restore_state_precision(optimizer: Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Undo ``Optimizer.load_state_dict``'s cast of state tensors to the parameter's dtype.

    torch casts floating state to the dtype of the parameter; for half-precision parameters
    that would round the fp32 moments and master copy, so the saved tensors are put back in
    their own precision (on the parameter's device).
    """
    saved_state = state_dict.get("state", {})
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
        for param, key in zip(group["params"], saved["params"], strict=True):
            for name, value in saved_state.get(key, {}).items():
                if isinstance(value, Tensor) and value.is_floating_point():
                    optimizer.state[param][name] = value.to(param.device, copy=True)


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element is finite, from each tensor's sum: one vectorised read pass
    without allocation, one host sync in all. NaN and Inf propagate into a sum; a sum can
    also overflow (beyond 3.4e38 in float32), and such gradients count as non-finite too."""
    sums = [t.sum().double() for t in tensors if t.numel()]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


def params_in_order(param_groups: Iterable[Mapping[str, Any]]) -> list[Tensor]:
    return [p for group in param_groups for p in group["params"]]
