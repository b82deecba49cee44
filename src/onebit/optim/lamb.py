"""LAMB: the uncompressed baseline (the warm-up stage of 1-bit LAMB, exactly)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from onebit.optim import _common
from onebit.optim._base import FlatOptimizer
from onebit.optim._flat import FlatState

__all__ = ["Lamb", "last_coefficients", "record_coefficients"]


def record_coefficients(flat: FlatState, coeff: Tensor, present: Sequence[bool]) -> None:
    """Store the step's per-parameter coefficient (``lamb_coeff``) for the parameters that
    took part."""
    last = flat.scalars["lamb_coeff"]
    taking_part = torch.tensor(list(present), device=coeff.device)
    last.copy_(torch.where(taking_part, coeff, last))


def last_coefficients(flat: FlatState | None, has_state: Sequence[bool]) -> list[float]:
    """The last step's per-parameter coefficients of the parameters that have state."""
    if flat is None:
        return []
    values = flat.scalars["lamb_coeff"].tolist()
    return [value for value, has in zip(values, has_state, strict=True) if has]


class Lamb(FlatOptimizer):
    r"""LAMB (You et al., 2019) in the form 1-bit LAMB uses for its warm-up stage.

    For each parameter tensor ``p`` with gradient ``g``:

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        u &= m / (\sqrt{v} + \epsilon) + \lambda p, \qquad
        c = \mathrm{clamp}(\|p\| / \|u\|, c_{min}, c_{max}) \\
        p &\leftarrow p - \gamma\, c\, u

    (``c = 1`` where ``||p||`` or ``||u||`` is 0; no bias correction.) It does no
    communication: use it in one process, or under ``DistributedDataParallel`` or FSDP2
    (``fully_shard``, on a 1-D mesh or FSDP's own HSDP on a 2-D one), which hand it averaged
    gradients; sharded, its norms are those of the whole tensors. Half-precision parameters
    get fp32 state and an fp32 master copy. State is flat (see :mod:`onebit.optim._flat`):
    the step is a few whole-buffer passes with no host synchronisation per tensor.

    Args:
        params: parameters or parameter groups; groups may override every hyper-parameter.
        lr: learning rate ``gamma``.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v)``.
        weight_decay: decoupled weight decay ``lambda``, added to the update.
        max_coeff, min_coeff: bounds of the trust ratio.
        kernels: the backend of the update, as in :class:`onebit.OneBitLamb`.
        max_grad_norm: if positive, the gradients are clipped at it first (as
            ``torch.nn.utils.clip_grad_norm_`` clips them); 0 (default): no clipping.
    """

    _TAKES_FSDP_HSDP = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        kernels: str | None = None,
        max_grad_norm: float = 0.0,
    ) -> None:
        _common.check_adam_hyperparameters(lr, betas, eps, weight_decay)
        _common.check_coeff_bounds(min_coeff, max_coeff)
        _common.check_max_grad_norm(max_grad_norm)
        self.max_grad_norm = max_grad_norm
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults, kernels)

    _SCALARS = {"lamb_coeff": 1.0}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = self._evaluate(closure)
        flat = self._flat_state()
        grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
        present = [grad is not None for grad in grads]
        if self.max_grad_norm:
            present_grads = [g for g in grads if g is not None]
            _common.clip_by_total_norm_(present_grads, self.max_grad_norm, self.shards)
        if any(present):
            self._expose_new_state(flat, present)
            coeff, _ = self.updates.lamb_step_(flat, grads, present, False)
            record_coefficients(flat, coeff, present)
            flat.refresh_half_params()
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter got at its last step, in parameter order, for the
        parameters that have state (one host read)."""
        return last_coefficients(self._flat, self._has_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_checkpoint(state_dict)
        super().load_state_dict(state_dict)
        _common.restore_state_precision(self, state_dict)
        self._forget_flat_state()
