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
_SUM_FLAGS = {"reassoc", "contract"}  # only on functions whose sole float work is a sum


@njit(fastmath=_SUM_FLAGS, cache=True)
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


@njit(cache=True)
def _error_feedback_sum(a, error, scale):
    """``error = (a + error) - scale * sign(a + error)``."""
    for i in range(a.size):
        v = a[i] + error[i]
        error[i] = v - (scale if v >= 0 else -scale)


@njit(cache=True)
def _add_signs(y, weight, packed):
    """``y += weight * sign`` from packed bits; ``+-weight`` is exact, one rounding per add."""
    for k in range(packed.size):
        byte = np.int32(packed[k])
        for j in range(8):
            y[8 * k + j] += weight if (byte >> (7 - j)) & 1 else -weight


@njit(cache=True)
def _server_sum(server_error, received, weights, y):
    """``y = server_error + sum_i weights[i] * sign_i`` over all ranks but the last, added in
    rank order; returns ``y``, or ``server_error`` itself when there is one rank."""
    last = received.shape[0] - 1
    if last == 0:
        return server_error
    for e in range(y.size):
        y[e] = server_error[e]
    for i in range(last):
        _add_signs(y, weights[i], received[i])
    return y


@njit(fastmath=_SUM_FLAGS, cache=True)
def _last_sumsq_pack(partial_sum, weight, received, packed):
    """With the last rank's signs: ``y = partial_sum + weight * sign``; packs ``sign(y)``
    and returns ``sum(y^2)``. (The only rounding in ``y`` is its one addition.)"""
    acc = 0.0
    for k in range(packed.size):
        signs = np.int32(received[k])
        byte = np.uint8(0)
        for j in range(8):
            v = partial_sum[8 * k + j] + (weight if (signs >> (7 - j)) & 1 else -weight)
            w = np.float64(v)
            acc += w * w
            byte |= np.uint8(v >= 0) << np.uint8(7 - j)
        packed[k] = byte
    return acc


@njit(cache=True)
def _last_error_feedback(partial_sum, weight, received, scale, error):
    """With the last rank's signs: ``y = partial_sum + weight * sign``;
    ``error = y - scale * sign(y)``."""
    for k in range(received.size):
        signs = np.int32(received[k])
        for j in range(8):
            v = partial_sum[8 * k + j] + (weight if (signs >> (7 - j)) & 1 else -weight)
            error[8 * k + j] = v - (scale if v >= 0 else -scale)


@njit(cache=True)
def _only_error_feedback(weight, received, scale, error):
    """:func:`_last_error_feedback` for a world of one rank, where ``partial_sum`` is
    ``error`` itself (one array, so the loop vectorises)."""
    for k in range(received.size):
        signs = np.int32(received[k])
        for j in range(8):
            v = error[8 * k + j] + (weight if (signs >> (7 - j)) & 1 else -weight)
            error[8 * k + j] = v - (scale if v >= 0 else -scale)


@njit(cache=True)
def _decode(packed, scale, out):
    """``out = scale * sign`` from packed bits (``+scale`` where a bit is set)."""
    for k in range(packed.size):
        byte = np.int32(packed[k])
        for j in range(8):
            out[8 * k + j] = scale if (byte >> (7 - j)) & 1 else -scale


@njit(cache=True)
def _decode_count(packed, scale, out):
    """:func:`_decode` of the first ``out.size`` elements (a last byte only partly used)."""
    whole = out.size >> 3
    _decode(packed[:whole], scale, out[: 8 * whole])
    byte = np.int32(packed[whole]) if out.size & 7 else 0
    for j in range(out.size & 7):
        out[8 * whole + j] = scale if (byte >> (7 - j)) & 1 else -scale


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
        y = np.empty(CHUNK, server_error.dtype)
        for c in range(s, e, CHUNK):
            d = min(c + CHUNK, e)
            rows = received[:, c // 8 : d // 8]
            head = _server_sum(server_error[c:d], rows, weights[t], y[: d - c])
            partial[b] += _last_sumsq_pack(head, weights[t, -1], rows[-1], packed[c // 8 : d // 8])
    return partial


def server_error_update(blocks, received, weights, server_error, scales, out, in_place):
    """``out = y - scales[t] sign(y)`` with ``y`` as in :func:`server_compress`; ``out`` is
    ``server_error`` itself where ``in_place``, else memory apart from it."""
    for b in prange(blocks.shape[0]):
        t, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        y = np.empty(CHUNK, server_error.dtype)
        for c in range(s, e, CHUNK):
            d = min(c + CHUNK, e)
            rows = received[:, c // 8 : d // 8]
            if rows.shape[0] == 1 and in_place:
                _only_error_feedback(weights[t, 0], rows[0], scales[t], out[c:d])
            else:
                head = _server_sum(server_error[c:d], rows, weights[t], y[: d - c])
                _last_error_feedback(head, weights[t, -1], rows[-1], scales[t], out[c:d])


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
