"""The 1-bit exchange over one process group: one fused buffer, or every tensor alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.exchange.base import Exchange, swap_storages
from onebit.exchange.over_group import exchange_over_group
from onebit.exchange.protocol import (
    Layout,
    PackedResult,
    exchange_bytes,
    padded_size,
)
from onebit.exchange.transport import GroupTransport, world_size
from onebit.exchange.workspace import CompressionWorkspace

__all__ = ["FlatExchange", "GroupExchange", "PerTensorExchange", "per_tensor_error_sizes"]


def per_tensor_error_sizes(numels: Sequence[int], n: int) -> tuple[int, int]:
    """``(worker_error elements, server_error elements)`` of the per-tensor exchange of
    tensors of these sizes over ``n`` ranks: ``W = sum_t P_t`` (each tensor padded alone,
    :func:`~onebit.compression.per_tensor_padded_size`) and ``W / n``."""
    layout = Layout.per_tensor(numels, n)
    return layout.width, layout.width // n


class GroupExchange(Exchange):
    """An exchange over the ranks of ``group`` (default: the world), flat, with its workspace
    (``workspace``, or one of its own), and the scratch its error updates go into while the
    bytes travel, where the buffer is its own (ALGORITHM.md, "Error updates while the bytes
    travel")."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        workspace: CompressionWorkspace | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.workspace = CompressionWorkspace() if workspace is None else workspace
        self._ahead: dict[str, Tensor] = {}  # scratch like the error buffers, by side

    @property
    def topology(self) -> tuple[int, int]:
        return 1, world_size(self.group)

    def nbytes(self) -> int:
        ahead = sum(t.numel() * t.element_size() for t in self._ahead.values())
        return self._scratch_bytes() + ahead

    def _scratch_bytes(self) -> int:
        return self.workspace.nbytes()

    def _scratch_like(self, side: str, error: Tensor) -> Tensor:
        held = self._ahead.get(side)
        if held is None or held.shape != error.shape or held.dtype != error.dtype:
            held = self._ahead[side] = torch.empty_like(error)
        return held

    def _worker_errors_ahead(self) -> Tensor:
        """Where the worker's error updates go while the bytes travel (the layout of the
        worker error): a scratch buffer of its own; the fused layouts' send buffer."""
        return self._scratch_like("worker", self.worker_error)

    def _errors_ahead(self, buffer: Tensor) -> tuple[Tensor, Tensor] | None:
        """Where the worker's and the server's error updates go while the bytes travel when
        ``buffer`` is the exchange's own, else ``None``."""
        if not self._owns(buffer):
            return None
        return self._worker_errors_ahead(), self._scratch_like("server", self.server_error)

    def _take_errors_ahead(self) -> None:
        """The updates computed ahead become the error state, the former error storage the
        scratch they go into next (no copy)."""
        swap_storages(self._worker_errors_ahead(), self.worker_error)
        swap_storages(self._ahead["server"], self.server_error)


class FlatExchange(GroupExchange):
    """All tensors in one buffer, padded to a multiple of ``8 n``, exchanged as one segment
    over ``group`` (one worker scale, a server scale per chunk). The result is decoded on the
    fly by the update kernels. An exchange of :meth:`send_buffer` computes its error updates
    while the bytes travel (ALGORITHM.md, "Error updates while the bytes travel");
    :meth:`exchange_into` leaves the buffer as it is."""

    def _worker_errors_ahead(self) -> Tensor:
        """The send buffer: its layout is the worker error's, and the local momentum in it
        is not needed once its signs are sent."""
        return self._send_buffer

    def buffer_size(self, numels: Sequence[int]) -> int:
        return padded_size(sum(numels), self.world_size)

    def error_sizes(self, numels: Sequence[int]) -> tuple[int, int]:
        size = self.buffer_size(numels)
        return size, size // self.world_size

    def _layout(self) -> Layout:
        return Layout.flat(self.buffer_size(self.numels), self.world_size)

    def bytes_per_call(self) -> dict[str, int]:
        return {"compressed_allreduce": exchange_bytes(self._layout(), self.dtype)}

    def exchange_into(self, buffer: Tensor, scratch: Tensor) -> PackedResult:
        """:meth:`exchange` of ``buffer``, left as it is, with the intermediates in ``scratch``
        (as many elements; it may be ``buffer``), where the caller may decode the result
        (:func:`onebit.compressed_allreduce`)."""
        return self._counted(self._exchange_into, self._checked(buffer), self._checked(scratch))

    def _exchange(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor) -> PackedResult:
        return self._exchange_into(buffer, buffer, worker_error, server_error)

    def _exchange_into(
        self, buffer: Tensor, scratch: Tensor, worker_error: Tensor, server_error: Tensor
    ) -> PackedResult:
        """One exchange of the flat ``buffer``, its intermediates in ``scratch`` (``buffer``
        itself, which it leaves as scratch, or memory apart from it)."""
        ws = self.workspace.prepare(self._layout(), self.dtype, self.device, self.backend)
        transport = GroupTransport(self.group)
        ahead = self._errors_ahead(buffer) if scratch is buffer else None
        result = exchange_over_group(
            [buffer], [scratch], worker_error, server_error, transport, ws, ahead
        )
        if ahead is not None:
            self._take_errors_ahead()
        return result


class PerTensorExchange(GroupExchange):
    """Every tensor compressed alone (DeepSpeed's 1-bit Adam): tensor ``t`` zero-padded to
    ``P_t`` (:func:`~onebit.compression.per_tensor_padded_size`) with its own worker scale,
    per-chunk server scales and slices of the error buffers; all tensors travel in the same
    two collectives. The buffer holds the tensors one after another, unpadded; the result
    decodes into the same layout. :meth:`exchange_tensors` takes the tensors where they are.
    An exchange of :meth:`send_buffer` computes its error updates while the bytes travel:
    the worker's into the send buffer where no tensor is padded, else into scratch as large
    as the worker error."""

    def buffer_size(self, numels: Sequence[int]) -> int:
        return sum(numels)

    def _worker_errors_ahead(self) -> Tensor:
        """The send buffer where no tensor is padded (its layout is then the worker
        error's), else a scratch buffer as large as the worker error."""
        if self._send_buffer.numel() == self.worker_error.numel():
            return self._send_buffer
        return super()._worker_errors_ahead()

    def error_sizes(self, numels: Sequence[int]) -> tuple[int, int]:
        return per_tensor_error_sizes(numels, self.world_size)

    def _layout(self) -> Layout:
        return Layout.per_tensor(self.numels, self.world_size)

    def bytes_per_call(self) -> dict[str, int]:
        return {"compressed_allreduce": exchange_bytes(self._layout(), self.dtype)}

    def moved_errors(
        self, origin: Sequence[int | None], numels: Sequence[int]
    ) -> tuple[Tensor, Tensor]:
        """Each tensor's slices of the worker and server errors (``P_t`` and ``P_t / n``
        elements, tensor after tensor) moved to its new place; a new tensor's are zero."""
        worker, server = self.errors()
        old, new = self._layout(), Layout.per_tensor(numels, self.world_size)
        moved = []
        for error, old_sizes, new_sizes in (
            (worker, old.sizes, new.sizes),
            (server, old.chunks, new.chunks),
        ):
            pieces = error.split(old_sizes)
            moved.append(
                torch.cat(
                    [
                        pieces[source].clone() if source is not None else error.new_zeros(size)
                        for source, size in zip(origin, new_sizes, strict=True)
                    ]
                )
            )
        return moved[0], moved[1]

    def exchange_tensors(self, tensors: Sequence[Tensor]) -> None:
        """Replace each of ``tensors`` (any shapes, of the bound sizes, dtype and device) by
        its exchanged average, in place, with no copy into one buffer
        (:func:`onebit.compressed_allreduce_per_tensor`). Raises like :meth:`exchange`, the
        tensors and the error state unchanged."""
        self._require_bound()
        tensors = list(tensors)
        numels = tuple(tensor.numel() for tensor in tensors)
        if numels != self.numels:
            raise ValueError(
                f"the tensors have {list(numels)} elements; this exchange takes {list(self.numels)}"
            )
        result, segments = self._counted(self._exchange_tensors, tensors)
        result.decode_segments(segments)  # the segments are spent
        for tensor, segment in zip(tensors, segments, strict=True):
            if segment.data_ptr() != tensor.data_ptr():
                tensor.copy_(segment[: tensor.numel()].view_as(tensor))

    def _exchange(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor) -> PackedResult:
        result, _ = self._exchange_tensors(
            buffer.split(self.numels),
            worker_error,
            server_error,
            in_place=True,
            errors_ahead=self._errors_ahead(buffer),
        )
        return result

    def _exchange_tensors(
        self,
        tensors: Sequence[Tensor],
        worker_error: Tensor,
        server_error: Tensor,
        in_place: bool = False,
        errors_ahead: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[PackedResult, list[Tensor]]:
        """One exchange of ``tensors``: the result, and the segments it was made of (each
        tensor flat, or its zero-padded copy in the workspace). The intermediates go into
        the segments themselves with ``in_place`` (the buffer of :meth:`exchange`, scratch
        afterwards), else into the workspace (the tensors stay as they are if it raises).
        With ``errors_ahead`` (:meth:`_errors_ahead`) the error updates go there while the
        bytes travel, taken as the error state once it has passed its checks."""
        layout = self._layout()
        ws = self.workspace.prepare(layout, self.dtype, self.device, self.backend)
        segments, padding = padded_segments(tensors, layout, ws)
        if in_place:
            xs = segments
        else:
            xs = ws.buffer("x", layout.width, self.dtype, self.device).split(layout.sizes)
        transport = GroupTransport(self.group)
        result = exchange_over_group(
            segments, xs, worker_error, server_error, transport, ws, errors_ahead
        )
        if errors_ahead is not None:
            self._take_errors_ahead()
        result.padding = padding
        return result, segments


def padded_segments(
    tensors: Sequence[Tensor], layout: Layout, workspace: CompressionWorkspace
) -> tuple[list[Tensor], Tensor]:
    """Each flat tensor padded alone to its segment of ``layout``: the tensor itself where it
    needs no padding, else a zero-padded copy in the workspace; and that scratch."""
    segments, padding = segment_views(tensors, layout, workspace)
    fill_segments(tensors, segments)
    return segments, padding


def segment_views(
    tensors: Sequence[Tensor], layout: Layout, workspace: CompressionWorkspace
) -> tuple[list[Tensor], Tensor]:
    """Where each flat tensor's segment of ``layout`` is: the tensor itself where it needs no
    padding, else its place in the workspace's scratch (filled by :func:`fill_segments`);
    and that scratch, as large as the padded segments together."""
    in_place = [
        tensor.numel() == size and tensor.is_contiguous()
        for tensor, size in zip(tensors, layout.sizes, strict=True)
    ]
    width = sum(size for size, kept in zip(layout.sizes, in_place, strict=True) if not kept)
    padding = workspace.buffer("padded", width, tensors[0].dtype, tensors[0].device)
    segments, offset = [], 0
    for tensor, size, kept in zip(tensors, layout.sizes, in_place, strict=True):
        if kept:
            segments.append(tensor.view(-1))
        else:
            segments.append(padding[offset : offset + size])
            offset += size
    return segments, padding


def fill_segments(tensors: Sequence[Tensor], segments: Sequence[Tensor]) -> None:
    """Copy each tensor into its segment where that is a padded copy, zeros after it."""
    for tensor, segment in zip(tensors, segments, strict=True):
        if segment.data_ptr() != tensor.data_ptr() or segment.numel() != tensor.numel():
            numel = tensor.numel()
            segment[:numel].copy_(tensor.reshape(-1))
            segment[numel:].zero_()
