"""The exchange of many data-parallel workers simulated in one process, fed worker by worker."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from onebit.compression import scale_dtype
from onebit.exchange.base import Exchange
from onebit.exchange.flat import padded_segments
from onebit.exchange.hierarchical import hierarchical_bytes, per_tensor_hierarchical_bytes
from onebit.exchange.protocol import Layout, PackedResult, Stages, exchange_bytes, padded_size
from onebit.exchange.workspace import CompressionWorkspace

__all__ = ["PerTensorSimulatedExchange", "SimulatedExchange", "SimulationDiverged"]


class SimulationDiverged(FloatingPointError):
    """A simulated worker's momentum (or a server's average) is not finite."""


def _check_finite(scale: Tensor, what: str) -> None:
    if not math.isfinite(float(scale)):
        raise SimulationDiverged(
            f"{what} is not finite (its compression scale is NaN or Inf); the simulation "
            "cannot skip the step, since earlier workers' error states are already updated"
        )


def _check_topology(workers: int, node_size: int) -> None:
    for name, value in (("workers", workers), ("node_size", node_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if workers % node_size:
        raise ValueError(
            f"node_size={node_size} must divide workers={workers} (nodes of equal size)"
        )


class _StreamedWorkers(Exchange):
    """Workers fed one at a time, in rank order: :meth:`add_worker` for every rank but the
    last, whose buffer :meth:`exchange` takes before it runs the servers."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self._added = 0  # workers added since the last exchange

    def add_worker(self, rank: int, buffer: Tensor) -> None:
        """Worker ``rank``'s buffer (:meth:`buffer_size` elements; used as scratch); ranks
        come in order, from 0, the last one through :meth:`exchange`."""
        self._require_bound()
        if rank != self._added or rank >= self.workers:
            raise ValueError(f"workers must be added in rank order: expected {self._added}")
        self._add(rank, buffer.view(-1))
        self._added += 1

    def _exchange(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor) -> PackedResult:
        if self._added != self.workers - 1:
            raise RuntimeError(
                f"exchange() takes the last of {self.workers} workers once the others are "
                f"added; {self._added} were"
            )
        self.add_worker(self.workers - 1, buffer)
        self._added = 0
        return self._serve(server_error)

    @abstractmethod
    def _add(self, rank: int, buffer: Tensor) -> None:
        """Compress worker ``rank``'s flat buffer with its error (for a node's last worker,
        the node's mean)."""

    @abstractmethod
    def _serve(self, server_error: Tensor) -> PackedResult:
        """Every server's stage, once all workers are in; the result."""


class SimulatedExchange(_StreamedWorkers):
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
        _check_topology(workers, node_size)
        super().__init__(workers)
        self.local, self.nodes = node_size, workers // node_size

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

    def _add(self, rank: int, buffer: Tensor) -> None:
        worker_error, _ = self.errors()
        errors = worker_error.view(self.workers, -1)
        node, index = divmod(rank, self.local)
        if self.local == 1:
            self._compress(0, node, buffer, errors[rank], rank)
        else:
            mean = self.node_mean
            if index == 0:
                mean.copy_(buffer)
            else:
                mean.add_(buffer)
            if index == self.local - 1:
                mean.div_(self.local)
                for shard, shard_mean in enumerate(mean.view(self.local, -1)):
                    member = node * self.local + shard
                    self._compress(shard, node, shard_mean, errors[member], rank)

    def _compress(self, shard: int, node: int, x: Tensor, error: Tensor, rank: int) -> None:
        """Worker compression of ``x`` (also its scratch) with ``error`` as member ``node``
        of the inter-node exchange of ``shard``."""
        packed, scale = self.signs[shard, node].view(-1), self.scales[shard, node : node + 1]
        self.stages.compress_worker([x], [x], error, packed, scale)
        _check_finite(scale, f"the local momentum of simulated worker {rank}")
        self.stages.update_worker_errors([x], [x], error, packed, scale)

    def _serve(self, server_error: Tensor) -> PackedResult:
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
                _check_finite(
                    self.server_scales[shard, server],
                    f"the server average of chunk {server} of shard {shard}",
                )
                self.stages.update_server_errors(*arguments)
        layout = Layout.flat(self.buffer_size(self.numels), self.workers)
        signs = self.server_signs.view(self.workers, chunk_bytes)
        return PackedResult(signs, self.server_scales.view(-1, 1), layout, self.backend)


