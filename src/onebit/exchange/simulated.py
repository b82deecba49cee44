"""The exchange of many data-parallel workers simulated in one process, fed worker by worker."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from onebit.compression import scale_dtype
from onebit.exchange.base import Exchange
from onebit.exchange.hierarchical import hierarchical_bytes
from onebit.exchange.protocol import Layout, PackedResult, Stages, exchange_bytes, padded_size

__all__ = ["SimulatedExchange", "SimulationDiverged"]


class SimulationDiverged(FloatingPointError):
    """A simulated worker's momentum (or a server's average) is not finite."""


class SimulatedExchange(Exchange):
    """The exchange of ``M`` nodes of ``L`` simulated workers (``W = M L``), with the error
    state of all of them, run with the stages of the distributed exchange
    (:class:`~onebit.exchange.protocol.Stages`) in the same order, so a real run of ``W``
    processes gives the same bits.

    :meth:`add_worker` takes rank ``r = node * L + l``'s buffer, in rank order from 0, and
    compresses it at once (workers are streamed: one buffer exists at a time); with
    ``L > 1`` the ranks of a node are first averaged densely (summed in rank order, divided
    by ``L``) and each of the node's ``L`` shards compressed with its worker error (the
    inter-node exchange of local index ``l``). :meth:`exchange` takes the last worker's
    buffer, runs every server and returns the result in the layout of the hierarchical
    exchange (chunk ``l M + j`` is server ``j``'s chunk of shard ``l``; the flat layout for
    ``L = 1``). Error buffers: ``[W, N / L]`` and ``[W, N / W]`` flattened, row ``r`` for
    rank ``r``.

    A non-finite momentum raises :class:`SimulationDiverged` (a simulated step cannot be
    skipped: the earlier workers' error states are already updated)."""

    def __init__(self, workers: int, node_size: int = 1) -> None:
        super().__init__()
        for name, value in (("workers", workers), ("node_size", node_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if workers % node_size:
            raise ValueError(
                f"node_size={node_size} must divide workers={workers} (nodes of equal size)"
            )
        self.workers, self.local, self.nodes = workers, node_size, workers // node_size
        self._added = 0  # workers added since the last exchange

    @property
    def topology(self) -> tuple[int, int]:
        return self.local, self.nodes

    def buffer_size(self, numels: Sequence[int]) -> int:
        return padded_size(sum(numels), self.workers)

    def error_sizes(self, numels: Sequence[int]) -> tuple[int, int]:
        size = self.buffer_size(numels)
        return self.workers * size // self.local, size

    def bind(self, numels, dtype, device, backend, traffic) -> None:
        super().bind(numels, dtype, device, backend, traffic)
        size = self.buffer_size(self.numels)
        shard = size // self.local
        chunk = shard // self.nodes
        signs = dict(dtype=torch.uint8, device=device)
        scales = dict(dtype=scale_dtype(dtype), device=device)
        self.signs = torch.empty(self.local, self.nodes, shard // 8, **signs)
        self.scales = torch.empty(self.local, self.nodes, **scales)
        self.server_signs = torch.empty(self.local, self.nodes, chunk // 8, **signs)
        self.server_scales = torch.empty(self.local, self.nodes, **scales)
        self.node_mean = torch.empty(size, dtype=dtype, device=device) if self.local > 1 else None
        self.stages = Stages(Layout.flat(shard, self.nodes), backend, dtype, device)

    def bytes_per_call(self) -> dict[str, int]:
        """Bytes one worker sends per exchange, by kind, as a distributed run counts them."""
        size = self.buffer_size(self.numels)
        if self.local == 1:
            return {
                "compressed_allreduce": exchange_bytes(Layout.flat(size, self.nodes), self.dtype)
            }
        return hierarchical_bytes(size, self.local, self.nodes, self.dtype)

    def nbytes(self) -> int:
        """Bytes of scratch held now: packed signs and scales, the node mean, the backend's."""
        if self.numels is None:
            return 0
        own = [self.signs, self.scales, self.server_signs, self.server_scales, self.node_mean]
        scratch = self.stages.scratch[0]
        own += list(vars(scratch).values()) if scratch is not None else []
        return sum(t.numel() * t.element_size() for t in own if t is not None)

    def add_worker(self, rank: int, buffer: Tensor) -> None:
        """Worker ``rank``'s buffer (:meth:`buffer_size` elements; used as scratch); ranks
        come in order, from 0, the last one through :meth:`exchange`."""
        self._require_bound()
        if rank != self._added or rank >= self.workers:
            raise ValueError(f"workers must be added in rank order: expected {self._added}")
        worker_error, _ = self.errors()
        errors = worker_error.view(self.workers, -1)
        node, index = divmod(rank, self.local)
        if self.local == 1:
            self._compress(0, node, buffer.view(-1), errors[rank], rank)
        else:
            mean = self.node_mean
            if index == 0:
                mean.copy_(buffer.view(-1))
            else:
                mean.add_(buffer.view(-1))
            if index == self.local - 1:
                mean.div_(self.local)
                for shard, shard_mean in enumerate(mean.view(self.local, -1)):
                    member = node * self.local + shard
                    self._compress(shard, node, shard_mean, errors[member], rank)
        self._added += 1

    def _compress(self, shard: int, node: int, x: Tensor, error: Tensor, rank: int) -> None:
        """Worker compression of ``x`` (also its scratch) with ``error`` as member ``node``
        of the inter-node exchange of ``shard``."""
        packed, scale = self.signs[shard, node].view(-1), self.scales[shard, node : node + 1]
        self.stages.compress_worker([x], [x], error, packed, scale)
        if not math.isfinite(float(scale)):
            raise SimulationDiverged(
                f"the local momentum of simulated worker {rank} is not finite (its compression "
                "scale is NaN or Inf); the simulation cannot skip the step, since earlier "
                "workers' error states are already updated"
            )
        self.stages.update_worker_errors([x], [x], error, packed, scale)

    def _exchange(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor) -> PackedResult:
        if self._added != self.workers - 1:
            raise RuntimeError(
                f"exchange() takes the last of {self.workers} workers once the others are "
                f"added; {self._added} were"
            )
        self.add_worker(self.workers - 1, buffer)
        self._added = 0
        chunk_bytes = self.server_signs.shape[2]
        errors = server_error.view(self.workers, -1)
        for shard in range(self.local):
            worker_scales = self.scales[shard].unsqueeze(0)  # [1 segment, M]
            for server in range(self.nodes):
                received = self.signs[shard, :, server * chunk_bytes : (server + 1) * chunk_bytes]
                arguments = (
                    self.stages.server_view(received.contiguous()),
                    worker_scales,
                    errors[server * self.local + shard],
                    self.server_signs[shard, server],
                    self.server_scales[shard, server : server + 1],
                )
                self.stages.compress_server(*arguments)
                if not math.isfinite(float(self.server_scales[shard, server])):
                    raise SimulationDiverged(
                        f"the server average of chunk {server} of shard {shard} is not finite"
                    )
                self.stages.update_server_errors(*arguments)
        layout = Layout.flat(self.buffer_size(self.numels), self.workers)
        signs = self.server_signs.view(self.workers, chunk_bytes)
        return PackedResult(signs, self.server_scales.view(-1, 1), layout, self.backend)
