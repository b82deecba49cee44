"""The data-parallel side of the 1-bit optimizers: the process group, the exchange built once
from the arguments (or given, to simulate many workers), DDP's averaging of the dense steps,
the accounting of bytes sent, failed collectives turned into clear errors, the checks that the
replicas agree and that the gradients passed to ``step()`` are each rank's own."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.consistency import ReplicaMismatchError, verify_replicas
from onebit.exchange import (
    BucketedExchange,
    Exchange,
    FlatExchange,
    HierarchicalExchange,
    NodeGroups,
    PerTensorExchange,
    TrafficCounter,
    node_topology,
    world_size,
)
from onebit.exchange.bucketed import bucket_elements
from onebit.exchange.transport import all_gather_into
from onebit.optim import _common
from onebit.optim._base import FlatOptimizer
from onebit.optim._flat import FlatState

__all__ = ["COMPRESSIONS", "CommunicatingOptimizer", "CommunicationError"]

#: How the momentum can be exchanged: one fused buffer scaled by ``s_p``, or each tensor alone.
COMPRESSIONS = ("fused", "per_tensor")


class CommunicationError(RuntimeError):
    """A collective of the optimizer's step failed: a peer died, hung or diverged."""


class CommunicatingOptimizer(FlatOptimizer):
    """A :class:`FlatOptimizer` that averages over a data-parallel group through an
    :class:`onebit.exchange.Exchange`: flat over ``process_group``, in buckets of
    ``bucket_cap_mb``, hierarchical over ``node_groups``, or per tensor (``compression``), or
    one given with :meth:`use_exchange`. Subclasses give the schedule (``stage``) and count
    the steps in ``_counters``.
    """

    # How the momentum is exchanged: "fused" (one buffer scaled by s_p) or "per_tensor"
    # (each tensor compressed alone; no s_p); whether it was left to the default.
    compression = "fused"
    _compression_chosen = False

    def _choose_compression(
        self,
        compression: str | None,
        node_groups: NodeGroups | None,
        bucket_cap_mb: float | None,
        overlap_backward: bool,
    ) -> None:
        """Set :attr:`compression` (before ``__init__``): ``None`` is ``"per_tensor"``, or
        ``"fused"`` where the exchange asked for (hierarchical, bucketed or overlapped) carries
        only the fused buffer."""
        fused_only = node_groups is not None or bucket_cap_mb is not None or overlap_backward
        self._compression_chosen = compression is None
        if compression is None:
            compression = "fused" if fused_only else "per_tensor"
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"Invalid compression={compression!r}: use None or one of {COMPRESSIONS}"
            )
        if compression == "per_tensor" and node_groups is not None:
            raise ValueError(
                "compression='per_tensor' does not support node_groups (the hierarchical "
                "exchange is fused only); use compression='fused' or node_groups=None"
            )
        self.compression = compression

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        kernels: str | None,
        process_group: dist.ProcessGroup | None,
        verify_every: int,
        node_groups: NodeGroups | None,
        bucket_cap_mb: float | None,
    ) -> None:
        if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
            raise ValueError(f"Invalid verify_every={verify_every}: it must be an int >= 0")
        self.verify_every = verify_every
        self._process_group = process_group
        self._exchange: Exchange | None = None
        self._exchange_given = False  # by use_exchange, not built from the arguments
        self._gradients_averaged_by_ddp = False
        self._counters: dict[str, Any] = {
            "step": 0,
            "skipped_steps": 0,
            "bytes_sent": {},  # by stage: the subclass names its stages
        }
        self._replicas_verified = False
        self._verification_pending = False  # a check was due while replicas differed by design
        self._gradients_checked = False
        self.node_groups = node_groups
        self._check_node_groups()
        self._traffic = TrafficCounter()
        super().__init__(params, defaults, kernels)
        if self.shards is not None:
            self._check_sharded_replicas()
        self.bucket_cap_mb = bucket_cap_mb
        self._bucket_elements = None
        if bucket_cap_mb is not None:
            dtypes = {_common.state_dtype(p) for p in _common.trainable_params(self)}
            element = 8 if dtypes == {torch.float64} else 4
            self._bucket_elements = bucket_elements(bucket_cap_mb, element)

    @property
    def step_count(self) -> int:
        """Steps applied so far (skipped steps are not counted)."""
        return self._counters["step"]

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank's gradients were not finite."""
        return self._counters["skipped_steps"]

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
        Only before the first exchange, in one process, for the fused exchange (which the
        simulated optimizer uses where its compression was left to the default)."""
        chosen = self.compression
        if self._compression_chosen:
            self.compression = "fused"
        try:
            self._use_exchange(exchange)
        except ValueError:
            self.compression = chosen  # nothing changed
            raise

    def _use_exchange(self, exchange: Exchange) -> None:
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

    def error_feedback_layout(self) -> dict[str, Any]:
        """Where each of this rank's error values belongs: the exchange, its data-parallel
        world size and ranks per node, its buckets (``None``: one buffer) and the elements of
        each tensor on this rank. Error buffers saved with one layout are only valid in it."""
        numels = self._local_numels()
        return {
            "exchange": type(self.exchange).__name__,
            "world_size": self.exchange.world_size,
            "ranks_per_node": self.exchange.topology[0],
            "buckets": self.exchange.layout_key(numels),
            "numels": numels,
        }

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

    def _check_sharded_replicas(self) -> None:
        """With FSDP-sharded parameters the data-parallel group is the replicate group: the
        ranks holding the same slices. Left to the default it is this rank alone when FSDP
        shards over the whole world, and must be given otherwise."""
        if self.node_groups is not None:
            raise ValueError(
                "node_groups with FSDP-sharded parameters: FSDP's shard group takes the "
                "place of the node; give process_group=the replicate group instead"
            )
        if self._process_group is not None:
            return
        if self.shards.size != world_size():
            raise ValueError(
                f"the parameters are sharded over {self.shards.size} of {world_size()} ranks: "
                "give process_group=the ranks that hold the same slices (with "
                "init_device_mesh(..., mesh_dim_names=('replicate', 'shard')): "
                "mesh['replicate'].get_group())"
            )
        self._process_group, _ = dist.new_subgroups(group_size=1)

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
        return flat.tensors + [master for _, master in flat.half_params]

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

    def _bind_exchange(self, flat: FlatState) -> Exchange:
        """:attr:`exchange`, bound to the flat state's tensors, backend and traffic counter."""
        exchange = self.exchange
        exchange.bind(
            [t.numel() for t in flat.tensors], flat.dtype, flat.device, self.backend, self._traffic
        )
        return exchange

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

    def _is_logging_rank(self) -> bool:
        return not dist.is_initialized() or dist.get_rank(self.process_group) == 0
