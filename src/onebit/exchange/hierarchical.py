"""The hierarchical 1-bit exchange for nodes of several ranks (ALGORITHM.md).

A data-parallel group of ``W = M * L`` ranks, ``M`` nodes of ``L`` ranks: each node first
averages the buffer densely over its fast local link (every rank ends with one shard of the
node's mean), then the ranks holding the same shard on every node run the flat two-phase
exchange among themselves, and each node gathers the compressed results of its ranks. Only
compressed bytes cross the slow network between nodes, about ``L`` times fewer than with the
flat exchange, and each rank compresses ``N / L`` elements.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.compression import scale_dtype
from onebit.exchange.base import Exchange
from onebit.exchange.flat import padded_segments
from onebit.exchange.over_group import exchange_over_group
from onebit.exchange.protocol import (
    Layout,
    PackedResult,
    check_buffer_size,
    check_error_state,
    exchange_bytes,
    padded_size,
)
from onebit.exchange.transport import (
    GroupTransport,
    TrafficCounter,
    all_gather_into,
    world_size,
)
from onebit.exchange.workspace import CompressionWorkspace
from onebit.kernels import Backend, select

__all__ = [
    "HierarchicalExchange",
    "HierarchicalWorkspace",
    "NodeGroups",
    "PerTensorHierarchicalExchange",
    "hierarchical_bytes",
    "hierarchical_compressed_allreduce",
    "hierarchical_exchange",
    "node_groups",
    "node_topology",
    "per_tensor_hierarchical_bytes",
]

NodeGroups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]


def node_groups(
    node_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    mesh=None,
) -> NodeGroups:
    """The intra-node and inter-node groups of a data-parallel group: ``(intra, inter)``.

    Either from a 2-D ``torch.distributed.device_mesh.DeviceMesh`` whose dimension 0 runs
    across nodes and dimension 1 within a node (``mesh``), or by splitting ``group`` (default:
    the world) into nodes of ``node_size`` consecutive ranks (default: torchrun's
    ``LOCAL_WORLD_SIZE``). The intra-node group of a node holds its ranks; the inter-node
    group of local index ``l`` holds the rank with that index on every node. Every rank of
    ``group`` must call this (it creates process groups).
    """
    if mesh is not None:
        if mesh.ndim != 2:
            raise ValueError(f"mesh must be 2-D (nodes x ranks per node), got {mesh.ndim}-D")
        return mesh.get_group(1), mesh.get_group(0)
    if node_size is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError("node_size not given and LOCAL_WORLD_SIZE is not set (torchrun)")
        node_size = int(os.environ["LOCAL_WORLD_SIZE"])
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    ranks = ranks or list(range(dist.get_world_size()))
    if isinstance(node_size, bool) or node_size < 1 or len(ranks) % node_size:
        raise ValueError(
            f"node_size={node_size} must be a positive divisor of the group's {len(ranks)} ranks"
        )
    nodes = len(ranks) // node_size
    position = ranks.index(dist.get_rank())
    intra = inter = None
    for node in range(nodes):  # every rank creates every group, in the same order
        created = dist.new_group(ranks[node * node_size : (node + 1) * node_size])
        if position // node_size == node:
            intra = created
    for local in range(node_size):
        created = dist.new_group([ranks[node * node_size + local] for node in range(nodes)])
        if position % node_size == local:
            inter = created
    return intra, inter


def node_topology(groups: NodeGroups) -> tuple[int, int]:
    """``(L, M)``: ranks per node and nodes."""
    return world_size(groups[0]), world_size(groups[1])


class HierarchicalWorkspace:
    """Scratch of the hierarchical exchange, allocated once and reused: the received shards
    (``N`` elements) and their mean (``N / L``), the gathered compressed results of the
    node, and the workspace of the inter-node exchange."""

    def __init__(self) -> None:
        self.inner = CompressionWorkspace()
        self._key: tuple | None = None

    def prepare(self, numel: int, local: int, nodes: int, dtype, device) -> HierarchicalWorkspace:
        key = (numel, local, nodes, dtype, device)
        if key != self._key:
            shard = numel // local
            self.shards = torch.empty(local, shard, dtype=dtype, device=device)
            self.mean = torch.empty(shard, dtype=dtype, device=device)
            self.signs = torch.empty(
                local, nodes, shard // nodes // 8, dtype=torch.uint8, device=device
            )
            self.scales = torch.empty(local, nodes, dtype=scale_dtype(dtype), device=device)
            self._key = key
        return self

    def nbytes(self) -> int:
        """Bytes of scratch held now."""
        own = [getattr(self, name, None) for name in ("shards", "mean", "signs", "scales")]
        return self.inner.nbytes() + sum(t.numel() * t.element_size() for t in own if t is not None)


def hierarchical_bytes(numel: int, local: int, nodes: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one rank sends per exchange of ``numel`` elements: ``"intra_node"`` (the dense
    all-to-all of shards and the all-gather of the compressed results, over the fast link)
    and ``"inter_node"`` (its flat 1-bit exchange of ``numel / L`` elements over ``M``)."""
    element = torch.empty((), dtype=dtype).element_size()
    shard = numel // local
    gathered = (local - 1) * (
        shard // 8 + nodes * torch.empty((), dtype=scale_dtype(dtype)).element_size()
    )
    return {
        "intra_node": (local - 1) * shard * element + gathered,
        "inter_node": exchange_bytes(Layout.flat(shard, nodes), dtype),
    }


