"""numba kernels of the optimizers' updates over flat state (CPU, float32 and float64).

The same maths as the torch reference in :mod:`onebit.optim.functional`, in one or two
passes over memory per step. Work is split into the blocks of
:attr:`~onebit.optim._flat.FlatState.blocks` (a block never crosses a parameter), partial
sums are kept per block in float64 and added per parameter in block order, so results do
not depend on the number of threads. Per-parameter scalars (trust ratios, factors) are
decided by the same torch functions as the reference, on vectors of one entry per parameter.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from onebit.kernels._numba import Compiled
from onebit.optim._flat import FlatState
from onebit.optim.functional import compression_factor, trust_ratio

_SUM_FLAGS = {"reassoc", "contract"}
CHUNK = 1 << 10  # elements whose ratios are kept in scratch at a time


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


@njit(inline="always", error_model="numpy", cache=True)
def _decode_momentum(exchanged, scale, mask, i):
    """``m = exchanged / s``, times the mask where one is given (``mask.size > 0``)."""
    new = exchanged / scale
    return new * mask[i] if mask.size else new


# ----------------------------------------------------------------------------- blocks
@njit(fastmath=_SUM_FLAGS, error_model="numpy", cache=True)
def _lamb_block_sums(g, m, v, p, b1, omb1, b2, omb2, eps, wd):
    sum_p, sum_u, sum_g = 0.0, 0.0, 0.0
    for i in range(g.size):
        mi, vi = _moments(m[i], v[i], g[i], b1, omb1, b2, omb2)
        _, u, _ = _direction(mi, vi, p[i], eps, wd)
        sum_p += np.float64(p[i]) * np.float64(p[i])
        sum_u += np.float64(u) * np.float64(u)
        sum_g += np.float64(g[i])
    return sum_p, sum_u, sum_g


@njit(error_model="numpy", cache=True)
def _adam_block_apply(g, m, v, p, b1, omb1, b2, omb2, eps, wd, step):
    """Moments from ``g``, then ``p += step * u`` (``step = -lr c`` for LAMB, ``-lr`` for Adam)."""
    for i in range(g.size):
        mi, vi = _moments(m[i], v[i], g[i], b1, omb1, b2, omb2)
        _, u, _ = _direction(mi, vi, p[i], eps, wd)
        m[i] = mi
        v[i] = vi
        p[i] += step * u


@njit(fastmath=_SUM_FLAGS, error_model="numpy", cache=True)
def _block_sum(x):
    total = 0.0
    for i in range(x.size):
        total += np.float64(x[i])
    return total


@njit(error_model="numpy", cache=True)
def _momentum_block(m, g, b1, omb1, scale, out):
    for i in range(m.size):
        out[i] = scale * (b1 * m[i] + omb1 * g[i])


@njit(inline="always", error_model="numpy", cache=True)
def _fresh_variance(new, m, fresh, b1, omb1, b2, omb2):
    """``g = (m_new - b1 m) / (1 - b1)``; returns ``b2 v_fresh + (1 - b2) g^2``."""
    grad = (new - b1 * m) / omb1
    return b2 * fresh + omb2 * (grad * grad)


@njit(fastmath=_SUM_FLAGS, error_model="numpy", cache=True)
def _onebit_lamb_chunk_a(
    exchanged, mask, m, v, fresh, p, scale, b1, omb1, b2, omb2, eps, wd, ratio
):
    """Decode the momentum and refresh ``v_fresh``; returns the sums of ``u0^2`` and ``u^2``
    and writes ``d / (sqrt(v_fresh) + eps)`` into ``ratio``."""
    sum_base, sum_full = 0.0, 0.0
    for i in range(m.size):
        new = _decode_momentum(exchanged[i], scale, mask, i)
        f = _fresh_variance(new, m[i], fresh[i], b1, omb1, b2, omb2)
        fresh[i] = f
        m[i] = new
        base, full, denom = _direction(new, v[i], p[i], eps, wd)
        sum_base += np.float64(base) * np.float64(base)
        sum_full += np.float64(full) * np.float64(full)
        ratio[i] = denom / (np.sqrt(f) + eps)
    return sum_base, sum_full


@njit(error_model="numpy", cache=True)
def _max_bits(bits):
    """The largest bit pattern: for non-negative floats viewed as integers, the largest
    value (NaN above every number), as an integer maximum that vectorises."""
    best = bits[0]
    for i in range(1, bits.size):
        value = bits[i]
        best = value if value > best else best
    return best


@njit(error_model="numpy", cache=True)
def _onebit_lamb_block_a(
    exchanged, mask, m, v, fresh, p, scale, b1, omb1, b2, omb2, eps, wd, bits_like
):
    """:func:`_onebit_lamb_chunk_a` chunk by chunk; returns the two sums and the maximum
    ratio (non-negative, so its maximum is taken on its bit pattern)."""
    ratio = np.empty(min(CHUNK, m.size), m.dtype)
    bits = ratio.view(bits_like.dtype)
    sum_base, sum_full, best = 0.0, 0.0, bits_like.dtype.type(0)
    for c in range(0, m.size, CHUNK):
        e = min(c + CHUNK, m.size)
        base, full = _onebit_lamb_chunk_a(
            exchanged[c:e],
            mask[c:e] if mask.size else mask,
            m[c:e],
            v[c:e],
            fresh[c:e],
            p[c:e],
            scale,
            b1,
            omb1,
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


@njit(error_model="numpy", cache=True)
def _step_block(m, v, p, eps, wd, step):
    """``p += step * (m / (sqrt(v) + eps) + wd p)``."""
    for i in range(m.size):
        _, u, _ = _direction(m[i], v[i], p[i], eps, wd)
        p[i] += step * u


@njit(error_model="numpy", cache=True)
def _onebit_adam_block(exchanged, mask, m, v, p, scale, eps, wd, step):
    for i in range(m.size):
        new = _decode_momentum(exchanged[i], scale, mask, i)
        m[i] = new
        _, u, _ = _direction(new, v[i], p[i], eps, wd)
        p[i] += step * u


# ----------------------------------------------------------------------------- drivers
def lamb_sums(blocks, active, g, m, v, p, b1, omb1, b2, omb2, eps, wd):
    out = np.zeros((blocks.shape[0], 3), np.float64)
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            out[b, 0], out[b, 1], out[b, 2] = _lamb_block_sums(
                g[s:e],
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


def adam_apply(blocks, active, g, m, v, p, b1, omb1, b2, omb2, eps, wd, step):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _adam_block_apply(
                g[s:e],
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


def grad_sums(blocks, active, g):
    out = np.zeros(blocks.shape[0], np.float64)
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            out[b] = _block_sum(g[s:e])
    return out


def momentum(blocks, active, m, g, b1, omb1, scale, out):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _momentum_block(m[s:e], g[s:e], b1[seg], omb1[seg], scale[seg], out[s:e])
        else:
            out[s:e] = 0


def onebit_lamb_a(
    blocks, active, exchanged, mask, m, v, fresh, p, scale, b1, omb1, b2, omb2, eps, wd, bits_like
):
    out = np.zeros((blocks.shape[0], 3), np.float64)
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            out[b, 0], out[b, 1], out[b, 2] = _onebit_lamb_block_a(
                exchanged[s:e],
                mask[s:e] if mask.size else mask,
                m[s:e],
                v[s:e],
                fresh[s:e],
                p[s:e],
                scale[seg],
                b1[seg],
                omb1[seg],
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


def onebit_adam(blocks, active, exchanged, mask, m, v, p, scale, eps, wd, step):
    for b in prange(blocks.shape[0]):
        seg, s, e = blocks[b, 0], blocks[b, 1], blocks[b, 2]
        if active[seg]:
            _onebit_adam_block(
                exchanged[s:e],
                mask[s:e] if mask.size else mask,
                m[s:e],
                v[s:e],
                p[s:e],
                scale[seg],
                eps[seg],
                wd[seg],
                step[seg],
            )


_KERNELS = Compiled(
    sys.modules[__name__],
    (
        "lamb_sums",
        "adam_apply",
        "grad_sums",
        "momentum",
        "onebit_lamb_a",
        "apply_step",
        "onebit_adam",
    ),
)


# ----------------------------------------------------------------------------- entry points
class _Hyper:
    """The groups' hyper-parameters as per-parameter numpy vectors in the state dtype."""

    def __init__(self, flat: FlatState) -> None:
        self._flat = flat
        self.dtype = np.float64 if flat.dtype == torch.float64 else np.float32

    def __call__(self, value_of) -> np.ndarray:
        return np.array([value_of(group) for group in self._flat.groups], dtype=self.dtype)

    def key(self, name: str) -> np.ndarray:
        return self(lambda group: group[name])

    def betas(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        b1, b2 = self(lambda g: g["betas"][0]), self(lambda g: g["betas"][1])
        one = self.dtype(1)
        return b1, one - b1, b2, one - b2


def _np(tensor: Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def _tensor(flat: FlatState, values: np.ndarray) -> Tensor:
    """A per-parameter numpy vector as a CPU tensor of the state dtype."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(flat.dtype)


def _active(active: Sequence[bool]) -> np.ndarray:
    return np.asarray(active, dtype=np.bool_)


def _per_segment(flat: FlatState, partials: np.ndarray) -> np.ndarray:
    """Per-block partial sums added per parameter, in block order."""
    totals = np.zeros((len(flat.params),) + partials.shape[1:], np.float64)
    np.add.at(totals, flat.blocks[:, 0], partials)
    return totals


def _segment_max(flat: FlatState, partials: np.ndarray) -> np.ndarray:
    """Per-block maxima reduced per parameter."""
    maxima = np.full(len(flat.params), -np.inf)
    np.maximum.at(maxima, flat.blocks[:, 0], partials)
    return maxima


def lamb_step_(flat: FlatState, active: Sequence[bool], check_finite: bool):
    hyper, mask = _Hyper(flat), _active(active)
    b1, omb1, b2, omb2 = hyper.betas()
    args = (_np(flat.grad), _np(flat.exp_avg), _np(flat.exp_avg_sq), _np(flat.weights))
    consts = (b1, omb1, b2, omb2, hyper.key("eps"), hyper.key("weight_decay"))
    sums = _per_segment(flat, _KERNELS("lamb_sums")(flat.blocks, mask, *args, *consts))
    if check_finite and not np.isfinite(sums[mask, 2].sum()):
        return None
    coeff, defined = trust_ratio(
        _tensor(flat, np.sqrt(sums[:, 0])),
        _tensor(flat, np.sqrt(sums[:, 1])),
        _tensor(flat, hyper.key("min_coeff")),
        _tensor(flat, hyper.key("max_coeff")),
    )
    step = -hyper.key("lr") * _np(coeff)
    _KERNELS("adam_apply")(flat.blocks, mask, *args, *consts, step.astype(hyper.dtype))
    return coeff, defined


def adam_step_(flat: FlatState, active: Sequence[bool], check_finite: bool) -> bool:
    hyper, mask = _Hyper(flat), _active(active)
    if check_finite:
        sums = _KERNELS("grad_sums")(flat.blocks, mask, _np(flat.grad))
        if not np.isfinite(sums.sum()):
            return False
    args = (_np(flat.grad), _np(flat.exp_avg), _np(flat.exp_avg_sq), _np(flat.weights))
    consts = (*hyper.betas(), hyper.key("eps"), hyper.key("weight_decay"))
    _KERNELS("adam_apply")(flat.blocks, mask, *args, *consts, -hyper.key("lr"))
    return True


def scaled_momentum(flat: FlatState, scaling: Tensor, out: Tensor, active: Sequence[bool]) -> None:
    hyper = _Hyper(flat)
    b1, omb1, _, _ = hyper.betas()
    _KERNELS("momentum")(
        flat.blocks,
        _active(active),
        _np(flat.exp_avg),
        _np(flat.grad),
        b1,
        omb1,
        _np(scaling.to(flat.dtype)),
        _np(out),
    )


def _mask_array(flat: FlatState, mask: Tensor | None) -> np.ndarray:
    return np.zeros(0, dtype=_Hyper(flat).dtype) if mask is None else _np(mask)


def onebit_lamb_compressed_step_(
    flat: FlatState,
    exchanged: Tensor,
    scaling: Tensor,
    mask: Tensor | None,
    active: Sequence[bool],
    lamb_coeff_freeze: Tensor,
    last_factor: Tensor,
) -> Tensor:
    hyper, on = _Hyper(flat), _active(active)
    b1, omb1, b2, omb2 = hyper.betas()
    eps, wd = hyper.key("eps"), hyper.key("weight_decay")
    m, v, p = _np(flat.exp_avg), _np(flat.exp_avg_sq), _np(flat.weights)
    partials = _KERNELS("onebit_lamb_a")(
        flat.blocks,
        on,
        _np(exchanged),
        _mask_array(flat, mask),
        m,
        v,
        _np(flat.exp_avg_sq_fresh),
        p,
        _np(scaling.to(flat.dtype)),
        b1,
        omb1,
        b2,
        omb2,
        eps,
        wd,
        np.zeros(0, np.int64 if flat.dtype == torch.float64 else np.int32),
    )
    sums = _per_segment(flat, partials[:, :2])
    factor = compression_factor(
        _tensor(flat, _segment_max(flat, partials[:, 2])),
        _tensor(flat, np.sqrt(sums[:, 0])),
        _tensor(flat, np.sqrt(sums[:, 1])),
        last_factor,
        _tensor(flat, hyper.key("factor_min")),
        _tensor(flat, hyper.key("factor_max")),
        _tensor(flat, hyper.key("factor_threshold")),
    )
    factor = torch.where(torch.from_numpy(on), factor, last_factor)
    step = (-hyper.key("lr") * _np(lamb_coeff_freeze * factor)).astype(hyper.dtype)
    _KERNELS("apply_step")(flat.blocks, on, m, v, p, eps, wd, step)
    return factor


def onebit_adam_compressed_step_(
    flat: FlatState,
    exchanged: Tensor,
    scaling: Tensor,
    mask: Tensor | None,
    active: Sequence[bool],
) -> None:
    hyper = _Hyper(flat)
    _KERNELS("onebit_adam")(
        flat.blocks,
        _active(active),
        _np(exchanged),
        _mask_array(flat, mask),
        _np(flat.exp_avg),
        _np(flat.exp_avg_sq),
        _np(flat.weights),
        _np(scaling.to(flat.dtype)),
        hyper.key("eps"),
        hyper.key("weight_decay"),
        -hyper.key("lr"),
    )
