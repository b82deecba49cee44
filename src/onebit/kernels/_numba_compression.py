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
def _blocks(n):
    return (n + BLOCK - 1) // BLOCK


def worker_compress(a, b, packed):
    """Pack ``sign(a + b)`` into ``packed``; returns ``sum((a + b)^2)`` (float64)."""
    n = a.size
    partial = np.empty(_blocks(n), np.float64)
    for block in prange(partial.size):
        s, e = block * BLOCK, min((block + 1) * BLOCK, n)
        partial[block] = _sumsq_pack_sum(a[s:e], b[s:e], packed[s // 8 : e // 8])
    return partial.sum()


def worker_error_update(a, error, scale):
    """``error = (a + error) - scale * sign(a + error)``, in place."""
    n = a.size
    for block in prange(_blocks(n)):
        s, e = block * BLOCK, min((block + 1) * BLOCK, n)
        _error_feedback_sum(a[s:e], error[s:e], scale)


def server_compress(received, weights, server_error, packed):
    """Pack ``sign(y)``, ``y = server_error + sum_i weights[i] sign_i``; returns ``sum(y^2)``."""
    n = server_error.size
    partial = np.zeros(_blocks(n), np.float64)
    for block in prange(partial.size):
        s, e = block * BLOCK, min((block + 1) * BLOCK, n)
        y = np.empty(CHUNK, server_error.dtype)
        for c in range(s, e, CHUNK):
            d = min(c + CHUNK, e)
            rows = received[:, c // 8 : d // 8]
            head = _server_sum(server_error[c:d], rows, weights, y[: d - c])
            partial[block] += _last_sumsq_pack(head, weights[-1], rows[-1], packed[c // 8 : d // 8])
    return partial.sum()


def server_error_update(received, weights, server_error, scale):
    """``server_error = y - scale * sign(y)`` with ``y`` as in :func:`server_compress`."""
    n = server_error.size
    for block in prange(_blocks(n)):
        s, e = block * BLOCK, min((block + 1) * BLOCK, n)
        y = np.empty(CHUNK, server_error.dtype)
        for c in range(s, e, CHUNK):
            d = min(c + CHUNK, e)
            rows = received[:, c // 8 : d // 8]
            if rows.shape[0] == 1:
                _only_error_feedback(weights[0], rows[0], scale, server_error[c:d])
            else:
                head = _server_sum(server_error[c:d], rows, weights, y[: d - c])
                _last_error_feedback(head, weights[-1], rows[-1], scale, server_error[c:d])


def decode(gathered, scales, out):
    """``out[chunk j] = scales[j] * sign`` from row ``j`` of ``gathered``."""
    chunks, nbytes = gathered.shape
    chunk = 8 * nbytes
    per_chunk = _blocks(chunk)
    for index in prange(chunks * per_chunk):
        j, block = index // per_chunk, index % per_chunk
        s, e = block * BLOCK, min((block + 1) * BLOCK, chunk)
        _decode(gathered[j, s // 8 : e // 8], scales[j], out[j * chunk + s : j * chunk + e])
