"""The cost model of one training step on a cluster (docs/ALGORITHM.md, "Cost model of a step").

An alpha-beta model: a collective costs ``alpha`` per message step plus its bytes over the
slowest link it crosses, plus the processor time the ranks spend moving those bytes through the
collective library; the 1-bit methods add the compression stage's local work. Bytes per rank
come from the library's own formulas (:func:`~onebit.collectives.allreduce_bytes`,
:func:`~onebit.collectives.compressed_allreduce_bytes`,
:func:`~onebit.exchange.hierarchical_bytes`), so the model sends what the code sends.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from onebit.collectives import (
    allreduce_bytes,
    compressed_allreduce_bytes,
    compressed_allreduce_per_tensor_bytes,
    padded_size,
)
from onebit.exchange.bucketed import bucket_elements, bucket_size
from onebit.exchange.hierarchical import hierarchical_bytes
from onebit.optim import DEFAULT_BUCKET_CAP_MB

__all__ = [
    "COMPRESSION_THROUGHPUT",
    "COPY_THROUGHPUT",
    "HOST_THROUGHPUT",
    "TCP_PAYLOAD_SHARE",
    "DILOCO_LABELS",
    "Cluster",
    "Exchange",
    "Machine",
    "MethodEstimate",
    "delayed_exchange",
    "dense_allreduce",
    "estimate",
    "flat_exchange",
    "hierarchical_exchange",
    "local_compression_seconds",
    "message_seconds",
    "overlapped_exchange",
    "turn_seconds",
]

#: Bytes of fp32 parameters per second through the compression stage's local work beyond
#: LAMB's update, on this machine: ``4N / (t(OneBitLamb compression step) - t(Lamb.step()))``
#: at world size 2 on loopback, both cores busy, numba kernels, as docs/bench/micro-optimizer.json
#: measured it at library commit ce967f0 (108.9M parameters, 0.312 s against 0.120 s); the
#: emulated cluster's latency and burst efficiency are fitted with it (ESTIMATE.md, "Against
#: the emulated cluster"). ``onebit estimate --calibrate`` measures it again.
COMPRESSION_THROUGHPUT = 2.27e9
#: Bytes per second one rank moves through gloo's dense allreduce on this machine:
#: ``2 (n-1)/n 4N / t(dist.all_reduce)`` at world size 2 on loopback (the same measurement:
#: 0.274 s).
HOST_THROUGHPUT = 1.59e9
#: Bytes of fp32 per second through a copy (read and written) of all parameters, on one core:
#: ``4N / t(copy)`` in the same measurement at library commit b83aeee (world size 2, numba:
#: 0.0807 s for 108.9M parameters); the delayed exchange's own passes over the weights.
COPY_THROUGHPUT = 5.40e9
#: Payload share of a full Ethernet frame for TCP with timestamps: 1448 of 1514 bytes.
TCP_PAYLOAD_SHARE = 1448 / 1514

FP32_BYTES = 4


def _check_positive(name: str, value: float, *, allow_inf: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if math.isinf(value) and not allow_inf:
        raise ValueError(f"{name} must be finite, got {value!r}")


def _check_share(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class Machine:
    """What the hardware and software stack cost, besides the links' bandwidth."""

    compression_throughput: float = COMPRESSION_THROUGHPUT
    """R_c: bytes of fp32 parameters per second through the compression stage's local work
    beyond LAMB's update."""
    host_throughput: float = HOST_THROUGHPUT
    """R_h: bytes per second a rank's processor moves through the dense allreduce; ``inf``
    where the collective library reduces on the device (NCCL on GPUs)."""
    copy_throughput: float = COPY_THROUGHPUT
    """R_m: bytes of fp32 per second through one copy of the weights (read and written)."""
    latency: float = 50e-6
    """alpha: seconds per message step of a collective."""
    link_efficiency: float = TCP_PAYLOAD_SHARE
    """eta: payload share of the line rate for long transfers."""
    burst_efficiency: float = 1.0
    """eta_b: share of the long-transfer rate the 1-bit exchange's short collectives reach."""
    cpu_sharing: float = 1.0
    """k: ranks that share one processor core for local work and host costs (>= 1)."""

    def __post_init__(self) -> None:
        _check_positive("compression_throughput", self.compression_throughput, allow_inf=True)
        _check_positive("host_throughput", self.host_throughput, allow_inf=True)
        _check_positive("copy_throughput", self.copy_throughput, allow_inf=True)
        if isinstance(self.latency, bool) or not (
            isinstance(self.latency, (int, float)) and 0 <= self.latency < math.inf
        ):
            raise ValueError(f"latency must be finite seconds >= 0, got {self.latency!r}")
        _check_share("link_efficiency", self.link_efficiency)
        _check_share("burst_efficiency", self.burst_efficiency)
        if isinstance(self.cpu_sharing, bool) or not (
            isinstance(self.cpu_sharing, (int, float)) and 1 <= self.cpu_sharing < math.inf
        ):
            raise ValueError(f"cpu_sharing must be a number >= 1, got {self.cpu_sharing!r}")


