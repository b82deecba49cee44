"""The 1-bit optimizer: one ``step()`` over the parts it owns.

:class:`OneBitOptimizer` is 1-bit LAMB, 1-bit Adam and 0/1 Adam; they differ by their
:mod:`schedule <onebit.optim._schedule>` (the kind of every step) and their
:mod:`update rule <onebit.optim._rules>`, which their classes choose. The parts:

- :class:`~onebit.optim._parameters.FlatParameters`: the flat state and the update kernels;
- the schedule, and :class:`~onebit.optim._readiness.ReadinessMonitor`, which watches the
  variance's readiness over the dense steps and takes the schedule's ``"auto"`` decisions;
- :class:`~onebit.optim._data_parallel.DataParallel`: the group, the exchange (which owns the
  error feedback), DDP, the bytes sent;
- :class:`~onebit.optim._compression_stage.CompressionStage`: the exchange buffer and masks;
- :class:`~onebit.optim._overlap.BackwardOverlap`: the exchange started during backward;
- :class:`~onebit.optim._delay.DelayedExchange`: the exchange run behind the next step's
  forward and backward, its update applied by that step;
- :class:`~onebit.optim._guard.StepGuard`: replica checks and non-finite gradients;
- :class:`~onebit.optim._variance_guard.VarianceGuard`: the growth of the momentum against the
  frozen variance, which returns the schedule to dense refresh steps.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from onebit.collectives import allreduce_mean_
from onebit.compression import ExchangeResult
from onebit.exchange import Exchange, NodeGroups, NonFiniteError, world_size
from onebit.exchange.bucketed import bucket_elements
from onebit.optim import _common, checks
from onebit.optim._compression_stage import (
    CompressionStage,
    check_group_masks,
    scaling_coefficients_,
)
from onebit.optim._data_parallel import COMPRESSIONS, DataParallel
from onebit.optim._delay import DelayedExchange, SharedWeights
from onebit.optim._flat import FlatState
from onebit.optim._guard import StepGuard
from onebit.optim._overlap import BackwardOverlap, bucket_members
from onebit.optim._parameters import (
    FlatParameters,
    holding_weights,
    trainable,
    views_of_flat_parameters,
)
from onebit.optim._readiness import ReadinessMonitor
from onebit.optim._rules import UpdateRule, ZeroOneAdamRule
from onebit.optim._schedule import (
    COMPRESSION,
    GRADIENT_1BIT,
    REFRESH,
    SYNC,
    WARMUP,
    Schedule,
)
from onebit.optim._variance_guard import MODE_OFF, VarianceGuard, check_mode
from onebit.optim.functional import _active_indices, predict_weights_

__all__ = [
    "COMPRESSION",
    "DEFAULT_BUCKET_CAP_MB",
    "WARMUP",
    "OneBitOptimizer",
    "choose_compression",
]

logger = logging.getLogger("onebit")

#: The buckets of ``overlap_backward`` when no ``bucket_cap_mb`` is given (DDP's default).
DEFAULT_BUCKET_CAP_MB = 25.0
#: The layout of ``state_dict()["onebit"]``. Format 1 (no ``"format"`` key) differs only in
#: that it recorded ``compression="fused"`` for 0/1 Adam, which exchanges each tensor alone;
#: format 3 is format 2 with a ``"pending_update"`` (``delayed_exchange``), written only where
#: one is pending; format 4 is format 3 whose pending update holds the shared weights (the
#: parameters hold this rank's prediction).
CHECKPOINT_FORMAT = 4


def _saved_compression(extra: dict[str, Any]) -> str:
    """The compression a checkpoint's error feedback was laid out for."""
    if extra.get("format", 1) == 1 and extra.get("optimizer") == "ZeroOneAdam":
        return "per_tensor"
    return extra.get("compression", "fused")


def choose_compression(compression: str | None) -> tuple[str, bool]:
    """``(compression, left to the default)``: ``None`` is ``"per_tensor"``."""
    chosen = compression is None
    if compression is None:
        compression = "per_tensor"
    if compression not in COMPRESSIONS:
        raise ValueError(f"Invalid compression={compression!r}: use None or one of {COMPRESSIONS}")
    return compression, chosen


def _zeros_where_missing(
    flat: FlatState, grads: Sequence[Tensor | None], only: Sequence[int] | None = None
) -> list[Tensor | None]:
    """This rank's gradients with zeros for the parameters it has none for (of ``only``,
    where given): such a parameter contributes zeros to the average."""
    selected = set(range(len(grads)) if only is None else only)
    return [
        torch.zeros(t.shape, dtype=flat.dtype, device=flat.device)
        if g is None and index in selected
        else g
        for index, (t, g) in enumerate(zip(flat.tensors, grads, strict=True))
    ]


