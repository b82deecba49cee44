"""The two-phase 1-bit exchange with error feedback, written once (ALGORITHM.md).

A buffer is laid out as *segments* (:class:`~onebit.compression.Layout`), each compressed
alone: one segment for the fused exchange of a flat buffer, one per tensor in DeepSpeed's
per-tensor scheme. Over ``n`` ranks, for every segment ``t`` of ``P_t`` elements (a multiple
of ``8 n``):

1. worker side (:meth:`Stages.compress_worker`, :meth:`Stages.update_worker_errors`):
   ``x = buffer + worker_error``, its packed signs and scale ``a = ||x|| / sqrt(P_t)``,
   ``worker_error <- x - a sign(x)``; chunk ``j`` of the signs goes to rank ``j``;
2. server side (:meth:`Stages.compress_server`, :meth:`Stages.update_server_errors`): rank
   ``j`` averages the chunks it received, ``y = server_error + (1/n) sum_i a_i sign_i``,
   compresses ``y`` to signs and ``b = ||y|| / sqrt(P_t / n)``,
   ``server_error <- y - b sign(y)``; every rank gathers every server's signs and scale.

The result (:class:`PackedResult`) stays packed until its consumer decodes it, on the fly
or into a buffer. :func:`onebit.exchange.over_group.exchange_over_group` moves the bytes
between the stages with ``torch.distributed`` collectives
(:class:`~onebit.exchange.transport.GroupTransport`); the
simulation of many workers in one process (:mod:`onebit.exchange.simulated`) drives the same
stages in a loop over its workers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from onebit.compression import Layout, SignRuns, scale_dtype
from onebit.kernels import Backend

__all__ = [
    "Layout",
    "PackedResult",
    "Stages",
    "check_buffer_size",
    "check_error_state",
    "exchange_bytes",
    "padded_size",
]


def check_error_state(
    name: str, tensor: Tensor, like: Tensor, like_name: str = "the buffer"
) -> None:
    """Raise ``ValueError`` naming ``name`` unless the error buffer ``tensor`` has
    ``like``'s dtype and device and is contiguous."""
    if tensor.dtype != like.dtype or tensor.device != like.device:
        raise ValueError(
            f"{name} is {tensor.dtype} on {tensor.device}; it must match {like_name} "
            f"({like.dtype} on {like.device})"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_buffer_size(numel: int, n: int, ranks: str) -> None:
    """Raise ``ValueError`` unless a buffer of ``numel`` elements splits into ``n`` chunks of
    whole bytes of signs (a positive multiple of ``8 n``); ``ranks`` names ``n``."""
    if numel == 0 or numel % (8 * n):
        raise ValueError(
            f"buffer has {numel} elements; it must be a positive multiple of 8 * {ranks} = "
            f"{8 * n} (pad it to onebit.padded_size({numel}, {n}) = {padded_size(numel, n)})"
        )


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


def exchange_bytes(layout: Layout, dtype: torch.dtype) -> int:
    """Bytes one rank sends in one exchange of ``layout``: its signs for the ``n - 1`` other
    servers (all-to-all), its server chunks' signs to ``n - 1`` peers (all-gather), and per
    peer its ``K`` worker scales with the backend code and its ``K`` server scales (scales
    in :func:`~onebit.compression.scale_dtype` precision)."""
    n = layout.n
    if n == 1:
        return 0
    scale_bytes = torch.empty((), dtype=scale_dtype(dtype)).element_size()
    signs = 2 * (n - 1) * (layout.width // n) // 8
    return signs + (2 * layout.segments + 1) * scale_bytes * (n - 1)


class Stages:
    """The local work of both phases for one layout on one backend (the backend's
    compression kernels, :mod:`onebit.kernels`), with their scratch: all segments in one
    call where the backend compresses segments together
    (:class:`~onebit.kernels.SegmentedCompressionKernels`), else segment by segment.

    Worker-side buffers are flat (``W`` elements, segment after segment), server-side ones
    flat over this rank's chunks (``W / n``); ``received`` is what :meth:`server_view` made
    of the all-to-all's ``[n, W / 8n]`` signs."""

    def __init__(
        self, layout: Layout, backend: Backend, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layout, self.backend = layout, backend
        self.kernels = backend.compression
        #: The backend's kernels that compress every segment in one call, where it has them.
        self.segmented = backend.segmented if layout.segments > 1 else None
        sizes = (layout.width,) if self.segmented is not None else layout.sizes
        self.scratch = [self.kernels.scratch(size, layout.n, dtype, device) for size in sizes]

    def _worker_parts(self, worker_error: Tensor, packed: Tensor):
        layout = self.layout
        return worker_error.split(layout.sizes), packed.split([s // 8 for s in layout.sizes])

    def _server_parts(self, server_error: Tensor, packed: Tensor):
        layout = self.layout
        return server_error.split(layout.chunks), packed.split(layout.chunk_bytes)

    def compress_worker(
        self,
        segments: Sequence[Tensor],
        xs: Sequence[Tensor],
        worker_error: Tensor,
        packed: Tensor,
        scales: Tensor,
    ) -> None:
        """Per segment: ``x = segment + error`` (in ``xs``, which may be the segments),
        its packed signs into ``packed`` and ``scales[t] = ||x|| / sqrt(P_t)``."""
        if self.segmented is not None:
            scales[: self.layout.segments] = self.segmented.worker_compress_segments(
                segments, worker_error, packed, self.layout
            )
            return
        errors, packs = self._worker_parts(worker_error, packed)
        for t in range(self.layout.segments):
            scales[t] = self.kernels.worker_compress(
                segments[t], errors[t], packs[t], xs[t], self.scratch[t]
            )

    def update_worker_errors(
        self,
        segments: Sequence[Tensor],
        xs: Sequence[Tensor],
        worker_error: Tensor,
        packed: Tensor,
        scales: Tensor,
    ) -> None:
        """Per segment: ``error = x - scales[t] sign(x)``."""
        if self.segmented is not None:
            self.segmented.worker_error_update_segments(
                segments, worker_error, packed, scales[: self.layout.segments], self.layout
            )
            return
        errors, packs = self._worker_parts(worker_error, packed)
        for t in range(self.layout.segments):
            self.kernels.worker_error_update(
                segments[t], errors[t], packs[t], scales[t], xs[t], self.scratch[t]
            )

    def fill_send(self, packed: Tensor, send: Tensor) -> None:
        """Chunk ``j`` of every segment's packed signs into row ``j`` of ``send``, segment
        after segment (nothing to do for one segment: ``send`` is a view of ``packed``)."""
        layout = self.layout
        if layout.segments == 1:
            return
        if self.segmented is not None:
            self.segmented.gather_columns(packed, send, layout)
            return
        columns = send.split(layout.chunk_bytes, dim=1)
        signs = packed.split([size // 8 for size in layout.sizes])
        for column, segment_signs in zip(columns, signs, strict=True):
            column.copy_(segment_signs.view(layout.n, -1))

    def server_view(self, received: Tensor) -> Tensor | list[Tensor]:
        """The all-to-all's signs as the server stages take them: whole, or each segment's
        ``[n, C_t / 8]`` columns made contiguous where segments are compressed one by one."""
        if self.segmented is not None:
            return received
        if self.layout.segments == 1:
            return [received]
        return [part.contiguous() for part in received.split(self.layout.chunk_bytes, dim=1)]

    def compress_server(
        self,
        received: Tensor | Sequence[Tensor],
        worker_scales: Tensor,
        server_error: Tensor,
        packed: Tensor,
        scales: Tensor,
    ) -> None:
        """Per segment: ``y = error + (1/n) sum_i worker_scales[t, i] sign_i`` of its
        chunks in ``received``, its packed signs and ``scales[t]``."""
        if self.segmented is not None:
            scales[:] = self.segmented.server_compress_segments(
                received, worker_scales, server_error, packed, self.layout
            )
            return
        errors, packs = self._server_parts(server_error, packed)
        for t in range(self.layout.segments):
            scales[t] = self.kernels.server_compress(
                received[t], worker_scales[t], errors[t], packs[t], self.scratch[t]
            )

    def update_server_errors(
        self,
        received: Tensor | Sequence[Tensor],
        worker_scales: Tensor,
        server_error: Tensor,
        packed: Tensor,
        scales: Tensor,
        out: Tensor | None = None,
    ) -> None:
        """Per segment: ``error = y - scales[t] sign(y)``, into ``out`` where given (memory
        apart from ``server_error``, which is then left as it is)."""
        if self.segmented is not None:
            self.segmented.server_error_update_segments(
                received, worker_scales, server_error, packed, scales, self.layout, out
            )
            return
        errors, packs = self._server_parts(server_error, packed)
        outs = errors if out is None else out.split(self.layout.chunks)
        for t in range(self.layout.segments):
            self.kernels.server_error_update(
                received[t],
                worker_scales[t],
                errors[t],
                packs[t],
                scales[t],
                self.scratch[t],
                outs[t],
            )


@functools.lru_cache(maxsize=64)
def _run_table(layout: Layout, row_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of a result of ``layout`` whose servers' signs are rows of ``row_bytes``
    bytes (row ``j``: chunk ``j`` of every segment, segment after segment): their bounds in
    the decoded order, their first bits, and the index of each one's scale in the flattened
    ``[server, segment]`` scales."""
    bounds, first_bits, scale_index = [0], [], []
    out = column = 0  # the segment's first decoded element; its first byte in a row
    for t, (numel, chunk) in enumerate(zip(layout.numels, layout.chunks, strict=True)):
        for j in range(layout.n):
            count = min(chunk, numel - j * chunk)
            if count > 0:
                bounds.append(out + j * chunk + count)
                first_bits.append(8 * (j * row_bytes + column))
                scale_index.append(j * layout.segments + t)
        out, column = out + numel, column + chunk // 8
    return (
        np.asarray(bounds, dtype=np.int64),
        np.asarray(first_bits, dtype=np.int64),
        np.asarray(scale_index, dtype=np.int64),
    )


@functools.lru_cache(maxsize=64)
def _scale_index(layout: Layout, row_bytes: int, device: torch.device) -> Tensor:
    """:func:`_run_table`'s scale index on ``device`` (copied there once, not every step)."""
    return torch.from_numpy(_run_table(layout, row_bytes)[2]).to(device)


@dataclass
class PackedResult:
    """The result of an exchange before decoding (an :class:`~onebit.compression.ExchangeResult`;
    a one-segment result in the flat layout): row ``j`` of ``signs`` holds server ``j``'s
    packed signs of chunk ``j`` of every segment, segment after segment; ``scales[j, t]``
    its scale of segment ``t``. Element ``e`` of segment ``t``'s result is
    ``+-scales[e // C_t, t]`` (``+`` where its bit is set). Views of the workspace, valid
    until its next use."""

    signs: Tensor
    scales: Tensor
    layout: Layout
    backend: Backend
    padding: Tensor | None = None  # scratch for decoding padded segments

    def sign_runs(self) -> SignRuns:
        """The result as runs (:class:`~onebit.compression.SignRuns`): a run per server's
        chunk of each segment, in the decoded order (segment ``t``'s first ``numels[t]``
        values, one segment after another)."""
        row_bytes = self.signs.shape[1]
        bounds, first_bits, _ = _run_table(self.layout, row_bytes)
        index = _scale_index(self.layout, row_bytes, self.scales.device)
        return SignRuns(bounds, first_bits, self.scales.reshape(-1)[index], self.signs.view(-1))

    @cached_property
    def _segment_signs(self) -> list[Tensor]:
        if self.layout.segments == 1:
            return [self.signs]
        return [part.contiguous() for part in self.signs.split(self.layout.chunk_bytes, dim=1)]

    def decode_segments(self, targets: Sequence[Tensor]) -> None:
        """Segment ``t``'s result, all ``P_t`` elements, into ``targets[t]`` (contiguous)."""
        scales = self.scales.T.contiguous()
        for t, (signs, target) in enumerate(zip(self._segment_signs, targets, strict=True)):
            self.backend.compression.decode(signs, scales[t], target.view(-1))

    def decode(self, out: Tensor) -> Tensor:
        """Write the result into ``out`` and return it: all ``P`` elements of the one segment,
        or, with several, segment ``t``'s first ``numels[t]`` values one after another."""
        flat = out.view(-1)
        if flat.numel() < sum(self.layout.numels):
            raise ValueError(
                f"out has {flat.numel()} elements; the result has {sum(self.layout.numels)}"
            )
        if self.layout.segments == 1 and flat.numel() == self.layout.width:
            self.backend.compression.decode(self.signs, self.scales[:, 0], flat)
            return out
        if self.backend.segmented is not None:
            self.backend.segmented.decode_segments(self.signs, self.scales, flat, self.layout)
            return out
        scales = self.scales.T.contiguous()
        offset = 0
        for t, (numel, size) in enumerate(zip(self.layout.numels, self.layout.sizes, strict=True)):
            target = flat[offset : offset + numel]
            if numel == size:
                self.backend.compression.decode(self._segment_signs[t], scales[t], target)
            else:
                if self.padding is None or self.padding.numel() < size:
                    raise ValueError(f"segment {t} is padded: decoding it needs padding scratch")
                padded = self.padding[:size]
                self.backend.compression.decode(self._segment_signs[t], scales[t], padded)
                target.copy_(padded[:numel])
            offset += numel
        return out
