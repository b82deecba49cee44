"""The numba backend: fused CPU kernels for float32 and float64 tensors.

Kernels are compiled on first use. With one torch thread (the usual setting for one
process per rank) they run serially, compiled once and cached on disk; with more threads a
parallel build of the same code runs on ``torch.get_num_threads()`` threads. Both give the
same bits: work is split into fixed blocks whatever the thread count. Every kernel releases
the GIL while it runs (``nogil``), so an exchange on another thread (the delayed exchange's)
computes beside the Python of forward and backward.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence

import numba
import numpy as np
import torch
from numba import typed
from torch import Tensor

from onebit.compression import Layout
from onebit.kernels import _numba_compression as compression
from onebit.kernels._reference import ReferenceKernels

_DRIVERS = (
    "worker_compress",
    "worker_error_update",
    "server_compress",
    "server_error_update",
    "decode",
    "gather_columns",
)


class Compiled:
    """Serial and parallel builds of a module's driver functions, compiled on first use and
    cached on disk (numba's cache keys a function by its qualified name, so the parallel
    build is made from a renamed copy of each function)."""

    def __init__(self, module, names) -> None:
        self._module, self._names = module, names
        self._builds: dict[bool, dict] = {}

    def __call__(self, name: str):
        threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
        parallel = threads > 1
        build = self._builds.get(parallel)
        if build is None:
            jit = numba.njit(parallel=parallel, error_model="numpy", cache=True, nogil=True)
            build = {n: jit(_variant(getattr(self._module, n), parallel)) for n in self._names}
            self._builds[parallel] = build
        if parallel:
            numba.set_num_threads(threads)
        return build[name]


def _variant(function, parallel: bool):
    """``function`` itself, or a copy named ``<name>_parallel`` for the parallel build."""
    if not parallel:
        return function
    copy = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__ + "_parallel",
        function.__defaults__,
        function.__closure__,
    )
    copy.__qualname__ = function.__qualname__ + "_parallel"
    copy.__module__ = function.__module__
    return copy


_COMPRESSION = Compiled(compression, _DRIVERS)


def to_numpy(tensor: Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (no copy)."""
    return tensor.detach().numpy()