@dataclass(frozen=True)
class Cluster:
    """The job: model size, topology, links and the step's computation."""

    parameters: int
    """N, trainable parameters (the gradient and momentum have N elements)."""
    compute_seconds: float
    """t_c: one step without communication (forward, backward, LAMB's update)."""
    bandwidth: float
    """B: line rate of each node's link, bytes per second and direction."""
    nodes: int = 1
    """M."""
    ranks_per_node: int = 1
    """L, ranks (GPUs) per node."""
    intra_bandwidth: float = math.inf
    """B_intra: bytes per second between two ranks of a node; ``inf``: limited only by the
    host throughput."""
    warmup_fraction: float = 0.2
    """w: share of the run's steps in the warm-up stage (dense allreduce)."""
    mixed_precision: bool = False
    """Gradients in fp16 (2 bytes) for the dense allreduce, as in the paper's runs."""
    backward_share: float = 0.6
    """b: share of ``t_c`` spent in backward, from whose start an overlapped exchange keeps
    the link busy (this machine's BERT-base: 0.6, ``benchmarks/step_phases.py``)."""
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    """MiB per bucket of the overlapped exchange (the optimizer's ``bucket_cap_mb``)."""
    update_share: float = 0.17
    """u_p: share of ``t_c`` spent in the optimizer's update (LAMB's ``step()``), which the
    delayed exchange's chain waits for (this machine's BERT-base: 0.15-0.19 in most of
    docs/bench's runs)."""
    tail_share: float = 0.0
    """u: share of the parameters whose gradients backward completes last, those forward
    uses first (a BERT's embeddings: 0.22 of BERT-base, 0.55 of ``small``); an overlapped
    exchange sends their bytes after backward."""
    sync_every: tuple[int, ...] = ()
    """H of each DiLoCo to predict, inner steps a round (none: no DiLoCo rows)."""
    fragments: int = 1
    """K: Streaming DiLoCo's fragments, one exchanged every H/K steps (1: not streaming)."""
    fragment_delay: int = 0
    """τ: inner steps each fragment's outer exchange runs behind (less than H/K)."""
    outer_block_size: int | None = None
    """b: DiLoCo's 1-bit outer exchange in blocks of ``b·W`` elements, each with its own
    scales (``None``: one scale for the buffer)."""

    def __post_init__(self) -> None:
        for name in ("parameters", "nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for value in self.sync_every:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sync_every must hold integers >= 1, got {value!r}")
        _check_positive("compute_seconds", self.compute_seconds)
        _check_positive("bandwidth", self.bandwidth)
        _check_positive("intra_bandwidth", self.intra_bandwidth, allow_inf=True)
        for name in ("warmup_fraction", "backward_share", "update_share", "tail_share"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value <= 1
            ):
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        _check_positive("bucket_cap_mb", self.bucket_cap_mb)
        block = self.outer_block_size
        if block is not None and (
            isinstance(block, bool) or not isinstance(block, int) or block < 8 or block % 8
        ):
            raise ValueError(f"outer_block_size must be a multiple of 8, got {block!r}")
        if block is not None and not self.sync_every:
            raise ValueError(
                "outer_block_size prices DiLoCo's 1-bit outer exchange: give sync_every"
            )
        self._check_streaming()

    def _check_streaming(self) -> None:
        for name, least in (("fragments", 1), ("fragment_delay", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        for rounds in self.sync_every if self.streams else ():
            if rounds % self.fragments or self.fragment_delay >= rounds // self.fragments:
                raise ValueError(
                    f"sync_every {rounds} must be a multiple of fragments {self.fragments} "
                    f"and fragment_delay {self.fragment_delay} less than their quotient"
                )

    @property
    def streams(self) -> bool:
        """Whether Streaming DiLoCo is predicted beside DiLoCo (fragments or a delay)."""
        return self.fragments > 1 or self.fragment_delay > 0

    @property
    def world(self) -> int:
        """W = M L ranks."""
        return self.nodes * self.ranks_per_node

    @property
    def padded(self) -> int:
        """Elements of the exchanged buffer: N padded to a multiple of 8 W."""
        return padded_size(self.parameters, self.world)

    @property
    def buckets(self) -> int:
        """K: buckets of ``bucket_cap_mb`` MiB of fp32 in the padded buffer, as the
        optimizer cuts them."""
        size = bucket_size(bucket_elements(self.bucket_cap_mb, FP32_BYTES), self.world)
        return -(-self.padded // size)

    @property
    def gradient_bytes(self) -> int:
        """Bytes per element of the dense allreduce's gradients."""
        return 2 if self.mixed_precision else FP32_BYTES


@dataclass(frozen=True)
class Exchange:
    """One collective operation's cost per step."""

    seconds: float
    rank_bytes: float
    """Bytes one rank sends, over every link."""
    node_link_bytes: float
    """Bytes that leave one node through its link (each direction carries as many)."""


def link_seconds(nbytes: float, cluster: Cluster, machine: Machine) -> float:
    """``x / (eta B)``: seconds for ``nbytes`` through one node link."""
    return nbytes / (machine.link_efficiency * cluster.bandwidth)


def message_seconds(cluster: Cluster, machine: Machine) -> float:
    """``4 (W-1) alpha``: the message steps of one flat 1-bit exchange (an all-to-all and a
    ring all-gather, each of ``2 (W-1)`` steps of the ring's latency)."""
    return 4 * (cluster.world - 1) * machine.latency


def host_seconds(nbytes: float, machine: Machine) -> float:
    """``k x / R_h``: processor time of one rank for ``nbytes`` through the collective library."""
    return machine.cpu_sharing * nbytes / machine.host_throughput


def dense_allreduce(cluster: Cluster, machine: Machine, element_bytes: int) -> Exchange:
    """A ring allreduce of N elements of ``element_bytes`` (gloo, NCCL's ring), ranks in node
    order: ``2 (W-1) alpha + max(link(s), s / B_intra) + k 2 (W-1)/W 4N / R_h`` with
    ``s = 2 (W-1)/W N e`` sent per rank; the ring leaves each node once, so a node link
    carries ``s`` (when M > 1), and every hop inside a node carries ``s`` too. The host works per
    element: an fp16 allreduce costs the processor what an fp32 one does."""
    w, n = cluster.world, cluster.parameters
    dtype = {2: torch.float16, 4: torch.float32}[element_bytes]
    sent = allreduce_bytes(torch.empty(n, dtype=dtype, device="meta"), w)
    node_link = sent if cluster.nodes > 1 else 0
    intra = sent / cluster.intra_bandwidth if cluster.ranks_per_node > 1 else 0.0
    host = sent * FP32_BYTES / element_bytes
    seconds = (
        2 * (w - 1) * machine.latency
        + max(link_seconds(node_link, cluster, machine), intra)
        + host_seconds(host, machine)
    )
    return Exchange(seconds, sent, node_link)


def flat_exchange(cluster: Cluster, machine: Machine, block_size: int | None = None) -> Exchange:
    """:func:`~onebit.compressed_allreduce` over all W ranks: an all-to-all of signs, then a
    ring all-gather, with three all-gathers of scalars. With ``p`` one phase's bytes per rank,
    a node link carries ``p (L (W-L)/(W-1) + 1)`` (the all-to-all sends W-L of each rank's W-1
    chunks off the node; the ring all-gather leaves the node once); seconds
    ``4 (W-1) alpha + link(node bytes) / eta_b + max over the node's inside 2p / B_intra
    + k 2p / R_h``. With ``block_size = b`` the buffer is cut into blocks of ``b·W``
    elements, each with its own scales (DiLoCo's outer exchange in blocks)."""
    w, per_node = cluster.world, cluster.ranks_per_node
    if w == 1:
        return Exchange(0.0, 0, 0)
    if block_size is None:
        sent = compressed_allreduce_bytes(cluster.padded, w, torch.float32)
    else:
        sent = _blocks_bytes(cluster.padded, block_size * w, w)
    phase = sent / 2
    node_link = phase * (per_node * (w - per_node) / (w - 1) + 1) if cluster.nodes > 1 else 0
    intra = sent / cluster.intra_bandwidth if per_node > 1 else 0.0
    seconds = (
        message_seconds(cluster, machine)
        + max(link_seconds(node_link, cluster, machine) / machine.burst_efficiency, intra)
        + host_seconds(sent, machine)
    )
    return Exchange(seconds, sent, node_link)


def _blocks_bytes(numel: int, block: int, n: int) -> int:
    """Bytes a rank sends in the per-tensor exchange of ``numel`` elements cut into blocks of
    ``block`` (the last one shorter), without listing the blocks: beyond the backend code each
    segment's bytes are its own, so the whole blocks cost one block's times their count."""

    def sent(sizes: list[int]) -> int:
        return compressed_allreduce_per_tensor_bytes(sizes, n, torch.float32)

    whole, rest = divmod(numel, block)
    code = sent([])  # the backend code, once per exchange
    return whole * (sent([block]) - code) + (sent([rest]) if rest else code)


def overlapped_exchange(cluster: Cluster, machine: Machine) -> Exchange:
    """:func:`flat_exchange` with ``overlap_backward=True``, in K pipelined buckets: the rank's
    core and the link work at once, and the step takes the longest of three bounds.

    * The core does everything it computes and issues every bucket's collectives one after
      another: ``T_core = t_c + t_local + k 2p / R_h + K 4 (W-1) alpha``.
    * The link idles in forward and in the update (forward needs the parameters of the last
      bucket, the update every bucket), and is busy from the start of backward:
      ``T_link = (1-b) t_c + 4 (W-1) alpha + link(node bytes) / eta_b``.
    * The tail: the bytes of the gradients backward completes last, at least the last
      bucket's, go on the link only after backward, while the core waits for them to
      update: ``T_tail = T_core + max(u, 1/K) link(node bytes) / eta_b``.

    ``seconds`` is what the exchange adds to the step: ``max(T_core, T_link, T_tail) - t_c -
    t_local``. One bucket is the flat exchange after backward.
    """
    flat = flat_exchange(cluster, machine)
    if cluster.world == 1:
        return flat
    compute, local = cluster.compute_seconds, local_compression_seconds(cluster, machine)
    latency = message_seconds(cluster, machine)
    wire = link_seconds(flat.node_link_bytes, cluster, machine) / machine.burst_efficiency
    core = compute + local + host_seconds(flat.rank_bytes, machine) + cluster.buckets * latency
    link = (1 - cluster.backward_share) * compute + latency + wire
    tail = core + max(cluster.tail_share, 1 / cluster.buckets) * wire
    return Exchange(max(link, tail) - compute - local, flat.rank_bytes, flat.node_link_bytes)


def delayed_exchange(cluster: Cluster, machine: Machine) -> Exchange:
    """:func:`flat_exchange` with ``delayed_exchange=True``: step t's exchange runs during step
    t+1's forward and backward (ALGORITHM.md, "Delayed exchange"), and the step takes the
    longer of two bounds.

    * The core computes, does the compression stage's local work and the delayed step's two
      passes over the weights (``t_pred = k 4N / R_m`` each: the prediction reads the shared
      weights kept aside and writes the parameters), and moves the exchange's bytes through
      the collective library: ``T_core = t_c + t_local + 2 t_pred + k 2p / R_h``.
    * The exchanges form a chain, each started once the one before has landed and the step
      has run its update and predicted: ``T_chain = u_p t_c + 2 t_pred + t_local + T_flat``.

    ``seconds`` is what the exchange adds to the step: ``max(T_core, T_chain) - t_c -
    t_local``."""
    flat = flat_exchange(cluster, machine)
    if cluster.world == 1:
        return flat
    compute, local = cluster.compute_seconds, local_compression_seconds(cluster, machine)
    weights_pass = machine.cpu_sharing * FP32_BYTES * cluster.parameters / machine.copy_throughput
    core = compute + local + 2 * weights_pass + host_seconds(flat.rank_bytes, machine)
    chain = cluster.update_share * compute + 2 * weights_pass + local + flat.seconds
    return Exchange(max(core, chain) - compute - local, flat.rank_bytes, flat.node_link_bytes)


def hierarchical_exchange(cluster: Cluster, machine: Machine) -> Exchange:
    """:func:`~onebit.hierarchical_compressed_allreduce` with nodes of L ranks, its three steps
    one after another: ``(3 (L-1) + 4 (M-1)) alpha + link(L inter) / eta_b + intra / B_intra
    + k (intra + inter) / R_h`` with ``intra``, ``inter`` from
    :func:`~onebit.exchange.hierarchical_bytes` (every inter-node byte leaves the node)."""
    per_node, nodes = cluster.ranks_per_node, cluster.nodes
    sent = hierarchical_bytes(cluster.padded, per_node, nodes, torch.float32)
    intra, inter = sent["intra_node"], sent["inter_node"]
    node_link = per_node * inter
    seconds = (
        (3 * (per_node - 1) + 4 * (nodes - 1)) * machine.latency
        + link_seconds(node_link, cluster, machine) / machine.burst_efficiency
        + intra / cluster.intra_bandwidth
        + host_seconds(intra + inter, machine)
    )
    return Exchange(seconds, intra + inter, node_link)


def local_compression_seconds(cluster: Cluster, machine: Machine) -> float:
    """``k 4N / R_c``: the compression stage's local work beyond LAMB's update."""
    return machine.cpu_sharing * FP32_BYTES * cluster.parameters / machine.compression_throughput


@dataclass(frozen=True)
class MethodEstimate:
    """One method's predicted step times and traffic, and how they compare with LAMB's."""

    method: str
    label: str
    warmup_step: float
    """Seconds of a step of the warm-up stage (LAMB's step for the 1-bit methods; DiLoCo's
    inner step)."""
    compression_step: float
    """Seconds of a compression-stage step (steady-state step for methods without stages;
    DiLoCo's last step of a round, with the outer exchange)."""
    mean_step: float
    """``w t_warm + (1-w) t_comp``: the run's mean step (DiLoCo's ``t_c + T_outer / H``)."""
    speedup: float
    """LAMB's mean step over this one."""
    compression_speedup: float
    """LAMB's step over this method's compression-stage (or steady) step."""
    rank_bytes: float
    """Bytes one rank sends per step, run average."""
    node_link_bytes: float
    """Bytes through one node link per step, run average."""
    traffic_reduction: float | None
    """LAMB's node-link bytes over this method's (None on one node: nothing leaves it)."""

    def as_dict(self) -> dict[str, float | str | None]:
        return dataclasses.asdict(self)


#: The methods :func:`estimate` predicts, and how tables name them.
METHODS = {
    "lamb": "LAMB (dense allreduce)",
    "fp16": "LAMB + DDP fp16 hook",
    "onebit": "1-bit LAMB / 1-bit Adam, flat",
    "onebit-overlap": "1-bit LAMB / 1-bit Adam, flat, overlapped with backward",
    "onebit-delayed": "1-bit LAMB / 1-bit Adam, flat, exchange delayed by one step",
    "onebit-hier": "1-bit LAMB / 1-bit Adam, hierarchical",
}
#: DiLoCo's outer exchanges in :func:`estimate`'s rows: ``diloco-{exchange}-h{H}``.
DILOCO_LABELS = {"dense": "DiLoCo, dense outer exchange", "1bit": "DiLoCo, 1-bit outer exchange"}


def estimate(cluster: Cluster, machine: Machine) -> list[MethodEstimate]:
    """Every method's step times, speedup and traffic against LAMB. ``fp16`` is left out under
    mixed precision (LAMB's allreduce is then fp16 already), ``onebit-hier`` on nodes of one
    rank (where it is the flat exchange); DiLoCo over the W ranks, dense and 1-bit, for each
    H of ``cluster.sync_every``."""
    compute, w = cluster.compute_seconds, cluster.warmup_fraction
    dense = dense_allreduce(cluster, machine, cluster.gradient_bytes)
    local = local_compression_seconds(cluster, machine)
    stages = {"lamb": (dense, dense, 0.0)}
    if not cluster.mixed_precision:
        fp16 = dense_allreduce(cluster, machine, 2)
        stages["fp16"] = (fp16, fp16, 0.0)
    stages["onebit"] = (dense, flat_exchange(cluster, machine), local)
    stages["onebit-overlap"] = (dense, overlapped_exchange(cluster, machine), local)
    stages["onebit-delayed"] = (dense, delayed_exchange(cluster, machine), local)
    if cluster.ranks_per_node > 1:
        stages["onebit-hier"] = (dense, hierarchical_exchange(cluster, machine), local)

    def mean(warm: float, comp: float) -> float:
        return w * warm + (1 - w) * comp

    lamb_step = compute + dense.seconds
    rows = []
    for method, (warm, comp, extra) in stages.items():
        warm_step, comp_step = compute + warm.seconds, compute + extra + comp.seconds
        mean_step = mean(warm_step, comp_step)
        node_bytes = mean(warm.node_link_bytes, comp.node_link_bytes)
        rows.append(
            MethodEstimate(
                method=method,
                label=METHODS[method],
                warmup_step=warm_step,
                compression_step=comp_step,
                mean_step=mean_step,
                speedup=lamb_step / mean_step,
                compression_speedup=lamb_step / comp_step,
                rank_bytes=mean(warm.rank_bytes, comp.rank_bytes),
                node_link_bytes=node_bytes,
                traffic_reduction=dense.node_link_bytes / node_bytes if node_bytes else None,
            )
        )
    return rows + _diloco_rows(cluster, machine, lamb_step, dense.node_link_bytes)


def _diloco_rows(
    cluster: Cluster, machine: Machine, lamb_step: float, lamb_node_bytes: float
) -> list[MethodEstimate]:
    """DiLoCo over the W ranks for each H of ``cluster.sync_every``, and Streaming DiLoCo
    where ``cluster.streams``: inner steps of ``t_c``, the turn's last adds
    :func:`turn_seconds`; the mean step ``t_c + T_stream K / H``."""
    shapes = [(1, 0)] + ([(cluster.fragments, cluster.fragment_delay)] if cluster.streams else [])
    compute = cluster.compute_seconds
    rows = []
    for rounds in cluster.sync_every:
        for fragments, delay in shapes:
            for name in DILOCO_LABELS:
                added, exchange = turn_seconds(cluster, machine, name, fragments, delay)
                turn = rounds // fragments
                mean_step = compute + added / turn
                node_bytes = exchange.node_link_bytes / turn
                method, label = f"diloco-{name}-h{rounds}", f"{DILOCO_LABELS[name]}, H = {rounds}"
                if name == "1bit" and cluster.outer_block_size is not None:
                    label += f", blocks of {cluster.outer_block_size}"
                if (fragments, delay) != (1, 0):
                    method += f"-k{fragments}-d{delay}"
                    label = f"Streaming {label}, {fragments} fragments, delay {delay}"
                rows.append(
                    MethodEstimate(
                        method=method,
                        label=label,
                        warmup_step=compute,
                        compression_step=compute + added,
                        mean_step=mean_step,
                        speedup=lamb_step / mean_step,
                        compression_speedup=lamb_step / (compute + added),
                        rank_bytes=exchange.rank_bytes / turn,
                        node_link_bytes=node_bytes,
                        traffic_reduction=lamb_node_bytes / node_bytes if node_bytes else None,
                    )
                )
    return rows


def turn_seconds(
    cluster: Cluster, machine: Machine, exchange: str, fragments: int = 1, delay: int = 0
) -> tuple[float, Exchange]:
    """``T_stream``, what DiLoCo's outer exchange adds to the last inner step of a turn, and
    that exchange: of one fragment of N/K elements, ``T_outer,f`` (dense: ``T_dense(4)``;
    1-bit: ``t_local + T_flat``) one after the inner steps; started ``τ = delay`` steps
    before the turn's end, ``max(τ t_c + T_core,f, T_link,f) - τ t_c``, where the core's
    share ``T_core,f`` is the local work and the collectives' host work, and ``T_link,f``
    the rest (messages and wire)."""
    part = dataclasses.replace(
        cluster, parameters=-(-cluster.parameters // fragments), fragments=1, fragment_delay=0
    )
    if exchange == "dense":
        sent, local = dense_allreduce(part, machine, FP32_BYTES), 0.0
    else:
        sent = flat_exchange(part, machine, cluster.outer_block_size)
        local = local_compression_seconds(part, machine)
    outer = local + sent.seconds
    if delay == 0:
        return outer, sent
    core = local + host_seconds(sent.rank_bytes, machine)
    hidden = delay * cluster.compute_seconds
    return max(hidden + core, outer - core) - hidden, sent
