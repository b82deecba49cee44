"""numba kernels of the optimizers' updates over flat state (CPU, float32 and float64).

The same maths as the torch reference in :mod:`onebit.optim.functional`, in one or two
passes over memory per step, as the update part of the numba backend (:class:`NumbaUpdates`).
The kernels work on numpy arrays: the flat buffers of a flat state (``flat``: anything with
the attributes of :class:`~onebit.optim._flat.FlatState`), its segment offsets and its
groups' hyper-parameters. Work is split into blocks of at most :data:`BLOCK` elements that
never cross a parameter (tables made here from the offsets, and cached); partial sums are
kept per block in float64 and added per parameter in block order, so results do not depend
on the number of threads. Per-parameter scalars (trust ratios, factors) are decided by the
same torch functions as the reference (:mod:`onebit.coefficients`), on vectors of one entry
per parameter.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numba import njit, prange, typed
from torch import Tensor

from onebit.coefficients import TrustBound, compression_factor, momentum_rebuild, trust_ratio
from onebit.compression import ExchangeResult
from onebit.kernels._numba import Compiled
from onebit.kernels._numba import to_numpy as _np
from onebit.kernels._numba_compression import _signed

_SUM_FLAGS = {"reassoc", "contract"}
CHUNK = 1 << 10  # elements whose ratios are kept in scratch at a time
BLOCK = 1 << 14  # elements per block of work; blocks never cross a segment


# ----------------------------------------------------------------------------- elementwise
@njit(inline="always", error_model="numpy", cache=True)
def _moments(m, v, g, b1, one_minus_b1, b2, one_minus_b2):
    """``(b1 m + (1 - b1) g, b2 v + (1 - b2) g^2)``."""
    return b1 * m + one_minus_b1 * g, b2 * v + one_minus_b2 * (g * g)


@njit(inline="always", error_model="numpy", cache=True)
def _direction(m, v, p, eps, wd):
    """``(m / (sqrt(v) + eps), m / (sqrt(v) + eps) + wd p, sqrt(v) + eps)``."""
    denom = np.sqrt(v) + eps
    base = m / denom
    return base, base + wd * p, denom


@njit(error_model="numpy", cache=True, nogil=True)
def _decode_chunk(signs, first, count, value, wide):
    """Decode elements ``first .. first + count - 1`` of the exchanged momentum, ``+-value``
    by their bits in ``signs`` (``value = b_j / s``), into ``wide`` from whole bytes;
    returns the offset of element ``first`` in ``wide``."""
    start_byte = first >> 3
    for k in range(((first + count + 7) >> 3) - start_byte):
        byte = np.int32(signs[start_byte + k])
        for j in range(8):
            wide[8 * k + j] = _signed(value, byte, j)
    return first & 7


@njit(inline="always", error_model="numpy", cache=True)
def _clamped(value, bound):
    """``value`` clamped to ``[-bound, bound]`` (NaN stays NaN, as in ``torch.clamp``)."""
    if value > bound:
        return bound
    if value < -bound:
        return -bound
    return value


@njit(inline="always", error_model="numpy", cache=True)
def _limited(decoded, limit, i):
    """The decoded momentum of element ``i``, clamped to ``+-limit[i]`` where a limit is
    given."""
    return _clamped(decoded[i], limit[i]) if limit.size else decoded[i]


# ----------------------------------------------------------------------------- blocks
@njit(fastmath=_SUM_FLAGS, error_model="numpy", cache=True, nogil=True)
def _lamb_block_sums(g, m, v, p, b1, omb1, b2, omb2, eps, wd):
    sum_p, sum_u, sum_g = 0.0, 0.0, 0.0
    for i in range(g.size):
        mi, vi = _moments(m[i], v[i], g[i], b1, omb1, b2, omb2)
        _, u, _ = _direction(mi, vi, p[i], eps, wd)
        sum_p += np.float64(p[i]) * np.float64(p[i])
        sum_u += np.float64(u) * np.float64(u)
        sum_g += np.float64(g[i])
    return sum_p, sum_u, sum_g


@njit(error_model="numpy", cache=True, nogil=True)
def _adam_block_apply(g, m, v, p, b1, omb1, b2, omb2, eps, wd, step):
    """Moments from ``g``, then ``p += step * u`` (``step = -lr c`` for LAMB, ``-lr`` for Adam)."""
    for i in range(g.size):
        mi, vi = _moments(m[i], v[i], g[i], b1, omb1, b2, omb2)
        _, u, _ = _direction(mi, vi, p[i], eps, wd)
        m[i] = mi
        v[i] = vi
        p[i] += step * u


@njit(fastmath=_SUM_FLAGS, error_model="numpy", cache=True, nogil=True)
def _block_sum(x):
    total = 0.0
    for i in range(x.size):
        total += np.float64(x[i])
    return total


@njit(error_model="numpy", cache=True, nogil=True)
def _momentum_block(m, g, b1, omb1, scale, out):
    for i in range(m.size):
        out[i] = scale * (b1 * m[i] + omb1 * g[i])


@njit(inline="always", error_model="numpy", cache=True)
def _fresh_variance(new, m, fresh, b1, inv_omb1, b2, omb2):
    """``g = (m_new - b1 m) / (1 - b1)``; returns ``b2 v_fresh + (1 - b2) g^2``."""
    grad = (new - b1 * m) * inv_omb1
    return b2 * fresh + omb2 * (grad * grad)


@njit(fastmath=_SUM_FLAGS, error_model="numpy", cache=True, nogil=True)
def _onebit_lamb_chunk_a(decoded, limit, m, v, fresh, p, b1, inv_omb1, b2, omb2, eps, wd, ratio):
    """Decode the momentum and refresh ``v_fresh``; returns the sums of ``u0^2`` and ``u^2``
    and writes ``d / (sqrt(v_fresh) + eps)`` into ``ratio``."""
    sum_base, sum_full = 0.0, 0.0
    for i in range(m.size):
        new = _limited(decoded, limit, i)
        f = _fresh_variance(new, m[i], fresh[i], b1, inv_omb1, b2, omb2)
        fresh[i] = f
        m[i] = new
        base, full, denom = _direction(new, v[i], p[i], eps, wd)
        sum_base += np.float64(base) * np.float64(base)
        sum_full += np.float64(full) * np.float64(full)
        ratio[i] = denom / (np.sqrt(f) + eps)
    return sum_base, sum_full


@njit(error_model="numpy", cache=True, nogil=True)
def _max_bits(bits):
    """The largest bit pattern: for non-negative floats viewed as integers, the largest
    value (NaN above every number), as an integer maximum that vectorises."""
    best = bits[0]
    for i in range(1, bits.size):
        value = bits[i]
        best = value if value > best else best
    return best


@njit(error_model="numpy", cache=True, nogil=True)
def _onebit_lamb_block_a(
    signs, start, value, limit, m, v, fresh, p, b1, inv_omb1, b2, omb2, eps, wd, bits_like
):
    """:func:`_onebit_lamb_chunk_a` chunk by chunk on the momentum decoded from ``signs``
    (``+-value``, from bit ``start``); returns the two sums and the maximum ratio
    (non-negative, so its maximum is taken on its bit pattern)."""
    ratio = np.empty(min(CHUNK, m.size), m.dtype)
    bits = ratio.view(bits_like.dtype)
    wide = np.empty(CHUNK + 16, m.dtype)
    sum_base, sum_full, best = 0.0, 0.0, bits_like.dtype.type(0)
    for c in range(0, m.size, CHUNK):
        e = min(c + CHUNK, m.size)
        offset = _decode_chunk(signs, start + c, e - c, value, wide)
        base, full = _onebit_lamb_chunk_a(
            wide[offset : offset + e - c],
            limit[c:e] if limit.size else limit,
            m[c:e],
            v[c:e],
            fresh[c:e],
            p[c:e],
            b1,
            inv_omb1,
            b2,
            omb2,
            eps,
            wd,
            ratio[: e - c],
        )
        sum_base += base
        sum_full += full
        chunk_best = _max_bits(bits[: e - c])
        best = chunk_best if chunk_best > best else best
    ratio[0:1].view(bits_like.dtype)[0] = best
    return sum_base, sum_full, np.float64(ratio[0])


@njit(error_model="numpy", cache=True, nogil=True)
def _step_block(m, v, p, eps, wd, step):
    """``p += step * (m / (sqrt(v) + eps) + wd p)``."""
    for i in range(m.size):
        _, u, _ = _direction(m[i], v[i], p[i], eps, wd)
        p[i] += step * u


@njit(error_model="numpy", cache=True, nogil=True)
def _momentum_step_block(m, g, v, p, b1, omb1, eps, wd, step):
    """``m = b1 m + (1 - b1) g``; ``p += step * (m / (sqrt(v) + eps) + wd p)``."""
    for i in range(m.size):
        m[i] = b1 * m[i] + omb1 * g[i]
        _, u, _ = _direction(m[i], v[i], p[i], eps, wd)
        p[i] += step * u


@njit(error_model="numpy", cache=True, nogil=True)
def _onebit_adam_chunk(decoded, limit, m, v, p, eps, wd, step):
    for i in range(m.size):
        new = _limited(decoded, limit, i)
        m[i] = new
        _, u, _ = _direction(new, v[i], p[i], eps, wd)
        p[i] += step * u


@njit(error_model="numpy", cache=True, nogil=True)
def _onebit_adam_block(signs, start, value, limit, m, v, p, eps, wd, step):
    """``m = clamp(decoded, -limit, limit)``; ``p += step * (m / (sqrt(v) + eps) + wd p)``, by
    chunks."""
    wide = np.empty(CHUNK + 16, m.dtype)
    for c in range(0, m.size, CHUNK):
        e = min(c + CHUNK, m.size)
        offset = _decode_chunk(signs, start + c, e - c, value, wide)
        _onebit_adam_chunk(
            wide[offset : offset + e - c],
            limit[c:e] if limit.size else limit,
            m[c:e],
            v[c:e],
            p[c:e],
            eps,
            wd,
            step,
        )


# ----------------------------------------------------------------------------- drivers
def lamb_sums(blocks, active, grads, offsets, m, v, p, b1, omb1, b2, omb2, eps, wd):
    out = np.zeros((blocks.shape[0], 3), np.float64)
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            out[b, 0], out[b, 1], out[b, 2] = _lamb_block_sums(
                grads[seg][s - offsets[seg] : e - offsets[seg]],
                m[s:e],
                v[s:e],
                p[s:e],
                b1[seg],
                omb1[seg],
                b2[seg],
                omb2[seg],
                eps[seg],
                wd[seg],
            )
    return out


def adam_apply(blocks, active, grads, offsets, m, v, p, b1, omb1, b2, omb2, eps, wd, step):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _adam_block_apply(
                grads[seg][s - offsets[seg] : e - offsets[seg]],
                m[s:e],
                v[s:e],
                p[s:e],
                b1[seg],
                omb1[seg],
                b2[seg],
                omb2[seg],
                eps[seg],
                wd[seg],
                step[seg],
            )


def grad_sums(blocks, active, grads, offsets):
    out = np.zeros(blocks.shape[0], np.float64)
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            out[b] = _block_sum(grads[seg][s - offsets[seg] : e - offsets[seg]])
    return out


def momentum(blocks, active, m, grads, offsets, b1, omb1, scale, out):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            g = grads[seg][s - offsets[seg] : e - offsets[seg]]
            _momentum_block(m[s:e], g, b1[seg], omb1[seg], scale[seg], out[s:e])
        else:
            out[s:e] = 0


def onebit_lamb_a(
    blocks, active, signs, values, limit, m, v, fresh, p, b1, inv_omb1, b2, omb2, eps, wd, bits_like
):
    """Pass A over the rows ``(segment, start, end, first bit)`` of a sign table
    (:func:`_sign_table`): elements ``start .. end - 1``, their momentum ``+-values[b]`` from
    the bits of ``signs`` from ``first bit`` on."""
    out = np.zeros((blocks.shape[0], 3), np.float64)
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            out[b, 0], out[b, 1], out[b, 2] = _onebit_lamb_block_a(
                signs,
                blocks[b, 3],
                values[b],
                limit[s:e] if limit.size else limit,
                m[s:e],
                v[s:e],
                fresh[s:e],
                p[s:e],
                b1[seg],
                inv_omb1[seg],
                b2[seg],
                omb2[seg],
                eps[seg],
                wd[seg],
                bits_like,
            )
    return out


def apply_step(blocks, active, m, v, p, eps, wd, step):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _step_block(m[s:e], v[s:e], p[s:e], eps[seg], wd[seg], step[seg])


def momentum_step(blocks, active, m, grads, offsets, v, p, b1, omb1, eps, wd, step):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            g = grads[seg][s - offsets[seg] : e - offsets[seg]]
            _momentum_step_block(
                m[s:e], g, v[s:e], p[s:e], b1[seg], omb1[seg], eps[seg], wd[seg], step[seg]
            )


def onebit_adam(blocks, active, signs, values, limit, m, v, p, eps, wd, step):
    """Over the rows of a sign table, as :func:`onebit_lamb_a`."""
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _onebit_adam_block(
                signs,
                blocks[b, 3],
                values[b],
                limit[s:e] if limit.size else limit,
                m[s:e],
                v[s:e],
                p[s:e],
                eps[seg],
                wd[seg],
                step[seg],
            )


def frozen_adam(blocks, active, exchanged, limit, m, v, p, eps, wd, step):
    """``m = clamp(exchanged, -limit, limit)``; ``p += step * (m / (sqrt(v) + eps) + wd p)``."""
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _onebit_adam_chunk(
                exchanged[s:e],
                limit[s:e] if limit.size else limit,
                m[s:e],
                v[s:e],
                p[s:e],
                eps[seg],
                wd[seg],
                step[seg],
            )


@njit(error_model="numpy", cache=True, nogil=True)
def _accumulated_block(p, synced, v, eps, out):
    """``out = (p - p_synced) (sqrt(v) + eps)``."""
    for i in range(p.size):
        out[i] = (p[i] - synced[i]) * (np.sqrt(v[i]) + eps)


@njit(error_model="numpy", cache=True, nogil=True)
def _synchronised_block(delta, m, synced, p, v, eps, rebuild):
    """``m = delta * rebuild``; ``p_synced += delta / (sqrt(v) + eps)``; ``p = p_synced``."""
    for i in range(delta.size):
        m[i] = delta[i] * rebuild
        synced[i] = synced[i] + delta[i] / (np.sqrt(v[i]) + eps)
        p[i] = synced[i]


def accumulated(blocks, active, p, synced, v, eps, out):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _accumulated_block(p[s:e], synced[s:e], v[s:e], eps[seg], out[s:e])
        else:
            out[s:e] = 0


def synchronised(blocks, active, delta, m, synced, p, v, eps, rebuild):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _synchronised_block(
                delta[s:e], m[s:e], synced[s:e], p[s:e], v[s:e], eps[seg], rebuild[seg]
            )


@njit(error_model="numpy", cache=True, nogil=True)
def _predict_block(shared, momentum, limit, v, out, inverse_scale, eps, wd, step):
    """``u = clamp(momentum / s, -limit, limit) / (sqrt(v) + eps) + wd shared``;
    ``out = shared + step u`` where ``step u`` is finite, else ``out = shared``."""
    for i in range(out.size):
        moved = momentum[i] * inverse_scale
        if limit.size:
            moved = _clamped(moved, limit[i])
        moved = moved / (np.sqrt(v[i]) + eps) + wd * shared[i]
        moved = moved * step
        out[i] = shared[i] + moved if np.isfinite(moved) else shared[i]


def predict(blocks, active, shared, momentum, limit, v, out, inverse_scale, eps, wd, step):
    """:func:`_predict_block` over the active parameters; ``out = shared`` elsewhere."""
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _predict_block(
                shared[s:e],
                momentum[s:e],
                limit[s:e] if limit.size else limit,
                v[s:e],
                out[s:e],
                inverse_scale[seg],
                eps[seg],
                wd[seg],
                step[seg],
            )
        else:
            out[s:e] = shared[s:e]


_KERNELS = Compiled(
    sys.modules[__name__],
    (
        "lamb_sums",
        "adam_apply",
        "grad_sums",
        "momentum",
        "onebit_lamb_a",
        "apply_step",
        "momentum_step",
        "onebit_adam",
        "frozen_adam",
        "accumulated",
        "synchronised",
        "predict",
    ),
)


# ----------------------------------------------------------------------------- block tables
@functools.lru_cache(maxsize=64)
def _block_table(offsets: bytes) -> np.ndarray:
    """``[B, 3]`` int64 rows ``(segment, start, end)``: blocks of at most :data:`BLOCK`
    elements that never cross a segment boundary, in order (``offsets``: the segments'
    int64 offsets, as bytes)."""
    bounds = np.frombuffer(offsets, dtype=np.int64)
    rows = []
    for segment in range(len(bounds) - 1):
        start, end = int(bounds[segment]), int(bounds[segment + 1])
        rows.extend((segment, s, min(s + BLOCK, end)) for s in range(start, end, BLOCK))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


@functools.lru_cache(maxsize=64)
def _exchange_block_table(offsets: bytes, bounds: bytes) -> np.ndarray:
    """``[B, 4]`` rows ``(segment, start, end, chunk)``: the blocks split further at the
    borders of the exchange's chunks (chunk ``c`` holds elements ``[bounds[c],
    bounds[c + 1])``; ``offsets`` and ``bounds`` as int64 bytes)."""
    borders = np.frombuffer(bounds, dtype=np.int64)
    rows = []
    for segment, start, end in _block_table(offsets):
        cut = start
        while cut < end:
            chunk = int(np.searchsorted(borders, cut, side="right")) - 1
            stop = min(end, int(borders[chunk + 1]))
            rows.append((segment, cut, stop, chunk))
            cut = stop
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)


def _blocks(flat: Any) -> np.ndarray:
    return _block_table(np.ascontiguousarray(flat.offsets, dtype=np.int64).tobytes())


def _exchange_blocks(flat: Any, bounds: np.ndarray) -> np.ndarray:
    offsets = np.ascontiguousarray(flat.offsets, dtype=np.int64).tobytes()
    return _exchange_block_table(offsets, np.ascontiguousarray(bounds, dtype=np.int64).tobytes())


# ----------------------------------------------------------------------------- helpers
class _Hyper:
    """The groups' hyper-parameters as per-parameter numpy vectors in the state dtype."""

    def __init__(self, flat: Any) -> None:
        self._flat = flat
        self.dtype = np.float64 if flat.dtype == torch.float64 else np.float32

    def __call__(self, value_of) -> np.ndarray:
        return np.array([value_of(group) for group in self._flat.groups], dtype=self.dtype)

    def key(self, name: str) -> np.ndarray:
        return self(lambda group: group[name])

    def betas(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``b1, 1 - b1, b2, 1 - b2``, each ``1 - b`` computed in double precision and rounded
        once to the state dtype, as the torch reference rounds it (``alpha=1 - beta``)."""
        b1, b2 = self(lambda g: g["betas"][0]), self(lambda g: g["betas"][1])
        return b1, self(lambda g: 1 - g["betas"][0]), b2, self(lambda g: 1 - g["betas"][1])


def _tensor(flat: Any, values: np.ndarray) -> Tensor:
    """A per-parameter numpy vector as a CPU tensor of the state dtype."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(flat.dtype)


def _active(active: Sequence[bool]) -> np.ndarray:
    return np.asarray(active, dtype=np.bool_)


def _per_segment(flat: Any, blocks: np.ndarray, partials: np.ndarray) -> np.ndarray:
    """Per-block partial sums added per parameter, in block order."""
    totals = np.zeros((len(flat.params),) + partials.shape[1:], np.float64)
    np.add.at(totals, blocks[:, 0], partials)
    return totals


def _grad_list(flat: Any, grads: Sequence[Tensor | None]) -> typed.List:
    """Each parameter's gradient as a flat numpy array (empty where there is none)."""
    empty = np.zeros(0, dtype=_Hyper(flat).dtype)
    return typed.List([empty if g is None else _np(g.reshape(-1)) for g in grads])


def _momentum_inputs(flat: Any, grads: Sequence[Tensor], active: Sequence[bool]):
    """The arguments every momentum driver starts with: the block table, the active flags,
    ``m``, the gradients and their offsets, then ``b1`` and ``1 - b1``."""
    b1, omb1, _, _ = _Hyper(flat).betas()
    return (
        (_blocks(flat), _active(active), _np(flat.exp_avg), _grad_list(flat, grads), flat.offsets),
        (b1, omb1),
    )


def _limit_array(flat: Any, limit: Tensor | None) -> np.ndarray:
    return np.zeros(0, dtype=_Hyper(flat).dtype) if limit is None else _np(limit)


def _sign_table(flat: Any, packed: ExchangeResult, scaling: Tensor):
    """Where the update kernels read each element's exchanged momentum: rows ``(segment,
    start, end, first bit)`` of elements ``start .. end - 1`` (the blocks, split further at
    the borders of the result's runs, :class:`~onebit.compression.SignRuns`), each row's
    ``value = b * (1 / s[segment])`` (``b`` its run's scale, rounded once as the
    reference's ``+-b_j * (1 / s)``), and the packed signs, bit ``first bit`` on."""
    runs = packed.sign_runs()
    if runs.numel < flat.numel:
        raise ValueError(
            f"the exchange's result holds {runs.numel} elements; the optimizer's tensors "
            f"{flat.numel}"
        )
    table = _exchange_blocks(flat, runs.bounds)
    run = table[:, 3]
    first_bits = runs.first_bits[run] + (table[:, 1] - runs.bounds[run])
    blocks = np.column_stack([table[:, :3], first_bits])
    inverse = _np(scaling.reciprocal())
    values = _np(runs.scales.to(flat.dtype))[run] * inverse[table[:, 0]]
    return blocks, values.astype(inverse.dtype), _np(runs.signs)


# ----------------------------------------------------------------------------- entry points
class NumbaUpdates:
    """The update part of the numba backend: the methods of
    :class:`onebit.kernels.UpdateKernels`, one or two passes over memory each."""

    def lamb_step_(
        self, flat: Any, grads: Sequence[Tensor | None], active: Sequence[bool], check_finite: bool
    ) -> tuple[Tensor, Tensor] | None:
        hyper, mask, blocks = _Hyper(flat), _active(active), _blocks(flat)
        b1, omb1, b2, omb2 = hyper.betas()
        args = (
            _grad_list(flat, grads),
            flat.offsets,
            _np(flat.exp_avg),
            _np(flat.exp_avg_sq),
            _np(flat.weights),
        )
        consts = (b1, omb1, b2, omb2, hyper.key("eps"), hyper.key("weight_decay"))
        sums = _per_segment(flat, blocks, _KERNELS("lamb_sums")(blocks, mask, *args, *consts))
        if check_finite and not np.isfinite(sums[mask, 2].sum()):
            return None
        coeff, defined = trust_ratio(
            _tensor(flat, np.sqrt(sums[:, 0])),
            _tensor(flat, np.sqrt(sums[:, 1])),
            _tensor(flat, hyper.key("min_coeff")),
            _tensor(flat, hyper.key("max_coeff")),
        )
        step = -hyper.key("lr") * _np(coeff)
        _KERNELS("adam_apply")(blocks, mask, *args, *consts, step.astype(hyper.dtype))
        return coeff, defined

    def adam_step_(
        self, flat: Any, grads: Sequence[Tensor | None], active: Sequence[bool], check_finite: bool
    ) -> bool:
        hyper, mask, blocks = _Hyper(flat), _active(active), _blocks(flat)
        grad_list = _grad_list(flat, grads)
        if check_finite:
            sums = _KERNELS("grad_sums")(blocks, mask, grad_list, flat.offsets)
            if not np.isfinite(sums.sum()):
                return False
        args = (grad_list, flat.offsets, _np(flat.exp_avg), _np(flat.exp_avg_sq), _np(flat.weights))
        consts = (*hyper.betas(), hyper.key("eps"), hyper.key("weight_decay"))
        _KERNELS("adam_apply")(blocks, mask, *args, *consts, -hyper.key("lr"))
        return True

    def scaled_momentum(
        self,
        flat: Any,
        grads: Sequence[Tensor],
        scaling: Tensor,
        out: Tensor,
        active: Sequence[bool],
        only: Sequence[int] | None = None,
    ) -> None:
        (blocks, *arrays), betas = _momentum_inputs(flat, grads, active)
        if only is not None:
            blocks = blocks[np.isin(blocks[:, 0], np.asarray(only, dtype=np.int64))]
        _KERNELS("momentum")(blocks, *arrays, *betas, _np(scaling.to(flat.dtype)), _np(out))

    def adam_momentum_step_(
        self, flat: Any, grads: Sequence[Tensor], active: Sequence[bool]
    ) -> None:
        hyper = _Hyper(flat)
        arrays, betas = _momentum_inputs(flat, grads, active)
        state = (_np(flat.exp_avg_sq), _np(flat.weights))
        constants = (hyper.key("eps"), hyper.key("weight_decay"), -hyper.key("lr"))
        _KERNELS("momentum_step")(*arrays, *state, *betas, *constants)

    def onebit_lamb_compressed_step_(
        self,
        flat: Any,
        packed: ExchangeResult,
        scratch: Tensor,
        scaling: Tensor,
        limit: Tensor | None,
        active: Sequence[bool],
        lamb_coeff_freeze: Tensor,
        last_factor: Tensor,
        trust: TrustBound | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(``scratch`` is unused: the momentum is decoded on the fly, from a result in the
        flat layout or of one segment per tensor.)"""
        hyper, on = _Hyper(flat), _active(active)
        b1, omb1, b2, omb2 = hyper.betas()
        eps, wd = hyper.key("eps"), hyper.key("weight_decay")
        m, v, p = _np(flat.exp_avg), _np(flat.exp_avg_sq), _np(flat.weights)
        blocks, values, signs = _sign_table(flat, packed, scaling)
        partials = _KERNELS("onebit_lamb_a")(
            blocks,
            on,
            signs,
            values,
            _limit_array(flat, limit),
            m,
            v,
            _np(flat.exp_avg_sq_fresh),
            p,
            b1,
            hyper(lambda group: flat.reciprocal(1 - group["betas"][0])),
            b2,
            omb2,
            eps,
            wd,
            np.zeros(0, np.int64 if flat.dtype == torch.float64 else np.int32),
        )
        sums = _per_segment(flat, blocks, partials[:, :2])
        maxima = np.full(len(flat.params), -np.inf)
        np.maximum.at(maxima, blocks[:, 0], partials[:, 2])
        full_norm = _tensor(flat, np.sqrt(sums[:, 1]))
        factor = compression_factor(
            _tensor(flat, maxima),
            _tensor(flat, np.sqrt(sums[:, 0])),
            full_norm,
            last_factor,
            _tensor(flat, hyper.key("factor_min")),
            _tensor(flat, hyper.key("factor_max")),
            _tensor(flat, hyper.key("factor_threshold")),
        )
        factor = torch.where(torch.from_numpy(on), factor, last_factor)
        # (-lr c_frz) f, multiplied in the reference's order
        lr = _tensor(flat, hyper.key("lr"))
        steps, coefficient = -lr * lamb_coeff_freeze * factor, lamb_coeff_freeze * factor
        if trust is not None:
            steps, coefficient = trust.apply(steps, coefficient, lr, full_norm)
        step = _np(steps).astype(hyper.dtype)
        _KERNELS("apply_step")(_blocks(flat), on, m, v, p, eps, wd, step)
        return factor, coefficient

    def onebit_adam_compressed_step_(
        self,
        flat: Any,
        packed: ExchangeResult,
        scratch: Tensor,
        scaling: Tensor,
        limit: Tensor | None,
        active: Sequence[bool],
    ) -> None:
        """(``scratch`` is unused: the momentum is decoded on the fly.)"""
        hyper = _Hyper(flat)
        blocks, values, signs = _sign_table(flat, packed, scaling)
        _KERNELS("onebit_adam")(
            blocks,
            _active(active),
            signs,
            values,
            _limit_array(flat, limit),
            _np(flat.exp_avg),
            _np(flat.exp_avg_sq),
            _np(flat.weights),
            hyper.key("eps"),
            hyper.key("weight_decay"),
            -hyper.key("lr"),
        )

    def onebit_adam_per_tensor_step_(
        self,
        flat: Any,
        packed: ExchangeResult,
        exchanged: Tensor,
        limit: Tensor | None,
        active: Sequence[bool],
    ) -> None:
        """The momentum is decoded into ``exchanged`` first (one segment per tensor)."""
        packed.decode(exchanged)
        hyper = _Hyper(flat)
        _KERNELS("frozen_adam")(
            _blocks(flat),
            _active(active),
            _np(exchanged),
            _limit_array(flat, limit),
            _np(flat.exp_avg),
            _np(flat.exp_avg_sq),
            _np(flat.weights),
            hyper.key("eps"),
            hyper.key("weight_decay"),
            -hyper.key("lr"),
        )

    def predict_weights_(
        self,
        flat: Any,
        shared: Tensor,
        out: Tensor,
        momentum: Tensor,
        scaling: Tensor,
        limit: Tensor | None,
        coefficients: Tensor | None,
        active: Sequence[bool],
    ) -> None:
        """In one pass over memory."""
        hyper = _Hyper(flat)
        step = -hyper.key("lr")
        if coefficients is not None:
            step = (step * _np(coefficients.to(flat.dtype))).astype(hyper.dtype)
        _KERNELS("predict")(
            _blocks(flat),
            _active(active),
            _np(shared),
            _np(momentum),
            _limit_array(flat, limit),
            _np(flat.exp_avg_sq),
            _np(out),
            _np(scaling.reciprocal()),
            hyper.key("eps"),
            hyper.key("weight_decay"),
            step,
        )

    def accumulated_update(self, flat: Any, active: Sequence[bool], out: Tensor) -> Tensor:
        hyper = _Hyper(flat)
        state = (_np(flat.weights), _np(flat.synced_param), _np(flat.exp_avg_sq))
        _KERNELS("accumulated")(_blocks(flat), _active(active), *state, hyper.key("eps"), _np(out))
        out[flat.numel :].zero_()
        return out

    def synchronised_update_(
        self, flat: Any, exchanged: Tensor, active: Sequence[bool], lr_sum: Tensor
    ) -> None:
        """(``exchanged`` is left as it is.)"""
        rebuild = momentum_rebuild(lr_sum)
        on = _active(active)
        _KERNELS("synchronised")(
            _blocks(flat),
            on,
            _np(exchanged),
            _np(flat.exp_avg),
            _np(flat.synced_param),
            _np(flat.weights),
            _np(flat.exp_avg_sq),
            _Hyper(flat).key("eps"),
            _np(rebuild.to(flat.dtype)),
        )
        lr_sum[torch.from_numpy(on)] = 0