# ----------------------------------------------------------------------------- tables
def _rows(spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``[B, 3]`` rows ``(segment, start, end)``: blocks of at most ``BLOCK`` elements of each
    span ``(start, end)`` of the flat buffer, which they never cross."""
    block = compression.BLOCK
    rows = [
        (t, s, min(s + block, end)) for t, (start, end) in enumerate(spans)
        for s in range(start, end, block)
    ]  # fmt: skip
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def _spans(sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return tuple(zip(bounds[:-1], bounds[1:], strict=True))


@functools.lru_cache(maxsize=128)
def _worker_blocks(sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The worker side's blocks of segments of ``sizes`` and each segment's start."""
    spans = _spans(sizes)
    return _rows(spans), np.asarray([start for start, _ in spans], dtype=np.int64)


@functools.lru_cache(maxsize=128)
def _server_blocks(chunks: tuple[int, ...]) -> np.ndarray:
    """The server side's blocks of its chunks of every segment (``chunks[t]`` elements)."""
    return _rows(_spans(chunks))


@functools.lru_cache(maxsize=128)
def _decode_pieces(layout: Layout) -> np.ndarray:
    """Rows ``(segment, server, out offset, first byte, count)`` that decode every segment's
    first ``numels[t]`` values, segment after segment (the whole buffer for one segment of
    ``width`` values), in pieces of at most ``BLOCK`` elements within one server's chunk."""
    block, rows, out = compression.BLOCK, [], 0
    column = 0  # the segment's first byte in a server's row
    for t, (numel, chunk) in enumerate(zip(layout.numels, layout.chunks, strict=True)):
        for j in range(layout.n):
            end = min(chunk, numel - j * chunk)
            rows.extend(
                (t, j, out + j * chunk + k, column + k // 8, min(block, end - k))
                for k in range(0, max(end, 0), block)
            )
        out, column = out + numel, column + chunk // 8
    return np.asarray(rows, dtype=np.int64).reshape(-1, 5)


def _per_segment(blocks: np.ndarray, partial: np.ndarray, segments: int) -> np.ndarray:
    """Per-block partial sums added per segment, in block order."""
    totals = np.zeros(segments, np.float64)
    np.add.at(totals, blocks[:, 0], partial)
    return totals


def _scales(sums: np.ndarray, sizes: Sequence[int], dtype: torch.dtype) -> Tensor:
    """``sqrt(sum) / sqrt(P_t)`` per segment, as a ``dtype`` vector."""
    return torch.from_numpy(np.sqrt(sums) / np.sqrt(np.asarray(sizes, np.float64))).to(dtype)


def _weights(worker_scales: Tensor, n: int, dtype: torch.dtype) -> np.ndarray:
    """The server's weights ``a_ti / n`` (``[segments, n]``), rounded to the buffer's dtype."""
    return to_numpy((worker_scales / n).to(dtype)).reshape(-1, n)


class NumbaKernels(ReferenceKernels):
    """Fused compression on CPU: worker side, server side and decoding, one pass each, for
    one buffer or for all segments of a per-tensor layout at once (the ``*_segments``
    methods of :class:`onebit.kernels.SegmentedCompressionKernels`)."""

    name = "numba"

    def supports(self, tensor: Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64)

    def scratch(self, numel, n, dtype, device) -> None:
        return None  # intermediates are recomputed, never stored

    # ------------------------------------------------------------- one buffer
    def worker_compress(self, buffer, error, packed, x, scratch):
        layout = Layout.flat(buffer.numel(), 1)
        return self.worker_compress_segments([buffer], error, packed, layout)[0]

    def worker_error_update(self, buffer, error, packed, x_scale, x, scratch):
        layout = Layout.flat(buffer.numel(), 1)
        self.worker_error_update_segments([buffer], error, packed, x_scale.reshape(1), layout)

    def server_compress(self, received, scales, server_error, packed, scratch):
        layout = Layout.flat(server_error.numel() * received.shape[0], received.shape[0])
        return self.server_compress_segments(
            received, scales.reshape(1, -1), server_error, packed, layout
        )[0]

    def server_error_update(
        self, received, scales, server_error, packed, y_scale, scratch, out=None
    ):
        layout = Layout.flat(server_error.numel() * received.shape[0], received.shape[0])
        self.server_error_update_segments(
            received, scales.reshape(1, -1), server_error, packed, y_scale.reshape(1), layout, out
        )

    def decode(self, gathered, scales, out):
        layout = Layout.flat(out.numel(), gathered.shape[0])
        self.decode_segments(gathered, scales.reshape(-1, 1), out, layout)

    # ------------------------------------------------------------- every segment at once
    def worker_compress_segments(self, segments, error, packed, layout):
        blocks, starts = _worker_blocks(layout.sizes)
        arrays = typed.List([to_numpy(segment) for segment in segments])
        partial = _COMPRESSION("worker_compress")(
            blocks, arrays, starts, to_numpy(error), to_numpy(packed)
        )
        sums = _per_segment(blocks, partial, layout.segments)
        return _scales(sums, layout.sizes, self.scale_dtype(error.dtype))

    def worker_error_update_segments(self, segments, error, packed, scales, layout):
        blocks, starts = _worker_blocks(layout.sizes)
        arrays = typed.List([to_numpy(segment) for segment in segments])
        _COMPRESSION("worker_error_update")(
            blocks, arrays, starts, to_numpy(error), to_numpy(scales.to(error.dtype))
        )

    def server_compress_segments(self, received, worker_scales, server_error, packed, layout):
        blocks = _server_blocks(layout.chunks)
        weights = _weights(worker_scales, layout.n, server_error.dtype)
        partial = _COMPRESSION("server_compress")(
            blocks, to_numpy(received), weights, to_numpy(server_error), to_numpy(packed)
        )
        sums = _per_segment(blocks, partial, layout.segments)
        return _scales(sums, layout.chunks, self.scale_dtype(server_error.dtype))

    def server_error_update_segments(
        self, received, worker_scales, server_error, packed, scales, layout, out=None
    ):
        blocks = _server_blocks(layout.chunks)
        weights = _weights(worker_scales, layout.n, server_error.dtype)
        in_place = out is None or out.data_ptr() == server_error.data_ptr()
        _COMPRESSION("server_error_update")(
            blocks,
            to_numpy(received),
            weights,
            to_numpy(server_error),
            to_numpy(scales.to(server_error.dtype)),
            to_numpy(server_error if out is None else out),
            in_place,
        )

    def decode_segments(self, gathered, scales, out, layout):
        _COMPRESSION("decode")(
            _decode_pieces(layout),
            to_numpy(gathered),
            to_numpy(scales.to(out.dtype)),
            to_numpy(out.view(-1)),
        )

    def gather_columns(self, packed, send, layout):
        segment_bytes = np.cumsum([0, *layout.sizes[:-1]], dtype=np.int64) // 8
        column_bytes = np.cumsum([0, *layout.chunk_bytes[:-1]], dtype=np.int64)
        widths = np.asarray(layout.chunk_bytes, dtype=np.int64)
        _COMPRESSION("gather_columns")(
            to_numpy(packed), to_numpy(send), segment_bytes, column_bytes, widths
        )
