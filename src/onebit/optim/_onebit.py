"""The machinery 1-bit LAMB, 1-bit Adam and 0/1 Adam share: a schedule of step kinds, dense
gradient averaging, the exchange (:mod:`onebit.exchange`) built once from the arguments,
checkpoints and accounting."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.collectives import allreduce_mean_
from onebit.consistency import ReplicaMismatchError, verify_replicas
from onebit.exchange import (
    BucketedExchange,
    Exchange,
    FlatExchange,
    HierarchicalExchange,
    NodeGroups,
    NonFiniteError,
    PackedResult,
    PerTensorExchange,
    TrafficCounter,
    node_topology,
    world_size,
)
from onebit.exchange.transport import all_gather_into
from onebit.optim import _common
from onebit.optim._base import FlatOptimizer
from onebit.optim._flat import FlatState
from onebit.optim._overlap import BackwardOverlap, bucket_members

logger = logging.getLogger("onebit")

WARMUP = "warmup"
COMPRESSION = "compression"
NONFINITE_POLICIES = ("skip", "raise")
#: The buckets of ``overlap_backward`` when no ``bucket_cap_mb`` is given (DDP's default).
DEFAULT_BUCKET_CAP_MB = 25.0


class CommunicationError(RuntimeError):
    """A collective of the optimizer's step failed: a peer died, hung or diverged."""


