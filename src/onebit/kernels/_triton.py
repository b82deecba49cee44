"""The triton backend: fused CUDA kernels for float16, bfloat16, float32 and float64 tensors.

Each stage is one kernel and one pass over memory. A program handles :data:`BLOCK_BYTES`
bytes of signs, a ``[BLOCK_BYTES, 8]`` tile of elements whose row ``k`` is byte ``k`` and
whose lane ``j`` is its bit ``7 - j`` (MSB first, a set bit meaning ``sign = +1``).

Element arithmetic rounds as the torch reference does: ``x = a + b`` once in the buffer's
dtype; ``y = server_error + sum_i (+-w_i)`` added in rank order, one rounding per add;
``x - scale * sign(x)`` computed as ``x + (-+scale)``, one rounding and no product; and
kernels are compiled without FMA contraction. Half-precision values are widened to float32
and every result is rounded back at once, which gives the correctly rounded result.
Scales and weights are cast to the buffer's dtype by torch, as the reference does.

A scale ``||x|| / sqrt(N)`` stays on the device: every program writes the float64 sum of
its squares, and torch sums those partial sums (a fixed order for a given size), takes the
square root and divides, so no stage waits for the host. Packed signs and error states
equal the reference's for equal scales; scales agree with the reference's to float32
rounding.

On CPU tensors the kernels run in Triton's interpreter, for tests: only when
``TRITON_INTERPRET=1`` was set before this module was imported.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from onebit.kernels._reference import ReferenceKernels

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit at import
# Bytes of signs per program: 4096 elements on a GPU. The interpreter runs programs one after
# another at a cost per operation more than per element, so it takes fewer, larger ones.
BLOCK_BYTES = 8192 if _INTERPRETED else 512
_NUM_WARPS = 8
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The interpreter rounds float32 to bfloat16 by truncation, unlike a GPU.
_INTERPRETER_DTYPES = (torch.float16, torch.float32, torch.float64)


@triton.jit
def _tile(block, nbytes, BLOCK_BYTES: tl.constexpr):
    """Program ``block``'s byte indices, which of them are in range, and element offsets."""
    rows = block.to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    return rows, rows < nbytes, rows[:, None] * 8 + tl.arange(0, 8)[None, :]


@triton.jit
def _widen(values):
    """Half-precision values as float32 (exact); float32 and float64 values as they are."""
    if values.dtype.primitive_bitwidth < 32:
        values = values.to(tl.float32)
    return values


@triton.jit
def _load(pointer, in_range):
    """Values at ``pointer``, widened (0 out of range)."""
    return _widen(tl.load(pointer, mask=in_range, other=0.0))


@triton.jit
def _rounded_add(a, b, dtype: tl.constexpr):
    """``a + b`` rounded once to ``dtype``, kept in ``a``'s (possibly wider) type."""
    return (a + b).to(dtype).to(a.dtype)


@triton.jit
def _pack(x):
    """Each row's byte of signs: bit ``7 - j`` set where lane ``j`` is ``>= 0``."""
    bits = (x >= 0).to(tl.int32) << (7 - tl.arange(0, 8))[None, :]
    return tl.sum(bits, axis=1).to(tl.uint8)


@triton.jit
def _signed(byte, value):
    """``value * sign`` for the eight signs of each row's ``byte`` (exact: ``+-value``)."""
    bits = (byte.to(tl.int32)[:, None] >> (7 - tl.arange(0, 8))[None, :]) & 1
    return tl.where(bits != 0, value, -value)


@triton.jit
def _feedback(x, scale, dtype: tl.constexpr):
    """``x - scale * sign(x)`` rounded once to ``dtype``."""
    return _rounded_add(x, tl.where(x >= 0, -scale, scale), dtype)


@triton.jit
def _sum_of_squares(x, in_range):
    """The float64 sum of ``x^2`` over the rows of a tile that are in range."""
    x = tl.where(in_range[:, None], x.to(tl.float64), 0.0)
    return tl.sum(tl.sum(x * x, axis=1), axis=0)


@triton.jit
def _worker_sum(a, b, in_range, offsets):
    """``x = a + b`` over a tile, rounded once to the buffers' dtype."""
    mask = in_range[:, None]
    return _rounded_add(_load(a + offsets, mask), _load(b + offsets, mask), a.dtype.element_ty)


@triton.jit
def _server_average(received, row_stride, weights, n, server_error, rows, in_range, offsets):
    """``y = server_error + sum_i weights[i] * sign_i`` over a tile, in rank order."""
    dtype: tl.constexpr = server_error.dtype.element_ty
    y = _load(server_error + offsets, in_range[:, None])
    for i in range(n):
        byte = tl.load(received + i * row_stride + rows, mask=in_range, other=0)
        weight = _widen(tl.load(weights + i))
        y = _rounded_add(y, _signed(byte, weight), dtype)
    return y


@triton.jit
def _worker_compress_kernel(a, b, packed, sumsq, nbytes, BLOCK_BYTES: tl.constexpr):
    block = tl.program_id(0)
    rows, in_range, offsets = _tile(block, nbytes, BLOCK_BYTES)
    x = _worker_sum(a, b, in_range, offsets)
    tl.store(packed + rows, _pack(x), mask=in_range)
    tl.store(sumsq + block, _sum_of_squares(x, in_range))


