"""The data-parallel side of a 1-bit optimizer: its group, the exchange built once from the
arguments (or given, to simulate many workers), DDP's averaging of the dense steps, the bytes
sent, failed collectives turned into clear errors, and the check that the gradients passed to
``step()`` are each rank's own."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.collectives import ring_allreduce_bytes
from onebit.consistency import ReplicaMismatchError
from onebit.exchange import (
    BucketedExchange,
    Exchange,
    FlatExchange,
    HierarchicalExchange,
    NodeGroups,
    PerTensorBucketedExchange,
    PerTensorExchange,
    PerTensorHierarchicalExchange,
    PerTensorSimulatedExchange,
    TrafficCounter,
    node_topology,
    world_size,
)
from onebit.exchange.transport import all_gather_into
from onebit.kernels import Backend
from onebit.optim._flat import FlatState
from onebit.optim._sharding import ShardGroup

__all__ = ["COMPRESSIONS", "CommunicationError", "DataParallel"]

#: How the momentum can be exchanged: one fused buffer scaled by ``s_p``, or each tensor alone.
COMPRESSIONS = ("fused", "per_tensor")


class CommunicationError(RuntimeError):
    """A collective of the optimizer's step failed: a peer died, hung or diverged."""


class DataParallel:
    """The ranks of ``process_group`` (``None``: the world) and how 1-bit values cross them.

    The exchange (:class:`onebit.exchange.Exchange`, it owns the error feedback) is built at
    first use from ``compression``, ``node_groups`` and ``bucket_elements``, or given with
    :meth:`use_exchange` (``simulatable`` optimizers only). ``owner`` names the optimizer in
    messages; ``stages`` are the keys of :attr:`bytes_sent`.

    ``delayed``: the exchange runs in a thread of its own while the caller computes
    (ALGORITHM.md, "Delayed exchange"): over a process group of its own (the same ranks,
    created here and where the group changes, on every rank), its bytes counted apart until
    :meth:`take_exchange_traffic` adds them to the step that waits for it.
    """

    def __init__(
        self,
        owner: str,
        stages: Sequence[str],
        process_group: dist.ProcessGroup | None,
        *,
        compression: str,
        compression_chosen: bool,
        node_groups: NodeGroups | None,
        bucket_elements: int | None,
        simulatable: bool,
        delayed: bool = False,
    ) -> None:
        self.owner = owner
        self.compression = compression
        self._compression_chosen = compression_chosen  # left to the default
        self.node_groups = node_groups
        self._bucket_elements = bucket_elements
        self._simulatable = simulatable
        self._process_group = process_group
        self._exchange: Exchange | None = None
        self._exchange_given = False  # by use_exchange, not built from the arguments
        self.gradients_averaged_by_ddp = False
        self.gradients_checked = False
        self.traffic = TrafficCounter()
        self.bytes_sent: dict[str, int] = dict.fromkeys(stages, 0)
        self._check_node_groups()
        self._delayed = delayed
        self._exchange_traffic = TrafficCounter() if delayed else self.traffic
        self._delay_group = self._new_delay_group()

    # ----------------------------------------------------------------- the group
    @property
    def world_size(self) -> int:
        return world_size(self._process_group)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        """Set before training (the DDP hook sets DDP's group): an exchange built from the
        old group is built again, keeping its error state if the topology is the same."""
        previous, self._process_group = self._process_group, group
        if group != previous:
            self._delay_group = self._new_delay_group()
        old = self._exchange
        if old is None or self._exchange_given:
            return
        new = self._build_exchange()
        if old.worker_error is not None and old.topology != new.topology:
            self._process_group = previous  # nothing changed
            raise ValueError(
                f"the process group of {self.owner} cannot change from {old.world_size} to "
                f"{new.world_size} ranks once its exchange holds error-feedback state"
            )
        if old.numels is not None:
            new.bind(old.numels, old.dtype, old.device, old.backend, old.traffic)
        if old.worker_error is not None:
            new.load_state_dict(old.state_dict(), old.worker_error.device)
        self._exchange = new

    def attach_to_ddp(self, process_group: dist.ProcessGroup | None) -> None:
        """DDP (over ``process_group``) averages the gradients of the dense steps."""
        if self._process_group is None:
            self.process_group = process_group
        elif self._process_group != process_group:
            raise ValueError("the optimizer's process_group differs from the DDP model's")
        self.gradients_averaged_by_ddp = True

    def take_replicate_group(self, shards: ShardGroup) -> None:
        """With FSDP-sharded parameters the group is the replicate group, the ranks that hold
        the same slices: this rank alone when FSDP shards over the whole world, and it must
        be given otherwise."""
        if self.node_groups is not None:
            raise ValueError(
                "node_groups with FSDP-sharded parameters: FSDP's shard group takes the "
                "place of the node; give process_group=the replicate group instead"
            )
        if self._process_group is not None:
            return
        if shards.size != world_size():
            raise ValueError(
                f"the parameters are sharded over {shards.size} of {world_size()} ranks: "
                "give process_group=the ranks that hold the same slices (with "
                "init_device_mesh(..., mesh_dim_names=('replicate', 'shard')): "
                "mesh['replicate'].get_group())"
            )
        self._process_group, _ = dist.new_subgroups(group_size=1)

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

    def _new_delay_group(self) -> dist.ProcessGroup | None:
        """With ``delayed`` over more than one rank: a group of the data-parallel group's
        ranks for the exchange alone (collective: every rank calls this alike); else
        ``None``."""
        if not self._delayed or self.world_size == 1:
            return None
        ranks = dist.get_process_group_ranks(self._process_group or dist.group.WORLD)
        return dist.new_group(ranks, use_local_synchronization=True)

    @property
    def _exchange_group(self) -> dist.ProcessGroup | None:
        """The group the exchange runs over: the data-parallel group, or the delayed
        exchange's own."""
        return self._process_group if self._delay_group is None else self._delay_group

    def untaken_exchange_traffic(self) -> dict[str, int]:
        """With ``delayed``: the bytes by kind that the exchange sent and
        :meth:`take_exchange_traffic` has not taken yet (those of the exchange in flight);
        none otherwise."""
        if self._exchange_traffic is self.traffic:
            return {}
        return dict(self._exchange_traffic.bytes_sent)

    def restore_untaken_exchange_traffic(self, bytes_by_kind: dict[str, int]) -> None:
        """With ``delayed``: bytes an exchange sent before a checkpoint (from
        :meth:`untaken_exchange_traffic`), for the next :meth:`take_exchange_traffic`."""
        if self._exchange_traffic is not self.traffic:
            self._exchange_traffic.record_all(bytes_by_kind)

    def take_exchange_traffic(self) -> None:
        """With ``delayed``: add the bytes the exchange sent since the last call to
        :attr:`traffic` (and so to the stage being counted)."""
        if self._exchange_traffic is not self.traffic:
            self.traffic.take(self._exchange_traffic)

    def is_logging_rank(self) -> bool:
        return not dist.is_initialized() or dist.get_rank(self._process_group) == 0

    # ----------------------------------------------------------------- the exchange
    @property
    def exchange(self) -> Exchange:
        if self._exchange is None:
            self._exchange = self._build_exchange()
        return self._exchange

    def _build_exchange(self) -> Exchange:
        group = self._exchange_group
        if self.node_groups and self.compression == "per_tensor":
            return PerTensorHierarchicalExchange(self.node_groups)
        if self.node_groups:
            return HierarchicalExchange(self.node_groups)
        if self.compression == "per_tensor" and self._bucket_elements:
            return PerTensorBucketedExchange(group, self._bucket_elements)
        if self.compression == "per_tensor":
            return PerTensorExchange(group)
        if self._bucket_elements:
            return BucketedExchange(group, self._bucket_elements)
        return FlatExchange(group)

    def use_exchange(self, exchange: Exchange) -> None:
        """Exchange through ``exchange`` (a simulation of many workers in one process), before
        the first exchange, of this compression (or of its own where the compression was left
        to the default)."""
        if not self._simulatable:
            raise ValueError(
                f"{self.owner} exchanges every tensor alone over its process group; it cannot "
                f"use a {type(exchange).__name__}"
            )
        if self._exchange_given:
            raise ValueError(
                f"{self.owner} is already simulated: it exchanges through "
                f"{type(self._exchange).__name__} (one SimulatedDataParallel per optimizer)"
            )
        simulated = "per_tensor" if isinstance(exchange, PerTensorSimulatedExchange) else "fused"
        compression = simulated if self._compression_chosen else self.compression
        if compression != simulated:
            raise ValueError(
                f"{self.owner} has compression={compression!r}; a {type(exchange).__name__} "
                f"simulates compression={simulated!r}"
            )
        if self.node_groups is not None or self.world_size > 1:
            raise ValueError(
                "the simulated optimizer must run in one process: give it no node_groups "
                "and no process group of more than one rank"
            )
        if self._bucket_elements is not None:
            raise ValueError("bucket_cap_mb is not simulated: give the optimizer none")
        if self._exchange is not None and self._exchange.worker_error is not None:
            raise ValueError(
                "use_exchange() must come before the first exchange (or checkpoint load): "
                "this optimizer's exchange already holds error-feedback state"
            )
        self.compression = compression
        self._exchange, self._exchange_given = exchange, True

    def bind(self, flat: FlatState, backend: Backend | None) -> Exchange:
        """The exchange, bound to the flat state's tensors, the backend and the traffic."""
        exchange = self.exchange
        exchange.bind(
            [t.numel() for t in flat.tensors],
            flat.dtype,
            flat.device,
            backend,
            self._exchange_traffic,
        )
        return exchange

    def check_can_relayout(self) -> None:
        """Refuse new tensors where the exchange was given (a simulation) and is bound."""
        given = self._exchange
        if self._exchange_given and given.numels is not None:
            raise ValueError(
                f"{self.owner} exchanges through a given {type(given).__name__}, bound to its "
                "tensors: it cannot take a parameter that joins later"
            )

    def relayout(self, origin: Sequence[int | None], numels: Sequence[int]) -> None:
        """The tensors were laid out anew (new tensor ``i`` of ``numels[i]`` elements was
        bound tensor ``origin[i]``; ``None``: it joined): an exchange bound already is built
        again, to be bound at its next use, with its error feedback moved tensor by tensor
        where it has one (:meth:`onebit.exchange.Exchange.moved_errors`). The caller has
        checked :meth:`check_can_relayout` before changing anything."""
        old = self._exchange
        if old is None or old.numels is None:
            return
        new = self._build_exchange()
        if old.worker_error is not None:
            worker, server = old.moved_errors(origin, numels)
            new.carry_errors(numels, worker, server, old.backend, self._exchange_traffic)
        self._exchange = new

    def error_feedback_layout(self, numels: list[int]) -> dict[str, Any]:
        """Where each of this rank's error values belongs (``numels``: each tensor's elements
        on this rank); error buffers saved with one layout are only valid in it."""
        exchange = self.exchange
        return {
            "exchange": type(exchange).__name__,
            "world_size": exchange.world_size,
            "ranks_per_node": exchange.topology[0],
            "buckets": exchange.layout_key(numels),
            "numels": numels,
        }

    def memory_bytes(self) -> tuple[int, int]:
        """Bytes of error feedback and of the exchange's own scratch (0 before it exists)."""
        if self._exchange is None:
            return 0, 0
        errors = [
            e for e in (self._exchange.worker_error, self._exchange.server_error) if e is not None
        ]
        return sum(e.numel() * e.element_size() for e in errors), self._exchange.nbytes()

    # ----------------------------------------------------------------- collectives
    @contextlib.contextmanager
    def collective(self, step: int, stage: str) -> Iterator[None]:
        """Turn a failed collective of ``step`` (a dead or stuck peer) into a clear error."""
        try:
            yield
        except ReplicaMismatchError:
            raise
        except RuntimeError as error:
            if self.world_size == 1:
                raise
            raise CommunicationError(
                f"{self.owner}: a collective failed at step {step} ({stage} stage) on rank "
                f"{dist.get_rank()}: another rank has probably died or stopped responding "
                "(collectives give up after the timeout passed to init_process_group). "
                f"Cause: {error}"
            ) from error

    @contextlib.contextmanager
    def counting(self, stage: str) -> Iterator[None]:
        """Add the bytes sent inside to ``stage``'s count, even if it fails."""
        before = self.traffic.total()
        try:
            yield
        finally:
            self.bytes_sent[stage] += self.traffic.total() - before

    def any_rank(
        self, step: int, stage: str, flags: Sequence[bool], device: torch.device
    ) -> list[bool]:
        """Per entry, whether any rank of the group set its flag (``flags``: this rank's): one
        byte each, maximised over the ranks in one allreduce, counted as ``"gradient_flags"``
        (as the exchange's workers send it where it simulates several). The same on every
        rank."""
        workers = self.exchange.world_size
        if workers > 1:
            self.traffic.record("gradient_flags", ring_allreduce_bytes(len(flags), workers))
        if self.world_size == 1:
            return list(flags)
        values = torch.tensor(flags, dtype=torch.uint8, device=device)
        with self.collective(step, stage):
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._process_group)
        return values.bool().tolist()

    def check_gradients_are_local(self, values: Tensor, step: int) -> None:
        """Once, at the first step that exchanges each rank's own values: warn (rank 0) if
        every rank passed the same gradients, i.e. something averaged them before ``step()``,
        most likely ``DistributedDataParallel`` without onebit's hook, which keeps sending
        every gradient densely. The ranks' states agree up to this step, so ``values`` (the
        exchange's input) agree exactly when the gradients do: each rank contributes a
        checksum (the wrapping int64 sum of the bits) to one all-gather, counted in
        ``bytes_sent``."""
        self.gradients_checked = True
        n = self.world_size
        if n == 1:
            return
        bits = values.view(torch.int64 if values.dtype == torch.float64 else torch.int32)
        checksum = bits.sum(dtype=torch.int64).reshape(1)
        gathered = torch.empty(n, dtype=torch.int64, device=checksum.device)
        all_gather_into(gathered, checksum, self._process_group, n)
        self.traffic.record("gradient_check", (n - 1) * checksum.element_size())
        if len(set(gathered.tolist())) == 1 and self.is_logging_rank():
            warnings.warn(
                f"{self.owner}: at the first compression step (step {step}) every rank passed "
                "bit-identical gradients to step(): something averaged them over the ranks "
                "already, most likely DistributedDataParallel without onebit's communication "
                "hook. DDP then still sends every gradient at full precision on every step, "
                "which optimizer.bytes_sent does not count, and the 1-bit exchange saves "
                "nothing. Register the hook once, before training: "
                "onebit.ddp.register_comm_hook(model, optimizer) (HF Trainer, Accelerate, "
                "Lightning: see onebit.integrations), or drop DDP and call step() on each "
                "rank's own gradients. If every rank trains on the same data on purpose, "
                "ignore this warning.",
                UserWarning,
                stacklevel=2,
            )
