"""0/1 Adam (Lu et al., 2022, arXiv 2202.06009): adaptive variance freezing and local steps."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.exchange import Exchange, NonFiniteError, PerTensorExchange
from onebit.optim import _common
from onebit.optim._flat import FlatState
from onebit.optim._onebit import OneBitOptimizer
from onebit.optim._readiness import AUTO
from onebit.optim._zero_one_schedule import (
    DEEPSPEED_SCHEDULE,
    GRADIENT_1BIT,
    LOCAL,
    PRE_FREEZE_EXCHANGES,
    STEP_KINDS,
    SYNC,
    VARIANCE_UPDATE,
    is_variance_update_step,
    local_step_interval,
    step_kind,
    variance_updates_until,
)
from onebit.optim.functional import _active_indices, _pick

logger = logging.getLogger("onebit")

__all__ = [
    "ZeroOneAdam",
    "DEEPSPEED_SCHEDULE",
    "GRADIENT_1BIT",
    "LOCAL",
    "SYNC",
    "VARIANCE_UPDATE",
    "PRE_FREEZE_EXCHANGES",
    "STEP_KINDS",
    "is_variance_update_step",
    "local_step_interval",
    "variance_updates_until",
    "step_kind",
]


# --------------------------------------------------------------------------- the optimizer
class ZeroOneAdam(OneBitOptimizer):
    r"""0/1 Adam: Adam whose variance is updated on exponentially spaced steps, gradients sent at
    1 bit in between, and after the variance freezes, local steps with the accumulated update
    synchronised at 1 bit at growing intervals (ALGORITHM.md, "0/1 Adam").

    Every step applies ``p <- p - lr (m / (sqrt(v) + eps) + wd p)`` (no bias correction).
    Up to ``var_freeze_step`` (T):

    * on the steps of the variance schedule (``var_update_scaler`` = kappa updates at each
      interval 1, 2, 4, ...) the gradients are averaged at full precision (by this optimizer,
      or by ``DistributedDataParallel`` with :func:`onebit.ddp.register_comm_hook`) and
      ``m, v`` updated as in Adam;
    * on the other steps the local gradients are averaged by the per-tensor 1-bit exchange
      (:class:`onebit.exchange.PerTensorExchange`) and only ``m`` is updated
      (``pre_freeze_exchange="gradient"``, DeepSpeed's scheme), or each rank takes its own
      momentum step and the step is synchronised as after the freeze, below, at an interval
      of one step (``"momentum"``, the paper's Algorithm 1).

    After T the variance stays frozen; each rank updates ``m`` from its own gradients and
    steps on its own, and at synchronisation steps (``t mod H_t = 0``, ``H_t`` doubling every
    ``local_step_scaler`` steps up to ``local_step_clipper``) the update accumulated since
    the last synchronisation, ``(p - p_synced) (sqrt(v) + eps)``, is exchanged at 1 bit; the
    momentum is rebuilt as ``-exchanged / sum(lr)`` and the weights set to
    ``p_synced + exchanged / (sqrt(v) + eps)`` on every rank alike.

    ``bytes_sent`` counts each kind of step apart: ``"variance_update"`` (dense),
    ``"gradient_1bit"``, ``"local"`` (nothing) and ``"sync"``; :attr:`stage` is the kind of
    the next step. Replicas are bit-identical up to T and right after every synchronisation;
    ``verify_every`` checks them at the first such point at or after each due step. A
    checkpoint taken inside a local interval also holds this rank's own weights, which
    ``load_state_dict`` puts back into the parameters.

    Args:
        params: parameters or parameter groups (groups may set ``lr``, ``betas``, ``eps``,
            ``weight_decay`` and ``exp_avg_mask``, which multiplies the exchanged gradients
            and accumulated updates).
        lr, betas, eps, weight_decay: as in :class:`onebit.OneBitAdam`; weight decay is part
            of the update, and so of the accumulated update (as in DeepSpeed).
        var_freeze_step: the last step that may update the variance (T). ``"auto"``
            (default): once the variance has caught up, as ``freeze_step="auto"`` of
            :class:`onebit.OneBitLamb` (checked every 10 variance updates), at
            ``max_var_freeze_step`` (default 100000, DeepSpeed's T) at the latest; with
            ``var_warmup_steps="auto"`` too, the variance freezes at the end of the first
            interval. A number (DeepSpeed suggests the end of the learning-rate warm-up): a
            warning says when the variance has not settled at T or at the first 1-bit step.
        var_update_scaler: variance updates at each interval before it doubles (kappa).
        local_step_scaler: steps after the freeze at each local interval before it doubles.
        local_step_clipper: the longest local interval (H).
        var_warmup_steps: the variance updates of the schedule's first interval (steps 1, 2,
            ..., each dense): ``"auto"`` (default) until the variance has caught up
            (ALGORITHM.md, "Variance readiness"), checked every 10 steps; a number of steps; or
            ``None`` for ``var_update_scaler``, DeepSpeed's schedule.
        pre_freeze_exchange: what the 1-bit steps before the freeze exchange: ``"momentum"``
            (default, the paper's; counted as ``"sync"`` steps) or ``"gradient"``
            (DeepSpeed's). In short runs whose variance schedule reaches past the
            learning-rate warm-up, ``"momentum"`` keeps up with 1-bit Adam where
            ``"gradient"`` falls behind (docs/ZERO-ONE-ADAM.md).
        process_group, on_nonfinite, verify_every, kernels, max_grad_norm: as in
            :class:`onebit.OneBitLamb` (the variance updates clip the averaged gradients, the
            other steps each rank's own, at ``max_grad_norm·√W``).
            A non-finite local gradient in a local or synchronisation step is ignored on that
            rank alone (with a warning, or an error with ``on_nonfinite="raise"``).

    Argument names follow DeepSpeed's ``ZeroOneAdam``, and so do the defaults except three
    (``var_freeze_step``, ``pre_freeze_exchange`` and ``var_warmup_steps`` are onebit's): with
    DeepSpeed's schedule the first 1-bit steps come after 16 dense steps, before the variance
    has caught up, and training stalled on the convergence study's model and on a task with a
    plateau; with its T = 100000 never reached, a short run sent more bytes than 1-bit Adam
    (docs/ZERO-ONE-ADAM.md). ``**DEEPSPEED_SCHEDULE`` restores DeepSpeed's.
    """

    _SCALARS = {"lr_sum": 0.0}  # Gamma: the sum of lr since the last synchronisation
    DENSE_KINDS = frozenset({VARIANCE_UPDATE})
    _FREEZE_ARGUMENT = "var_freeze_step"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int | str = AUTO,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        pre_freeze_exchange: str = "momentum",
        process_group: dist.ProcessGroup | None = None,
        on_nonfinite: str = "skip",
        verify_every: int = 0,
        kernels: str | None = None,
        max_grad_norm: float = 0.0,
        max_var_freeze_step: int | None = None,
        var_warmup_steps: int | str | None = AUTO,
    ) -> None:
        _common.check_adam_hyperparameters(lr, betas, eps, weight_decay)
        if var_warmup_steps not in (None, AUTO):
            _common.check_positive_int(
                "var_warmup_steps",
                var_warmup_steps,
                "the first steps, each a variance update; or 'auto', or None for var_update_scaler",
            )
        for name, value, meaning in (
            ("var_update_scaler", var_update_scaler, "variance updates at each interval"),
            ("local_step_scaler", local_step_scaler, "steps at each local interval"),
            ("local_step_clipper", local_step_clipper, "the longest local interval"),
        ):
            _common.check_positive_int(name, value, meaning)
        if pre_freeze_exchange not in PRE_FREEZE_EXCHANGES:
            raise ValueError(
                f"pre_freeze_exchange must be one of {list(PRE_FREEZE_EXCHANGES)}, "
                f"got {pre_freeze_exchange!r}"
            )
        self.pre_freeze_exchange = pre_freeze_exchange
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(
            params,
            defaults,
            freeze_step=var_freeze_step,
            max_freeze_step=max_var_freeze_step,
            process_group=process_group,
            on_nonfinite=on_nonfinite,
            verify_every=verify_every,
            kernels=kernels,
            max_grad_norm=max_grad_norm,
        )
        if self.shards is not None:
            raise ValueError(
                "ZeroOneAdam does not take FSDP-sharded parameters: its local steps, where "
                "the replicas move apart between synchronisations, are implemented for "
                "replicated parameters only; use OneBitAdam or OneBitLamb with fully_shard"
            )
        self._counters["bytes_sent"] = dict.fromkeys(STEP_KINDS, 0)
        self.warmup_auto = var_warmup_steps == AUTO
        #: The variance updates at interval 1 (steps 1..first_interval): ``var_warmup_steps``,
        #: kappa where it is None; with ``"auto"`` the freeze's bound until the variance has
        #: caught up, then the step it did.
        self.first_interval = self.freeze_step if self.warmup_auto else var_warmup_steps
        self._first_local_exchange = self._first_local_exchange_step()

    def _first_local_exchange_step(self) -> int:
        """The step of the gradient check, once: the first step that exchanges local values,
        the first step up to the freeze that is not a variance update (steps 1..k are, at
        interval 1, k the first interval's updates, so it is k + 1 or, where that starts the
        interval of 2, k + 2), else the first step after the freeze (a synchronisation)."""
        kappa, freeze = self._first_interval_updates(), self.freeze_step
        return next(
            (
                t
                for t in (kappa + 1, kappa + 2)
                if t <= freeze and self.kind_of_step(t) != VARIANCE_UPDATE
            ),
            freeze + 1,
        )

    # ----------------------------------------------------------------- the schedule
    @property
    def var_freeze_step(self) -> int:
        return self.freeze_step

    def kind_of_step(self, step: int) -> str:
        """The kind of step ``step`` (from 1): one of :data:`STEP_KINDS`."""
        return step_kind(
            step,
            self.freeze_step,
            self.var_update_scaler,
            self.local_step_scaler,
            self.local_step_clipper,
            self.pre_freeze_exchange,
            self.first_interval,
        )

    def _first_interval_updates(self) -> int:
        return self.var_update_scaler if self.first_interval is None else self.first_interval

    def variance_updates(self, step: int) -> int:
        return variance_updates_until(
            min(step, self.freeze_step), self.var_update_scaler, self.first_interval
        )

    def _readiness_checks(self) -> dict[int, tuple[str, str]]:
        """As :meth:`OneBitOptimizer._readiness_checks`, and before the first 1-bit step."""
        checks = super()._readiness_checks()
        last_dense = self._first_local_exchange - 1
        if not self.warmup_auto and last_dense < self.freeze_step:
            checks.setdefault(
                self.variance_updates(last_dense),
                (
                    f"starts its 1-bit steps after step {last_dense}, updating the variance on "
                    "every 2nd step from there on and then ever more rarely,",
                    "Pass var_warmup_steps='auto', which keeps every step dense until the "
                    "variance has caught up, or a larger var_warmup_steps",
                ),
            )
        return checks

    def _readiness_schedule(self) -> tuple[int, ...]:
        return (self.freeze_step, self._first_local_exchange)

    def _readiness_decision_pending(self, step: int) -> bool:
        """With ``var_freeze_step="auto"`` or ``var_warmup_steps="auto"``: whether to freeze
        or to end the first interval after ``step``."""
        warmup = self.warmup_auto and step < self.first_interval
        return step < self.freeze_step and (self.auto_freeze or warmup)

    def _variance_caught_up(self, step: int, ratios: Tensor, flat: FlatState) -> None:
        """``var_freeze_step="auto"``: the variance freezes after ``step``; else
        ``var_warmup_steps="auto"``: the first interval ends there."""
        if self.auto_freeze:
            super()._variance_caught_up(step, ratios, flat)
        else:
            self.first_interval = step
            self._log_caught_up(step, "the 1-bit steps start", ratios, flat)
        self._first_local_exchange = self._first_local_exchange_step()

    def _build_exchange(self) -> Exchange:
        """Every tensor compressed alone (DeepSpeed's 0/1 Adam), over the process group."""
        return PerTensorExchange(self.process_group)

    def use_exchange(self, exchange: Exchange) -> None:
        raise ValueError(
            f"{type(self).__name__} exchanges every tensor alone over its process group; "
            f"it cannot use a {type(exchange).__name__}"
        )

    def _replicas_agree(self) -> bool:
        """Up to the freeze and right after a synchronisation; not inside a local interval."""
        last = self.step_count
        return last <= self.freeze_step or self.kind_of_step(last) == SYNC

    # ----------------------------------------------------------------- the steps
    def _warmup_update(
        self, flat: FlatState, grads: Sequence[Tensor | None], active: Sequence[bool]
    ) -> bool:
        return self.updates.adam_step_(flat, grads, active, True)

    def _exchanged_step(self, kind: str, flat: FlatState, grads: Sequence[Tensor | None]) -> bool:
        """A step that does not average gradients densely: 1-bit gradient, local or sync (of
        the interval that starts at the last synchronisation, or at the weights of step
        ``t - 1`` for every step ``t <= T + 1``)."""
        buffer = self._prepare_exchange(flat)
        if kind == GRADIENT_1BIT:
            flat.load_grads(grads)  # this rank's gradients, zeros where it has none
            try:
                self._exchange_per_tensor(flat, flat.grad)
            except NonFiniteError:
                return self._skip("a rank's local gradients")
            self.updates.adam_momentum_step_(flat, flat.views(flat.grad), self._has_state)
            return True
        if self.step_count <= self.freeze_step:
            self._start_interval(flat)
        local = [
            torch.zeros(t.shape, dtype=flat.dtype, device=flat.device) if g is None else g
            for t, g in zip(flat.tensors, grads, strict=True)
        ]
        if _common.all_finite(_pick(local, _active_indices(self._has_state))):
            self.updates.adam_momentum_step_(flat, local, self._has_state)
        else:
            self._ignore_local_gradients()
        lr_sum = flat.scalars["lr_sum"]
        indices = _active_indices(self._has_state)
        lr_sum[indices] += flat.segment_values(lambda group: group["lr"])[indices]
        if kind == SYNC:
            self.updates.accumulated_update(flat, self._has_state, buffer)
            self._exchange_per_tensor(flat, buffer)
            self.updates.synchronised_update_(flat, buffer, self._has_state, lr_sum)
        return True

    def _prepare_exchange(self, flat: FlatState) -> Tensor:
        """The buffer of the accumulated update (``N`` elements) and the masks (anew at every
        step up to the freeze: the variance may have changed); the exchange bound."""
        if self._exchange_buffer is None:
            self._exchange_buffer = torch.empty(flat.numel, dtype=flat.dtype, device=flat.device)
            self._mask = self._flat_mask(flat)
        elif self.step_count < self.freeze_step:
            self._mask = self._flat_mask(flat)
        self._bind_exchange(flat)
        return self._exchange_buffer

    def _exchange_per_tensor(self, flat: FlatState, buffer: Tensor) -> None:
        """``buffer`` (every parameter's values, one after another) replaced by its per-tensor
        1-bit average over the ranks, times the masks; the gradient check first, once."""
        if not self._gradients_checked and self.step_count + 1 == self._first_local_exchange:
            with self._collective():
                self._check_gradients_are_local(buffer)
        with self._collective():
            self.exchange.exchange(buffer).decode(buffer)
        if self._mask is not None:
            buffer.mul_(self._mask)

    def _start_interval(self, flat: FlatState) -> None:
        """Before a synchronised step ``t <= T + 1``: ``p_synced = p`` (a variance update may
        have moved the weights since the last synchronisation) and ``lr_sum = 0``. At the
        freeze after 1-bit gradient steps the error buffers, which held the gradients' error,
        restart from zero for the accumulated updates."""
        if flat.synced_param is None:
            flat.enable_synced_param()
            for index, has_state in enumerate(self._has_state):
                if has_state:
                    flat.expose(self.state[flat.params[index]], index)
        flat.copy_weights_into(flat.synced_param)
        flat.scalars["lr_sum"].zero_()
        if self.step_count == self.freeze_step and self.pre_freeze_exchange == "gradient":
            self.exchange.reset_errors()

    def _ignore_local_gradients(self) -> None:
        """A local or synchronisation step whose gradients on this rank are not finite: they
        are ignored here (the step still counts, so the schedules stay aligned across ranks)."""
        message = (
            f"non-finite local gradients at step {self.step_count + 1} (a {self.stage} step, "
            "which uses this rank's own gradients)"
        )
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message + " on this rank (on_nonfinite='raise')")
        self._counters["skipped_steps"] += 1
        warnings.warn(
            f"{message}: ignored on this rank, its weights and momentum unchanged for this step",
            RuntimeWarning,
            stacklevel=4,
        )

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """As :meth:`OneBitOptimizer.state_dict`; inside a local interval each parameter's
        state also holds this rank's own weights (``local_param``)."""
        state = super().state_dict()
        state["onebit"]["first_interval"] = self.first_interval
        if self._replicas_agree():
            return state
        params = _common.trainable_params(self)
        if self._flat is not None:
            weights = self._flat.weight_views()
        else:  # loaded, not stepped since: the parameters (or their fp32 masters) hold them
            weights = [self.state[p].get("master_param", p.detach()) for p in params]
        index_of = {id(p): i for i, p in enumerate(_common.params_in_order(self.param_groups))}
        for param, own in zip(params, weights, strict=True):
            key = index_of[id(param)]
            state["state"][key] = {**state["state"].get(key, {}), "local_param": own}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`OneBitOptimizer.load_state_dict`; a checkpoint taken inside a local
        interval also puts this rank's own weights back into the parameters."""
        super().load_state_dict(state_dict)
        saved = state_dict["onebit"].get("first_interval")
        if self.warmup_auto and saved is not None and saved < self.first_interval:
            self.first_interval = int(saved)  # where "auto" ended the first interval
        self._first_local_exchange = self._first_local_exchange_step()
        for param in _common.params_in_order(self.param_groups):
            local = self.state[param].pop("local_param", None)
            if local is not None:
                param.data.copy_(local)