@triton.jit
def _worker_error_update_kernel(a, error, scale, nbytes, BLOCK_BYTES: tl.constexpr):
    rows, in_range, offsets = _tile(tl.program_id(0), nbytes, BLOCK_BYTES)
    x = _worker_sum(a, error, in_range, offsets)
    new_error = _feedback(x, _widen(tl.load(scale)), error.dtype.element_ty)
    tl.store(error + offsets, new_error, in_range[:, None])


@triton.jit
def _server_compress_kernel(
    received, row_stride, weights, n, server_error, packed, sumsq, nbytes, BLOCK_BYTES: tl.constexpr
):
    block = tl.program_id(0)
    rows, in_range, offsets = _tile(block, nbytes, BLOCK_BYTES)
    y = _server_average(received, row_stride, weights, n, server_error, rows, in_range, offsets)
    tl.store(packed + rows, _pack(y), mask=in_range)
    tl.store(sumsq + block, _sum_of_squares(y, in_range))


@triton.jit
def _server_error_update_kernel(
    received, row_stride, weights, n, server_error, scale, out, nbytes, BLOCK_BYTES: tl.constexpr
):
    rows, in_range, offsets = _tile(tl.program_id(0), nbytes, BLOCK_BYTES)
    y = _server_average(received, row_stride, weights, n, server_error, rows, in_range, offsets)
    error = _feedback(y, _widen(tl.load(scale)), server_error.dtype.element_ty)
    tl.store(out + offsets, error, in_range[:, None])


@triton.jit
def _decode_kernel(gathered, row_stride, scales, out, nbytes, BLOCK_BYTES: tl.constexpr):
    j = tl.program_id(1).to(tl.int64)
    rows, in_range, offsets = _tile(tl.program_id(0), nbytes, BLOCK_BYTES)
    byte = tl.load(gathered + j * row_stride + rows, mask=in_range, other=0)
    scale = _widen(tl.load(scales + j))
    tl.store(out + j * (8 * nbytes) + offsets, _signed(byte, scale), in_range[:, None])


def _launch(kernel, grid: tuple[int, ...], *args) -> None:
    """Run ``kernel`` on the device of its first argument (which need not be the current one)."""
    with torch.cuda.device(args[0].get_device()):
        kernel[grid](*args, BLOCK_BYTES=BLOCK_BYTES, num_warps=_NUM_WARPS, enable_fp_fusion=False)


def _blocks(nbytes: int) -> int:
    return triton.cdiv(nbytes, BLOCK_BYTES)


def _scale(sumsq: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """``sqrt(sum(sumsq)) / sqrt(numel)`` as a 0-d ``dtype`` tensor, computed on the device."""
    return (sumsq.sum().sqrt_() / math.sqrt(numel)).to(dtype)


def _weights(scales: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """The server's weights ``scales / n``, rounded to the buffer's dtype as the reference does."""
    return (scales / n).to(dtype)


class TritonKernels(ReferenceKernels):
    """Fused compression on CUDA: worker side, server side and decoding, one kernel each."""

    name = "triton"

    def supports(self, tensor: Tensor) -> bool:
        if tensor.device.type == "cuda":
            return tensor.dtype in _DTYPES
        return tensor.device.type == "cpu" and _INTERPRETED and tensor.dtype in _INTERPRETER_DTYPES

    def scratch(self, numel, n, dtype, device) -> None:
        return None  # intermediates are recomputed, never stored

    def worker_compress(self, buffer, error, packed, x, scratch):
        nbytes = packed.numel()
        sumsq = torch.empty(_blocks(nbytes), dtype=torch.float64, device=buffer.device)
        _launch(_worker_compress_kernel, sumsq.shape, buffer, error, packed, sumsq, nbytes)
        return _scale(sumsq, buffer.numel(), self.scale_dtype(buffer.dtype))

    def worker_error_update(self, buffer, error, packed, x_scale, x, scratch):
        nbytes = packed.numel()
        scale = x_scale.to(error.dtype)
        _launch(_worker_error_update_kernel, (_blocks(nbytes),), buffer, error, scale, nbytes)

    def server_compress(self, received, scales, server_error, packed, scratch):
        n, nbytes = received.shape
        weights = _weights(scales, n, server_error.dtype)
        sumsq = torch.empty(_blocks(nbytes), dtype=torch.float64, device=server_error.device)
        args = (received, received.stride(0), weights, n, server_error, packed, sumsq, nbytes)
        _launch(_server_compress_kernel, sumsq.shape, *args)
        return _scale(sumsq, server_error.numel(), self.scale_dtype(server_error.dtype))

    def server_error_update(
        self, received, scales, server_error, packed, y_scale, scratch, out=None
    ):
        n, nbytes = received.shape
        weights = _weights(scales, n, server_error.dtype)
        scale = y_scale.to(server_error.dtype)
        out = server_error if out is None else out
        args = (received, received.stride(0), weights, n, server_error, scale, out, nbytes)
        _launch(_server_error_update_kernel, (_blocks(nbytes),), *args)

    def decode(self, gathered, scales, out):
        n, nbytes = gathered.shape
        scales = scales.to(out.dtype).contiguous()
        _launch(
            _decode_kernel, (_blocks(nbytes), n), gathered, gathered.stride(0), scales, out, nbytes
        )
