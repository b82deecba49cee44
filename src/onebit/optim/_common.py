"""What the optimizers share beyond their parts: gradients in state precision, clipping, the
finiteness check, the parameter groups' options checked, and checkpoints checked and loaded
per parameter."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from onebit.optim import checks
from onebit.optim._sharding import ShardGroup, local_tensor


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


def checked_real(param_group: Mapping[str, Any]) -> dict[str, Any]:
    """``param_group`` (its parameters as a list, where torch takes them as one), after
    refusing complex parameters, naming the first: their state and update are real."""
    params = param_group["params"]
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        return dict(param_group)  # torch refuses an unordered set itself
    params = list(params)
    for index, param in enumerate(params):
        if isinstance(param, Tensor) and param.is_complex():
            raise ValueError(
                f"parameter {index} of the group is complex ({param.dtype}): onebit's "
                "optimizers update real tensors; keep its real and imaginary parts as a real "
                "parameter (torch.view_as_real) instead"
            )
    return {**param_group, "params": params}


def check_group_options(
    optimizer: Optimizer, param_group: Mapping[str, Any], group_only: Collection[str] = ()
) -> None:
    """Refuse, by name, a key of ``param_group`` that ``optimizer`` would ignore though onebit
    knows it (an argument of the optimizer as a whole, or a group option of another onebit
    optimizer), then check the hyper-parameters of the group merged with the optimizer's
    defaults (:func:`onebit.optim.checks.check_group`). Other keys pass, as torch's
    optimizers let them. ``group_only``: options the groups take beyond the defaults."""
    name = type(optimizer).__name__
    takes = {*optimizer.defaults, *group_only, "params"}
    arguments = set(inspect.signature(type(optimizer).__init__).parameters) - {"self"}
    for key in param_group:
        if key in takes:
            continue
        if key in arguments:
            raise ValueError(
                f"{key} is an argument of {name} as a whole, not of a parameter group: pass it "
                f"to {name}(...)"
            )
        if key in checks.GROUP_OPTIONS:
            raise ValueError(
                f"{name}'s parameter groups do not take {key} (they take "
                f"{', '.join(sorted(takes - {'params'}))})"
            )
    checks.check_group({**optimizer.defaults, **param_group})


def load_checked(
    optimizer: Optimizer, state_dict: dict[str, Any], check: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """torch's ``load_state_dict`` with ``check`` run on the dict its load pre-hooks leave,
    before anything is loaded (a ``ValueError`` there changes nothing), and the loaded state
    put back in its own precision before its post-hooks run (torch casts floating state to
    the parameter's dtype, which would round a half-precision parameter's fp32 moments and
    master copy). Returns the dict that was loaded."""
    final: dict[str, dict[str, Any]] = {}

    def checked(_: Optimizer, hooked: dict[str, Any]) -> None:
        check(hooked)
        final["dict"] = hooked

    def own_precision(_: Optimizer) -> None:
        restore_state_precision(optimizer, final["dict"])

    handles = [
        optimizer.register_load_state_dict_pre_hook(checked),  # the last pre-hook
        optimizer.register_load_state_dict_post_hook(own_precision, prepend=True),
    ]
    try:
        Optimizer.load_state_dict(optimizer, state_dict)
    finally:
        for handle in handles:
            handle.remove()
    return final["dict"]


def restore_state_precision(optimizer: Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Each floating state tensor of ``state_dict`` into ``optimizer.state`` in its own
    precision, on its parameter's device."""
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
