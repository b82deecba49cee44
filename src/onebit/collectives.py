"""Collectives over ``torch.distributed``: the 1-bit compressed allreduce and a dense mean.

Only ``torch.distributed`` collectives are used (``all_to_all_single``,
``all_gather_single``, ``all_reduce``), so the same code runs on gloo (CPU tensors) and
NCCL (CUDA tensors). Without an initialised process group, or with a group of one rank,
everything runs locally with the same maths and no communication.

Every collective issued here is counted in :data:`TRAFFIC`: the bytes this rank sends,
modelled as a bandwidth-optimal implementation sends them (a ring allreduce sends
``2 (n-1)/n`` times the buffer; an all-gather sends this rank's part to ``n-1`` peers; an
all-to-all sends ``(n-1)/n`` of the buffer).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.compression import (
    compress,
    scale_dtype,
    server_average,
    unpack_signs,
    update_error,
)

__all__ = [
    "TRAFFIC",
    "TrafficCounter",
    "NonFiniteError",
    "padded_size",
    "world_size",
    "allreduce_mean_",
    "compressed_allreduce",
]


class NonFiniteError(FloatingPointError):
    """A buffer taking part in a collective holds NaN or Inf (raised on every rank)."""


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


TRAFFIC = TrafficCounter()
"""Process-wide count of the bytes sent by onebit's collectives (see :class:`TrafficCounter`)."""


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


def allreduce_mean_(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """In place: ``tensor = mean over ranks of tensor`` (a dense allreduce), counted as traffic."""
    n = world_size(group)
    if n == 1:
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    tensor.div_(n)
    record_allreduce(tensor, n)
    return tensor


def record_allreduce(tensor: Tensor, n: int) -> int:
    """Count a dense ring allreduce of ``tensor`` over ``n`` ranks: ``2 (n-1)/n`` of its bytes.

    Returns the bytes counted."""
    nbytes = 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
    TRAFFIC.record("allreduce", nbytes)
    return nbytes


class _Workspace:
    """Scratch of one compressed allreduce shape, allocated once and reused across calls.

    For a buffer of ``N`` elements: ``N`` bools for the sign comparison, two chunk-sized
    buffers (``2 N / n`` elements) for the server, and ``N / 4`` bytes of packed signs.
    """

    def __init__(self, numel: int, n: int, dtype: torch.dtype, device: torch.device) -> None:
        chunk = numel // n
        self.bits = torch.empty(numel, dtype=torch.bool, device=device)
        self.received = torch.empty(n, chunk // 8, dtype=torch.uint8, device=device)
        self.gathered = torch.empty(n, chunk // 8, dtype=torch.uint8, device=device)
        self.y = torch.empty(chunk, dtype=dtype, device=device)
        self.work = torch.empty(chunk, dtype=dtype, device=device)
        self.worker_scales = torch.empty(n, dtype=scale_dtype(dtype), device=device)
        self.server_scales = torch.empty(n, dtype=scale_dtype(dtype), device=device)


_WORKSPACES: OrderedDict[tuple, _Workspace] = OrderedDict()
_MAX_WORKSPACES = 4


def _workspace(numel: int, n: int, dtype: torch.dtype, device: torch.device) -> _Workspace:
    key = (numel, n, dtype, device)
    workspace = _WORKSPACES.pop(key, None) or _Workspace(numel, n, dtype, device)
    _WORKSPACES[key] = workspace
    while len(_WORKSPACES) > _MAX_WORKSPACES:
        _WORKSPACES.popitem(last=False)
    return workspace


# `all_gather_single` supersedes `all_gather_into_tensor` in newer torch releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(output: Tensor, local: Tensor, group: dist.ProcessGroup | None, n: int) -> None:
    if n == 1:
        output.copy_(local.reshape(-1))
    else:
        _all_gather_single(output, local.reshape(-1), group=group)


def _check_finite(scales: Tensor, what: str) -> None:
    """Raise the same :class:`NonFiniteError` on every rank if a gathered scale is not finite."""
    finite = torch.isfinite(scales)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise NonFiniteError(
            f"compressed_allreduce: non-finite {what} on rank(s) {bad} "
            f"(NaN or Inf in the buffer); the error-feedback state was left unchanged"
        )


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


def compressed_allreduce(
    buffer: Tensor,
    worker_error: Tensor,
    server_error: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    out: Tensor | None = None,
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

    Returns:
        The decompressed average, identical on every rank.

    Raises:
        ValueError: on sizes, dtypes or devices that do not fit (before any communication).
        NonFiniteError: on every rank, if any rank's buffer (or a server's average) is not
            finite; the error states are left unchanged (``out`` holds scratch values).

    Each rank sends about ``2 (n-1)/n * numel / 8`` bytes plus ``8 (n-1)`` bytes of scales.
    """
    n = world_size(group)
    _validate(buffer, worker_error, server_error, n)
    numel = buffer.numel()
    chunk = numel // n
    if out is None:
        out = torch.empty_like(buffer)
    elif out.numel() != numel or out.dtype != buffer.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {buffer.dtype} tensor of {numel} elements")
    elif out.data_ptr() in (worker_error.data_ptr(), server_error.data_ptr()):
        raise ValueError("out must not be worker_error or server_error")
    ws = _workspace(numel, n, buffer.dtype, buffer.device)
    flat_worker_error = worker_error.view(-1)
    flat_server_error = server_error.view(-1)
    x = out.view(-1)  # `out` holds x = buffer + worker_error until the result arrives

    # Phase 1, worker side: compress x; check every rank's scale before any state changes;
    # then send chunk j of the signs to rank j.
    torch.add(buffer.view(-1), flat_worker_error, out=x)
    packed, worker_scale = compress(x, work=ws.bits)
    packed = packed.to(buffer.device)
    _all_gather(ws.worker_scales, worker_scale, group, n)
    _check_finite(ws.worker_scales, "worker scale")
    update_error(flat_worker_error, x, packed, worker_scale)
    if n == 1:
        ws.received.view(-1).copy_(packed)
    else:
        dist.all_to_all_single(ws.received.view(-1), packed, group=group)

    # Phase 1, server side: this rank's chunk averaged over all workers plus the server
    # error, compressed again.
    server_average(ws.received, ws.worker_scales, flat_server_error, ws.y, ws.work)
    server_packed, server_scale = compress(ws.y, work=ws.bits[:chunk])
    server_packed = server_packed.to(buffer.device)

    # Phase 2: every rank gathers every server's compressed chunk and scale, and decodes.
    _all_gather(ws.server_scales, server_scale, group, n)
    _check_finite(ws.server_scales, "server scale")
    update_error(flat_server_error, ws.y, server_packed, server_scale)
    _all_gather(ws.gathered.view(-1), server_packed, group, n)
    result = out.view(-1)
    for j in range(n):
        unpack_signs(
            ws.gathered[j],
            chunk,
            out=result[j * chunk : (j + 1) * chunk],
            scale=ws.server_scales[j],
        )

    if n > 1:
        sign_bytes = (n - 1) * chunk // 8  # all-to-all and all-gather each send this much
        TRAFFIC.record("compressed_allreduce", 2 * sign_bytes + 2 * 4 * (n - 1))
    return out
