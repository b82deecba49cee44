"""0/1 Adam (Lu et al., 2022, arXiv 2202.06009): adaptive variance freezing and local steps."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from onebit.optim import checks
from onebit.optim._onebit import OneBitOptimizer
from onebit.optim._readiness import AUTO
from onebit.optim._rules import ZeroOneAdamRule
from onebit.optim._schedule import ZeroOneSchedule
from onebit.optim._variance_guard import MODE_REFRESH
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
    ``"gradient_1bit"``, ``"local"`` (nothing), ``"sync"`` and ``"refresh"`` (dense, the
    guard after the freeze); :attr:`stage` is the kind of
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
        variance_guard: after T, the rebuilt momentum of each synchronisation watched against
            the frozen variance (ALGORITHM.md, "The guard after the freeze", 0/1 Adam):
            ``"refresh"`` (default) returns to dense ``"refresh"`` steps when the variance has
            fallen behind and freezes it again once it has caught up, the local intervals
            starting again at 1; ``"warn"`` warns once; ``"off"`` is DeepSpeed's.
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
    (``var_freeze_step``, ``pre_freeze_exchange`` and ``var_warmup_steps`` are onebit's;
    ``variance_guard`` is onebit's own): with
    DeepSpeed's schedule the first 1-bit steps come after 16 dense steps, before the variance
    has caught up, and training stalled on the convergence study's model and on a task with a
    plateau; with its T = 100000 never reached, a short run sent more bytes than 1-bit Adam
    (docs/ZERO-ONE-ADAM.md). ``**DEEPSPEED_SCHEDULE`` restores DeepSpeed's.
    """

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
        variance_guard: str = MODE_REFRESH,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        checks.check_group(defaults)
        schedule = ZeroOneSchedule(
            var_freeze_step,
            max_var_freeze_step,
            var_update_scaler,
            local_step_scaler,
            local_step_clipper,
            pre_freeze_exchange,
            var_warmup_steps,
        )
        super().__init__(
            params,
            defaults,
            schedule=schedule,
            rule=ZeroOneAdamRule(),
            process_group=process_group,
            on_nonfinite=on_nonfinite,
            verify_every=verify_every,
            kernels=kernels,
            max_grad_norm=max_grad_norm,
            simulatable=False,
            variance_guard=variance_guard,
        )
        self._schedule = schedule  # the schedule, typed as 0/1 Adam's
        if self.shards is not None:
            raise ValueError(
                "ZeroOneAdam does not take FSDP-sharded parameters: its local steps, where "
                "the replicas move apart between synchronisations, are implemented for "
                "replicated parameters only; use OneBitAdam or OneBitLamb with fully_shard"
            )

    # The schedule's arguments and decisions, as DeepSpeed's ZeroOneAdam names them.
    @property
    def var_freeze_step(self) -> int:
        return self._schedule.freeze_step

    @property
    def first_interval(self) -> int | str | None:
        """The variance updates at interval 1 (``var_warmup_steps``, or where ``"auto"``
        ended it)."""
        return self._schedule.first_interval

    @property
    def warmup_auto(self) -> bool:
        return self._schedule.warmup_auto

    @property
    def pre_freeze_exchange(self) -> str:
        return self._schedule.pre_freeze_exchange

    @property
    def var_update_scaler(self) -> int:
        return self._schedule.var_update_scaler

    @property
    def local_step_scaler(self) -> int:
        return self._schedule.local_step_scaler

    @property
    def local_step_clipper(self) -> int:
        return self._schedule.local_step_clipper