class OneBitOptimizer(Optimizer):
    """The optimizer of 1-bit LAMB, 1-bit Adam and 0/1 Adam (ALGORITHM.md).

    Each ``step()`` has the kind its ``schedule`` gives (:attr:`stage` is the next one's):

    - a dense kind (the warm-up, 0/1 Adam's variance updates): the gradients are averaged
      over the ranks at full precision (by this optimizer, one allreduce of a flat buffer
      with a flag per parameter, or by ``DistributedDataParallel`` with
      :func:`onebit.ddp.register_comm_hook`), then the ``rule``'s dense update;
    - ``"compression"``: each rank's momentum ``s_p (b1 m + (1 - b1) g_local)`` goes through
      the 1-bit exchange (during backward with ``overlap_backward``), then the rule's update
      with the exchanged momentum, identical on every rank;
    - ``"gradient_1bit"`` (0/1 Adam): the local gradients through the exchange, then a
      momentum step;
    - ``"local"`` and ``"sync"`` (0/1 Adam): a momentum step on the rank's own gradients; at
      a synchronisation the update accumulated since the last one goes through the exchange
      and sets momentum and weights on every rank alike.

    The flat state (:mod:`onebit.optim._flat`) is laid out at the first step; ``self.state``
    holds views of it.
    """

    # torch.amp.GradScaler calls step() on every rank with `grad_scale` set instead of
    # unscaling and skipping the step itself on the ranks that saw an Inf: a local skip would
    # leave the other ranks waiting in a collective. The step unscales, and its own check of
    # non-finite gradients agrees across ranks.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        schedule: Schedule,
        rule: UpdateRule,
        process_group: dist.ProcessGroup | None,
        on_nonfinite: str,
        verify_every: int,
        kernels: str | None,
        compression: str | None = "per_tensor",
        node_groups: NodeGroups | None = None,
        max_grad_norm: float = 0.0,
        bucket_cap_mb: float | None = None,
        overlap_backward: bool = False,
        simulatable: bool = True,
        delayed_exchange: bool = False,
        variance_guard: str = MODE_OFF,
    ) -> None:
        name = type(self).__name__
        checks.check_max_grad_norm(max_grad_norm)
        check_mode(variance_guard)
        for option, value in (
            ("overlap_backward", overlap_backward),
            ("delayed_exchange", delayed_exchange),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{option} must be True or False, got {value!r}")
        if delayed_exchange and overlap_backward:
            raise ValueError(
                "delayed_exchange=True runs each step's exchange behind the next forward and "
                "backward already, and overlap_backward would form the next step's buckets "
                "before the delayed exchange delivers the momentum they start from: use one "
                "of them"
            )
        if delayed_exchange and node_groups is not None:
            raise ValueError(
                "delayed_exchange=True runs over one process group: not with node_groups"
            )
        if delayed_exchange and bucket_cap_mb is None and world_size(process_group) > 1:
            bucket_cap_mb = DEFAULT_BUCKET_CAP_MB  # its phases pipelined in the thread
        if overlap_backward:
            if max_grad_norm:
                raise ValueError(
                    "overlap_backward=True sends each bucket's momentum during backward, before "
                    "the total norm of the gradients that max_grad_norm clips by is known: use "
                    "one of them"
                )
            if bucket_cap_mb is None:
                bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
        compression, chosen = choose_compression(compression)
        checks.check_bucket_cap_mb("bucket_cap_mb", bucket_cap_mb)
        if bucket_cap_mb is not None and node_groups is not None:
            raise ValueError(
                "bucket_cap_mb and overlap_backward bucket the exchange over one process "
                "group: not with node_groups"
            )
        self.schedule = schedule
        self.rule = rule
        self.max_grad_norm = max_grad_norm
        self.bucket_cap_mb = bucket_cap_mb
        self._step = 0
        self._loaded = False  # a checkpoint was loaded: the groups are those it was saved with
        self._guard = StepGuard(on_nonfinite, verify_every)
        # 0/1 Adam: per parameter, whether this rank had a gradient since the last
        # synchronisation (None: no local step since)
        self._gradients_since_sync: list[bool] | None = None
        self._parameters = FlatParameters(rule.scalars, kernels, takes_fsdp_hsdp=False)
        self._stage = CompressionStage()
        self._readiness = ReadinessMonitor(name)
        self._variance_guard = (
            None if variance_guard == MODE_OFF else VarianceGuard(name, variance_guard)
        )
        self._overlap = (
            BackwardOverlap(self._overlaps_this_step, self._begin_overlap)
            if overlap_backward
            else None
        )
        super().__init__(params, defaults)  # each group through add_param_group
        params = trainable(self.param_groups)
        dtypes = {_common.state_dtype(p) for p in params}
        self._data_parallel = DataParallel(
            name,
            schedule.kinds,
            process_group,
            compression=compression,
            compression_chosen=chosen,
            node_groups=node_groups,
            bucket_elements=None
            if bucket_cap_mb is None
            else bucket_elements(bucket_cap_mb, 8 if dtypes == {torch.float64} else 4),
            simulatable=simulatable,
            delayed=delayed_exchange,
        )
        self._delay = (
            DelayedExchange(threaded=self._data_parallel.world_size > 1)
            if delayed_exchange
            else None
        )
        self._shared_weights = SharedWeights() if delayed_exchange else None
        if self.shards is not None:
            if delayed_exchange:
                raise ValueError(
                    "delayed_exchange=True with FSDP-sharded parameters: FSDP gathers and "
                    "reduces them in forward and backward itself; construct the optimizer with "
                    "delayed_exchange=False"
                )
            if overlap_backward:
                raise ValueError(
                    "overlap_backward=True with FSDP-sharded parameters: FSDP reduce-scatters "
                    "their gradients during backward itself; construct the optimizer with "
                    "overlap_backward=False"
                )
            self._data_parallel.take_replicate_group(self.shards)

    # ----------------------------------------------------------------- the step
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step of the kind the schedule gives it; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self._step + 1
        flat = self._flat_state(step)
        self._unscale_for_grad_scaler(flat.params)
        kind = self.schedule.kind(step)
        delayed = kind == COMPRESSION and self._delay is not None
        if kind != COMPRESSION:
            self.finish_exchange()  # the prediction undone, the pending update applied
        if kind == REFRESH and self.schedule.refreshes.of(step) == step:
            self._return_to_dense()
        with self._data_parallel.counting(kind):
            try:
                if not self._overlaps_this_step():  # else after the exchange: one order
                    self._verify_replicas_if_due(flat)
                grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
                if kind in self.schedule.dense_kinds:
                    applied = self._dense_step(step, kind, flat, grads)
                else:
                    self._warn_if_left_out(step, kind, flat, grads)
                    self._clip_own_gradients(grads)
                    if delayed:
                        applied = self._delayed_compressed_step(step, flat, grads)
                    elif kind == COMPRESSION:
                        applied = self._compressed_step(step, flat, grads)
                    elif kind == GRADIENT_1BIT:
                        applied = self._gradient_1bit_step(step, flat, grads)
                    else:
                        applied = self._local_step(step, kind, flat, grads)
            finally:
                if self._overlap is not None:
                    self._overlap.cancel()  # nothing stays in flight after a step
        if applied:
            flat.refresh_half_params()
            self._step = step
            if kind == REFRESH and self.schedule.last_freeze(step + 1) == step:
                self._log_refresh_end(step)
        return loss

    def _log_refresh_end(self, step: int) -> None:
        if self._data_parallel.is_logging_rank():
            first = self.schedule.refreshes.of(step)
            logger.info(
                "%s: dense refresh steps %d-%d refreshed the variance, frozen again from step "
                "%d; refresh steps have sent %d bytes in all",
                type(self).__name__,
                first,
                step,
                step + 1,
                self._data_parallel.bytes_sent[REFRESH],
            )

    def _dense_step(
        self, step: int, kind: str, flat: FlatState, grads: Sequence[Tensor | None]
    ) -> bool:
        """Average the gradients (unless DDP did), clip them, then the rule's dense update.

        One dense allreduce carries every gradient and one flag per parameter that says
        whether a rank had a gradient for it; a parameter no rank has a gradient for is left
        alone, and a gradient missing on some ranks counts as zero."""
        data_parallel = self._data_parallel
        if not data_parallel.gradients_averaged_by_ddp and data_parallel.world_size > 1:
            flat.load_grads(grads)
            with data_parallel.collective(step, kind):
                allreduce_mean_(
                    flat.grad_and_flags, data_parallel.process_group, traffic=data_parallel.traffic
                )
            present = (flat.grad_flags > 0).tolist()
            grads = flat.views(flat.grad)
        else:
            present = [grad is not None for grad in grads]
        if self.max_grad_norm:
            present_grads = [
                g for g, has in zip(grads, present, strict=True) if has and g is not None
            ]
            _common.clip_by_total_norm_(present_grads, self.max_grad_norm, self.shards)
        self._parameters.expose_new(self.state, present)
        if not self.rule.dense(self.updates, flat, grads, present):
            return self._guard.skip("warm-up gradients", step)
        logging_rank = data_parallel.is_logging_rank()
        if kind == REFRESH:
            self._readiness.after_refresh_step(
                step, self.schedule, flat, grads, present, logging_rank
            )
        else:
            self._readiness.after_dense_step(
                step, self.schedule, flat, grads, present, logging_rank
            )
        return True

    def _compressed_step(self, step: int, flat: FlatState, grads: list[Tensor | None]) -> bool:
        """The local momentum through the exchange, then the rule's update with the exchanged
        momentum. With ``overlap_backward`` (after the stage's first step) the exchange
        started during backward, and the replica check comes after it, so that every rank's
        collectives keep one order."""
        buffer = self._momentum_buffer(step, flat)
        active = self._taking_part(flat)
        data_parallel = self._data_parallel
        packed: ExchangeResult
        try:
            overlap = self._overlap if self._overlaps_this_step() else None
            if overlap is not None:
                with data_parallel.collective(step, COMPRESSION):
                    packed = overlap.complete()
                self._verify_replicas_if_due(flat)
            else:
                self._scaled_local_momentum(flat, grads, buffer, active)
                self._check_gradients_once(step, COMPRESSION, buffer)
                with data_parallel.collective(step, COMPRESSION):
                    packed = data_parallel.exchange.exchange(buffer)
            nonfinite = False
        except NonFiniteError:
            nonfinite = True
        if self.shards is not None:  # the other slices' replicas skip the step too
            nonfinite = self.shards.any_(nonfinite, flat.device)
        if nonfinite:
            return self._guard.skip("a rank's local momentum", step)
        applied = self._where_some_rank_had(step, COMPRESSION, flat, active, grads)
        per_tensor = data_parallel.compression == "per_tensor"
        self.rule.compressed(
            self.updates, flat, packed, buffer, self._stage.limit, applied, per_tensor
        )
        self._watch_variance(step, flat)
        return True

    def _delayed_compressed_step(
        self, step: int, flat: FlatState, grads: list[Tensor | None]
    ) -> bool:
        """The update of the exchange the last step started (none at the stage's first step,
        nor after a load or :meth:`finish_exchange`) applied to the shared weights kept aside,
        then this rank's momentum of this step formed, the parameters moved to this rank's
        prediction from it and the shared weights, and its exchange started, to run while the
        caller computes the next step's gradients at the prediction (ALGORITHM.md, "Delayed
        exchange")."""
        delay = cast(DelayedExchange, self._delay)
        shared = cast(SharedWeights, self._shared_weights).keep(flat)
        buffer = self._momentum_buffer(step, flat)
        with flat.weights_in(shared):
            if self._apply_delayed_update(flat, buffer):
                self._watch_variance(step, flat)
        active = self._taking_part(flat)
        self._scaled_local_momentum(flat, grads, buffer, active)
        self._check_gradients_once(step, COMPRESSION, buffer)
        applies_to = self._where_some_rank_had(step, COMPRESSION, flat, active, grads)
        self._predict(flat, shared, cast(Tensor, flat.weights), buffer, active)
        exchange = self.exchange
        delay.start(step, lambda: exchange.exchange(buffer), flat.device, applies_to)
        return True

    def _predict(
        self, flat: FlatState, shared: Tensor, out: Tensor, momentum: Tensor, active: Sequence[bool]
    ) -> None:
        """``out`` (flat) = the prediction from ``momentum`` and the flat weights ``shared``,
        by the backend's fused kernel where it has one."""
        predict = getattr(self.updates, "predict_weights_", predict_weights_)
        predict(
            flat,
            shared,
            out,
            momentum,
            flat.scalars["scaling_coeff"],
            self._stage.limit,
            self.rule.prediction_coefficients(flat),
            active,
        )

    def _apply_delayed_update(self, flat: FlatState, buffer: Tensor) -> bool:
        """Wait for the exchange in flight and apply its update (``buffer`` its scratch);
        where some rank's momentum was not finite, drop it (or raise). Returns whether an
        update was applied."""
        delay = cast(DelayedExchange, self._delay)
        started = delay.step
        if started is None:
            return False
        data_parallel = self._data_parallel
        with data_parallel.collective(started, COMPRESSION):
            landed = delay.wait()
        data_parallel.take_exchange_traffic()
        if landed.result is None:
            return self._guard.skip(
                f"a rank's local momentum; its update is dropped at step {self._step + 1}",
                started,
            )
        per_tensor = data_parallel.compression == "per_tensor"
        self.rule.compressed(
            self.updates,
            flat,
            landed.result,
            buffer,
            self._stage.limit,
            landed.applies_to,
            per_tensor,
        )
        return True

    @torch.no_grad()
    def finish_exchange(self) -> None:
        """With ``delayed_exchange=True``: put the shared weights back in place of this
        rank's prediction, wait for the exchange the last ``step()`` started and apply its
        update, so the weights hold every step's update and are the same on every rank (at
        the end of training, before evaluating; a checkpoint needs no such call). The next
        ``step()`` then applies nothing. Nothing to do otherwise."""
        shared = self._shared_weights
        if shared is None or not (shared.set_aside or self.update_pending):
            return
        flat = self._parameters.build(self.param_groups, self.state)  # also after a load
        shared.put_back(flat)
        if self.update_pending:
            buffer = self._momentum_buffer(self._step + 1, flat)
            with self._data_parallel.counting(COMPRESSION):
                self._apply_delayed_update(flat, buffer)
            flat.refresh_half_params()

    def _gradient_1bit_step(self, step: int, flat: FlatState, grads: list[Tensor | None]) -> bool:
        """0/1 Adam before the freeze: the local gradients (zeros where a rank has none)
        averaged by the 1-bit exchange, then a momentum step with the variance unchanged."""
        self._accumulator(step, flat)
        flat.load_grads(grads)
        try:
            self._exchange_per_tensor(step, GRADIENT_1BIT, flat.grad)
        except NonFiniteError:
            return self._guard.skip("a rank's local gradients", step)
        active = self._taking_part(flat)
        applied = self._where_some_rank_had(step, GRADIENT_1BIT, flat, active, grads)
        rule = cast(ZeroOneAdamRule, self.rule)
        rule.momentum_step(self.updates, flat, flat.views(flat.grad), applied)
        return True

    def _local_step(
        self, step: int, kind: str, flat: FlatState, grads: list[Tensor | None]
    ) -> bool:
        """0/1 Adam's local or synchronisation step (of the interval that starts at the last
        synchronisation, or at the weights of step ``t - 1`` for every step ``t <= T + 1``):
        a momentum step on this rank's gradients (the parameters it has none for skipped on
        this rank; all of them where they are not finite); at a synchronisation the
        accumulated update through the exchange, applied where some rank had a gradient
        since the last one."""
        rule = cast(ZeroOneAdamRule, self.rule)
        buffer = self._accumulator(step, flat)
        last_freeze = self.schedule.last_freeze(step)
        if step - 1 <= last_freeze:
            self._start_interval(step, flat)
        active = self._taking_part(flat)
        own = [
            taking_part and grad is not None
            for taking_part, grad in zip(active, grads, strict=True)
        ]
        if _common.all_finite(
            [g for g, mine in zip(grads, own, strict=True) if mine and g is not None]
        ):
            rule.momentum_step(self.updates, flat, grads, own)
            since = self._gradients_since_sync or [False] * len(own)
            self._gradients_since_sync = [a or b for a, b in zip(since, own, strict=True)]
        else:
            self._guard.ignore_local(step, kind)
        indices = _active_indices(active)
        lr_sum = flat.scalars["lr_sum"]
        lr_sum[indices] += flat.segment_values(lambda group: group["lr"])[indices]
        if kind == SYNC:
            rule.accumulated_update(self.updates, flat, active, buffer)
            self._exchange_per_tensor(step, SYNC, buffer)
            had = self._gradients_since_sync or [False] * len(active)
            self._gradients_since_sync = None
            applied = self._data_parallel.any_rank(step, SYNC, had, flat.device)
            rule.synchronised_update(
                self.updates, flat, buffer, [a and b for a, b in zip(active, applied, strict=True)]
            )
            if step > last_freeze:  # the variance frozen: the guard after the freeze watches
                self._watch_variance(step, flat)
        return True

    # ----------------------------------------------------------------- step helpers
    def _flat_state(self, step: int) -> FlatState:
        """The flat state, laid out anew first where parameters joined since: up to the
        freeze, carrying every quantity over; after it, they are refused (ALGORITHM.md,
        "Parameters that join late")."""
        parameters = self._parameters
        joining = parameters.joining(self.param_groups)
        if not joining:
            return parameters.build(self.param_groups, self.state)
        freeze = self.schedule.freeze_step
        if step > freeze:
            parameters.refuse_joining(
                joining,
                f"at step {step}, after the variance froze (step {freeze}), it has no "
                f"variance for the 1-bit steps. Unfreeze it by step {freeze}, or give it "
                "an optimizer of its own",
            )
        self._data_parallel.check_can_relayout()
        origin = parameters.lay_out_again(self.param_groups, self.state)
        flat = parameters.build(self.param_groups, self.state)  # the new layout
        self._stage.reset()
        self._readiness.relayout(origin)
        self._guard.relayout(origin)
        self._data_parallel.relayout(origin, [t.numel() for t in flat.tensors])
        self._gradients_since_sync = None
        if self._overlap is not None:
            self._overlap.relayout(flat.params)
        return flat

    def _where_some_rank_had(
        self,
        step: int,
        kind: str,
        flat: FlatState,
        active: Sequence[bool],
        grads: Sequence[Tensor | None],
    ) -> list[bool]:
        """``active`` where some rank had a gradient (ALGORITHM.md, "Parameters without
        gradients"): agreed in one allreduce of a byte per parameter."""
        had = [grad is not None for grad in grads]
        anywhere = self._data_parallel.any_rank(step, kind, had, flat.device)
        return [a and b for a, b in zip(active, anywhere, strict=True)]

    @property
    def _has_state(self) -> list[bool]:
        return self._parameters.has_state

    def _taking_part(self, flat: FlatState) -> list[bool]:
        """Per parameter, whether a 1-bit step updates it: it has state and is not frozen
        (``requires_grad=False``; ALGORITHM.md, "Parameters without gradients")."""
        pairs = zip(self._has_state, flat.params, strict=True)
        return [has and param.requires_grad for has, param in pairs]

    def _warn_if_left_out(
        self, step: int, kind: str, flat: FlatState, grads: Sequence[Tensor | None]
    ) -> None:
        late = [
            (index, tuple(flat.params[index].shape))
            for index, (grad, has) in enumerate(zip(grads, self._has_state, strict=True))
            if grad is not None and not has
        ]
        if late:
            self._guard.warn_left_out(step, kind, late)

    def _unscale_for_grad_scaler(self, params: list[Tensor]) -> None:
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        if grad_scale is None:
            return
        if self._overlap is not None:
            self._overlap.cancel()
            raise RuntimeError(
                "overlap_backward=True reads the gradients while backward produces them, "
                "before GradScaler's scale could be taken out: construct the optimizer with "
                "overlap_backward=False to train with a GradScaler"
            )
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, grad_scale.to(grads[0].device))

    def _verify_replicas_if_due(self, flat: FlatState) -> None:
        with self._data_parallel.collective(self._step + 1, self.stage):
            self._guard.verify_if_due(
                self._step,
                self.schedule.replicas_agree(self._step),
                lambda: self._replicated_weights(flat),
                self._data_parallel.process_group,
            )

    def _replicated_weights(self, flat: FlatState) -> list[Tensor]:
        """The weights every rank holds alike: the parameters (and half-precision ones'
        masters), or with ``delayed_exchange`` the shared weights where they are kept aside."""
        if self._shared_weights is not None and self._shared_weights.set_aside:
            return flat.views(self._shared_weights.flat(flat))
        return flat.tensors + [master for _, master in flat.half_params]

    def _clip_own_gradients(self, grads: Sequence[Tensor | None]) -> None:
        """With ``max_grad_norm``: this rank's own gradients clipped at ``max_grad_norm·√W``
        (W workers of the exchange; ALGORITHM.md, "Gradient clipping")."""
        if self.max_grad_norm:
            threshold = self.max_grad_norm * math.sqrt(self.exchange.world_size)
            _common.clip_by_total_norm_([g for g in grads if g is not None], threshold, self.shards)

    def _check_gradients_once(self, step: int, kind: str, values: Tensor) -> None:
        """At the first step that exchanges each rank's own values (not on a resume later)."""
        data_parallel = self._data_parallel
        if not data_parallel.gradients_checked and step == self.schedule.first_local_exchange:
            with data_parallel.collective(step, kind):
                data_parallel.check_gradients_are_local(values, step)

    def _momentum_buffer(self, step: int, flat: FlatState) -> Tensor:
        """The buffer the momentum is exchanged in; at the stage's first step (or the first
        after a load) also the masks, and at the switch itself the scaling coefficients."""
        if self._stage.buffer is not None:
            return self._stage.buffer
        exchange = self._data_parallel.bind(flat, self.backend)
        buffer = self._stage.set_up(flat, self._has_state, exchange, self.param_groups, self.shards)
        if step == self.schedule.last_freeze(step) + 1:  # not when resuming later in the stage
            self._start_compression(flat)
        return buffer

    def _start_compression(self, flat: FlatState) -> None:
        """The switch (at every freeze): ``s_p`` of the fused exchange, what the rule keeps
        from here on, the guard's baseline anew."""
        if self.compression == "fused":
            scaling_coefficients_(flat, self._has_state)
        self.rule.start_compression(flat)
        self._parameters.expose_all(self.state)
        if self._variance_guard is not None:
            self._variance_guard.restart()
        if self._data_parallel.is_logging_rank():
            logger.info(
                "%s: switching to 1-bit compressed momentum at step %d (%d tensors, %d "
                "elements, %d ranks)",
                type(self).__name__,
                self._step + 1,
                sum(self._has_state),
                sum(t.numel() for t, has in zip(flat.tensors, self._has_state, strict=True) if has),
                self.world_size,
            )

    def _watch_variance(self, step: int, flat: FlatState) -> None:
        """After compression step ``step`` (0/1 Adam: a synchronisation after the freeze):
        the guard's observation; where its check finds the frozen variance fallen behind, a
        refresh from the next step on (or a warning)."""
        guard = self._variance_guard
        if guard is not None and guard.after_compression_step(
            step, flat, self._data_parallel.is_logging_rank()
        ):
            self.schedule.refreshes.start(step + 1)

    def _return_to_dense(self) -> None:
        """At a refresh's first step (the exchange in flight has landed; 0/1 Adam's weights
        synchronised): the error feedback restarts from zero, the stage (its masks) is set up
        again at the next freeze, and the readiness statistic starts a new window."""
        self.exchange.reset_errors()
        self._stage.reset()
        self._readiness.restart()
        self._gradients_since_sync = None

    def _scaled_local_momentum(
        self,
        flat: FlatState,
        grads: Sequence[Tensor | None],
        buffer: Tensor,
        active: Sequence[bool],
        only: Sequence[int] | None = None,
    ) -> None:
        """``buffer = s_p (b1 m_p + (1 - b1) g_p)`` of this rank's gradients for the
        ``active`` tensors, zeros for the others, padded; with ``only``, just those tensors'
        ranges (the padding untouched)."""
        local = _zeros_where_missing(flat, grads, only)
        self.updates.scaled_momentum(
            flat, local, flat.scalars["scaling_coeff"], buffer, active, only
        )
        if only is None:
            buffer[flat.numel :].zero_()

    def _overlaps_this_step(self) -> bool:
        """Whether the next step's exchange starts during backward: ``overlap_backward``, in
        the compression stage, after its first step (which sets the stage up) or the first
        after a checkpoint load. The same on every rank."""
        return self._overlap is not None and self._stage.ready and self.stage == COMPRESSION

    def _begin_overlap(self):
        """The step's bucketed exchange, for :class:`~onebit.optim._overlap.BackwardOverlap`:
        its pipeline, the tensors in each bucket, how to form their momenta, and which
        tensors need no gradient (those left out of the stage)."""
        flat, buffer, exchange = self._parameters.flat, self._stage.buffer, self.exchange
        buffer[flat.numel :].zero_()
        members = bucket_members(flat.offsets, exchange.buckets())
        active = self._taking_part(flat)

        def form(only: Sequence[int]) -> None:
            grads: list[Tensor | None] = [None] * len(flat.params)
            for index in only:
                grads[index] = _common.dense_grad(flat.params[index], flat.dtype)
            self._scaled_local_momentum(flat, grads, buffer, active, only)

        ready = [not taking_part for taking_part in active]
        return exchange.begin(buffer), members, form, ready

    def _accumulator(self, step: int, flat: FlatState) -> Tensor:
        """0/1 Adam's exchange buffer (``N`` elements) with the masks (anew at every step up
        to the freeze: the variance may have changed); the exchange bound."""
        refresh = step - 1 < self.schedule.freeze_step
        buffer = self._stage.set_up_accumulator(
            flat, self._has_state, self.param_groups, self.shards, refresh
        )
        self._data_parallel.bind(flat, self.backend)
        return buffer

    def _exchange_per_tensor(self, step: int, kind: str, buffer: Tensor) -> None:
        """``buffer`` (every parameter's values, one after another) replaced by its per-tensor
        1-bit average over the ranks, times the masks; the gradient check first, once."""
        self._check_gradients_once(step, kind, buffer)
        with self._data_parallel.collective(step, kind):
            self.exchange.exchange(buffer).decode(buffer)
        if self._stage.mask is not None:
            buffer.mul_(self._stage.mask)

    def _start_interval(self, step: int, flat: FlatState) -> None:
        """Before a synchronised step ``t <= T + 1``, or the first after a refresh:
        ``p_synced = p`` (a variance update may have moved the weights since the last
        synchronisation) and ``lr_sum = 0``. At the freeze after 1-bit gradient steps the
        error buffers, which held the gradients' error, restart from zero for the accumulated
        updates. At every freeze the guard after the freeze measures its baseline anew."""
        new = flat.synced_param is None
        synced = flat.enable_synced_param()
        if new:
            self._parameters.expose_all(self.state)
        flat.copy_weights_into(synced)
        flat.scalars["lr_sum"].zero_()
        schedule = self.schedule
        if step - 1 == schedule.freeze_step and schedule.errors_restart_at_freeze:
            self.exchange.reset_errors()
        if step - 1 == schedule.last_freeze(step) and self._variance_guard is not None:
            self._variance_guard.restart()

    # ----------------------------------------------------------------- what users see
    @property
    def step_count(self) -> int:
        """Steps applied so far (skipped steps are not counted)."""
        return self._step

    def kind_of_step(self, step: int) -> str:
        """The kind of step ``step`` (counted from 1), from the schedule."""
        return self.schedule.kind(step)

    @property
    def stage(self) -> str:
        """The kind of the next ``step()``, the key its bytes are counted under in
        :attr:`bytes_sent`."""
        return self.schedule.kind(self._step + 1)

    @property
    def needs_averaged_gradients(self) -> bool:
        """Whether the next ``step()`` works on gradients averaged over the ranks at full
        precision (the warm-up, 0/1 Adam's variance updates): the DDP hook and a training
        loop that averages gradients itself do so exactly then."""
        return self.stage in self.schedule.dense_kinds

    @property
    def freeze_step(self) -> int:
        """The last step that may update the variance; with ``"auto"`` the bound until the
        variance has caught up, then the step it froze after."""
        return self.schedule.freeze_step

    @property
    def auto_freeze(self) -> bool:
        return self.schedule.auto_freeze

    def variance_updates(self, step: int) -> int:
        """How many steps up to ``step`` updated the variance."""
        return self.schedule.variance_updates(step)

    def variance_readiness(self) -> Tensor | None:
        """The readiness statistic ``R_j`` of every parameter over the last 10 observed dense
        steps (ALGORITHM.md, "Variance readiness"), or ``None`` before a step that observed
        them: every dense step with ``freeze_step="auto"``, the 20 before the freeze with a
        fixed one."""
        flat = self._parameters.flat
        return self._readiness.ratios(flat, self.schedule.variance_updates(self._step))

    @property
    def variance_guard(self) -> str:
        """What a growth of the momentum against the frozen variance does (ALGORITHM.md, "The
        guard after the freeze"): ``"refresh"``, ``"warn"`` or ``"off"``."""
        return MODE_OFF if self._variance_guard is None else self._variance_guard.mode

    @property
    def refreshes(self) -> list[tuple[int, int | None]]:
        """The first and last step of each refresh the guard after the freeze returned to
        (the last ``None`` while it lasts)."""
        return list(self.schedule.refreshes.spans)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank's gradients were not finite."""
        return self._guard.skipped_steps

    @property
    def on_nonfinite(self) -> str:
        return self._guard.on_nonfinite

    @property
    def verify_every(self) -> int:
        return self._guard.verify_every

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank has sent for this optimizer in each kind of step (a copy), as a
        bandwidth-optimal implementation sends them (:mod:`onebit.collectives`): the dense
        allreduce of averaged gradients and the 1-bit exchange of ``step()``, the dense
        allreduces of :func:`onebit.ddp.register_comm_hook`, and the one-time gradient check.
        Not counted: the replica checks (a few bytes per tensor, at the first step and every
        ``verify_every``) and traffic the optimizer does not make, such as the dense
        allreduce of a ``DistributedDataParallel`` model without onebit's hook (``step()``
        warns when it finds the gradients averaged already)."""
        return dict(self._data_parallel.bytes_sent)

    @property
    def traffic_by_kind(self) -> dict[str, int]:
        """Bytes this rank has sent in ``step()`` per kind of collective (a copy):
        ``"allreduce"``, ``"compressed_allreduce"`` (or ``"intra_node"`` and ``"inter_node"``
        with ``node_groups``) and ``"gradient_check"``."""
        return dict(self._data_parallel.traffic.bytes_sent)

    def count_bytes_sent(self, stage: str, nbytes: int) -> None:
        """Add traffic sent on this optimizer's behalf outside ``step()`` (the DDP hook)."""
        self._data_parallel.bytes_sent[stage] += nbytes

    @property
    def gradients_averaged_by_ddp(self) -> bool:
        """Whether ``DistributedDataParallel`` averages the gradients of the dense steps
        (:meth:`attach_to_ddp`); otherwise ``step()`` averages them itself."""
        return self._data_parallel.gradients_averaged_by_ddp

    def attach_to_ddp(self, process_group: dist.ProcessGroup | None) -> None:
        """Let DDP (over ``process_group``) average the gradients of the dense steps; called
        by :func:`onebit.ddp.register_comm_hook`, whose hook does it. The optimizer's group
        becomes DDP's (it must be the same if one was given)."""
        self._data_parallel.attach_to_ddp(process_group)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group (``None``: the world)."""
        return self._data_parallel.process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self._data_parallel.process_group = group

    @property
    def world_size(self) -> int:
        return self._data_parallel.world_size

    @property
    def compression(self) -> str:
        """How the momentum is exchanged: ``"per_tensor"`` or ``"fused"``."""
        return self._data_parallel.compression

    @property
    def node_groups(self) -> NodeGroups | None:
        return self._data_parallel.node_groups

    @property
    def exchange(self) -> Exchange:
        """The exchange of the steps that do not average densely (it owns the error state)."""
        return self._data_parallel.exchange

    def use_exchange(self, exchange: Exchange) -> None:
        """Exchange through ``exchange`` instead of the one the arguments ask for (a
        :class:`onebit.exchange.SimulatedExchange` simulates many workers in one process).
        Only before the first exchange, in one process, for the fused exchange (which the
        simulated optimizer uses where its compression was left to the default)."""
        self._data_parallel.use_exchange(exchange)

    @property
    def topology(self) -> tuple[int, int]:
        """``(ranks per node, nodes)`` of the exchange: ``(1, world_size)`` when flat."""
        return self.exchange.topology

    @property
    def error_feedback(self) -> tuple[Tensor | None, Tensor | None]:
        """``(worker_error, server_error)`` of :attr:`exchange`, created at its first use:
        this rank's, or with a simulated exchange every simulated worker's, rank after rank."""
        return self.exchange.worker_error, self.exchange.server_error

    def error_feedback_layout(self) -> dict[str, Any]:
        """Where each of this rank's error values belongs: the exchange, its data-parallel
        world size and ranks per node, its buckets (``None``: one buffer) and the elements of
        each tensor on this rank. Error buffers saved with one layout are only valid in it."""
        return self._data_parallel.error_feedback_layout(self._local_numels())

    kernels, flat_state, backend, updates, shards = views_of_flat_parameters()

    @property
    def delayed_exchange(self) -> bool:
        """Whether each compression step's exchange runs behind the next step and its update
        lands there (ALGORITHM.md, "Delayed exchange")."""
        return self._delay is not None

    @torch.no_grad()
    def shared_weights(self) -> list[Tensor]:
        """Copies of the weights every rank shares, one per trainable parameter in
        ``param_groups`` order: with ``delayed_exchange``, those set aside while the
        parameters hold this rank's prediction (the pending update not applied); otherwise
        the parameters' own."""
        shared: dict[int, Tensor] = {}
        if self._shared_weights is not None and self._shared_weights.set_aside:
            flat = self._parameters.build(self.param_groups, self.state)
            views = flat.views(self._shared_weights.flat(flat))
            shared = {id(p): view for p, view in zip(flat.params, views, strict=True)}
        return [shared.get(id(p), p.detach()).clone() for p in trainable(self.param_groups)]

    @contextlib.contextmanager
    def holding_shared_weights(self) -> Iterator[None]:
        """Inside the block the parameters hold :meth:`shared_weights` (with
        ``delayed_exchange``, in place of this rank's prediction: to evaluate the weights
        every rank shares); after it, what they held before. Nothing to do otherwise."""
        if self._shared_weights is None or not self._shared_weights.set_aside:
            yield
            return
        with holding_weights(trainable(self.param_groups), self.shared_weights()):
            yield

    @torch.no_grad()
    def predicted_weights(self, momentum: Tensor) -> list[Tensor]:
        """With ``delayed_exchange``, in the compression stage: the weights a rank whose
        momentum is ``momentum`` (as :meth:`local_momentum` returns it) takes its next
        gradients at, as ``step()`` predicts them from the shared weights; new tensors,
        per parameter. Nothing changes (the simulation of many workers makes each one's)."""
        if self._shared_weights is None or self.stage != COMPRESSION:
            raise RuntimeError(
                "predicted_weights() is for the compression stage of delayed_exchange=True"
            )
        flat = self._parameters.build(self.param_groups, self.state)
        shared = self._shared_weights.flat(flat)
        out = torch.empty_like(shared)
        self._predict(flat, shared, out, momentum, self._taking_part(flat))
        return flat.views(out)

    @property
    def update_pending(self) -> bool:
        """With ``delayed_exchange``: whether an update waits to be applied (by the next
        ``step()`` or :meth:`finish_exchange`); ``False`` otherwise."""
        return self._delay is not None and self._delay.step is not None

    @property
    def overlap_backward(self) -> bool:
        """Whether the compression stage's exchange starts during backward."""
        return self._overlap is not None

    @property
    def buckets_started(self) -> int:
        """With ``overlap_backward``: buckets of the coming step whose exchange has started
        (during backward); 0 otherwise."""
        return 0 if self._overlap is None else self._overlap.buckets_started

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside only accumulate gradients: with ``overlap_backward``, the
        exchange starts in the next backward pass outside (gradient accumulation, as
        ``DistributedDataParallel.no_sync``). Without it, nothing to do."""
        return contextlib.nullcontext() if self._overlap is None else self._overlap.no_sync()

    @torch.no_grad()
    def local_momentum(self) -> Tensor:
        """In the compression stage: the momentum the next ``step()`` would send for the
        gradients in ``.grad``, ``s_p (b1 m_p + (1 - b1) g_p)`` in the padded exchange buffer
        (overwritten by the next call and by ``step()``), from the gradients clipped as
        ``step()`` clips them (``max_grad_norm``). Nothing else changes, except that the first
        call of the stage sets up its state, as its first ``step()`` would."""
        if self.stage != COMPRESSION:
            raise RuntimeError(
                f"local_momentum() is for the compression stage; step {self._step + 1} "
                f"is in the warm-up (freeze_step={self.freeze_step})"
            )
        if self._overlap is not None and self._overlap.in_flight:
            raise RuntimeError(
                "local_momentum() would overwrite the momentum whose exchange started during "
                "backward (overlap_backward=True); call it before backward or after step()"
            )
        if self._delay is not None and self._delay.step is not None:
            raise RuntimeError(
                "local_momentum() would overwrite the momentum whose exchange is in flight "
                "(delayed_exchange=True); call finish_exchange() first"
            )
        flat = self._parameters.build(self.param_groups, self.state)
        grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
        buffer = self._momentum_buffer(self._step + 1, flat)
        self._clip_own_gradients(grads)
        self._scaled_local_momentum(flat, grads, buffer, self._taking_part(flat))
        return buffer

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the optimizer holds now: ``"state"`` (moments, fp32 master weights of
        low-precision parameters, per-tensor scalars), ``"scratch"`` (buffers every step
        reuses: the gathered gradients, the exchange buffer and the exchange's own) and
        ``"error_feedback"`` (the exchange's worker and server errors, once created)."""
        memory = self._parameters.memory_bytes()
        if self._shared_weights is not None:
            memory["state"] += self._shared_weights.nbytes()
        errors, exchange_scratch = self._data_parallel.memory_bytes()
        memory["error_feedback"] = errors
        memory["scratch"] += self._stage.nbytes() + exchange_scratch
        return memory

    def _local_numels(self) -> list[int]:
        return self._parameters.local_numels(self.param_groups, self.state)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"{type(self).__name__} cannot be copied or pickled: it holds its process group, "
            "its exchange's error feedback and hooks on the parameters. Save "
            "optimizer.state_dict() and load it into a new optimizer built over the (copied) "
            "parameters instead"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, before the first step and before a checkpoint load, after checking the
        group (complex parameters, ``exp_avg_mask``, its options and hyper-parameters; nothing
        is added when it is wrong); the overlap's hooks go on its parameters."""
        self._parameters.check_can_add()
        if self._loaded:
            raise RuntimeError(
                "cannot add a parameter group after load_state_dict: the loaded state (error "
                "feedback included) is laid out for the checkpoint's parameters; add the group "
                "before loading, or build the optimizer with every group"
            )
        param_group = check_group_masks(_common.checked_real(param_group))
        _common.check_group_options(self, param_group, group_only=("exp_avg_mask",))
        super().add_param_group(param_group)
        self._parameters.regroup(self.param_groups)
        if self._overlap is not None:
            self._overlap.watch([p for p in self.param_groups[-1]["params"] if p.requires_grad])

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (per parameter) plus ``"onebit"``: the step, this rank's
        error-feedback buffers, the world size they belong to, the traffic counters and the
        schedule's decisions. Where the replicas differ by design (inside 0/1 Adam's local
        intervals; this rank's prediction with ``delayed_exchange``) each parameter's state
        also holds this rank's own weights (``local_param``), which :meth:`load_state_dict`
        puts back in the parameters. With ``delayed_exchange``, the exchange in flight is
        waited for and its result saved with the shared weights (``"pending_update"``), to be
        applied by the next step, as it will be here: nothing changes."""
        pending = None if self._delay is None else self._delay.state_dict()
        shared = None if self._shared_weights is None else self._shared_weights.state_dict()
        if pending is not None:  # counted by the next step, here as after a load
            pending["bytes_sent"] = self._data_parallel.untaken_exchange_traffic()
        if pending is not None and shared is not None:
            pending["shared_weights"] = shared
        state = super().state_dict()
        data_parallel = self._data_parallel
        sent = dict(data_parallel.bytes_sent)
        state["onebit"] = {
            "format": 2 if pending is None else 4 if shared is not None else 3,
            "optimizer": type(self).__name__,
            "step": self._step,
            "skipped_steps": self._guard.skipped_steps,
            "bytes_sent": sent,
            "compression": data_parallel.compression,
            "readiness": self._readiness.state_dict(),
            "variance_guard": None
            if self._variance_guard is None
            else self._variance_guard.state_dict(),
            "gradients_since_sync": self._gradients_since_sync,
            **self.schedule.state_dict(),
            **data_parallel.exchange.state_dict(self._local_numels()),
        }
        if pending is not None:
            state["onebit"]["pending_update"] = pending
        if not self.schedule.replicas_agree(self._step) or shared is not None:
            self._save_own_weights(state)  # this rank's own: its prediction, if delayed
        return state

    def _save_own_weights(self, state: dict[str, Any]) -> None:
        params = [p for _, p in self._parameters.members(self.param_groups, self.state)]
        flat = self._parameters.flat
        if flat is not None:
            weights = flat.weight_views()
        else:  # loaded, not stepped since: the parameters (or their fp32 masters) hold them
            weights = [self.state[p].get("master_param", p.detach()) for p in params]
        index_of = {id(p): i for i, p in enumerate(_common.params_in_order(self.param_groups))}
        for param, own in zip(params, weights, strict=True):
            key = index_of[id(param)]
            state["state"][key] = {**state["state"].get(key, {}), "local_param": own}

    def check_checkpoint(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the first thing in ``state_dict`` that does not fit: a
        checkpoint of another optimizer, of another compression, or of another model."""
        name = type(self).__name__
        extra = state_dict.get("onebit")
        if not isinstance(extra, dict) or extra.get("optimizer") != name:
            found = extra.get("optimizer") if isinstance(extra, dict) else "a non-onebit optimizer"
            raise ValueError(f"checkpoint was saved by {found}, not by {name}")
        if extra.get("format", 1) > CHECKPOINT_FORMAT:
            raise ValueError(
                f"checkpoint has format {extra['format']}, newer than this onebit reads "
                f"({CHECKPOINT_FORMAT}): upgrade onebit to load it"
            )
        if extra.get("pending_update") is not None and self._delay is None:
            raise ValueError(
                f"checkpoint holds the update of step {extra['pending_update']['step']}, whose "
                "exchange was in flight (saved with delayed_exchange=True): construct the "
                "optimizer with delayed_exchange=True to resume it"
            )
        saved_compression = _saved_compression(extra)
        if saved_compression != self.compression:
            raise ValueError(
                f"checkpoint was saved with compression={saved_compression!r}, this "
                f"{name} uses compression={self.compression!r}: their error-feedback states "
                "have different layouts; construct the optimizer with "
                f"compression={saved_compression!r} to resume"
            )
        _common.validate_checkpoint(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint (as torch's load pre-hooks leave it); with another world size the
        error buffers restart from zero.

        Raises ``ValueError`` naming the problem, with nothing changed, for a checkpoint of
        another optimizer or model (:meth:`check_checkpoint`), or error buffers of the wrong
        size."""
        exchange = self.exchange
        fits: dict[str, Any] = {}

        def check(hooked: dict[str, Any]) -> None:
            self.check_checkpoint(hooked)
            params = _common.params_in_order(self.param_groups)
            loaded = {p: hooked["state"].get(key, {}) for key, p in enumerate(params)}
            numels = self._parameters.local_numels(self.param_groups, loaded, laid_out=False)
            fits["errors"] = exchange.check_state(hooked["onebit"], numels)
            fits["restart"] = exchange.restart_reason(hooked["onebit"], numels)
            if self._overlap is not None:
                self._overlap.cancel()
            if self._delay is not None:
                self._delay.cancel()
                self._data_parallel.take_exchange_traffic()

        extra = _common.load_checked(self, state_dict, check)["onebit"]
        errors_fit, restart = fits["errors"], fits["restart"]
        self._loaded = True
        self._step = int(extra["step"])
        self._guard.skipped_steps = int(extra["skipped_steps"])
        self._data_parallel.bytes_sent = {
            **dict.fromkeys(self.schedule.kinds, 0),
            **extra["bytes_sent"],
        }
        self._parameters.forget()
        self._stage.reset()
        self._guard.restart()
        if extra["worker_error"] is not None and not errors_fit:
            warnings.warn(
                f"checkpoint was {restart}: the error-feedback buffers are reset to zero",
                UserWarning,
                stacklevel=2,
            )
        device = next(iter(_common.params_in_order(self.param_groups))).device
        exchange.load_state_dict(extra if errors_fit else None, device)
        self._readiness.load_state_dict(extra.get("readiness"), device)
        if self._variance_guard is not None:
            self._variance_guard.load_state_dict(extra.get("variance_guard"), device)
        if self._delay is not None:
            pending = extra.get("pending_update")
            self._delay.load_state_dict(pending, device)
            if pending is not None:
                self._data_parallel.restore_untaken_exchange_traffic(pending.get("bytes_sent", {}))
            shared = None if pending is None else pending.get("shared_weights")
            cast(SharedWeights, self._shared_weights).load_state_dict(shared, device)
        self.schedule.load_state_dict(extra)
        self._gradients_since_sync = extra.get("gradients_since_sync")
        for param in _common.params_in_order(self.param_groups):
            own = self.state[param].pop("local_param", None)
            if own is not None:
                param.data.copy_(own)