def hierarchical_exchange(
    buffer: Tensor,
    worker_error: Tensor,
    server_error: Tensor,
    groups: NodeGroups,
    workspace: HierarchicalWorkspace,
    backend: Backend,
) -> PackedResult:
    """One hierarchical exchange of the flat ``buffer`` (``N``, a multiple of ``8 L M``;
    not modified) with this rank's error state (``N / L`` and ``N / (L M)``), updated in
    place; the result in the form of a flat exchange over ``L M`` chunks (chunk ``l M + j``
    is server ``j``'s chunk of shard ``l``).

    1. intra-node reduce-scatter (dense): rank ``l`` of a node gets shard ``l`` of the node's
       mean, ``z = (1/L) sum_i x_i[shard l]``, summed in rank order (reproducible);
    2. the flat two-phase exchange of ``z`` among the ranks holding shard ``l`` on every
       node, every check agreed on within the node too, so all ranks raise together;
    3. intra-node all-gather of the ``L`` results in compressed form (32x fewer bytes)."""
    intra, inter = groups
    local, nodes = node_topology(groups)
    numel = buffer.numel()
    ws = workspace.prepare(numel, local, nodes, buffer.dtype, buffer.device)
    flat = buffer.view(-1)
    if local == 1:
        mean = flat
    else:
        mean = _node_mean(flat, ws.shards, ws.mean, intra)
    inner_ws = ws.inner.prepare(
        Layout.flat(numel // local, nodes), buffer.dtype, buffer.device, backend
    )
    scratch = mean if local > 1 else ws.mean
    transport = GroupTransport(inter, agree_on=intra)
    inner = exchange_over_group([mean], [scratch], worker_error, server_error, transport, inner_ws)
    if local == 1:
        return inner
    layout = Layout.flat(numel, local * nodes)
    return _gathered_in_node(inner, ws.signs, ws.scales, intra, layout)


def _node_mean(
    send: Tensor, received: Tensor, out: Tensor, intra: dist.ProcessGroup | None
) -> Tensor:
    """Step 1: row ``l`` of ``send`` (``[L, n]`` flat) to local rank ``l``, the rows from
    every local rank into ``received`` (``[L, n]``); ``out`` = their mean, summed in rank order
    (reproducible), then divided by ``L``."""
    dist.all_to_all_single(received.view(-1), send.view(-1), group=intra)
    out.copy_(received[0])
    for row in received[1:]:
        out.add_(row)
    return out.div_(received.shape[0])


def _gathered_in_node(
    inner: PackedResult,
    signs: Tensor,
    scales: Tensor,
    intra: dist.ProcessGroup | None,
    layout: Layout,
    padding: Tensor | None = None,
) -> PackedResult:
    """Step 3: every local rank's result between nodes (``M`` rows of signs and scales),
    gathered in the node into ``signs`` and ``scales``; the result over ``L M`` chunks of
    ``layout`` (chunk ``l M + j``: server ``j``'s chunk of shard ``l``)."""
    local = signs.numel() // inner.signs.numel()
    all_gather_into(signs, inner.signs, intra, local)
    all_gather_into(scales, inner.scales, intra, local)
    rows = local * inner.signs.shape[0]
    return PackedResult(signs.view(rows, -1), scales.view(rows, -1), layout, inner.backend, padding)


class HierarchicalExchange(Exchange):
    """The hierarchical exchange over ``(intra_group, inter_group)`` (:func:`node_groups`):
    one fused buffer padded to a multiple of ``8 L M``; error buffers of ``N / L`` and
    ``N / (L M)``. With ``L = 1`` it is the flat exchange over the inter-node group, bit for
    bit. The buffer is left as it is. Scratch: ``workspace``, or one of its own."""

    def __init__(self, groups: NodeGroups, workspace: HierarchicalWorkspace | None = None) -> None:
        super().__init__()
        if len(groups) != 2:
            raise ValueError("node_groups must be the pair (intra_group, inter_group)")
        self.groups = tuple(groups)
        self.workspace = HierarchicalWorkspace() if workspace is None else workspace

    @property
    def topology(self) -> tuple[int, int]:
        return node_topology(self.groups)

    def buffer_size(self, numels: Sequence[int]) -> int:
        return padded_size(sum(numels), self.world_size)

    def error_sizes(self, numels: Sequence[int]) -> tuple[int, int]:
        size = self.buffer_size(numels)
        return size // self.topology[0], size // self.world_size

    def bytes_per_call(self) -> dict[str, int]:
        return hierarchical_bytes(self.buffer_size(self.numels), *self.topology, self.dtype)

    def nbytes(self) -> int:
        return self.workspace.nbytes()

    def _exchange(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor) -> PackedResult:
        return hierarchical_exchange(
            buffer, worker_error, server_error, self.groups, self.workspace, self.backend
        )


def per_tensor_hierarchical_bytes(
    numels: Sequence[int], local: int, nodes: int, dtype: torch.dtype
) -> dict[str, int]:
    """Bytes one rank sends per per-tensor hierarchical exchange of tensors of ``numels``
    elements: ``"intra_node"`` (the dense all-to-all of every tensor's shards and the
    all-gather of the compressed results) and ``"inter_node"`` (its per-tensor exchange of
    the shards over ``M`` ranks)."""
    shards = [size // local for size in Layout.per_tensor(numels, local * nodes).sizes]
    element = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=scale_dtype(dtype)).element_size()
    gathered = (local - 1) * (sum(shards) // 8 + nodes * len(shards) * scale)
    return {
        "intra_node": (local - 1) * sum(shards) * element + gathered,
        "inter_node": exchange_bytes(Layout.per_tensor(shards, nodes), dtype),
    }


class PerTensorHierarchicalExchange(Exchange):
    """The hierarchical exchange with every tensor compressed alone (ALGORITHM.md,
    "Hierarchical exchange", "Per tensor"): tensor ``t`` padded alone to ``P_t`` (a multiple
    of ``8 L M``); the node's mean of every tensor's shard ``l`` on its rank ``l``; the
    per-tensor exchange of those shards between nodes; the compressed results gathered in
    the node. The buffer holds the tensors one after another, unpadded (as
    :class:`~onebit.exchange.PerTensorExchange`'s); error buffers of ``sum P_t / L`` and
    ``sum P_t / (L M)``. Per tensor it is :class:`HierarchicalExchange` of the tensor padded
    alone, bit for bit."""

    def __init__(self, groups: NodeGroups) -> None:
        super().__init__()
        if len(groups) != 2:
            raise ValueError("node_groups must be the pair (intra_group, inter_group)")
        self.groups = tuple(groups)
        self.outer = CompressionWorkspace()  # the padded tensors, the shards sent and received
        self.inner = CompressionWorkspace()  # the exchange between nodes

    @property
    def topology(self) -> tuple[int, int]:
        return node_topology(self.groups)

    def buffer_size(self, numels: Sequence[int]) -> int:
        return sum(numels)

    def _layout(self, numels: Sequence[int]) -> Layout:
        return Layout.per_tensor(numels, self.world_size)

    def error_sizes(self, numels: Sequence[int]) -> tuple[int, int]:
        width = self._layout(numels).width
        return width // self.topology[0], width // self.world_size

    def bytes_per_call(self) -> dict[str, int]:
        return per_tensor_hierarchical_bytes(self.numels, *self.topology, self.dtype)

    def nbytes(self) -> int:
        return self.outer.nbytes() + self.inner.nbytes()

    def _exchange(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor) -> PackedResult:
        intra, inter = self.groups
        local, nodes = self.topology
        layout = self._layout(self.numels)
        dtype, device = self.dtype, self.device
        outer = self.outer.prepare(layout, dtype, device, self.backend)
        padded, padding = padded_segments(buffer.split(self.numels), layout, outer)
        shards = [size // local for size in layout.sizes]
        if local == 1:
            z = padded
        else:  # row l: shard l of every tensor, for local rank l
            send = outer.buffer("send", layout.width, dtype, device).view(local, -1)
            for column, segment in zip(send.split(shards, dim=1), padded, strict=True):
                column.copy_(segment.view(local, -1))
            received = outer.buffer("received", layout.width, dtype, device).view(local, -1)
            mean = outer.buffer("mean", layout.width // local, dtype, device)
            z = list(_node_mean(send, received, mean, intra).split(shards))
        inner_layout = Layout.per_tensor(shards, nodes)
        ws = self.inner.prepare(inner_layout, dtype, device, self.backend)
        transport = GroupTransport(inter, agree_on=intra)
        # the intermediates in place: z is the buffer's segments or the node mean, both spent
        result = exchange_over_group(z, z, worker_error, server_error, transport, ws)
        signs = outer.buffer("signs", local * result.signs.numel(), torch.uint8, device)
        scales = outer.buffer("scales", local * result.scales.numel(), result.scales.dtype, device)
        return _gathered_in_node(result, signs, scales, intra, layout, padding)


def hierarchical_compressed_allreduce(
    buffer: Tensor,
    worker_error: Tensor,
    server_error: Tensor,
    intra_group: dist.ProcessGroup | None,
    inter_group: dist.ProcessGroup | None,
    *,
    out: Tensor | None = None,
    workspace: HierarchicalWorkspace | None = None,
    traffic: TrafficCounter | None = None,
    kernels: str | None = None,
) -> Tensor:
    """Average ``buffer`` over ``M`` nodes of ``L`` ranks at 1 bit per element between nodes
    (:func:`hierarchical_exchange`), with caller-held error state.

    Args:
        buffer: flat floating-point tensor, ``numel`` a multiple of ``8 L M``; not modified.
        worker_error: ``numel / L`` elements; server_error: ``numel / (L M)`` elements.
        intra_group, inter_group: from :func:`node_groups`.
        out, workspace, traffic, kernels: as in :func:`onebit.compressed_allreduce`
            (traffic kinds ``"intra_node"`` and ``"inter_node"``).

    With ``L = 1`` this is :func:`onebit.compressed_allreduce` over the inter-node group, bit
    for bit. Raises like it, on every rank of the ``L * M``, before any error state changes.
    """
    groups = (intra_group, inter_group)
    local, nodes = node_topology(groups)
    numel = buffer.numel()
    check_buffer_size(numel, local * nodes, "L * M")
    for name, tensor, expected in (
        ("worker_error", worker_error, numel // local),
        ("server_error", server_error, numel // (local * nodes)),
    ):
        if tensor.numel() != expected:
            raise ValueError(
                f"{name} has {tensor.numel()} elements; the hierarchical exchange needs "
                f"{expected} for a buffer of {numel} over {nodes} nodes of {local} ranks"
            )
        check_error_state(name, tensor, buffer)
    if out is None:
        out = torch.empty_like(buffer)
    exchange = HierarchicalExchange(groups, workspace)
    exchange.carry_errors([numel], worker_error, server_error, select(buffer, kernels), traffic)
    return exchange.exchange(buffer).decode(out)
