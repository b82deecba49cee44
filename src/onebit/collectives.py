"""Collectives over ``torch.distributed``: the 1-bit compressed allreduce and a dense mean.

Only ``torch.distributed`` collectives are used (``all_to_all_single``,
``all_gather_single``, ``all_reduce``), so the same code runs on gloo (CPU tensors) and
NCCL (CUDA tensors). Without an initialised process group, or with a group of one rank,
everything runs locally with the same maths and no communication.

Traffic is counted in a :class:`TrafficCounter` the caller passes (each optimizer owns
one): the bytes this rank sends, modelled as a bandwidth-optimal implementation sends them
(a ring allreduce sends ``2 (n-1)/n`` times the buffer; an all-gather sends this rank's part
to ``n-1`` peers; an all-to-all sends ``(n-1)/n`` of the buffer). Scratch memory lives in a
:class:`CompressionWorkspace` the caller passes, or is allocated for the one call.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from onebit import kernels as backends
from onebit.compression import per_tensor_padded_size, scale_dtype

__all__ = [
    "CompressionWorkspace",
    "KernelMismatchError",
    "TrafficCounter",
    "NonFiniteError",
    "padded_size",
    "world_size",
    "allreduce_mean_",
    "compressed_allreduce",
    "compressed_allreduce_packed",
    "compressed_allreduce_per_tensor",
    "per_tensor_error_sizes",
    "PackedResult",
]


class NonFiniteError(FloatingPointError):
    """A buffer taking part in a collective holds NaN or Inf (raised on every rank)."""


class KernelMismatchError(RuntimeError):
    """Ranks of a group run different compression backends (raised on every rank)."""


@dataclass
class TrafficCounter:
    """Bytes this process has sent, per kind of collective, and how many calls made them."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + int(nbytes)
            self.calls[kind] = self.calls.get(kind, 0) + 1

    def total(self) -> int:
        """All bytes sent so far, every kind together."""
        with self._lock:
            return sum(self.bytes_sent.values())

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent.clear()
            self.calls.clear()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group``; 1 when ``torch.distributed`` is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def padded_size(numel: int, world_size: int) -> int:
    """Smallest multiple of ``8 * world_size`` that is ``>= numel`` (and at least one multiple).

    A buffer of that size splits into ``world_size`` equal chunks of whole bytes of signs.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    unit = 8 * world_size
    return max(unit, -(-numel // unit) * unit)


def allreduce_mean_(
    tensor: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
) -> Tensor:
    """In place: ``tensor = mean over ranks of tensor`` (a dense allreduce).

    Its bytes are counted in ``traffic`` if given."""
    n = world_size(group)
    if n == 1:
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(n)
    if traffic is not None:
        traffic.record("allreduce", allreduce_bytes(tensor, n))
    return tensor


def allreduce_bytes(tensor: Tensor, n: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``tensor`` over ``n`` ranks:
    ``2 (n-1)/n`` of its size."""
    return 2 * (n - 1) * tensor.numel() * tensor.element_size() // n


