"""LAMB: the uncompressed baseline (the warm-up stage of 1-bit LAMB, exactly)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from onebit.optim import _common
from onebit.optim.functional import lamb_step_

__all__ = ["Lamb", "lamb_group_step_"]


def lamb_group_step_(
    group: dict[str, Any],
    param: Tensor,
    state: dict[str, Any],
    grad: Tensor,
    scratch: _common.ScratchPool,
) -> float | None:
    """:func:`~onebit.optim.functional.lamb_step_` with ``group``'s hyper-parameters, on the
    parameter's master copy; returns the trust ratio (``None`` where it is undefined)."""
    target = _common.master(param, state)
    beta1, beta2 = group["betas"]
    return lamb_step_(
        target,
        grad,
        state["exp_avg"],
        state["exp_avg_sq"],
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        min_coeff=group["min_coeff"],
        max_coeff=group["max_coeff"],
        work=scratch.get(0, target),
    )


class Lamb(Optimizer):
    r"""LAMB (You et al., 2019) in the form 1-bit LAMB uses for its warm-up stage.

    For each parameter tensor ``p`` with gradient ``g``:

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        u &= m / (\sqrt{v} + \epsilon) + \lambda p, \qquad
        c = \mathrm{clamp}(\|p\| / \|u\|, c_{min}, c_{max}) \\
        p &\leftarrow p - \gamma\, c\, u

    (``c = 1`` where ``||p||`` or ``||u||`` is 0; no bias correction.) It does no
    communication: use it in one process, or under ``DistributedDataParallel``, which hands
    it averaged gradients. Half-precision parameters get fp32 state and an fp32 master copy.

    Args:
        params: parameters or parameter groups; groups may override every hyper-parameter.
        lr: learning rate ``gamma``.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v)``.
        weight_decay: decoupled weight decay ``lambda``, added to the update.
        max_coeff, min_coeff: bounds of the trust ratio.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        _common.check_adam_hyperparameters(lr, betas, eps, weight_decay)
        _common.check_coeff_bounds(min_coeff, max_coeff)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._scratch = _common.ScratchPool()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                grad = _common.dense_grad(param, _common.state_dtype(param))
                if grad is None:
                    continue
                _common.init_param_state(param, state)
                coeff = lamb_group_step_(group, param, state, grad, self._scratch)
                state["lamb_coeff"] = 1.0 if coeff is None else coeff
                _common.sync_param_from_master(param, state)
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter got at its last step (a copy), in parameter order."""
        return [
            self.state[p]["lamb_coeff"]
            for p in _common.params_in_order(self.param_groups)
            if "lamb_coeff" in self.state[p]
        ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _common.validate_checkpoint(self, state_dict)
        super().load_state_dict(state_dict)
        _common.restore_state_precision(self, state_dict)
