"""The machinery 1-bit LAMB and 1-bit Adam share: stages, the fused momentum buffer, the
compressed exchange with its error state, gradient averaging, checkpoints and accounting."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.collectives import (
    CompressionWorkspace,
    NonFiniteError,
    PackedResult,
    TrafficCounter,
    allreduce_mean_,
    compressed_allreduce_packed,
    compressed_allreduce_per_tensor,
    padded_size,
    per_tensor_error_sizes,
    world_size,
)
from onebit.consistency import ReplicaMismatchError, verify_replicas
from onebit.hierarchical import (
    HierarchicalWorkspace,
    NodeGroups,
    hierarchical_compressed_allreduce_packed,
    node_topology,
)
from onebit.optim import _common, functional
from onebit.optim._flat import FlatOptimizer, FlatState

logger = logging.getLogger("onebit")

WARMUP = "warmup"
COMPRESSION = "compression"
NONFINITE_POLICIES = ("skip", "raise")


class CommunicationError(RuntimeError):
    """A collective of the optimizer's step failed: a peer died, hung or diverged."""


class MomentumExchange(Protocol):
    """What replaces the collective exchange of the compression stage: the simulation of
    ``L * M`` workers in one process (:class:`onebit.simulate.SimulatedDataParallel`), which
    feeds every worker's :meth:`OneBitOptimizer.local_momentum` in before ``step()``. The
    optimizer then holds the error state of all workers, one after another."""

    topology: tuple[int, int]  # (ranks per node L, nodes M)

    def exchange(
        self, worker_error: Tensor, server_error: Tensor, traffic: TrafficCounter
    ) -> PackedResult:
        """The exchanged momentum of all workers (their bytes counted in ``traffic``)."""
        ...