class OneBitOptimizer(FlatOptimizer):
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
    # How the momentum is exchanged: "fused" (one buffer scaled by s_p) or "per_tensor"
    # (each tensor compressed alone, DeepSpeed's 1-bit Adam; no s_p).
    compression = "fused"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        freeze_step: int,
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
        if bucket_cap_mb is not None:
            if not (bucket_cap_mb > 0 and math.isfinite(bucket_cap_mb)):
                raise ValueError(
                    f"Invalid bucket_cap_mb={bucket_cap_mb}: it must be a finite number > 0 "
                    "(or None: the whole buffer in one exchange)"
                )
            if node_groups is not None or self.compression != "fused":
                raise ValueError(
                    "bucket_cap_mb and overlap_backward bucket the flat fused exchange: not "
                    f"with node_groups or compression={self.compression!r}"
                )
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"Invalid freeze_step={freeze_step}: it must be an int >= 1 (the number of "
                "warm-up steps that estimate the variance before it is frozen)"
            )
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid on_nonfinite={on_nonfinite!r}: use 'skip' or 'raise'")
        if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
            raise ValueError(f"Invalid verify_every={verify_every}: it must be an int >= 0")
        self.verify_every = verify_every
        self.freeze_step = freeze_step
        self._process_group = process_group
        self._exchange: Exchange | None = None
        self._exchange_given = False  # by use_exchange, not built from the arguments
        self.on_nonfinite = on_nonfinite
        self.max_grad_norm = max_grad_norm
        self._gradients_averaged_by_ddp = False
        self._counters: dict[str, Any] = {
            "step": 0,
            "skipped_steps": 0,
            "bytes_sent": {WARMUP: 0, COMPRESSION: 0},
        }
        self._exchange_buffer: Tensor | None = None
        self._mask: Tensor | None = None
        self._replicas_verified = False
        self._verification_pending = False  # a check was due while replicas differed by design
        self._gradients_checked = False
        self.node_groups = node_groups
        self._check_node_groups()
        self._traffic = TrafficCounter()
        super().__init__(params, defaults, kernels)
        self.bucket_cap_mb = bucket_cap_mb
        self._bucket_elements = None
        if bucket_cap_mb is not None:
            dtypes = {_common.state_dtype(p) for p in _common.trainable_params(self)}
            element = 8 if dtypes == {torch.float64} else 4
            self._bucket_elements = max(1, int(bucket_cap_mb * 2**20) // element)
        self._overlap = None
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
    @property
    def step_count(self) -> int:
        """Steps applied so far (skipped steps are not counted)."""
        return self._counters["step"]

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank's gradients were not finite."""
        return self._counters["skipped_steps"]

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

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank has sent for this optimizer in each stage (a copy), as a
        bandwidth-optimal implementation sends them (:mod:`onebit.collectives`): the dense
        allreduce of warm-up gradients and the 1-bit exchange of ``step()``, the warm-up
        allreduces of :func:`onebit.ddp.register_comm_hook`, and the one-time gradient check
        of the first compression step. Not counted: the replica checks (a few bytes per
        tensor, at the first step and every ``verify_every``) and traffic the optimizer does
        not make, such as the dense allreduce of a ``DistributedDataParallel`` model without
        onebit's hook (``step()`` warns when it finds the gradients averaged already)."""
        return dict(self._counters["bytes_sent"])

    @property
    def traffic_by_kind(self) -> dict[str, int]:
        """Bytes this rank has sent in ``step()`` per kind of collective (a copy):
        ``"allreduce"``, ``"compressed_allreduce"`` (or ``"intra_node"`` and ``"inter_node"``
        with ``node_groups``) and ``"gradient_check"`` (the first compression step's)."""
        return dict(self._traffic.bytes_sent)

    @property
    def gradients_averaged_by_ddp(self) -> bool:
        """Whether ``DistributedDataParallel`` averages the gradients of the dense steps
        (:meth:`attach_to_ddp`); otherwise ``step()`` averages them itself."""
        return self._gradients_averaged_by_ddp

    def attach_to_ddp(self, process_group: dist.ProcessGroup | None) -> None:
        """Let DDP (over ``process_group``) average the gradients of the dense steps; called
        by :func:`onebit.ddp.register_comm_hook`, whose hook does it. The optimizer's group
        becomes DDP's (it must be the same if one was given)."""
        if self.process_group is None:
            self.process_group = process_group
        elif self.process_group != process_group:
            raise ValueError("the optimizer's process_group differs from the DDP model's")
        self._gradients_averaged_by_ddp = True

    def count_bytes_sent(self, stage: str, nbytes: int) -> None:
        """Add traffic sent on this optimizer's behalf outside ``step()`` (the DDP hook)."""
        self._counters["bytes_sent"][stage] += nbytes

    @property
    def world_size(self) -> int:
        return world_size(self.process_group)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group (``None``: the world)."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        """Set before training (the DDP hook sets DDP's group): an exchange built from the
        old group is built again, keeping its error state if the topology is the same."""
        previous, self._process_group = self._process_group, group
        old = self._exchange
        if old is None or self._exchange_given:
            return
        new = self._build_exchange()
        if old.worker_error is not None and old.topology != new.topology:
            self._process_group = previous  # nothing changed
            raise ValueError(
                f"the process group of {type(self).__name__} cannot change from "
                f"{old.world_size} to {new.world_size} ranks once its exchange holds "
                "error-feedback state"
            )
        if old.numels is not None:
            new.bind(old.numels, old.dtype, old.device, old.backend, old.traffic)
        if old.worker_error is not None:
            new.load_state_dict(old.state_dict(), old.worker_error.device)
        self._exchange = new

    @property
    def exchange(self) -> Exchange:
        """The exchange of the steps that do not average densely (it owns the error state)."""
        if self._exchange is None:
            self._exchange = self._build_exchange()
        return self._exchange

    def _build_exchange(self) -> Exchange:
        """The exchange the arguments ask for: per tensor, hierarchical over the node
        groups, or flat over the process group."""
        if self.compression == "per_tensor":
            return PerTensorExchange(self.process_group)
        if self.node_groups:
            return HierarchicalExchange(self.node_groups)
        if self._bucket_elements:
            return BucketedExchange(self.process_group, self._bucket_elements)
        return FlatExchange(self.process_group)

    def use_exchange(self, exchange: Exchange) -> None:
        """Exchange through ``exchange`` instead of the one the arguments ask for (a
        :class:`onebit.exchange.SimulatedExchange` simulates many workers in one process).
        Only before the first exchange, in one process, for the fused exchange."""
        if self._exchange_given:
            raise ValueError(
                f"{type(self).__name__} is already simulated: it exchanges through "
                f"{type(self._exchange).__name__} (one SimulatedDataParallel per optimizer)"
            )
        if self.compression != "fused":
            raise ValueError(
                f"compression={self.compression!r} exchanges over the process group only; a "
                f"{type(exchange).__name__} simulates the fused exchange (use "
                "compression='fused')"
            )
        if self.node_groups is not None or self.world_size > 1:
            raise ValueError(
                "the simulated optimizer must run in one process: give it no node_groups "
                "and no process group of more than one rank"
            )
        if self.bucket_cap_mb is not None:
            raise ValueError("bucket_cap_mb is not simulated: give the optimizer none")
        if self._exchange is not None and self._exchange.worker_error is not None:
            raise ValueError(
                "use_exchange() must come before the first exchange (or checkpoint load): "
                "this optimizer's exchange already holds error-feedback state"
            )
        self._exchange, self._exchange_given = exchange, True

    @property
    def topology(self) -> tuple[int, int]:
        """``(ranks per node, nodes)`` of the exchange: ``(1, world_size)`` when flat."""
        return self.exchange.topology

    @property
    def error_feedback(self) -> tuple[Tensor | None, Tensor | None]:
        """``(worker_error, server_error)`` of :attr:`exchange`, created at its first use:
        this rank's, or with a simulated exchange every simulated worker's, rank after rank."""
        return self.exchange.worker_error, self.exchange.server_error

    def memory_bytes(self) -> dict[str, int]:
        """:meth:`FlatOptimizer.memory_bytes` plus ``"error_feedback"`` (the exchange's
        worker and server errors, once created); ``"scratch"`` includes the exchange buffer
        and the exchange's own scratch."""
        memory = super().memory_bytes()
        errors = [] if self._exchange is None else [e for e in self.error_feedback if e is not None]
        memory["error_feedback"] = sum(e.numel() * e.element_size() for e in errors)
        if self._exchange_buffer is not None:
            buffer = self._exchange_buffer
            memory["scratch"] += buffer.numel() * buffer.element_size()
        if self._exchange is not None:
            memory["scratch"] += self._exchange.nbytes()
        return memory

    def _check_node_groups(self) -> None:
        if self.node_groups is None:
            return
        if len(self.node_groups) != 2:
            raise ValueError("node_groups must be the pair (intra_group, inter_group)")
        local, nodes = node_topology(self.node_groups)
        if local * nodes != self.world_size:
            raise ValueError(
                f"node_groups describe {nodes} nodes of {local} ranks = {local * nodes} ranks, "
                f"but the data-parallel group has {self.world_size}"
            )

    # ----------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "exp_avg_mask" in group:
            masks = self._masks_of(group)
            for index, (param, mask) in enumerate(zip(group["params"], masks, strict=True)):
                if mask.shape != param.shape:
                    raise ValueError(
                        f"exp_avg_mask for parameter {index} of its group has shape "
                        f"{tuple(mask.shape)}; the parameter has shape {tuple(param.shape)}"
                    )

    @staticmethod
    def _masks_of(group: dict[str, Any]) -> list[Tensor]:
        masks = group["exp_avg_mask"]
        if isinstance(masks, Tensor):
            return [masks] * len(group["params"])
        masks = list(masks)
        if len(masks) != len(group["params"]) or not all(isinstance(m, Tensor) for m in masks):
            raise ValueError(
                f"exp_avg_mask must be a tensor or a list of one tensor per parameter; got "
                f"{len(masks)} entries for {len(group['params'])} parameters"
            )
        return masks

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

    def _verify_replicas_if_due(self, flat: FlatState) -> None:
        """The replica check, at the first step and every ``verify_every``, once the
        replicas agree by design (one small all-gather)."""
        due = self.verify_every and self.step_count % self.verify_every == 0
        self._verification_pending |= bool(due) or not self._replicas_verified
        if self._verification_pending and self._replicas_agree():
            with self._collective():
                verify_replicas(
                    self._replica_tensors(flat), self.process_group, step=self.step_count + 1
                )
            self._replicas_verified, self._verification_pending = True, False

    def _replicas_agree(self) -> bool:
        """Whether every rank's parameters are bit-identical by design before the next step
        (always, for 1-bit LAMB and 1-bit Adam); replica checks wait until they are."""
        return True

    def _replica_tensors(self, flat: FlatState) -> list[Tensor]:
        """What must agree across ranks: the parameters and any fp32 master copies."""
        return flat.params + [master for _, master in flat.half_params]

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """Turn a failed collective (a dead or stuck peer) into a clear error."""
        try:
            yield
        except ReplicaMismatchError:
            raise
        except RuntimeError as error:
            if self.world_size == 1:
                raise
            raise CommunicationError(
                f"{type(self).__name__}: a collective failed at step {self.step_count + 1} "
                f"({self.stage} stage) on rank {dist.get_rank()}: another rank has probably "
                "died or stopped responding (collectives give up after the timeout passed to "
                f"init_process_group). Cause: {error}"
            ) from error

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
            _common.clip_by_total_norm_(present_grads, self.max_grad_norm)
        self._expose_new_state(flat, present)
        if not self._warmup_update(flat, grads, present):
            return self._skip("warm-up gradients")
        return True

    def _clip_own_gradients(self, grads: Sequence[Tensor | None]) -> None:
        """With ``max_grad_norm``: this rank's own gradients clipped at ``max_grad_norm·√W``
        (W workers of the exchange; ALGORITHM.md, "Gradient clipping")."""
        if self.max_grad_norm:
            threshold = self.max_grad_norm * math.sqrt(self.exchange.world_size)
            _common.clip_by_total_norm_([g for g in grads if g is not None], threshold)

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
        except NonFiniteError:
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

    def _begin_overlap(self):
        """The step's bucketed exchange, for :class:`~onebit.optim._overlap.BackwardOverlap`:
        its pipeline, the tensors in each bucket, how to form their momenta, and which
        tensors need no gradient (those left out of the stage)."""
        flat, buffer, exchange = self._flat, self._exchange_buffer, self.exchange
        buffer[flat.numel :].zero_()
        members = bucket_members(flat.offsets, exchange.buckets())

        def form(only: Sequence[int]) -> None:
            grads = [None] * len(flat.params)
            for index in only:
                grads[index] = _common.dense_grad(flat.params[index], flat.dtype)
            self._scaled_local_momentum(flat, grads, buffer, only)

        ready = [not has for has in self._has_state]
        return exchange.begin(buffer), members, form, ready

    def _bind_exchange(self, flat: FlatState) -> Exchange:
        """:attr:`exchange`, bound to the flat state's tensors, backend and traffic counter."""
        exchange = self.exchange
        exchange.bind(
            [p.numel() for p in flat.params], flat.dtype, flat.device, self.backend, self._traffic
        )
        return exchange

    def _scaled_local_momentum(
        self,
        flat: FlatState,
        grads: Sequence[Tensor | None],
        buffer: Tensor,
        only: Sequence[int] | None = None,
    ) -> None:
        """``buffer = s_p (b1 m_p + (1 - b1) g_p)`` of this rank's gradients, padded; with
        ``only``, just those tensors' ranges (the padding untouched)."""
        selected = set(range(len(grads)) if only is None else only)
        local = [  # a parameter without a gradient on this rank contributes zeros
            torch.zeros(p.shape, dtype=flat.dtype, device=flat.device)
            if g is None and index in selected
            else g
            for index, (p, g) in enumerate(zip(flat.params, grads, strict=True))
        ]
        self.updates.scaled_momentum(
            flat, local, flat.scalars["scaling_coeff"], buffer, self._has_state, only
        )
        if only is None:
            buffer[flat.numel :].zero_()

    @torch.no_grad()
    def local_momentum(self) -> Tensor:
        """In the compression stage: the momentum the next ``step()`` would send for the
        gradients in ``.grad``, ``s_p (b1 m_p + (1 - b1) g_p)`` in the padded exchange buffer
        (overwritten by the next call and by ``step()``), from the gradients clipped as
        ``step()`` clips them (``max_grad_norm``). Nothing else changes, except that the first
        call of the stage sets up its state, as its first ``step()`` would."""
        if self.stage != COMPRESSION:
            raise RuntimeError(
                f"local_momentum() is for the compression stage; step {self.step_count + 1} "
                f"is in the warm-up (freeze_step={self.freeze_step})"
            )
        if self._overlap is not None and self._overlap.in_flight:
            raise RuntimeError(
                "local_momentum() would overwrite the momentum whose exchange started during "
                "backward (overlap_backward=True); call it before backward or after step()"
            )
        flat = self._flat_state()
        grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
        buffer = self._exchange_buffer_for(flat)
        self._clip_own_gradients(grads)
        self._scaled_local_momentum(flat, grads, buffer)
        return buffer

    def _check_gradients_are_local(self, momentum: Tensor) -> None:
        """Once, at the first compression step: warn (rank 0) if every rank passed the same
        gradients, i.e. something averaged them before ``step()``, most likely
        ``DistributedDataParallel`` without onebit's hook, which keeps sending every gradient
        densely. The ranks' momenta agree up to this step, so the new ones (the exchange
        buffer ``momentum``) agree exactly when the gradients do: each rank contributes a
        checksum (the wrapping int64 sum of the bits) to one all-gather, counted in
        ``bytes_sent``. No cost at later steps."""
        self._gradients_checked = True
        n = self.world_size
        if n == 1:
            return
        bits = momentum.view(torch.int64 if momentum.dtype == torch.float64 else torch.int32)
        checksum = bits.sum(dtype=torch.int64).reshape(1)
        gathered = torch.empty(n, dtype=torch.int64, device=checksum.device)
        all_gather_into(gathered, checksum, self.process_group, n)
        self._traffic.record("gradient_check", (n - 1) * checksum.element_size())
        if len(set(gathered.tolist())) == 1 and self._is_logging_rank():
            warnings.warn(
                f"{type(self).__name__}: at the first compression step (step "
                f"{self.step_count + 1}) every rank passed bit-identical gradients to step(): "
                "something averaged them over the ranks already, most likely "
                "DistributedDataParallel without onebit's communication hook. DDP then still "
                "sends every gradient at full precision on every step, which "
                "optimizer.bytes_sent does not count, and the 1-bit exchange saves nothing. "
                "Register the hook once, before training: "
                "onebit.ddp.register_comm_hook(model, optimizer) (HF Trainer, Accelerate, "
                "Lightning: see onebit.integrations), or drop DDP and call step() on each "
                "rank's own gradients. If every rank trains on the same data on purpose, "
                "ignore this warning.",
                UserWarning,
                stacklevel=2,
            )

    # ----------------------------------------------------------------- the switch
    def _exchange_buffer_for(self, flat: FlatState) -> Tensor:
        """The buffer the momentum is exchanged in (padded as :attr:`exchange` needs); at the
        first compression step also the masks, the scaling coefficients ``s_p`` and the
        subclass's compression-stage state."""
        if self._exchange_buffer is not None:
            return self._exchange_buffer
        if not any(self._has_state):
            raise RuntimeError(
                "no parameter received a gradient during the warm-up stage; nothing to compress"
            )
        skipped = self._has_state.count(False)
        if skipped:
            logger.warning(
                "%d trainable parameter tensor(s) had no gradient during warm-up; they are "
                "left out of the compression stage and no longer updated",
                skipped,
            )
        exchange = self._bind_exchange(flat)
        size = exchange.buffer_size([p.numel() for p in flat.params])
        self._mask = self._flat_mask(flat)
        if self.step_count == self.freeze_step:  # not when resuming later in the stage
            self._start_compression(flat)
        self._exchange_buffer = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        return self._exchange_buffer

    def _flat_mask(self, flat: FlatState) -> Tensor | None:
        """The tensors' masks as one flat buffer: ``[v > 0]`` times the groups'
        ``exp_avg_mask`` (ALGORITHM.md, "Elements whose variance is 0"); ``None`` where that
        is 1 everywhere. Tensors left out of the exchange count as ones."""
        mask = (flat.exp_avg_sq > 0).to(flat.dtype)
        for index, active in enumerate(self._has_state):
            if not active:
                flat.view(mask, index).fill_(1)
        index_of = {id(param): index for index, param in enumerate(flat.params)}
        for group in self.param_groups:
            if "exp_avg_mask" in group:
                for param, param_mask in zip(group["params"], self._masks_of(group), strict=True):
                    if id(param) in index_of:
                        flat.view(mask, index_of[id(param)]).mul_(param_mask)
        return None if bool((mask == 1).all()) else mask

    def _start_compression(self, flat: FlatState) -> None:
        """At the first compression step: ``s_p = mean_q rms(m_q) / rms(m_p)`` (1 if 0; stays 1
        with per-tensor compression); subclasses add their compression-stage state."""
        indices = [i for i, has in enumerate(self._has_state) if has]
        momenta = [flat.view(flat.exp_avg, i) for i in indices]
        if self.compression == "fused":
            sizes = torch.tensor([m.numel() for m in momenta], dtype=flat.dtype, device=flat.device)
            rms = torch.stack(torch._foreach_norm(momenta)) / sizes.sqrt()
            scaling = torch.where(rms > 0, rms.mean() / torch.where(rms > 0, rms, 1), 1)
            flat.scalars["scaling_coeff"][indices] = scaling
        if self._is_logging_rank():
            logger.info(
                "%s: switching to 1-bit compressed momentum at step %d (%d tensors, %d "
                "elements, %d ranks)",
                type(self).__name__,
                self.step_count + 1,
                len(indices),
                sum(m.numel() for m in momenta),
                self.world_size,
            )

    def _is_logging_rank(self) -> bool:
        return not dist.is_initialized() or dist.get_rank(self.process_group) == 0

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
            **self.exchange.state_dict([p.numel() for p in _common.trainable_params(self)]),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint; with another world size the error buffers restart from zero.

        Raises ``ValueError`` naming the problem, with nothing changed, for a checkpoint of
        another optimizer or model, or error buffers of the wrong size."""
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
        _common.validate_checkpoint(self, state_dict)
        if self._overlap is not None:
            self._overlap.cancel()
        numels = [p.numel() for p in _common.trainable_params(self)]
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
