"""The machinery 1-bit LAMB, 1-bit Adam and 0/1 Adam share: a schedule of step kinds, dense
gradient averaging, the warm-up and exchanged steps, the exchange overlapped with backward,
checkpoints. Below it: the compression stage's state and local momentum
(:mod:`onebit.optim._compression_stage`) and the data-parallel side, the exchange, DDP,
accounting and collectives (:mod:`onebit.optim._communicating`)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.collectives import allreduce_mean_
from onebit.exchange import (
    NodeGroups,
    NonFiniteError,
    PackedResult,
)
from onebit.optim import _common
from onebit.optim._compression_stage import COMPRESSION, CompressionStage
from onebit.optim._flat import FlatState
from onebit.optim._overlap import BackwardOverlap
from onebit.optim._readiness import ReadinessChecks, VarianceReadiness

logger = logging.getLogger("onebit")

WARMUP = "warmup"
NONFINITE_POLICIES = ("skip", "raise")
#: The buckets of ``overlap_backward`` when no ``bucket_cap_mb`` is given (DDP's default).
DEFAULT_BUCKET_CAP_MB = 25.0


class OneBitOptimizer(ReadinessChecks, CompressionStage):
    """Base class of :class:`OneBitLamb`, :class:`OneBitAdam` and :class:`ZeroOneAdam`.

    Every step has a *kind* from the optimizer's schedule (:meth:`kind_of_step`;
    :attr:`stage` is the kind of the next step). On the kinds in ``DENSE_KINDS`` the
    gradients are averaged over ranks at full precision (by this optimizer with one dense
    allreduce of a flat buffer, or by ``DistributedDataParallel`` when
    :func:`onebit.ddp.register_comm_hook` is used) and the subclass applies its uncompressed
    update (``_warmup_update``). Every other kind is a step of ``_exchanged_step``: here the
    two-kind case of 1-bit LAMB and 1-bit Adam, steps ``1 .. freeze_step`` dense
    (``"warmup"``) and the later ones ``"compression"``: each rank folds its *local* gradient
    into the momentum, the scaled momenta of all tensors go through :attr:`exchange`, and the
    subclass applies its update (``_compressed_update``) with the exchanged momentum, which
    is identical on every rank. :class:`ZeroOneAdam` has four kinds.

    The exchange (:class:`onebit.exchange.Exchange`) is built once from the arguments (flat
    over ``process_group``, in buckets with ``bucket_cap_mb``, hierarchical over
    ``node_groups``, or per tensor), or given with
    :meth:`use_exchange` (the simulation of many workers); it owns the error-feedback state.
    State lives in a :class:`~onebit.optim._flat.FlatState` (built at the first step) and is
    updated in whole-buffer passes by :attr:`updates`; ``self.state[p]`` holds views of it.
    Subclasses set ``_SCALARS`` (per-parameter scalar state and its initial value).
    """

    DENSE_KINDS: frozenset[str] = frozenset({WARMUP})

    _SCALARS: dict[str, float] = {"scaling_coeff": 1.0}

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        freeze_step: int | str,
        max_freeze_step: int | None = None,
        process_group: dist.ProcessGroup | None,
        on_nonfinite: str,
        verify_every: int,
        kernels: str | None,
        node_groups: NodeGroups | None = None,
        max_grad_norm: float = 0.0,
        bucket_cap_mb: float | None = None,
        overlap_backward: bool = False,
    ) -> None:
        _common.check_max_grad_norm(max_grad_norm)
        if not isinstance(overlap_backward, bool):
            raise ValueError(f"overlap_backward must be True or False, got {overlap_backward!r}")
        if overlap_backward:
            if max_grad_norm:
                raise ValueError(
                    "overlap_backward=True sends each bucket's momentum during backward, before "
                    "the total norm of the gradients that max_grad_norm clips by is known: use "
                    "one of them"
                )
            if bucket_cap_mb is None:
                bucket_cap_mb = DEFAULT_BUCKET_CAP_MB

        _common.check_bucket_cap_mb("bucket_cap_mb", bucket_cap_mb)
        if bucket_cap_mb is not None:
            if node_groups is not None or self.compression != "fused":
                raise ValueError(
                    "bucket_cap_mb and overlap_backward bucket the flat fused exchange: not "
                    f"with node_groups or compression={self.compression!r}"
                )
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid on_nonfinite={on_nonfinite!r}: use 'skip' or 'raise'")
        self._init_freeze(freeze_step, max_freeze_step)
        self.on_nonfinite = on_nonfinite
        self.max_grad_norm = max_grad_norm
        self._exchange_buffer: Tensor | None = None
        self._mask: Tensor | None = None
        super().__init__(
            params,
            defaults,
            kernels=kernels,
            process_group=process_group,
            verify_every=verify_every,
            node_groups=node_groups,
            bucket_cap_mb=bucket_cap_mb,
        )
        self._counters["bytes_sent"] = {WARMUP: 0, COMPRESSION: 0}
        self._overlap = None
        if overlap_backward and self.shards is not None:
            raise ValueError(
                "overlap_backward=True with FSDP-sharded parameters: FSDP reduce-scatters "
                "their gradients during backward itself; construct the optimizer with "
                "overlap_backward=False"
            )
        if overlap_backward:
            self._overlap = BackwardOverlap(
                _common.trainable_params(self), self._overlaps_this_step, self._begin_overlap
            )

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

    # ----------------------------------------------------------------- what users see

    def kind_of_step(self, step: int) -> str:
        """The kind of step ``step`` (counted from 1): ``"warmup"`` up to ``freeze_step``,
        then ``"compression"``."""
        return WARMUP if step <= self.freeze_step else COMPRESSION

    @property
    def stage(self) -> str:
        """The kind of the next ``step()`` (:meth:`kind_of_step`), the key its bytes are
        counted under in :attr:`bytes_sent`."""
        return self.kind_of_step(self._counters["step"] + 1)

    @property
    def needs_averaged_gradients(self) -> bool:
        """Whether the next ``step()`` works on gradients averaged over the ranks at full
        precision (a kind in ``DENSE_KINDS``: the warm-up, 0/1 Adam's variance updates): the
        DDP hook and a training loop that averages gradients itself do so exactly then."""
        return self.stage in self.DENSE_KINDS

    # ----------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step; in the compression stage, one compressed exchange."""
        loss = self._evaluate(closure)
        flat = self._flat_state()
        if self._overlap is not None and getattr(self, "grad_scale", None) is not None:
            self._overlap.cancel()
            raise RuntimeError(
                "overlap_backward=True reads the gradients while backward produces them, "
                "before GradScaler's scale could be taken out: construct the optimizer with "
                "overlap_backward=False to train with a GradScaler"
            )
        self._unscale_for_grad_scaler(flat.params)
        stage = self.stage
        traffic_before = self._traffic.total()
        try:
            if not self._overlaps_this_step():  # else after the exchange (_exchanged_step)
                self._verify_replicas_if_due(flat)
            grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
            if stage in self.DENSE_KINDS:
                applied = self._warmup_step(flat, grads)
            else:
                self._clip_own_gradients(grads)
                applied = self._exchanged_step(stage, flat, grads)
        finally:
            if self._overlap is not None:
                self._overlap.cancel()  # nothing stays in flight after a step, even a failed one
            self.count_bytes_sent(stage, self._traffic.total() - traffic_before)
        if applied:
            flat.refresh_half_params()
            self._counters["step"] += 1
        return loss

    # torch.amp.GradScaler calls step() on every rank with `grad_scale` set instead of
    # unscaling and skipping the step itself on the ranks that saw an Inf: a local skip would
    # leave the other ranks waiting in a collective. The step unscales, and its own check of
    # non-finite gradients agrees across ranks.
    _step_supports_amp_scaling = True

    def _unscale_for_grad_scaler(self, params: list[Tensor]) -> None:
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is None:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, grad_scale.to(grads[0].device))

    def _skip(self, reason: str) -> bool:
        message = f"non-finite gradients at step {self.step_count + 1} ({reason})"
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message + "; raising on every rank (on_nonfinite='raise')")
        self._counters["skipped_steps"] += 1
        warnings.warn(
            f"{message}: step skipped on every rank, state unchanged "
            f"({self.skipped_steps} skipped so far)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False

    def _warmup_step(self, flat: FlatState, grads: Sequence[Tensor | None]) -> bool:
        """Average the gradients (unless DDP did), then the subclass's uncompressed update.

        In the plain loop one dense allreduce carries every gradient and one flag per
        parameter that says whether a rank had a gradient for it; a parameter no rank has a
        gradient for is left alone, and a gradient missing on some ranks counts as zero."""
        if not self.gradients_averaged_by_ddp and self.world_size > 1:
            flat.load_grads(grads)
            with self._collective():
                allreduce_mean_(flat.grad_and_flags, self.process_group, traffic=self._traffic)
            present = (flat.grad_flags > 0).tolist()
            grads = flat.views(flat.grad)
        else:
            present = [grad is not None for grad in grads]
        if self.max_grad_norm:
            present_grads = [g for g, has in zip(grads, present, strict=True) if has]
            _common.clip_by_total_norm_(present_grads, self.max_grad_norm, self.shards)
        self._expose_new_state(flat, present)
        if not self._warmup_update(flat, grads, present):
            return self._skip("warm-up gradients")
        self._check_readiness(flat, grads, present)
        return True

    def _exchanged_step(self, kind: str, flat: FlatState, grads: Sequence[Tensor | None]) -> bool:
        """A step of a kind that does not average densely; here ``"compression"``: the local
        momentum through :attr:`exchange`, then ``_compressed_update``. With
        ``overlap_backward`` (after the stage's first step) the exchange started during
        backward, and the replica check comes after it, so that every rank's collectives
        keep one order."""
        buffer = self._exchange_buffer_for(flat)
        try:
            if self._overlaps_this_step():
                with self._collective():
                    packed = self._overlap.complete()
                self._verify_replicas_if_due(flat)
            else:
                self._scaled_local_momentum(flat, grads, buffer)
                if not self._gradients_checked and self.step_count == self.freeze_step:
                    with self._collective():  # the first compression step only (not on resume)
                        self._check_gradients_are_local(buffer)
                with self._collective():
                    packed = self.exchange.exchange(buffer)
            nonfinite = False
        except NonFiniteError:
            nonfinite = True
        if self.shards is not None:  # the other slices' replicas skip the step too
            nonfinite = self.shards.any_(nonfinite, flat.device)
        if nonfinite:
            return self._skip("a rank's local momentum")
        self._compressed_update(flat, packed, buffer, self._mask, self._has_state)
        return True

    def _overlaps_this_step(self) -> bool:
        """Whether the next step's exchange starts during backward: ``overlap_backward``, in
        the compression stage, after its first step (which sets the stage up) or the first
        after a checkpoint load. The same on every rank."""
        return (
            self._overlap is not None
            and self._exchange_buffer is not None
            and self.stage == COMPRESSION
        )

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (per parameter) plus ``"onebit"``: the step, this rank's
        error-feedback buffers, the world size they belong to, and the traffic counters."""
        state = super().state_dict()
        state["onebit"] = {
            "optimizer": type(self).__name__,
            "step": self._counters["step"],
            "skipped_steps": self._counters["skipped_steps"],
            "bytes_sent": dict(self._counters["bytes_sent"]),
            "compression": self.compression,
            "freeze_step": self.freeze_step,
            "readiness": self._readiness.state_dict(),
            **self.exchange.state_dict(self._local_numels()),
        }
        return state

    def check_checkpoint(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the first thing in ``state_dict`` that does not fit: a
        checkpoint of another optimizer, of another compression, or of another model."""
        extra = state_dict.get("onebit")
        if not isinstance(extra, dict) or extra.get("optimizer") != type(self).__name__:
            found = extra.get("optimizer") if isinstance(extra, dict) else "a non-onebit optimizer"
            raise ValueError(f"checkpoint was saved by {found}, not by {type(self).__name__}")
        saved_compression = extra.get("compression", "fused")
        if saved_compression != self.compression:
            raise ValueError(
                f"checkpoint was saved with compression={saved_compression!r}, this "
                f"{type(self).__name__} uses compression={self.compression!r}: their error-"
                "feedback states have different layouts; construct the optimizer with "
                f"compression={saved_compression!r} to resume"
            )
        super().check_checkpoint(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint; with another world size the error buffers restart from zero.

        Raises ``ValueError`` naming the problem, with nothing changed, for a checkpoint of
        another optimizer or model (:meth:`check_checkpoint`), or error buffers of the wrong
        size."""
        self.check_checkpoint(state_dict)
        extra = state_dict["onebit"]
        if self._overlap is not None:
            self._overlap.cancel()
        numels = self._local_numels()
        errors_fit = self.exchange.check_state(extra, numels)
        restart = self.exchange.restart_reason(extra, numels)
        super().load_state_dict({k: state_dict[k] for k in ("state", "param_groups")})
        _common.restore_state_precision(self, state_dict)
        self._counters = {
            "step": int(extra["step"]),
            "skipped_steps": int(extra["skipped_steps"]),
            "bytes_sent": dict(extra["bytes_sent"]),
        }
        self._forget_flat_state()
        self._exchange_buffer = None
        self._replicas_verified = False
        if extra["worker_error"] is not None and not errors_fit:
            warnings.warn(
                f"checkpoint was {restart}: the error-feedback buffers are reset to zero",
                UserWarning,
                stacklevel=2,
            )
        device = next(iter(_common.params_in_order(self.param_groups))).device
        self.exchange.load_state_dict(extra if errors_fit else None, device)
        self._readiness = VarianceReadiness()
        if "readiness" in extra:
            self._readiness.load_state_dict(extra["readiness"], device)
        if self.auto_freeze and extra.get("freeze_step", self.freeze_step) < self.freeze_step:
            self.freeze_step = int(extra["freeze_step"])  # where "auto" froze (or will)

    # ----------------------------------------------------------------- subclass hooks
    def _warmup_update(
        self, flat: FlatState, grads: Sequence[Tensor | None], active: Sequence[bool]
    ) -> bool:
        """The uncompressed update with the averaged gradients ``grads``; False (and
        nothing changed) if a gradient is not finite."""
        raise NotImplementedError

    def _compressed_update(
        self,
        flat: FlatState,
        packed: PackedResult,
        scratch: Tensor,
        mask: Tensor | None,
        active: Sequence[bool],
    ) -> None:
        """The update with the exchanged (scaled) momentum ``packed``, decoded on the fly or
        into ``scratch`` (the exchange buffer, free now); ``flat.exp_avg`` still holds the
        previous momentum."""
        raise NotImplementedError
