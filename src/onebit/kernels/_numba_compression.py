"""numba kernels of the compressed allreduce's local work (CPU, float32 and float64).

Each public kernel is one pass over memory. Work is split into fixed blocks of
:data:`BLOCK` elements (independent of the thread count) and every reduction is summed
per block, then over blocks in order, so results do not depend on how many threads run.
The per-element arithmetic is written to round exactly as the torch reference does
(``x = a + b`` once; ``y`` summed in rank order; ``x - scale * sign(x)`` with an exact
product), so packed signs and error states equal the reference's for equal scales; only
the sums of squares behind the scales are summed in another order (float64 accumulators).
Inner loops take slices that start at 0 so LLVM vectorises them.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

BLOCK = 1 << 16  # elements per block: a multiple of 8, so blocks hold whole bytes of signs
CHUNK = 1 << 10  # elements of the server's average kept in scratch at a time
# Fast-math flags for the functions that sum squares (their sums vectorise), and that do no
# other float work than additions without products: LLVM reassociates additions only when
# they also carry ``nsz``, so every other addition there keeps its order (numba applies the
# flags to the functions those call too). The tests compare every bit with the reference.
_SUM_FLAGS = {"reassoc", "contract"}


@njit(fastmath=_SUM_FLAGS, cache=True, nogil=True)
def _sumsq_pack_sum(a, b, packed):
    """Signs of ``a + b`` into ``packed`` (MSB first); returns ``sum((a + b)^2)``."""
    acc = 0.0
    for k in range(packed.size):
        byte = np.uint8(0)
        for j in range(8):
            v = a[8 * k + j] + b[8 * k + j]
            w = np.float64(v)
            acc += w * w
            byte |= np.uint8(v >= 0) << np.uint8(7 - j)
        packed[k] = byte
    return acc


@njit(cache=True, nogil=True)
def _error_feedback_sum(a, error, scale):
    """``error = (a + error) - scale * sign(a + error)``."""
    for i in range(a.size):
        v = a[i] + error[i]
        error[i] = v - (scale if v >= 0 else -scale)


@njit(inline="always")
def _signed(weight, byte, j):
    """``+weight`` where bit ``j`` of ``byte`` is set (MSB first), else ``-weight``: exact."""
    return weight if (byte >> (7 - j)) & 1 else -weight


# The server's average ``y = server_error + sum_i weights[i] sign_i`` is added in rank order,
# two ranks a pass, the last two fused into the pass that packs or updates the error. With an
# odd count a virtual rank of weight 0 and all bits 0 goes first: it adds ``-0.0``, which leaves
# every value as it is (``+0.0`` included), so the sum rounds exactly as the reference's.
@njit(cache=True, nogil=True)
def _add_two(head, w0, signs0, w1, signs1, y):
    """``y = (head + w0 sign_0) + w1 sign_1`` (``y`` may be ``head``)."""
    for k in range(signs0.size):
        b0, b1 = np.int32(signs0[k]), np.int32(signs1[k])
        for j in range(8):
            y[8 * k + j] = (head[8 * k + j] + _signed(w0, b0, j)) + _signed(w1, b1, j)


@njit(fastmath=_SUM_FLAGS, cache=True, nogil=True)
def _pack_two(head, w0, signs0, w1, signs1, packed):
    """With the last two ranks' signs: packs ``sign(y)``, ``y = (head + w0 sign_0) + w1
    sign_1``, and returns ``sum(y^2)``."""
    acc = 0.0
    for k in range(packed.size):
        b0, b1 = np.int32(signs0[k]), np.int32(signs1[k])
        byte = np.uint8(0)
        for j in range(8):
            v = (head[8 * k + j] + _signed(w0, b0, j)) + _signed(w1, b1, j)
            w = np.float64(v)
            acc += w * w
            byte |= np.uint8(v >= 0) << np.uint8(7 - j)
        packed[k] = byte
    return acc


@njit(cache=True, nogil=True)
def _feedback_two(head, w0, signs0, w1, signs1, scale, error):
    """With the last two ranks' signs: ``error = y - scale * sign(y)``, ``y`` as in
    :func:`_pack_two` (``error`` may be ``head``)."""
    for k in range(signs0.size):
        b0, b1 = np.int32(signs0[k]), np.int32(signs1[k])
        for j in range(8):
            v = (head[8 * k + j] + _signed(w0, b0, j)) + _signed(w1, b1, j)
            error[8 * k + j] = v - (scale if v >= 0 else -scale)


@njit(inline="always")
def _rank(received, weights, zeros, i, first, last):
    """Rank ``i``'s weight and signs of bytes ``[first, last)``; rank ``-1`` is the virtual one."""
    if i < 0:
        return weights.dtype.type(0), zeros[: last - first]
    return weights[i], received[i, first:last]