class OneBitOptimizer(FlatOptimizer):
    """Base class of :class:`OneBitLamb` and :class:`OneBitAdam`.

    Steps ``1 .. freeze_step`` form the warm-up stage: gradients are averaged over ranks at full
    precision (by this optimizer with one dense allreduce of a flat buffer, or by
    ``DistributedDataParallel`` when :func:`onebit.ddp.register_comm_hook` is used) and the
    subclass applies its uncompressed update. Later steps form the compression stage: each
    rank folds its *local* gradient into the momentum, the scaled momenta of all tensors are
    exchanged in one :func:`onebit.compressed_allreduce`, and the subclass applies its update
    with the decoded momentum, which is identical on every rank.

    State lives in a :class:`~onebit.optim._flat.FlatState` (built at the first step) and is
    updated in whole-buffer passes by :mod:`onebit.optim.functional`; ``self.state[p]`` holds
    views of it. Subclasses set ``_SCALARS`` (per-parameter scalar state and its initial
    value) and implement ``_warmup_update`` and ``_compressed_update``.
    """

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
    ) -> None:
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
        self.process_group = process_group
        self.on_nonfinite = on_nonfinite
        self.gradients_averaged_by_ddp = False
        self._counters: dict[str, Any] = {
            "step": 0,
            "skipped_steps": 0,
            "bytes_sent": {WARMUP: 0, COMPRESSION: 0},
        }
        self._worker_error: Tensor | None = None
        self._server_error: Tensor | None = None
        # None: this rank's momentum is exchanged over the process group (or node groups).
        self.momentum_exchange: MomentumExchange | None = None
        self._exchange_buffer: Tensor | None = None
        self._mask: Tensor | None = None
        self._replicas_verified = False
        self._verification_pending = False  # a check was due while replicas differed by design
        self._gradients_checked = False
        self.node_groups = node_groups
        self._check_node_groups()
        self._workspace = HierarchicalWorkspace() if node_groups else CompressionWorkspace()
        self._traffic = TrafficCounter()
        super().__init__(params, defaults, kernels)

    # ----------------------------------------------------------------- what users see
    @property
    def step_count(self) -> int:
        """Steps applied so far (skipped steps are not counted)."""
        return self._counters["step"]

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank's gradients were not finite."""
        return self._counters["skipped_steps"]

    @property
    def stage(self) -> str:
        """``"warmup"`` or ``"compression"``: the stage the next ``step()`` runs in."""
        return WARMUP if self._counters["step"] < self.freeze_step else COMPRESSION

    @property
    def needs_averaged_gradients(self) -> bool:
        """Whether the next ``step()`` works on gradients averaged over the ranks at full
        precision (the warm-up stage): the DDP hook and a training loop that averages
        gradients itself do so exactly then."""
        return self.stage == WARMUP

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

    def count_bytes_sent(self, stage: str, nbytes: int) -> None:
        """Add traffic sent on this optimizer's behalf outside ``step()`` (the DDP hook)."""
        self._counters["bytes_sent"][stage] += nbytes

    @property
    def world_size(self) -> int:
        return world_size(self.process_group)

    @property
    def topology(self) -> tuple[int, int]:
        """``(ranks per node, nodes)`` of the exchange: ``(1, world_size)`` when flat."""
        if self.momentum_exchange is not None:
            return self.momentum_exchange.topology
        return node_topology(self.node_groups) if self.node_groups else (1, self.world_size)

    @property
    def error_feedback(self) -> tuple[Tensor | None, Tensor | None]:
        """``(worker_error, server_error)``, created at the first compression step: this
        rank's, or with a :attr:`momentum_exchange` every simulated worker's, rank after rank."""
        return self._worker_error, self._server_error

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
        self._unscale_for_grad_scaler(flat.params)
        stage = self.stage
        traffic_before = self._traffic.total()
        try:
            due = self.verify_every and self.step_count % self.verify_every == 0
            self._verification_pending |= bool(due) or not self._replicas_verified
            if self._verification_pending and self._replicas_agree():
                with self._collective():
                    verify_replicas(
                        self._replica_tensors(flat), self.process_group, step=self.step_count + 1
                    )
                self._replicas_verified, self._verification_pending = True, False
            grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
            if self.needs_averaged_gradients:
                applied = self._warmup_step(flat, grads)
            else:
                applied = self._compression_step(flat, grads)
        finally:
            self.count_bytes_sent(stage, self._traffic.total() - traffic_before)
        if applied:
            flat.refresh_half_params()
            self._counters["step"] += 1
        return loss

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
        self._expose_new_state(flat, present)
        if not self._warmup_update(flat, grads, present):
            return self._skip("warm-up gradients")
        return True

    def _compression_step(self, flat: FlatState, grads: Sequence[Tensor | None]) -> bool:
        buffer = self._exchange_buffer_for(flat)
        try:
            if self.momentum_exchange is None:
                self._scaled_local_momentum(flat, grads, buffer)
                if not self._gradients_checked and self.step_count == self.freeze_step:
                    with self._collective():  # the first compression step only (not on resume)
                        self._check_gradients_are_local(buffer)
                with self._collective():
                    packed = self._exchange(buffer)
            else:
                errors = (self._worker_error, self._server_error)
                packed = self.momentum_exchange.exchange(*errors, self._traffic)
        except NonFiniteError:
            return self._skip("a rank's local momentum")
        self._compressed_update(flat, packed, buffer, self._mask, self._has_state)
        return True

    def _scaled_local_momentum(
        self, flat: FlatState, grads: Sequence[Tensor | None], buffer: Tensor
    ) -> None:
        """``buffer = s_p (b1 m_p + (1 - b1) g_p)`` of this rank's gradients, padded."""
        local = [  # a parameter without a gradient on this rank contributes zeros
            torch.zeros(p.shape, dtype=flat.dtype, device=flat.device) if g is None else g
            for p, g in zip(flat.params, grads, strict=True)
        ]
        functional.scaled_momentum(
            flat,
            local,
            flat.scalars["scaling_coeff"],
            buffer,
            self._has_state,
            backend=self._backend,
        )

    @torch.no_grad()
    def local_momentum(self) -> Tensor:
        """In the compression stage: the momentum the next ``step()`` would send for the
        gradients in ``.grad``, ``s_p (b1 m_p + (1 - b1) g_p)`` in the padded exchange buffer
        (overwritten by the next call and by ``step()``). Nothing else changes, except that
        the first call of the stage sets up its state, as its first ``step()`` would."""
        if self.stage != COMPRESSION:
            raise RuntimeError(
                f"local_momentum() is for the compression stage; step {self.step_count + 1} "
                f"is in the warm-up (freeze_step={self.freeze_step})"
            )
        flat = self._flat_state()
        grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
        buffer = self._exchange_buffer_for(flat)
        self._scaled_local_momentum(flat, grads, buffer)
        return buffer

    def _exchange(self, buffer: Tensor) -> PackedResult | None:
        """The 1-bit exchange of the scaled momenta: flat, or hierarchical by node; with
        per-tensor compression, each parameter's view of ``buffer`` is replaced in place by its
        exchanged momentum (and nothing is returned)."""
        if self.compression == "per_tensor":
            compressed_allreduce_per_tensor(
                self._flat.views(buffer),
                self._worker_error,
                self._server_error,
                self.process_group,
                traffic=self._traffic,
                kernels=self._backend,
            )
            return None
        errors = (buffer, self._worker_error, self._server_error)
        options = dict(workspace=self._workspace, traffic=self._traffic, kernels=self._backend)
        if self.node_groups:
            return hierarchical_compressed_allreduce_packed(*errors, *self.node_groups, **options)
        return compressed_allreduce_packed(*errors, self.process_group, scratch=buffer, **options)

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
        dist.all_gather_into_tensor(gathered, checksum, group=self.process_group)
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
        """The padded buffer the momentum is exchanged in; at the first compression step also
        the error-feedback state, the masks, the scaling coefficients ``s_p`` and the
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
        size = padded_size(flat.numel, math.prod(self.topology))
        worker_size, server_size = self._error_sizes(flat.numel)
        if self._worker_error is None or self._worker_error.numel() != worker_size:
            self._worker_error = torch.zeros(worker_size, dtype=flat.dtype, device=flat.device)
            self._server_error = torch.zeros(server_size, dtype=flat.dtype, device=flat.device)
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
            "world_size": math.prod(self.topology),
            "ranks_per_node": self.topology[0],
            "compression": self.compression,
            "worker_error": self._worker_error,
            "server_error": self._server_error,
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
        worker_error, server_error = extra["worker_error"], extra["server_error"]
        saved_topology = (extra.get("ranks_per_node", 1), extra["world_size"])
        same_world = saved_topology == (self.topology[0], math.prod(self.topology))
        if worker_error is not None and same_world:
            self._validate_error_sizes(worker_error, server_error)
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
        if worker_error is not None and not same_world:
            warnings.warn(
                f"checkpoint was saved with world size {extra['world_size']} in nodes of "
                f"{saved_topology[0]} ranks, now {math.prod(self.topology)} in nodes of "
                f"{self.topology[0]}: the error-feedback buffers are reset to zero",
                UserWarning,
                stacklevel=2,
            )
            worker_error = server_error = None
        device = next(iter(_common.params_in_order(self.param_groups))).device
        self._worker_error = None if worker_error is None else worker_error.to(device, copy=True)
        self._server_error = None if server_error is None else server_error.to(device, copy=True)

    def _error_sizes(self, numel: int) -> tuple[int, int]:
        """Elements of ``worker_error`` and ``server_error`` for ``numel`` parameters:
        ``N_pad / L`` and ``N_pad / (L M)`` (``L = 1`` when flat), times ``L M`` with a
        :attr:`momentum_exchange` (every simulated worker's); with per-tensor compression
        :func:`onebit.per_tensor_error_sizes` of the parameters."""
        if self.compression == "per_tensor":  # each tensor padded alone
            sizes = [p.numel() for p in _common.trainable_params(self)]
            return per_tensor_error_sizes(sizes, self.world_size)
        local, nodes = self.topology
        size = padded_size(numel, local * nodes)
        workers = 1 if self.momentum_exchange is None else local * nodes
        return workers * size // local, workers * size // (local * nodes)

    def _validate_error_sizes(self, worker_error: Tensor, server_error: Tensor) -> None:
        numel = sum(p.numel() for p in _common.trainable_params(self))
        expected = dict(
            zip(("worker_error", "server_error"), self._error_sizes(numel), strict=True)
        )
        for name, tensor in (("worker_error", worker_error), ("server_error", server_error)):
            if tensor is None or tensor.numel() != expected[name]:
                size = None if tensor is None else tensor.numel()
                raise ValueError(
                    f"checkpoint's {name} has {size} elements; this optimizer's parameters "
                    f"({numel} elements, world size {math.prod(self.topology)}, nodes of "
                    f"{self.topology[0]}) need {expected[name]}"
                )

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
        packed: PackedResult | None,
        scratch: Tensor,
        mask: Tensor | None,
        active: Sequence[bool],
    ) -> None:
        """The update with the exchanged (scaled) momentum ``packed`` (``scratch``: the
        exchange buffer, free now; with per-tensor compression ``packed`` is ``None`` and
        ``scratch`` holds the exchanged momentum); ``flat.exp_avg`` still holds the previous
        momentum."""
        raise NotImplementedError
