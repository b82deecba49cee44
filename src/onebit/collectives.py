"""The collectives as functions over ``torch.distributed``: the 1-bit compressed allreduce
(whole buffer or tensor by tensor) with caller-held error state, and a dense mean.

Each checks its arguments, then runs the exchange the optimizers run (:mod:`onebit.exchange`:
:class:`~onebit.exchange.FlatExchange`, :class:`~onebit.exchange.PerTensorExchange`) over the
caller's error buffers. Traffic is counted in a :class:`TrafficCounter` the caller passes:
the bytes this rank sends, modelled as a bandwidth-optimal implementation sends them (a ring
allreduce sends ``2 (n-1)/n`` times the buffer; an all-gather sends this rank's part to
``n-1`` peers; an all-to-all sends ``(n-1)/n`` of the buffer). Scratch memory lives in a
:class:`CompressionWorkspace` the caller passes, or is allocated for the one call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from onebit import kernels as backends
from onebit.exchange.flat import FlatExchange, PerTensorExchange, per_tensor_error_sizes
from onebit.exchange.protocol import (
    Layout,
    check_buffer_size,
    check_error_state,
    exchange_bytes,
    padded_size,
)
from onebit.exchange.transport import (
    KernelMismatchError,
    NonFiniteError,
    TrafficCounter,
    world_size,
)
from onebit.exchange.workspace import CompressionWorkspace

__all__ = [
    "CompressionWorkspace",
    "KernelMismatchError",
    "TrafficCounter",
    "NonFiniteError",
    "padded_size",
    "world_size",
    "allreduce_mean_",
    "compressed_allreduce",
    "compressed_allreduce_per_tensor",
    "per_tensor_error_sizes",
    "allreduce_bytes",
    "compressed_allreduce_bytes",
    "compressed_allreduce_per_tensor_bytes",
]


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
    return ring_allreduce_bytes(tensor.numel() * tensor.element_size(), n)


def ring_allreduce_bytes(nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes`` over ``n`` ranks."""
    return 2 * (n - 1) * nbytes // n


def compressed_allreduce_bytes(numel: int, n: int, dtype: torch.dtype) -> int:
    """Bytes one rank sends in a :func:`compressed_allreduce` of ``numel`` elements of
    ``dtype`` over ``n`` ranks: its signs for the ``n-1`` other servers (all-to-all), its
    server chunk's signs to ``n-1`` peers (all-gather), and two scales and the backend code
    per peer (scales in :func:`~onebit.compression.scale_dtype` precision)."""
    return exchange_bytes(Layout.flat(numel, n), dtype)


def compressed_allreduce_per_tensor_bytes(numels: Sequence[int], n: int, dtype: torch.dtype) -> int:
    """Bytes one rank sends in a :func:`compressed_allreduce_per_tensor` of tensors of these
    sizes and ``dtype`` over ``n`` ranks: its signs for the ``n-1`` other servers
    (all-to-all), its server chunks' signs to ``n-1`` peers (all-gather), and per peer its
    vector of worker scales and backend code and its vector of server scales."""
    return exchange_bytes(Layout.per_tensor(numels, n), dtype)


def _validate(buffer: Tensor, worker_error: Tensor, server_error: Tensor, n: int) -> None:
    numel = buffer.numel()
    if not buffer.is_floating_point():
        raise TypeError(f"buffer must be a floating-point tensor, got {buffer.dtype}")
    check_buffer_size(numel, n, "world_size")
    if worker_error.numel() != numel:
        raise ValueError(
            f"worker_error has {worker_error.numel()} elements; it must match the buffer's {numel}"
        )
    if server_error.numel() != numel // n:
        raise ValueError(
            f"server_error has {server_error.numel()} elements; it must be "
            f"buffer.numel() // world_size = {numel} // {n} = {numel // n}"
        )
    check_error_state("worker_error", worker_error, buffer)
    check_error_state("server_error", server_error, buffer)
    if not buffer.is_contiguous():
        raise ValueError("buffer must be contiguous")


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
    n = world_size(group)
    _validate(buffer, worker_error, server_error, n)
    if out is None:
        out = torch.empty_like(buffer)
    numel = buffer.numel()
    if out.numel() != numel or out.dtype != buffer.dtype or not out.is_contiguous():
        raise ValueError(
            f"the output buffer must be a contiguous {buffer.dtype} tensor of {numel} elements"
        )
    if out.data_ptr() in (worker_error.data_ptr(), server_error.data_ptr()):
        raise ValueError("the output buffer must not be worker_error or server_error")
    exchange = FlatExchange(group, workspace)
    backend = backends.select(buffer, kernels)
    exchange.carry_errors([numel], worker_error, server_error, backend, traffic)
    return exchange.exchange_into(buffer, out).decode(out)


def _validate_per_tensor(
    tensors: Sequence[Tensor], worker_error: Tensor, server_error: Tensor, n: int
) -> None:
    """Check the inputs of :func:`compressed_allreduce_per_tensor`."""
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
        check_error_state(name, tensor, worker_error, "worker_error")


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
    two collectives (ALGORITHM.md, "Per-tensor compression"): one all-to-all (server ``j``
    gets each rank's worker scales, then chunk ``j`` of every tensor's signs) and one
    all-gather of every server's signs and scales.

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
    _validate_per_tensor(tensors, worker_error, server_error, n)
    exchange = PerTensorExchange(group)
    backend = backends.select(worker_error, kernels)
    numels = [tensor.numel() for tensor in tensors]
    exchange.carry_errors(numels, worker_error, server_error, backend, traffic)
    exchange.exchange_tensors(tensors)