@njit(inline="always")
def _operands(head, received, weights, zeros, first, last, scratch):
    """For the elements of signs bytes ``[first, last)``, ``head`` of the server error: the
    sum of ``head`` and every rank's signs but the last two's (``head`` itself with two ranks
    or fewer), then the last two ranks' weights and signs. Partial sums alternate between the
    rows of ``scratch``, so that no pass writes the memory it reads (its loop vectorises)."""
    n, row = received.shape[0], 0
    for i in range(-(n % 2), n - 2, 2):
        w0, s0 = _rank(received, weights, zeros, i, first, last)
        y = scratch[row, : head.size]
        _add_two(head, w0, s0, weights[i + 1], received[i + 1, first:last], y)
        head, row = y, 1 - row
    w0, s0 = _rank(received, weights, zeros, n - 2, first, last)
    return head, w0, s0, weights[n - 1], received[n - 1, first:last]


@njit(cache=True, nogil=True)
def _decode(packed, scale, out):
    """``out = scale * sign`` from packed bits (``+scale`` where a bit is set)."""
    for k in range(packed.size):
        byte = np.int32(packed[k])
        for j in range(8):
            out[8 * k + j] = _signed(scale, byte, j)


@njit(cache=True, nogil=True)
def _decode_count(packed, scale, out):
    """:func:`_decode` of the first ``out.size`` elements (a last byte only partly used)."""
    whole = out.size >> 3
    _decode(packed[:whole], scale, out[: 8 * whole])
    byte = np.int32(packed[whole]) if out.size & 7 else 0
    for j in range(out.size & 7):
        out[8 * whole + j] = _signed(scale, byte, j)


# Drivers: every one works on *segments* compressed alone, in blocks of at most BLOCK
# elements that never cross a segment (a table of rows ``(segment, start, end)`` in flat
# coordinates, made by :mod:`onebit.kernels._numba`); a buffer exchanged whole is one
# segment. Reductions are returned per block, for the caller to add per segment in block
# order.
def worker_compress(blocks, segments, starts, error, packed):
    """Pack ``sign(x)``, ``x = segment + error``; per block ``sum(x^2)`` (float64).
    ``segments[t]`` holds segment ``t``, which starts at ``starts[t]`` of ``error``."""
    partial = np.empty(blocks.shape[0], np.float64)
    for b in prange(blocks.shape[0]):
        t, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        a = segments[t][s - starts[t] : e - starts[t]]
        partial[b] = _sumsq_pack_sum(a, error[s:e], packed[s // 8 : e // 8])
    return partial


def worker_error_update(blocks, segments, starts, error, scales):
    """``error = x - scales[t] sign(x)``, ``x = segment + error``, in place."""
    for b in prange(blocks.shape[0]):
        t, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        a = segments[t][s - starts[t] : e - starts[t]]
        _error_feedback_sum(a, error[s:e], scales[t])


def server_compress(blocks, received, weights, server_error, packed):
    """Pack ``sign(y)``, ``y = server_error + sum_i weights[t, i] sign_i``; per block
    ``sum(y^2)``."""
    partial = np.zeros(blocks.shape[0], np.float64)
    for b in prange(blocks.shape[0]):
        t, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        scratch, zeros = np.empty((2, CHUNK), server_error.dtype), np.zeros(CHUNK // 8, np.uint8)
        for c in range(s, e, CHUNK):
            d = min(c + CHUNK, e)
            first, last = c // 8, d // 8
            head = server_error[c:d]
            operands = _operands(head, received, weights[t], zeros, first, last, scratch)
            partial[b] += _pack_two(*operands, packed[first:last])
    return partial


def server_error_update(blocks, received, weights, server_error, scales, out, in_place):
    """``out = y - scales[t] sign(y)`` with ``y`` as in :func:`server_compress`; ``out`` is
    ``server_error`` itself where ``in_place``, else memory apart from it."""
    n = received.shape[0]
    for b in prange(blocks.shape[0]):
        t, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        scratch, zeros = np.empty((2, CHUNK), server_error.dtype), np.zeros(CHUNK // 8, np.uint8)
        for c in range(s, e, CHUNK):
            d = min(c + CHUNK, e)
            first, last = c // 8, d // 8
            head = server_error[c:d]
            if in_place and n <= 2:  # the last pass then reads a copy, not what it writes
                head = scratch[1, : d - c]
                head[:] = server_error[c:d]
            operands = _operands(head, received, weights[t], zeros, first, last, scratch)
            _feedback_two(*operands, scales[t], out[c:d])


def decode(pieces, gathered, scales, out):
    """``out[o : o + k] = scales[j, t] * sign`` for each piece ``(t, j, o, byte, k)``: ``k``
    elements of server ``j``'s signs of segment ``t`` from byte ``byte`` of its row."""
    for b in prange(pieces.shape[0]):
        t, j, o = pieces[b, 0], pieces[b, 1], pieces[b, 2]
        first, count = pieces[b, 3], pieces[b, 4]
        _decode_count(
            gathered[j, first : first + (count + 7) // 8], scales[j, t], out[o : o + count]
        )


def gather_columns(packed, send, segment_bytes, column_bytes, widths):
    """``send[j, column_bytes[t] + :w_t] = packed[segment_bytes[t] + j w_t + :w_t]``: chunk
    ``j`` of every segment's signs (``w_t`` bytes) into row ``j``, segment after segment."""
    for t in prange(widths.size):
        w = widths[t]
        for j in range(send.shape[0]):
            start = segment_bytes[t] + j * w
            send[j, column_bytes[t] : column_bytes[t] + w] = packed[start : start + w]
