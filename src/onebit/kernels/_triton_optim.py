"""Triton kernels of the optimizers' updates over flat state (CUDA; CPU in the interpreter).

The same maths as the torch reference in :mod:`onebit.optim.functional`, as the update part
of the triton backend (:class:`TritonUpdates`). Every pass is one launch over all parameters:
a program takes one *block* of at most :data:`BLOCK` elements that never crosses a parameter
(a table of ``(parameter, start, end, parameter start)`` rows, made on the host once per
layout and kept on the device). Gradients are read where they lie, through a table of their
addresses (one launch per gradient dtype; half-precision gradients are widened exactly to
the state dtype). Per-parameter sums are float64 partial sums per block, reduced per
parameter in block order by ``torch.segment_reduce`` on the device; per-parameter scalars
(trust ratios, factors) are decided by the reference's torch functions
(:mod:`onebit.coefficients`) on device vectors. No pass waits for the host; a finite check
is one synchronisation per step.

Rounding: each operation rounds once in the state dtype, with no FMA contraction (the numba
kernels' rounding); the per-parameter constants (``1 - beta``, ``1 / (1 - beta1)``, ``-lr c``)
are rounded as the reference rounds them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from onebit.coefficients import TrustBound, compression_factor, momentum_rebuild, trust_ratio
from onebit.compression import ExchangeResult
from onebit.kernels._triton import _INTERPRETED

# Elements per program. The interpreter runs programs one after another at a cost per
# operation more than per element, so it takes larger ones.
BLOCK = 1 << 14 if _INTERPRETED else 4096
_NUM_WARPS = 8
_TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}

# The per-parameter constants (columns of the table the kernels read; the first eight are
# read by position there), each rounded to the state dtype as the reference rounds it.
_COLUMNS = (
    "b1",
    "1 - b1",
    "b2",
    "1 - b2",
    "eps",
    "weight_decay",
    "lr",
    "1 / (1 - b1)",
    "min_coeff",
    "max_coeff",
    "factor_min",
    "factor_max",
    "factor_threshold",
)
_WIDTH = len(_COLUMNS)
_TABLE_WIDTH = tl.constexpr(_WIDTH)


# ----------------------------------------------------------------------------- elementwise
# (Few nested calls per program: Triton's interpreter pays for each call, not for each element.)
@triton.jit
def _block(rows, hyper, BLOCK: tl.constexpr):
    """This program's parameter, element offsets into the flat buffers, which of them are in
    range, the parameter's first element, and its constants (the first eight of
    :data:`_COLUMNS`)."""
    row = rows + 4 * tl.program_id(0).to(tl.int64)
    segment, start, end = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    offsets = start + tl.arange(0, BLOCK).to(tl.int64)
    at = hyper + segment * _TABLE_WIDTH
    constants = (
        tl.load(at),
        tl.load(at + 1),
        tl.load(at + 2),
        tl.load(at + 3),
        tl.load(at + 4),
        tl.load(at + 5),
        tl.load(at + 6),
        tl.load(at + 7),
    )
    return segment, offsets, offsets < end, tl.load(row + 3), constants


@triton.jit
def _sqrt(x):
    """The correctly rounded square root (``tl.sqrt`` is approximate in float32 on a GPU)."""
    if x.dtype == tl.float32:
        return tl.sqrt_rn(x)
    return tl.sqrt(x)


@triton.jit
def _div(a, b):
    """The correctly rounded quotient (``/`` is approximate in float32 on a GPU)."""
    if a.dtype == tl.float32:
        return tl.div_rn(a, b)
    return a / b


@triton.jit
def _gradient(grads, segment, offsets, in_range, first, GRAD: tl.constexpr, STATE: tl.constexpr):
    """The parameter's gradient at ``offsets`` (read at its own address), in the state dtype."""
    pointer = tl.load(grads + segment).to(tl.pointer_type(GRAD))
    return tl.load(pointer + (offsets - first), mask=in_range, other=0.0).to(STATE)