class PerTensorSimulatedExchange(_StreamedWorkers):
    """The per-tensor exchange of ``M`` nodes of ``L`` simulated workers (``W = M L``): flat
    (``L = 1``, :class:`~onebit.exchange.PerTensorExchange`) or hierarchical
    (:class:`~onebit.exchange.PerTensorHierarchicalExchange`). Every tensor is zero-padded
    alone to ``P_t`` (``Layout.per_tensor`` over ``W``); with ``L > 1`` each node's workers
    are first averaged densely (summed in rank order, divided by ``L``) and shard ``l`` of
    every tensor compressed with worker ``node L + l``'s error; every tensor has its own
    worker and server scales. The stages of the distributed exchange run in its order, so a
    real run of ``W`` processes gives the same bits. The buffer holds the tensors one after
    another, unpadded; the result decodes into that layout. Error buffers: ``[W, sum P_t / L]``
    and ``[W, sum P_t / W]`` flattened, row ``r`` for rank ``r``. A non-finite momentum
    raises :class:`SimulationDiverged`, as :class:`SimulatedExchange`'s does."""

    def __init__(self, workers: int, node_size: int = 1) -> None:
        _check_topology(workers, node_size)
        super().__init__(workers)
        self.local, self.nodes = node_size, workers // node_size
        self.outer = CompressionWorkspace()  # a worker's padded tensors
        self.inner = CompressionWorkspace()  # the stages of the exchange between nodes

    @property
    def topology(self) -> tuple[int, int]:
        return self.local, self.nodes

    def buffer_size(self, numels: Sequence[int]) -> int:
        return sum(numels)

    def error_sizes(self, numels: Sequence[int]) -> tuple[int, int]:
        width = Layout.per_tensor(numels, self.workers).width
        return self.workers * width // self.local, width

    def bind(self, numels, dtype, device, backend, traffic) -> None:
        super().bind(numels, dtype, device, backend, traffic)
        local, nodes = self.local, self.nodes
        self.layout = layout = Layout.per_tensor(self.numels, self.workers)
        self.shards = [size // local for size in layout.sizes]
        self.inner_layout = Layout.per_tensor(self.shards, nodes)
        row = self.inner_layout.width // nodes // 8
        segments, scales = layout.segments, dict(dtype=scale_dtype(dtype), device=device)
        signs = dict(dtype=torch.uint8, device=device)
        self.signs = torch.empty(local, nodes, nodes, row, **signs)  # [shard, node, server]
        self.scales = torch.empty(local, nodes, segments, **scales)
        self.server_signs = torch.empty(local, nodes, row, **signs)
        self.server_scales = torch.empty(local, nodes, segments, **scales)
        self.node_mean = (
            torch.empty(layout.width, dtype=dtype, device=device) if local > 1 else None
        )

    def bytes_per_call(self) -> dict[str, int]:
        """Bytes one worker sends per exchange, by kind, as a distributed run counts them."""
        if self.local == 1:
            return {"compressed_allreduce": exchange_bytes(self.layout, self.dtype)}
        return per_tensor_hierarchical_bytes(self.numels, self.local, self.nodes, self.dtype)

    def nbytes(self) -> int:
        """Bytes of scratch held now: every worker's packed signs and scales, the node mean,
        the workspaces."""
        if self.numels is None:
            return 0
        own = [self.signs, self.scales, self.server_signs, self.server_scales, self.node_mean]
        held = sum(t.numel() * t.element_size() for t in own if t is not None)
        return held + self.outer.nbytes() + self.inner.nbytes()

    def _add(self, rank: int, buffer: Tensor) -> None:
        worker_error, _ = self.errors()
        errors = worker_error.view(self.workers, -1)
        layout, local = self.layout, self.local
        outer = self.outer.prepare(layout, self.dtype, self.device, self.backend)
        padded, _ = padded_segments(buffer.split(self.numels), layout, outer)
        node, index = divmod(rank, local)
        if local == 1:
            self._compress(0, node, padded, errors[rank], rank)
            return
        means = self.node_mean.split(layout.sizes)
        for mean, segment in zip(means, padded, strict=True):
            if index == 0:
                mean.copy_(segment)
            else:
                mean.add_(segment)
        if index == local - 1:
            self.node_mean.div_(local)
            for shard in range(local):
                z = [mean.view(local, -1)[shard] for mean in means]
                self._compress(shard, node, z, errors[node * local + shard], rank)

    def _compress(
        self, shard: int, node: int, segments: Sequence[Tensor], error: Tensor, rank: int
    ) -> None:
        """Worker compression of ``segments`` with ``error`` as member ``node`` of the
        exchange between nodes of ``shard``."""
        layout = self.inner_layout
        ws = self.inner.prepare(layout, self.dtype, self.device, self.backend)
        xs = ws.buffer("x", layout.width, self.dtype, self.device).split(layout.sizes)
        stages, scales = ws.stages, self.scales[shard, node]
        stages.compress_worker(segments, xs, error, ws.worker_packed, scales)
        _check_finite(scales.max(), f"the local momentum of simulated worker {rank}")
        stages.update_worker_errors(segments, xs, error, ws.worker_packed, scales)
        if layout.segments == 1:
            self.signs[shard, node].copy_(ws.worker_packed.view(self.nodes, -1))
        else:
            stages.fill_send(ws.worker_packed, self.signs[shard, node])

    def _serve(self, server_error: Tensor) -> PackedResult:
        stages = self.inner.stages
        errors = server_error.view(self.workers, -1)
        for shard in range(self.local):
            worker_scales = self.scales[shard].T.contiguous()  # row t: a_0t ... a_(M-1)t
            for server in range(self.nodes):
                arguments = (
                    stages.server_view(self.signs[shard, :, server].contiguous()),
                    worker_scales,
                    errors[server * self.local + shard],
                    self.server_signs[shard, server],
                    self.server_scales[shard, server],
                )
                stages.compress_server(*arguments)
                _check_finite(
                    self.server_scales[shard, server].max(),
                    f"the server average of chunk {server} of shard {shard}",
                )
                stages.update_server_errors(*arguments)
        padding = self.outer.buffer("padded", self.layout.padded_width, self.dtype, self.device)
        return PackedResult(
            self.server_signs.view(self.workers, -1),
            self.server_scales.view(self.workers, -1),
            self.layout,
            self.backend,
            padding,
        )