def compressed_allreduce_bytes(numel: int, n: int, dtype: torch.dtype) -> int:
    """Bytes one rank sends in a :func:`compressed_allreduce` of ``numel`` elements of
    ``dtype`` over ``n`` ranks: its signs for the ``n-1`` other servers (all-to-all), its
    server chunk's signs to ``n-1`` peers (all-gather), and two scales and the backend code
    per peer (scales in :func:`~onebit.compression.scale_dtype` precision)."""
    if n == 1:
        return 0
    sign_bytes = (n - 1) * (numel // n) // 8
    scale_bytes = torch.empty((), dtype=scale_dtype(dtype)).element_size()
    return 2 * sign_bytes + 3 * scale_bytes * (n - 1)


class CompressionWorkspace:
    """Scratch memory of :func:`compressed_allreduce`, allocated once and reused.

    Holds, for the most recent buffer shape (size, world size, dtype, device, backend):
    ``N / 4`` bytes of packed signs, the gathered scales, and whatever the backend keeps
    between its stages (the reference: ``N`` bools and two chunk-sized buffers; the fused
    backends: nothing). Each optimizer owns one; pass your own to reuse it across calls.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None

    def prepare(
        self, numel: int, n: int, dtype: torch.dtype, device: torch.device, backend
    ) -> CompressionWorkspace:
        key = (numel, n, dtype, device, backend.name)
        if key == self._key:
            return self
        chunk, sdtype = numel // n, scale_dtype(dtype)
        self.worker_packed = torch.empty(numel // 8, dtype=torch.uint8, device=device)
        self.received = torch.empty(n, chunk // 8, dtype=torch.uint8, device=device)
        self.server_packed = torch.empty(chunk // 8, dtype=torch.uint8, device=device)
        self.gathered = torch.empty(n, chunk // 8, dtype=torch.uint8, device=device)
        self.local_scale = torch.empty(2, dtype=sdtype, device=device)  # scale, backend code
        self.worker_scales = torch.empty(n, 2, dtype=sdtype, device=device)
        self.server_scales = torch.empty(n, dtype=sdtype, device=device)
        self.backend_scratch = backend.scratch(numel, n, dtype, device)
        self._key = key
        return self

    def nbytes(self) -> int:
        """Bytes of scratch held now."""
        scratch = vars(self.backend_scratch) if self.backend_scratch is not None else {}
        return sum(
            value.numel() * value.element_size()
            for value in [*vars(self).values(), *scratch.values()]
            if isinstance(value, Tensor)
        )


# `all_gather_single` supersedes `all_gather_into_tensor` in newer torch releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into(output: Tensor, local: Tensor, group: dist.ProcessGroup | None, n: int) -> None:
    """``output`` (``n`` times ``local``'s size) = every rank's ``local``, in rank order."""
    if n == 1:
        output.copy_(local.reshape(output.shape))
    else:
        _all_gather_single(output.view(-1), local.reshape(-1), group=group)


def _worker_scales_problem(gathered: Tensor, backend_name: str) -> Exception | None:
    """The error every rank raises if ranks run different backends or a worker scale is not
    finite (one host read of the gathered ``[scales..., backend code]`` rows)."""
    rows = gathered.tolist()
    codes = [int(row[-1]) if row[-1] == row[-1] else 0 for row in rows]
    if len(set(codes)) > 1:
        names = [
            backends.BACKENDS[code - 1] if 0 < code <= len(backends.BACKENDS) else "?"
            for code in codes
        ]
        return KernelMismatchError(
            f"compressed_allreduce: ranks use different compression backends {names} (by "
            f"rank; this rank: {backend_name!r}). Install the same packages on every rank, or "
            "set ONEBIT_KERNELS to the same backend everywhere."
        )
    return _finite_problem([row[:-1] for row in rows], "worker scale")


def _finite_problem(scales: list, what: str) -> NonFiniteError | None:
    """The :class:`NonFiniteError` every rank raises if a gathered scale is not finite
    (``scales[rank]``: that rank's scale, or a list of its scales)."""
    bad = [
        rank
        for rank, values in enumerate(scales)
        if not all(map(math.isfinite, values if isinstance(values, list) else [values]))
    ]
    if bad:
        return NonFiniteError(
            f"compressed_allreduce: non-finite {what} on rank(s) {bad} "
            f"(NaN or Inf in the buffer); the error-feedback state was left unchanged"
        )
    return None


_PROBLEMS = (NonFiniteError, KernelMismatchError)  # codes 1, 2; 0 is none


def _raise_agreed(
    problem: Exception | None, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Raise ``problem``, or the worst problem any rank of ``group`` found, on every rank of
    ``group`` (one all-reduce of a small integer; nothing when ``group`` is ``None``)."""
    if group is not None and world_size(group) > 1:
        code = 0 if problem is None else _PROBLEMS.index(type(problem)) + 1
        flag = torch.tensor([code], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        agreed = int(flag)
        if agreed and (problem is None or _PROBLEMS.index(type(problem)) + 1 != agreed):
            problem = _PROBLEMS[agreed - 1](
                "compressed_allreduce: another rank of the agreeing group found a "
                f"{_PROBLEMS[agreed - 1].__name__}; the error-feedback state was left unchanged"
            )
    if problem is not None:
        raise problem


def _validate(buffer: Tensor, worker_error: Tensor, server_error: Tensor, n: int) -> None:
    numel = buffer.numel()
    if not buffer.is_floating_point():
        raise TypeError(f"buffer must be a floating-point tensor, got {buffer.dtype}")
    if numel == 0 or numel % (8 * n):
        raise ValueError(
            f"buffer has {numel} elements; it must be a positive multiple of 8 * world_size = "
            f"{8 * n} (pad it to onebit.padded_size({numel}, {n}) = {padded_size(numel, n)})"
        )
    if worker_error.numel() != numel:
        raise ValueError(
            f"worker_error has {worker_error.numel()} elements; it must match the buffer's {numel}"
        )
    if server_error.numel() != numel // n:
        raise ValueError(
            f"server_error has {server_error.numel()} elements; it must be "
            f"buffer.numel() // world_size = {numel} // {n} = {numel // n}"
        )
    for name, tensor in (("worker_error", worker_error), ("server_error", server_error)):
        if tensor.dtype != buffer.dtype or tensor.device != buffer.device:
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device}; it must match the buffer "
                f"({buffer.dtype} on {buffer.device})"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not buffer.is_contiguous():
        raise ValueError("buffer must be contiguous")


@dataclass
class PackedResult:
    """The result of a compressed allreduce before decoding: row ``j`` of ``signs`` holds
    server ``j``'s packed signs of chunk ``j``, ``scales[j]`` its scale; element ``e`` of the
    result is ``+-scales[e // chunk]`` (``+`` where its bit is set). Views of the workspace,
    valid until its next use."""

    signs: Tensor
    scales: Tensor
    backend: str

    @property
    def chunk(self) -> int:
        return 8 * self.signs.shape[1]

    def decode(self, out: Tensor) -> Tensor:
        """Write the decompressed result into ``out`` (``N`` elements) and return it."""
        backends.select(out, self.backend).decode(self.signs, self.scales, out.view(-1))
        return out


def compressed_allreduce(
    buffer: Tensor,
    worker_error: Tensor,
    server_error: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    out: Tensor | None = None,
    workspace: CompressionWorkspace | None = None,
    traffic: TrafficCounter | None = None,
    kernels: str | None = None,
) -> Tensor:
    """Average ``buffer`` over the ranks of ``group`` at 1 bit per element, with error feedback.

    Two phases (ALGORITHM.md): each rank compresses ``x = buffer + worker_error`` to signs and
    one scale, and sends chunk ``j`` of its signs to rank ``j`` (all-to-all); rank ``j``
    averages the chunks it received, compresses that average plus ``server_error``, and all
    ranks gather every rank's compressed chunk. ``worker_error`` and ``server_error`` are
    updated in place with what the compression lost, so it is sent in later calls.

    Args:
        buffer: flat floating-point tensor whose ``numel`` is a multiple of ``8 * world_size``
            (see :func:`padded_size`); not modified (unless it is ``out``).
        worker_error: this rank's error state, same size, dtype and device as ``buffer``.
        server_error: error state of this rank's chunk, ``buffer.numel() // world_size``.
        group: process group (default: the world); a world of one rank needs no init.
        out: where to write the result (may be ``buffer`` itself); allocated if ``None``.
        workspace: scratch reused across calls (allocated for this call if ``None``).
        traffic: where to count the bytes this rank sends (nowhere if ``None``).
        kernels: the backend of the local work (:mod:`onebit.kernels`); default
            ``$ONEBIT_KERNELS`` or ``"auto"``. Every rank must use the same one.

    Returns:
        The decompressed average, identical on every rank.

    Raises:
        ValueError: on sizes, dtypes or devices that do not fit (before any communication).
        NonFiniteError: on every rank, if any rank's buffer (or a server's average) is not
            finite; the error states are left unchanged (``out`` holds scratch values).
        KernelMismatchError: on every rank, if ranks run different backends; the error
            states are left unchanged.

    Each rank sends :func:`compressed_allreduce_bytes`: about ``2 (n-1)/n * numel / 8``.
    """
    if out is None:
        out = torch.empty_like(buffer)
    packed = compressed_allreduce_packed(
        buffer,
        worker_error,
        server_error,
        group,
        scratch=out,
        workspace=workspace,
        traffic=traffic,
        kernels=kernels,
    )
    return packed.decode(out)


def compressed_allreduce_packed(
    buffer: Tensor,
    worker_error: Tensor,
    server_error: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    scratch: Tensor,
    workspace: CompressionWorkspace | None = None,
    traffic: TrafficCounter | None = None,
    kernels: str | None = None,
    agree_on: dist.ProcessGroup | None = None,
) -> PackedResult:
    """:func:`compressed_allreduce` without the final decoding: for a consumer that decodes
    on the fly (the optimizers' fused updates). ``scratch`` (the buffer's size; may be the
    buffer itself) holds intermediate values. With ``agree_on``, a second group whose ranks
    must all raise when any of them does (the hierarchical exchange's node), every check is
    agreed on over it too, before any error state changes."""
    n = world_size(group)
    _validate(buffer, worker_error, server_error, n)
    numel = buffer.numel()
    if scratch.numel() != numel or scratch.dtype != buffer.dtype or not scratch.is_contiguous():
        raise ValueError(
            f"the output buffer must be a contiguous {buffer.dtype} tensor of {numel} elements"
        )
    if scratch.data_ptr() in (worker_error.data_ptr(), server_error.data_ptr()):
        raise ValueError("the output buffer must not be worker_error or server_error")
    backend = backends.select(buffer, kernels)
    ws = (workspace or CompressionWorkspace()).prepare(
        numel, n, buffer.dtype, buffer.device, backend
    )
    stage_scratch = ws.backend_scratch
    buffer, worker_error, server_error, x = (
        t.view(-1) for t in (buffer, worker_error, server_error, scratch)
    )

    # Phase 1, worker side: compress x = buffer + worker_error; check every rank's scale and
    # backend before any state changes; then send chunk j of the signs to rank j.
    worker_scale = backend.worker_compress(buffer, worker_error, ws.worker_packed, x, stage_scratch)
    ws.local_scale[0] = worker_scale
    ws.local_scale[1] = backends.code(backend)
    all_gather_into(ws.worker_scales, ws.local_scale, group, n)
    _raise_agreed(_worker_scales_problem(ws.worker_scales, backend.name), agree_on, x.device)
    backend.worker_error_update(
        buffer, worker_error, ws.worker_packed, worker_scale, x, stage_scratch
    )
    if n == 1:
        ws.received.view(-1).copy_(ws.worker_packed)
    else:
        dist.all_to_all_single(ws.received.view(-1), ws.worker_packed, group=group)

    # Phase 1, server side: this rank's chunk averaged over all workers plus the server
    # error, compressed again.
    worker_scales = ws.worker_scales[:, 0]
    server_scale = backend.server_compress(
        ws.received, worker_scales, server_error, ws.server_packed, stage_scratch
    )

    # Phase 2: every rank gathers every server's compressed chunk and scale.
    all_gather_into(ws.server_scales, server_scale, group, n)
    _raise_agreed(_finite_problem(ws.server_scales.tolist(), "server scale"), agree_on, x.device)
    backend.server_error_update(
        ws.received, worker_scales, server_error, ws.server_packed, server_scale, stage_scratch
    )
    all_gather_into(ws.gathered, ws.server_packed, group, n)
    if traffic is not None and n > 1:
        traffic.record("compressed_allreduce", compressed_allreduce_bytes(numel, n, buffer.dtype))
    return PackedResult(ws.gathered, ws.server_scales, backend.name)


def per_tensor_error_sizes(numels: Sequence[int], n: int) -> tuple[int, int]:
    """``(worker_error elements, server_error elements)`` of
    :func:`compressed_allreduce_per_tensor` for tensors of these sizes over ``n`` ranks:
    ``W = sum_t P_t`` (each tensor padded alone, :func:`~onebit.compression.per_tensor_padded_size`)
    and ``W / n``."""
    width = sum(per_tensor_padded_size(numel, n) for numel in numels)
    return width, width // n


def compressed_allreduce_per_tensor_bytes(numels: Sequence[int], n: int, dtype: torch.dtype) -> int:
    """Bytes one rank sends in a :func:`compressed_allreduce_per_tensor` of tensors of these
    sizes and ``dtype`` over ``n`` ranks: its signs for the ``n-1`` other servers
    (all-to-all), its server chunks' signs to ``n-1`` peers (all-gather), and per peer its
    vector of worker scales and backend code and its vector of server scales."""
    if n == 1:
        return 0
    _, server = per_tensor_error_sizes(numels, n)
    scale_bytes = torch.empty((), dtype=scale_dtype(dtype)).element_size()
    return 2 * (n - 1) * server // 8 + (2 * len(numels) + 1) * scale_bytes * (n - 1)


def _validate_per_tensor(
    tensors: Sequence[Tensor], worker_error: Tensor, server_error: Tensor, n: int
) -> list[int]:
    """Check the inputs of :func:`compressed_allreduce_per_tensor`; each tensor's padded size."""
    if not tensors:
        raise ValueError("tensors must hold at least one tensor")
    if not worker_error.is_floating_point():
        raise TypeError(f"worker_error must be a floating-point tensor, got {worker_error.dtype}")
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor) or tensor.dtype != worker_error.dtype:
            found = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
            raise TypeError(f"tensors[{index}] is {found}; it must be {worker_error.dtype}")
        if tensor.device != worker_error.device:
            raise ValueError(
                f"tensors[{index}] is on {tensor.device}; it must be on {worker_error.device}"
            )
    width, server = per_tensor_error_sizes([t.numel() for t in tensors], n)
    for name, tensor, expected in (
        ("worker_error", worker_error, width),
        ("server_error", server_error, server),
    ):
        if tensor.numel() != expected:
            raise ValueError(
                f"{name} has {tensor.numel()} elements; these tensors need {expected} over "
                f"{n} ranks (onebit.per_tensor_error_sizes)"
            )
        if tensor.dtype != worker_error.dtype or tensor.device != worker_error.device:
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device}; it must match worker_error "
                f"({worker_error.dtype} on {worker_error.device})"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return [per_tensor_padded_size(t.numel(), n) for t in tensors]


def compressed_allreduce_per_tensor(
    tensors: Sequence[Tensor],
    worker_error: Tensor,
    server_error: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kernels: str | None = None,
) -> None:
    """Replace each tensor, in place, by its 1-bit compressed average over the group
    (DeepSpeed's per-tensor compressed allreduce), with flat error buffers holding every
    tensor's padded error one after another; fused collectives.

    Tensor ``t`` (``N_t`` elements) is zero-padded alone to ``P_t``
    (:func:`~onebit.compression.per_tensor_padded_size`) and exchanged as by
    :func:`compressed_allreduce`, with its own worker scale, per-chunk server scales and the
    slices ``worker_error[W_t : W_t + P_t]`` and ``server_error[S_t : S_t + P_t / n]``
    (``W_t``, ``S_t``: the sums over the tensors before it). All tensors travel together in
    four collectives (ALGORITHM.md, "Per-tensor compression"): an all-gather of each rank's
    worker scales, one all-to-all of the signs (server ``j`` gets chunk ``j`` of every
    tensor), an all-gather of the server scales and one of the servers' signs.

    Args:
        tensors: floating-point tensors of one dtype and device, any shapes.
        worker_error, server_error: this rank's error state, of the tensors' dtype and
            device, with the sizes :func:`per_tensor_error_sizes` gives.
        group, traffic, kernels: as in :func:`compressed_allreduce`; the bytes are
            :func:`compressed_allreduce_per_tensor_bytes`, counted as ``"compressed_allreduce"``.

    Raises:
        ValueError, TypeError: on sizes, dtypes or devices that do not fit (before any
            communication).
        NonFiniteError, KernelMismatchError: on every rank, as :func:`compressed_allreduce`;
            the tensors and the error states are left unchanged.
    """
    n = world_size(group)
    tensors = list(tensors)
    sizes = _validate_per_tensor(tensors, worker_error, server_error, n)
    dtype, device = worker_error.dtype, worker_error.device
    backend = backends.select(worker_error, kernels)
    count, width = len(tensors), sum(sizes)
    worker_errors = worker_error.view(-1).split(sizes)
    server_errors = server_error.view(-1).split([size // n for size in sizes])
    # Each tensor padded alone: the tensor itself where it needs no padding, else a copy.
    buffers = [
        tensor.view(-1) if tensor.is_contiguous() and tensor.numel() == size else None
        for tensor, size in zip(tensors, sizes, strict=True)
    ]
    for t, size in enumerate(sizes):
        if buffers[t] is None:
            buffers[t] = torch.zeros(size, dtype=dtype, device=device)
            buffers[t][: tensors[t].numel()].copy_(tensors[t].reshape(-1))
    xs = torch.empty(width, dtype=dtype, device=device).split(sizes)  # the reference's x
    worker_packed = torch.empty(width // 8, dtype=torch.uint8, device=device)
    packed = worker_packed.split([size // 8 for size in sizes])
    scratch = [backend.scratch(size, n, dtype, device) for size in sizes]
    sdtype = scale_dtype(dtype)

    # Phase 1, worker side: every tensor compressed alone; every rank's scales and backend
    # checked before any state changes; chunk j of every tensor's signs to rank j.
    local_scales = torch.empty(count + 1, dtype=sdtype, device=device)
    for t in range(count):
        local_scales[t] = backend.worker_compress(
            buffers[t], worker_errors[t], packed[t], xs[t], scratch[t]
        )
    local_scales[count] = backends.code(backend)
    worker_scales = torch.empty(n, count + 1, dtype=sdtype, device=device)
    all_gather_into(worker_scales, local_scales, group, n)
    _raise_agreed(_worker_scales_problem(worker_scales, backend.name), None, device)
    for t in range(count):
        backend.worker_error_update(
            buffers[t], worker_errors[t], packed[t], local_scales[t], xs[t], scratch[t]
        )
    chunk_bytes = [size // (8 * n) for size in sizes]
    by_server = torch.cat([p.view(n, c) for p, c in zip(packed, chunk_bytes, strict=True)], dim=1)
    received = torch.empty_like(by_server)
    if n == 1:
        received.copy_(by_server)
    else:
        dist.all_to_all_single(received.view(-1), by_server.view(-1), group=group)

    # Phase 1, server side: this rank's chunk of every tensor, averaged and compressed again.
    received_by_tensor = [part.contiguous() for part in received.split(chunk_bytes, dim=1)]
    worker_scales_by_tensor = worker_scales[:, :count].T.contiguous()  # row t: a_0t ... a_(n-1)t
    server_packed = torch.empty(width // (8 * n), dtype=torch.uint8, device=device)
    server_parts = server_packed.split(chunk_bytes)
    local_server_scales = torch.empty(count, dtype=sdtype, device=device)
    for t in range(count):
        local_server_scales[t] = backend.server_compress(
            received_by_tensor[t],
            worker_scales_by_tensor[t],
            server_errors[t],
            server_parts[t],
            scratch[t],
        )

    # Phase 2: every rank gathers every server's scales and signs.
    server_scales = torch.empty(n, count, dtype=sdtype, device=device)
    all_gather_into(server_scales, local_server_scales, group, n)
    _raise_agreed(_finite_problem(server_scales.tolist(), "server scale"), None, device)
    for t in range(count):
        backend.server_error_update(
            received_by_tensor[t],
            worker_scales_by_tensor[t],
            server_errors[t],
            server_parts[t],
            local_server_scales[t],
            scratch[t],
        )
    gathered = torch.empty(n, width // (8 * n), dtype=torch.uint8, device=device)
    all_gather_into(gathered, server_packed, group, n)
    server_scales_by_tensor = server_scales.T.contiguous()
    for t, part in enumerate(gathered.split(chunk_bytes, dim=1)):  # the buffers are spent
        backend.decode(part.contiguous(), server_scales_by_tensor[t], buffers[t])
        if buffers[t].data_ptr() != tensors[t].data_ptr():
            tensors[t].copy_(buffers[t][: tensors[t].numel()].view_as(tensors[t]))
    if traffic is not None and n > 1:
        traffic.record(
            "compressed_allreduce",
            compressed_allreduce_per_tensor_bytes([t.numel() for t in tensors], n, dtype),
        )
