"""The scratch memory of one exchange, allocated once and reused, and the messages that
carry its signs and scales between the ranks (ALGORITHM.md, "One protocol over segments": one
message per peer and phase)."""

from __future__ import annotations

import torch
from torch import Tensor

from onebit.compression import scale_dtype
from onebit.exchange.protocol import Layout, Stages
from onebit.kernels import Backend

__all__ = ["CompressionWorkspace"]


class CompressionWorkspace:
    """Scratch memory of the exchange, allocated once and reused: for the most recent layout
    (and dtype, device, backend), the packed signs (``N / 4`` bytes), the messages that
    carry them with the scales (about ``N / 2`` bytes more), the gathered scales and the
    backend's stage scratch (the reference: ``N`` bools and two chunk-sized buffers;
    the fused backends: nothing). Each optimizer's exchange owns one; pass your own to
    :func:`onebit.compressed_allreduce` to reuse it across calls."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._buffers: dict[str, Tensor] = {}

    def prepare(
        self, layout: Layout, dtype: torch.dtype, device: torch.device, backend: Backend
    ) -> CompressionWorkspace:
        key = (layout, dtype, device, backend.name)
        if key == self._key:
            return self
        n, segments, sdtype = layout.n, layout.segments, scale_dtype(dtype)
        server_bytes = layout.width // n // 8
        signs = dict(dtype=torch.uint8, device=device)
        self.worker_packed = torch.empty(layout.width // 8, **signs)
        self.received = torch.empty(n, server_bytes, **signs)
        self.gathered = torch.empty(n, server_bytes, **signs)
        # Chunk j of every segment's signs, for rank j; the packed signs themselves when
        # there is one segment.
        if segments == 1:
            self.send = self.worker_packed.view(n, server_bytes)
        else:
            self.send = torch.empty(n, server_bytes, **signs)
        self.local_scales = torch.empty(segments + 1, dtype=sdtype, device=device)  # + code
        self.worker_scales = torch.empty(n, segments + 1, dtype=sdtype, device=device)
        self.local_server_scales = torch.empty(segments, dtype=sdtype, device=device)
        self.server_scales = torch.empty(n, segments, dtype=sdtype, device=device)
        # What travels (one message a phase): to server j, this rank's scales and code, then
        # chunk j's signs; from server j to all, its signs, then its scales.
        self._n = n
        self._worker_header = self.local_scales.numel() * self.local_scales.element_size()
        self.send_framed = torch.empty(n, self._worker_header + server_bytes, **signs)
        self.received_framed = torch.empty_like(self.send_framed)
        scale_bytes = self.local_server_scales.numel() * self.local_server_scales.element_size()
        self.server_frame = torch.empty(server_bytes + scale_bytes, **signs)
        self.server_packed = self.server_frame[:server_bytes]
        self.gathered_framed = torch.empty(n, server_bytes + scale_bytes, **signs)
        self.stages = Stages(layout, backend, dtype, device)
        self._buffers = {}
        self._key = key
        return self

    def frame_worker_message(self) -> None:
        """Row ``j`` of :attr:`send_framed`: :attr:`local_scales`' bytes, then row ``j`` of
        :attr:`send` (chunk ``j`` of every segment's signs)."""
        header = self._worker_header
        self.send_framed[:, :header].copy_(_bytes(self.local_scales).expand(self._n, -1))
        self.send_framed[:, header:].copy_(self.send)

    def unframe_worker_messages(self) -> None:
        """From :attr:`received_framed`: every rank's scales into :attr:`worker_scales`,
        the signs of this rank's chunk into :attr:`received`."""
        header = self._worker_header
        _bytes(self.worker_scales).view(self._n, header).copy_(self.received_framed[:, :header])
        self.received.copy_(self.received_framed[:, header:])

    def frame_server_message(self) -> None:
        """:attr:`server_frame`: :attr:`server_packed` (written in place), then
        :attr:`local_server_scales`' bytes."""
        self.server_frame[self.server_packed.numel() :].copy_(_bytes(self.local_server_scales))

    def unframe_server_messages(self) -> None:
        """From :attr:`gathered_framed`: every server's signs into :attr:`gathered`, its
        scales into :attr:`server_scales`."""
        signs = self.gathered.shape[1]
        self.gathered.copy_(self.gathered_framed[:, :signs])
        _bytes(self.server_scales).view(self._n, -1).copy_(self.gathered_framed[:, signs:])

    def incoming(self) -> tuple[Tensor, Tensor]:
        """The two messages one exchange receives, in the order they arrive: the workers'
        signs and scales for this rank's chunk (:attr:`received_framed`), then every
        server's (:attr:`gathered_framed`)."""
        return self.received_framed, self.gathered_framed

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A named scratch buffer (contents undefined), kept for the current layout."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype:
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer

    def nbytes(self) -> int:
        """Bytes of scratch held now."""
        if self._key is None:
            return 0
        tensors = [
            self.worker_packed,
            self.received,
            self.server_frame,
            self.gathered,
            self.send_framed,
            self.received_framed,
            self.gathered_framed,
            self.local_scales,
            self.worker_scales,
            self.local_server_scales,
            self.server_scales,
            *self._buffers.values(),
        ]
        if self.send.data_ptr() != self.worker_packed.data_ptr():
            tensors.append(self.send)
        for scratch in self.stages.scratch:
            tensors.extend(vars(scratch).values() if scratch is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


def _bytes(tensor: Tensor) -> Tensor:
    """The bytes of a contiguous ``tensor``, flat (a view)."""
    return tensor.view(-1).view(torch.uint8)
