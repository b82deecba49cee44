"""LAMB: the uncompressed baseline (the warm-up stage of 1-bit LAMB, exactly)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch import Tensor
from torch.optim import Optimizer

from onebit.optim import _common, checks
from onebit.optim._parameters import FlatParameters, views_of_flat_parameters
from onebit.optim._rules import LambRule, last_coefficients

__all__ = ["Lamb"]


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
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        checks.check_group(defaults)
        checks.check_max_grad_norm(max_grad_norm)
        self.max_grad_norm = max_grad_norm
        self.rule = LambRule()
        self._parameters = FlatParameters(self.rule.scalars, kernels, takes_fsdp_hsdp=True)
        super().__init__(params, defaults)

    kernels, flat_state, backend, updates, shards = views_of_flat_parameters()

    def __getstate__(self) -> dict[str, Any]:
        """torch's, with the arguments and the flat parameters; the flat state is laid out
        anew from the per-parameter state at the copy's first step."""
        if self.shards is not None:
            raise TypeError(
                "Lamb over FSDP-sharded parameters cannot be copied or pickled: save "
                "onebit.dcp.save(...) and load it into a new optimizer instead"
            )
        return {
            **super().__getstate__(),
            "max_grad_norm": self.max_grad_norm,
            "rule": self.rule,
            "_parameters": self._parameters,
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, before the first step, after checking the group (complex parameters, its
        options and hyper-parameters; nothing is added when it is wrong)."""
        self._parameters.check_can_add()
        param_group = _common.checked_real(param_group)
        _common.check_group_options(self, param_group)
        super().add_param_group(param_group)
        self._parameters.regroup(self.param_groups)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the optimizer holds now: ``"state"`` and ``"scratch"`` (0 before the first
        step)."""
        return self._parameters.memory_bytes()

    def check_checkpoint(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the first thing in ``state_dict`` that does not fit
        this optimizer (its parameter groups, the shapes of its state); nothing changes."""
        _common.validate_checkpoint(self, state_dict)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB step on the gradients as they are (no communication); parameters
        unfrozen since the state was laid out join it (ALGORITHM.md, "Parameters that join
        late")."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._parameters.joining(self.param_groups):
            self._parameters.lay_out_again(self.param_groups, self.state)
        flat = self._parameters.build(self.param_groups, self.state)
        grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
        present = [grad is not None for grad in grads]
        if self.max_grad_norm:
            present_grads = [g for g in grads if g is not None]
            _common.clip_by_total_norm_(present_grads, self.max_grad_norm, self.shards)
        if any(present):
            self._parameters.expose_new(self.state, present)
            self.rule.dense(self.updates, flat, grads, present)
            flat.refresh_half_params()
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter got at its last step, in parameter order, for the
        parameters that have state (one host read)."""
        return last_coefficients(self._parameters.flat, self._parameters.has_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, after :meth:`check_checkpoint` of the dict its load pre-hooks leave."""
        _common.load_checked(self, state_dict, self.check_checkpoint)
        self._parameters.forget()