@triton.jit
def _adam(m, v, p, g, c, MOMENTS: tl.constexpr):
    """With ``MOMENTS``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` first. Returns
    ``m, v, sqrt(v) + eps, m / (sqrt(v) + eps)`` and ``u = m / (sqrt(v) + eps) + wd p``
    (``c``: the parameter's constants)."""
    if MOMENTS:
        m = c[0] * m + c[1] * g
        v = c[2] * v + c[3] * (g * g)
    denom = _sqrt(v) + c[4]
    base = _div(m, denom)
    return m, v, denom, base, base + c[5] * p


@triton.jit
def _sum_of_squares(x, in_range):
    x = tl.where(in_range, x.to(tl.float64), 0.0)
    return tl.sum(x * x, axis=0)


@triton.jit
def _clamped(value, bound):
    """``value`` clamped to ``[-bound, bound]`` (NaN stays NaN, as in ``torch.clamp``)."""
    return tl.where(value > bound, bound, tl.where(value < -bound, -bound, value))


@triton.jit
def _exchanged(
    signs,
    chunk_elements,
    chunk_scales,
    inverse,
    limit,
    segment,
    offsets,
    in_range,
    HAS_LIMIT,
    DECODED,
):
    """The exchanged momentum ``+-(b_c * (1 / s))`` of each element (its bit MSB first in
    ``signs``, ``b_c`` the scale of its chunk of ``chunk_elements`` elements; where
    ``DECODED``, ``+-b_c`` read from ``signs``, a buffer of decoded values), clamped to
    ``+-limit`` where ``HAS_LIMIT``."""
    if DECODED:
        value = tl.load(signs + offsets, mask=in_range, other=0.0) * tl.load(inverse + segment)
    else:
        byte = tl.load(signs + (offsets >> 3), mask=in_range, other=0).to(tl.int32)
        positive = ((byte >> (7 - (offsets & 7)).to(tl.int32)) & 1) != 0
        scale = tl.load(chunk_scales + offsets // chunk_elements, mask=in_range, other=0.0)
        value = scale * tl.load(inverse + segment)
        value = tl.where(positive, value, -value)
    if HAS_LIMIT:
        value = _clamped(value, tl.load(limit + offsets, mask=in_range, other=0.0))
    return value


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _lamb_sums_kernel(
    rows,
    grads,
    m,
    v,
    p,
    hyper,
    partials,
    STORE: tl.constexpr,
    GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per block: ``sum p^2``, ``sum u^2`` and ``sum g`` with the new moments (written back
    where ``STORE``)."""
    segment, offsets, in_range, first, c = _block(rows, hyper, BLOCK)
    g = _gradient(grads, segment, offsets, in_range, first, GRAD, m.dtype.element_ty)
    weights = tl.load(p + offsets, mask=in_range)
    mi, vi, _, _, u = _adam(
        tl.load(m + offsets, mask=in_range),
        tl.load(v + offsets, mask=in_range),
        weights,
        g,
        c,
        True,
    )
    if STORE:
        tl.store(m + offsets, mi, mask=in_range)
        tl.store(v + offsets, vi, mask=in_range)
    out = partials + 3 * tl.program_id(0).to(tl.int64)
    tl.store(out, _sum_of_squares(weights, in_range))
    tl.store(out + 1, _sum_of_squares(u, in_range))
    tl.store(out + 2, tl.sum(tl.where(in_range, g.to(tl.float64), 0.0), axis=0))


@triton.jit
def _adam_apply_kernel(
    rows,
    grads,
    m,
    v,
    p,
    hyper,
    steps,
    STORED: tl.constexpr,
    GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``m, v <- moments(g)`` (read back where ``STORED``); ``p += steps[t] * u``."""
    segment, offsets, in_range, first, c = _block(rows, hyper, BLOCK)
    weights = tl.load(p + offsets, mask=in_range)
    g = weights  # (not read where the moments are stored)
    if not STORED:
        g = _gradient(grads, segment, offsets, in_range, first, GRAD, m.dtype.element_ty)
    mi, vi, _, _, u = _adam(
        tl.load(m + offsets, mask=in_range),
        tl.load(v + offsets, mask=in_range),
        weights,
        g,
        c,
        not STORED,
    )
    if not STORED:
        tl.store(m + offsets, mi, mask=in_range)
        tl.store(v + offsets, vi, mask=in_range)
    tl.store(p + offsets, weights + tl.load(steps + segment) * u, mask=in_range)


@triton.jit
def _gradient_sum_kernel(rows, grads, hyper, partials, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    segment, offsets, in_range, first, _ = _block(rows, hyper, BLOCK)
    g = _gradient(grads, segment, offsets, in_range, first, GRAD, tl.float64)
    tl.store(partials + tl.program_id(0), tl.sum(tl.where(in_range, g, 0.0), axis=0))


@triton.jit
def _momentum_kernel(rows, grads, m, hyper, scaling, out, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """``out = s_t (b1 m + (1 - b1) g)``."""
    segment, offsets, in_range, first, c = _block(rows, hyper, BLOCK)
    g = _gradient(grads, segment, offsets, in_range, first, GRAD, m.dtype.element_ty)
    momentum = c[0] * tl.load(m + offsets, mask=in_range) + c[1] * g
    tl.store(out + offsets, tl.load(scaling + segment) * momentum, mask=in_range)


@triton.jit
def _momentum_step_kernel(rows, grads, m, v, p, hyper, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """``m = b1 m + (1 - b1) g``; ``p += -lr u`` (``v`` unchanged)."""
    segment, offsets, in_range, first, c = _block(rows, hyper, BLOCK)
    g = _gradient(grads, segment, offsets, in_range, first, GRAD, m.dtype.element_ty)
    mi = c[0] * tl.load(m + offsets, mask=in_range) + c[1] * g
    _frozen_adam_update(mi, m, v, p, c, offsets, in_range)


@triton.jit
def _onebit_lamb_a_kernel(
    rows,
    signs,
    chunk_elements,
    chunk_scales,
    inverse,
    limit,
    m,
    v,
    fresh,
    p,
    hyper,
    partials,
    HAS_LIMIT: tl.constexpr,
    DECODED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Decode the momentum (:func:`_exchanged`), refresh ``v_fresh``, ``m = m_new``; per
    block ``sum u0^2``, ``sum u^2`` and the largest ``d / (sqrt(v_fresh) + eps)``."""
    segment, offsets, in_range, _, c = _block(rows, hyper, BLOCK)
    new = _exchanged(
        signs,
        chunk_elements,
        chunk_scales,
        inverse,
        limit,
        segment,
        offsets,
        in_range,
        HAS_LIMIT,
        DECODED,
    )
    grad = (new - c[0] * tl.load(m + offsets, mask=in_range)) * c[7]
    f = c[2] * tl.load(fresh + offsets, mask=in_range) + c[3] * (grad * grad)
    tl.store(fresh + offsets, f, mask=in_range)
    tl.store(m + offsets, new, mask=in_range)
    weights = tl.load(p + offsets, mask=in_range)
    _, _, denom, base, full = _adam(
        new, tl.load(v + offsets, mask=in_range), weights, new, c, False
    )
    ratio = _div(denom, _sqrt(f) + c[4])
    out = partials + 3 * tl.program_id(0).to(tl.int64)
    tl.store(out, _sum_of_squares(base, in_range))
    tl.store(out + 1, _sum_of_squares(full, in_range))
    tl.store(out + 2, tl.max(tl.where(in_range, ratio.to(tl.float64), -float("inf")), axis=0))


@triton.jit
def _apply_step_kernel(rows, m, v, p, hyper, steps, BLOCK: tl.constexpr):
    """``p += steps[t] (m / (sqrt(v) + eps) + wd p)``."""
    segment, offsets, in_range, _, c = _block(rows, hyper, BLOCK)
    weights = tl.load(p + offsets, mask=in_range)
    mi = tl.load(m + offsets, mask=in_range)
    _, _, _, _, u = _adam(mi, tl.load(v + offsets, mask=in_range), weights, mi, c, False)
    tl.store(p + offsets, weights + tl.load(steps + segment) * u, mask=in_range)


@triton.jit
def _frozen_adam_update(new, m, v, p, c, offsets, in_range):
    """``m = new``; ``p += -lr (m / (sqrt(v) + eps) + wd p)``."""
    tl.store(m + offsets, new, mask=in_range)
    weights = tl.load(p + offsets, mask=in_range)
    _, _, _, _, u = _adam(new, tl.load(v + offsets, mask=in_range), weights, new, c, False)
    tl.store(p + offsets, weights + -c[6] * u, mask=in_range)


@triton.jit
def _decoded_adam_kernel(
    rows,
    signs,
    chunk_elements,
    chunk_scales,
    inverse,
    limit,
    m,
    v,
    p,
    hyper,
    HAS_LIMIT: tl.constexpr,
    DECODED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The frozen-variance Adam update with the momentum decoded (:func:`_exchanged`)."""
    segment, offsets, in_range, _, c = _block(rows, hyper, BLOCK)
    new = _exchanged(
        signs,
        chunk_elements,
        chunk_scales,
        inverse,
        limit,
        segment,
        offsets,
        in_range,
        HAS_LIMIT,
        DECODED,
    )
    _frozen_adam_update(new, m, v, p, c, offsets, in_range)


@triton.jit
def _frozen_adam_kernel(
    rows, exchanged, limit, m, v, p, hyper, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr
):
    """The frozen-variance Adam update with the decoded momentum ``exchanged``, clamped to
    ``+-limit``."""
    _, offsets, in_range, _, c = _block(rows, hyper, BLOCK)
    new = tl.load(exchanged + offsets, mask=in_range)
    if HAS_LIMIT:
        new = _clamped(new, tl.load(limit + offsets, mask=in_range, other=0.0))
    _frozen_adam_update(new, m, v, p, c, offsets, in_range)


@triton.jit
def _accumulated_kernel(rows, p, synced, v, hyper, out, BLOCK: tl.constexpr):
    """``out = (p - p_synced) (sqrt(v) + eps)``."""
    _, offsets, in_range, _, c = _block(rows, hyper, BLOCK)
    delta = tl.load(p + offsets, mask=in_range) - tl.load(synced + offsets, mask=in_range)
    tl.store(out + offsets, delta * (_sqrt(tl.load(v + offsets, mask=in_range)) + c[4]), in_range)


@triton.jit
def _synchronised_kernel(rows, exchanged, m, synced, p, v, hyper, rebuild, BLOCK: tl.constexpr):
    """``m = exchanged * rebuild_t``; ``p_synced += exchanged / (sqrt(v) + eps)``;
    ``p = p_synced``."""
    segment, offsets, in_range, _, c = _block(rows, hyper, BLOCK)
    delta = tl.load(exchanged + offsets, mask=in_range)
    tl.store(m + offsets, delta * tl.load(rebuild + segment), mask=in_range)
    denom = _sqrt(tl.load(v + offsets, mask=in_range)) + c[4]
    weights = tl.load(synced + offsets, mask=in_range) + _div(delta, denom)
    tl.store(synced + offsets, weights, mask=in_range)
    tl.store(p + offsets, weights, mask=in_range)


@triton.jit
def _predict_kernel(
    rows,
    shared,
    momentum,
    limit,
    v,
    out,
    hyper,
    inverse,
    steps,
    HAS_LIMIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The delayed exchange's prediction: ``u = clamp(momentum / s, -limit, limit) / (sqrt(v)
    + eps) + wd shared``; ``out = shared + steps[t] u`` where ``steps[t] u`` is finite, else
    ``out = shared``."""
    segment, offsets, in_range, _, c = _block(rows, hyper, BLOCK)
    weights = tl.load(shared + offsets, mask=in_range)
    moved = tl.load(momentum + offsets, mask=in_range) * tl.load(inverse + segment)
    if HAS_LIMIT:
        moved = _clamped(moved, tl.load(limit + offsets, mask=in_range, other=0.0))
    _, _, _, _, u = _adam(moved, tl.load(v + offsets, mask=in_range), weights, moved, c, False)
    move = tl.load(steps + segment) * u
    finite = tl.abs(move) < float("inf")
    tl.store(out + offsets, tl.where(finite, weights + move, weights), mask=in_range)


def _launch(kernel, table: _Table, *args, **constants) -> None:
    if table.blocks:
        with torch.cuda.device(table.rows.get_device()):
            kernel[(table.blocks,)](
                table.rows,
                *args,
                **constants,
                BLOCK=BLOCK,
                num_warps=_NUM_WARPS,
                enable_fp_fusion=False,
            )


# ----------------------------------------------------------------------------- block tables
class _Table:
    """The blocks of some parameters, on the device: ``rows`` (``[B, 4]`` int64: parameter,
    start, end, the parameter's first element), the parameters in order (``segments``) and
    how many blocks each has (``lengths``)."""

    def __init__(self, offsets: np.ndarray, segments: Sequence[int], device: torch.device):
        rows, lengths = [], []
        for segment in segments:
            start, end = int(offsets[segment]), int(offsets[segment + 1])
            cuts = range(start, end, BLOCK)
            rows.extend((segment, s, min(s + BLOCK, end), start) for s in cuts)
            lengths.append(len(cuts))
        self.blocks = len(rows)
        self.rows = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).to(device)
        self.segments = torch.tensor(list(segments), dtype=torch.int64, device=device)
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device)

    def per_segment(self, partials: Tensor, reduce: str) -> Tensor:
        """Per-block partials ``[B, k]`` reduced per parameter in block order: ``[S, k]``."""
        return torch.segment_reduce(partials, reduce, lengths=self.lengths, axis=0)


@functools.lru_cache(maxsize=256)
def _cached_table(offsets: bytes, segments: tuple[int, ...], device: str, block: int) -> _Table:
    """(``block``, the :data:`BLOCK` the table is cut by, keys the cache only.)"""
    return _Table(np.frombuffer(offsets, dtype=np.int64), segments, torch.device(device))


def _table(flat: Any, segments: Sequence[int]) -> _Table:
    return _cached_table(flat.offsets.tobytes(), tuple(segments), str(flat.device), BLOCK)


def _active_segments(active: Sequence[bool]) -> list[int]:
    return [index for index, is_active in enumerate(active) if is_active]


# ----------------------------------------------------------------------------- host helpers
def _upload(values: np.ndarray, device: torch.device) -> Tensor:
    """A small host array on the device, without waiting for the device."""
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


class _Constants:
    """The per-parameter constants of :data:`_COLUMNS` as one ``[S, W]`` device table in the
    state dtype (one upload per step), rounded as the reference rounds them: ``1 - beta`` in
    double precision, then once to the state dtype; ``1 / (1 - b1)`` in the state dtype."""

    def __init__(self, flat: Any) -> None:
        real = np.float64 if flat.dtype == torch.float64 else np.float32
        values = np.empty((len(flat.groups), _WIDTH), dtype=real)
        for index, group in enumerate(flat.groups):
            beta1, beta2 = group["betas"]
            values[index, :8] = (
                beta1,
                1 - beta1,
                beta2,
                1 - beta2,
                group["eps"],
                group["weight_decay"],
                group["lr"],
                flat.reciprocal(1 - beta1),
            )
            values[index, 8:] = [group.get(name, 0.0) for name in _COLUMNS[8:]]
        self.table = _upload(values, flat.device)

    def __getitem__(self, name: str) -> Tensor:
        """One constant of every parameter, a device vector."""
        return self.table[:, _COLUMNS.index(name)]


def _by_grad_dtype(
    flat: Any, grads: Sequence[Tensor | None], segments: Sequence[int]
) -> list[tuple[Any, _Table, Tensor, list[Tensor]]]:
    """Per gradient dtype among ``segments``: its Triton dtype, its parameters' blocks, the
    device table of the gradients' addresses (one entry per parameter, 0 for the others) and
    the flat gradients (kept alive while the launches are queued)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    addresses = np.zeros(len(flat.params), dtype=np.int64)
    kept = []
    for segment in segments:
        if grads[segment] is None:
            raise ValueError(f"parameter {segment} takes part in the step but has no gradient")
        kept.append(grads[segment].reshape(-1))
        addresses[segment] = kept[-1].data_ptr()
        by_dtype.setdefault(kept[-1].dtype, []).append(segment)
    table = _upload(addresses, flat.device)
    return [
        (_TL_DTYPES[dtype], _table(flat, members), table, kept)
        for dtype, members in by_dtype.items()
    ]


def _scatter(values: Tensor, table: _Table, size: int, fill: float) -> Tensor:
    """Per-parameter results of ``table``'s parameters into a vector of ``size``."""
    full = torch.full((size,) + values.shape[1:], fill, dtype=values.dtype, device=values.device)
    full[table.segments] = values
    return full


def _taking_part(table: _Table, size: int) -> Tensor:
    """A bool device vector of ``size``: True for ``table``'s parameters."""
    on = torch.zeros(size, dtype=torch.bool, device=table.rows.device)
    on[table.segments] = True
    return on


def _exchange_inputs(
    flat: Any, packed: ExchangeResult, scaling: Tensor, scratch: Tensor
) -> dict[str, Any]:
    """The decoding arguments of an exchange result: its signs, the elements per chunk and
    the chunks' scales in the state dtype where its runs are chunks of one size in element
    order (:attr:`~onebit.compression.SignRuns.chunk_elements`); otherwise the result decoded
    into ``scratch`` first (``DECODED``); and ``1 / s`` per parameter."""
    runs = packed.sign_runs()
    inverse = scaling.reciprocal().contiguous()
    chunk = runs.chunk_elements
    if chunk is None:
        decoded = packed.decode(scratch)
        signs, scales = decoded, decoded  # the scales unused
    else:
        signs, scales = runs.signs, runs.scales.to(flat.dtype).contiguous()
    return {
        "signs": signs,
        "chunk_elements": chunk or 1,
        "chunk_scales": scales,
        "inverse": inverse,
        "DECODED": chunk is None,
    }


def _limit_input(flat: Any, limit: Tensor | None) -> dict[str, Any]:
    """The limit arguments: the limit (any tensor where there is none) and whether to use it."""
    return {"limit": flat.exp_avg if limit is None else limit, "HAS_LIMIT": limit is not None}


def _apply_adam(flat: Any, launches: list, constants: _Constants, steps: Tensor, stored: bool):
    """``p += steps[t] u`` with the moments from the gradients (``launches``: what
    :func:`_by_grad_dtype` gave), or read back where the first pass ``stored`` them."""
    for grad_dtype, table, addresses, _ in launches:
        state = (flat.exp_avg, flat.exp_avg_sq, flat.weights, constants.table)
        _launch(_adam_apply_kernel, table, addresses, *state, steps, STORED=stored, GRAD=grad_dtype)


def _partials(table: _Table, columns: int) -> Tensor:
    return torch.empty((table.blocks, columns), dtype=torch.float64, device=table.rows.device)


# ----------------------------------------------------------------------------- entry points
class TritonUpdates:
    """The update part of the triton backend: the methods of
    :class:`onebit.kernels.UpdateKernels`, one launch per pass over memory (per gradient
    dtype where gradients are read)."""

    def lamb_step_(
        self, flat: Any, grads: Sequence[Tensor | None], active: Sequence[bool], check_finite: bool
    ) -> tuple[Tensor, Tensor] | None:
        segments, constants = _active_segments(active), _Constants(flat)
        # Without a finite check the first pass writes the moments and the second reads them
        # back; with one, nothing is written before the check.
        store = not check_finite
        launches = _by_grad_dtype(flat, grads, segments)
        sums = torch.zeros((len(flat.params), 3), dtype=torch.float64, device=flat.device)
        for grad_dtype, table, addresses, _ in launches:
            partials = _partials(table, 3)
            state = (flat.exp_avg, flat.exp_avg_sq, flat.weights, constants.table)
            _launch(
                _lamb_sums_kernel, table, addresses, *state, partials, STORE=store, GRAD=grad_dtype
            )
            sums[table.segments] = table.per_segment(partials, "sum")
        if check_finite and not bool(torch.isfinite(sums[:, 2].sum())):
            return None
        coeff, defined = trust_ratio(
            sums[:, 0].sqrt().to(flat.dtype),
            sums[:, 1].sqrt().to(flat.dtype),
            constants["min_coeff"],
            constants["max_coeff"],
        )
        _apply_adam(flat, launches, constants, -constants["lr"] * coeff, stored=store)
        on = _taking_part(_table(flat, segments), len(active))
        return torch.where(on, coeff, 1), defined & on

    def adam_step_(
        self, flat: Any, grads: Sequence[Tensor | None], active: Sequence[bool], check_finite: bool
    ) -> bool:
        constants = _Constants(flat)
        launches = _by_grad_dtype(flat, grads, _active_segments(active))
        if check_finite:
            total = torch.zeros((), dtype=torch.float64, device=flat.device)
            for grad_dtype, table, addresses, _ in launches:
                partials = _partials(table, 1)
                _launch(
                    _gradient_sum_kernel,
                    table,
                    addresses,
                    constants.table,
                    partials,
                    GRAD=grad_dtype,
                )
                total += partials.sum()
            if not bool(torch.isfinite(total)):
                return False
        _apply_adam(flat, launches, constants, -constants["lr"], stored=False)
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
        selected = range(len(active)) if only is None else only
        segments = [index for index in selected if active[index]]
        constants, scaling = _Constants(flat), scaling.to(flat.dtype).contiguous()
        for grad_dtype, table, addresses, _ in _by_grad_dtype(flat, grads, segments):
            state = (flat.exp_avg, constants.table, scaling, out)
            _launch(_momentum_kernel, table, addresses, *state, GRAD=grad_dtype)
        inactive = [flat.view(out, index) for index in selected if not active[index]]
        if inactive:
            torch._foreach_zero_(inactive)

    def adam_momentum_step_(
        self, flat: Any, grads: Sequence[Tensor], active: Sequence[bool]
    ) -> None:
        constants = _Constants(flat)
        for grad_dtype, table, addresses, _ in _by_grad_dtype(
            flat, grads, _active_segments(active)
        ):
            state = (flat.exp_avg, flat.exp_avg_sq, flat.weights, constants.table)
            _launch(_momentum_step_kernel, table, addresses, *state, GRAD=grad_dtype)

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
        """The momentum is decoded on the fly, or into ``scratch`` first
        (:func:`_exchange_inputs`)."""
        table, constants = _table(flat, _active_segments(active)), _Constants(flat)
        partials = _partials(table, 3)
        _launch(
            _onebit_lamb_a_kernel,
            table,
            **_exchange_inputs(flat, packed, scaling, scratch),
            m=flat.exp_avg,
            v=flat.exp_avg_sq,
            fresh=flat.exp_avg_sq_fresh,
            p=flat.weights,
            hyper=constants.table,
            partials=partials,
            **_limit_input(flat, limit),
        )
        size = len(flat.params)
        sums = _scatter(table.per_segment(partials[:, :2], "sum"), table, size, 0.0)
        maxima = _scatter(table.per_segment(partials[:, 2], "max"), table, size, -np.inf)
        full_norm = sums[:, 1].sqrt().to(flat.dtype)
        factor = compression_factor(
            maxima.to(flat.dtype),
            sums[:, 0].sqrt().to(flat.dtype),
            full_norm,
            last_factor,
            constants["factor_min"],
            constants["factor_max"],
            constants["factor_threshold"],
        )
        factor = torch.where(_taking_part(table, size), factor, last_factor)
        steps = -constants["lr"] * lamb_coeff_freeze * factor  # the reference's order
        coefficient = lamb_coeff_freeze * factor
        if trust is not None:
            steps, coefficient = trust.apply(steps, coefficient, constants["lr"], full_norm)
        state = (flat.exp_avg, flat.exp_avg_sq, flat.weights, constants.table)
        _launch(_apply_step_kernel, table, *state, steps)
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
        """The momentum is decoded on the fly, or into ``scratch`` first
        (:func:`_exchange_inputs`)."""
        _launch(
            _decoded_adam_kernel,
            _table(flat, _active_segments(active)),
            **_exchange_inputs(flat, packed, scaling, scratch),
            m=flat.exp_avg,
            v=flat.exp_avg_sq,
            p=flat.weights,
            hyper=_Constants(flat).table,
            **_limit_input(flat, limit),
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
        _launch(
            _frozen_adam_kernel,
            _table(flat, _active_segments(active)),
            exchanged=exchanged,
            m=flat.exp_avg,
            v=flat.exp_avg_sq,
            p=flat.weights,
            hyper=_Constants(flat).table,
            **_limit_input(flat, limit),
        )

    def accumulated_update(self, flat: Any, active: Sequence[bool], out: Tensor) -> Tensor:
        state = (flat.weights, flat.synced_param, flat.exp_avg_sq, _Constants(flat).table)
        _launch(_accumulated_kernel, _table(flat, _active_segments(active)), *state, out)
        others = [flat.view(out, index) for index, on in enumerate(active) if not on]
        if others:
            torch._foreach_zero_(others)
        out[flat.numel :].zero_()
        return out

    def synchronised_update_(
        self, flat: Any, exchanged: Tensor, active: Sequence[bool], lr_sum: Tensor
    ) -> None:
        """(``exchanged`` is left as it is.)"""
        table = _table(flat, _active_segments(active))
        rebuild = momentum_rebuild(lr_sum)
        _launch(
            _synchronised_kernel,
            table,
            exchanged,
            flat.exp_avg,
            flat.synced_param,
            flat.weights,
            flat.exp_avg_sq,
            _Constants(flat).table,
            rebuild.to(flat.dtype).contiguous(),
        )
        lr_sum[table.segments] = 0

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
        """In one pass over memory (``out = shared`` for the parameters not active)."""
        constants = _Constants(flat)
        steps = -constants["lr"]
        if coefficients is not None:
            steps = steps * coefficients.to(flat.dtype)
        _launch(
            _predict_kernel,
            _table(flat, _active_segments(active)),
            shared=shared,
            momentum=momentum,
            v=flat.exp_avg_sq,
            out=out,
            hyper=constants.table,
            inverse=scaling.reciprocal().contiguous(),
            steps=steps.contiguous(),
            **_limit_input(flat, limit),
        )
        for index, on in enumerate(active):
            if not on:
                flat.view(out, index).copy_(flat.view(shared, index))
