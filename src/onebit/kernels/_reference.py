"""The pure-torch reference backend: every device and dtype, plain torch ops.

It is the specification the fused backends are tested against, and the fallback where
none applies. Its intermediates live in scratch memory: ``x = buffer + worker_error`` in
the output buffer of the call, the server's average ``y`` in the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from onebit.compression import (
    pack_signs,
    scale,
    scale_dtype,
    server_average,
    unpack_signs,
    update_error,
)


@dataclass
class ReferenceScratch:
    """``N`` bools for the sign comparison and two chunk-sized buffers for the server."""

    bits: Tensor
    y: Tensor
    work: Tensor


class ReferenceKernels:
    """The local work of :func:`onebit.compressed_allreduce` in plain torch (five stages).

    1. ``worker_compress``: ``x = buffer + error``; packed ``sign(x)``; ``a = ||x||/sqrt(N)``.
    2. ``worker_error_update``: ``error = x - a sign(x)``.
    3. ``server_compress``: ``y = server_error + sum_i w_i sign_i`` (rank order); packed
       ``sign(y)``; ``b = ||y||/sqrt(C)``.
    4. ``server_error_update``: ``server_error = y - b sign(y)`` (or into ``out``).
    5. ``decode``: ``out[chunk j] = b_j sign_j``.
    """

    name = "torch"

    def supports(self, tensor: Tensor) -> bool:
        return True

    @staticmethod
    def scale_dtype(dtype: torch.dtype) -> torch.dtype:
        return scale_dtype(dtype)

    def scratch(
        self, numel: int, n: int, dtype: torch.dtype, device: torch.device
    ) -> ReferenceScratch | None:
        chunk = numel // n
        return ReferenceScratch(
            bits=torch.empty(numel, dtype=torch.bool, device=device),
            y=torch.empty(chunk, dtype=dtype, device=device),
            work=torch.empty(chunk, dtype=dtype, device=device),
        )

    def worker_compress(
        self, buffer: Tensor, error: Tensor, packed: Tensor, x: Tensor, scratch: ReferenceScratch
    ) -> Tensor:
        torch.add(buffer, error, out=x)
        packed.copy_(pack_signs(x, work=scratch.bits))
        return scale(x)

    def worker_error_update(
        self,
        buffer: Tensor,
        error: Tensor,
        packed: Tensor,
        x_scale: Tensor,
        x: Tensor,
        scratch: ReferenceScratch,
    ) -> None:
        update_error(error, x, packed, x_scale, work=scratch.work)  # error may be x itself

    def server_compress(
        self,
        received: Tensor,
        scales: Tensor,
        server_error: Tensor,
        packed: Tensor,
        scratch: ReferenceScratch,
    ) -> Tensor:
        server_average(received, scales, server_error, scratch.y, scratch.work)
        packed.copy_(pack_signs(scratch.y, work=scratch.bits[: scratch.y.numel()]))
        return scale(scratch.y)

    def server_error_update(
        self,
        received: Tensor,
        scales: Tensor,
        server_error: Tensor,
        packed: Tensor,
        y_scale: Tensor,
        scratch: ReferenceScratch,
        out: Tensor | None = None,
    ) -> None:
        target = server_error if out is None else out
        update_error(target, scratch.y, packed, y_scale)  # y from server_compress, in scratch

    def decode(self, gathered: Tensor, scales: Tensor, out: Tensor) -> None:
        chunk = out.numel() // gathered.shape[0]
        for j in range(gathered.shape[0]):
            unpack_signs(gathered[j], chunk, out=out[j * chunk : (j + 1) * chunk], scale=scales[j])
