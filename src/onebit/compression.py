"""Pure tensor maths of 1-bit compression with error feedback.

Everything here is local to one process: signs, bit packing, scales, the error-feedback
compression step, the padding of the per-tensor exchange and the layout of a buffer in
segments compressed alone (:class:`Layout`, which the kernels read too). The exchange itself
(:mod:`onebit.exchange`) is built from these pieces through the backends' kernels; the
single-process models it is tested against live with the tests (``tests/helpers/oracle.py``).

Conventions (ALGORITHM.md):

* ``sign(x) = +1`` for ``x >= 0`` (so ``sign(0) = sign(-0.0) = +1``) and ``-1`` otherwise.
* Bits are packed eight to a byte, most significant bit first (``numpy.packbits`` order):
  element ``8k + j`` is bit ``7 - j`` of byte ``k``; a set bit means ``+1``.
* The scale of a buffer ``x`` with ``N`` elements is ``||x||_2 / sqrt(N)``, so that
  ``scale(x) * sign(x)`` has the same Euclidean norm as ``x``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "sign_bits",
    "signs",
    "pack_signs",
    "unpack_signs",
    "scale",
    "scale_dtype",
    "update_error",
    "server_average",
    "per_tensor_padded_size",
    "Layout",
    "SignRuns",
    "ExchangeResult",
]

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
_SIGN_TABLES: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def sign_bits(x: Tensor) -> Tensor:
    """Boolean tensor that is True where ``sign(x) = +1``, i.e. ``x >= 0`` (True for -0.0)."""
    return x >= 0


def signs(x: Tensor) -> Tensor:
    """``sign(x)`` as ``+1``/``-1`` of ``x``'s dtype, with ``sign(0) = sign(-0.0) = +1``."""
    one = torch.ones((), dtype=x.dtype, device=x.device)
    return torch.where(sign_bits(x), one, -one)


def pack_signs(x: Tensor, *, work: Tensor | None = None) -> Tensor:
    """Pack ``sign(x)`` of a flat tensor into ``ceil(numel / 8)`` bytes (uint8, MSB first).

    Bits past the end of ``x`` in the last byte are zero. On CPU the comparison runs in numpy
    (several times faster than torch's for this) and ``work``, a bool tensor of ``x``'s size,
    avoids allocating its result.
    """
    flat = x.reshape(-1)
    if flat.device.type != "cpu":
        return _pack_bits_torch(sign_bits(flat))
    if flat.dtype in _NUMPY_FLOATS:
        values = flat.detach().numpy()
        bits = np.greater_equal(values, 0, out=None if work is None else work.numpy())
    else:  # bfloat16 and other types numpy lacks
        bits = sign_bits(flat).numpy()
    return torch.from_numpy(np.packbits(bits))


def _pack_bits_torch(bits: Tensor) -> Tensor:
    """Device-agnostic packing of a flat boolean tensor (used on accelerators)."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def sign_table(device: torch.device, dtype: torch.dtype) -> Tensor:
    """The ``[256, 8]`` lookup table from a byte to its eight signs as ``+1``/``-1``."""
    key = (device, dtype)
    table = _SIGN_TABLES.get(key)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32)
        table = torch.where((codes & weights) != 0, 1.0, -1.0).to(device=device, dtype=dtype)
        _SIGN_TABLES[key] = table
    return table


def unpack_signs(
    packed: Tensor,
    numel: int,
    *,
    dtype: torch.dtype = torch.float32,
    out: Tensor | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """Unpack ``numel`` signs from ``packed`` bytes into ``+1``/``-1`` values (``+-scale``).

    Uses a 256-entry lookup table, one gather per byte; with ``scale`` (a 0-d tensor) the
    table is scaled first, so ``scale * sign`` costs no extra pass. With ``out``
    (contiguous, ``numel`` elements, a multiple of 8) nothing is allocated for the result.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    nbytes = math.ceil(numel / 8)
    if packed.numel() < nbytes:
        raise ValueError(f"{packed.numel()} packed bytes cannot hold {numel} signs")
    target_dtype = out.dtype if out is not None else dtype
    table = sign_table(packed.device, target_dtype)
    if scale is not None:
        table = table * scale.to(target_dtype)
    index = packed.reshape(-1)[:nbytes].to(torch.int32)
    if out is not None and numel % 8 == 0:
        if out.numel() != numel or not out.is_contiguous():
            raise ValueError(f"out must be contiguous with {numel} elements, got {out.numel()}")
        torch.index_select(table, 0, index, out=out.view(nbytes, 8))
        return out
    result = torch.index_select(table, 0, index).reshape(-1)[:numel]
    if out is not None:
        return out.copy_(result.view_as(out))
    return result


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of scales for buffers of ``dtype``: float32, or wider for wider buffers."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scale(x: Tensor) -> Tensor:
    """``||x||_2 / sqrt(numel(x))`` as a 0-d tensor of :func:`scale_dtype` precision."""
    if x.numel() == 0:
        raise ValueError("cannot take the scale of an empty tensor")
    norm = torch.linalg.vector_norm(x.reshape(-1), dtype=scale_dtype(x.dtype))
    return norm / math.sqrt(x.numel())


def update_error(
    error: Tensor, x: Tensor, packed: Tensor, x_scale: Tensor, work: Tensor | None = None
) -> Tensor:
    """Error feedback: ``error = x - scale * sign(x)``, with ``sign(x)`` read from ``packed``.

    Two passes and no scratch memory: ``error = -scale * sign(x)`` from a scaled lookup
    table, then ``error += x``. The product ``scale * (+-1)`` is exact, so this equals
    ``x - scale * sign(x)`` to the last bit. ``error`` may be ``x`` itself (the update in
    place) given ``work``, a scratch of a multiple of 8 elements that the same sums pass
    through chunk by chunk; otherwise it must not overlap ``x``.
    """
    if error.data_ptr() != x.data_ptr():
        unpack_signs(packed, x.numel(), out=error.view(-1), scale=-x_scale)
        return error.add_(x.view_as(error))
    if work is None or work.numel() % 8:
        raise ValueError("an error update in place needs work space of a multiple of 8 elements")
    flat, step = x.view(-1), work.numel()
    for start in range(0, flat.numel(), step):
        count = min(step, flat.numel() - start)
        chunk = work[:count]
        unpack_signs(packed.view(-1)[start // 8 :], count, out=chunk, scale=-x_scale)
        flat[start : start + count].copy_(chunk.add_(flat[start : start + count]))
    return error


def server_average(
    packed_chunks: Tensor, scales: Tensor, server_error: Tensor, out: Tensor, work: Tensor
) -> Tensor:
    """``out = server_error + (1/n) sum_i scales[i] sign_i``, what a server compresses.

    ``packed_chunks`` is ``[n, C / 8]``: row ``i`` holds worker ``i``'s packed signs of this
    server's chunk of ``C`` elements; ``work`` is scratch of ``C`` elements. Summed in rank
    order with exact products (the signs are +-1, decoded through a scaled lookup table), so
    the result is bit-reproducible for a given ``n`` and ``C`` on any number of threads.
    """
    n, chunk = packed_chunks.shape[0], out.numel()
    weights = scales / n
    out.copy_(server_error)
    for rank in range(n):
        out.add_(unpack_signs(packed_chunks[rank], chunk, out=work, scale=weights[rank]))
    return out


def per_tensor_padded_size(numel: int, n: int) -> int:
    """The size a tensor of ``numel`` elements is padded to alone in the per-tensor exchange:
    the smallest multiple of ``n * lcm(n, 8)`` (DeepSpeed's unit) that is ``>= numel``, and at
    least one unit (ALGORITHM.md, "Per-tensor compression")."""
    if numel < 0 or n < 1:
        raise ValueError(f"need numel >= 0 and n >= 1, got numel={numel}, n={n}")
    unit = n * math.lcm(n, 8)
    return max(unit, -(-numel // unit) * unit)


@dataclass(frozen=True)
class Layout:
    """Segments compressed alone over ``n`` ranks: segment ``t`` carries ``numels[t]``
    values in ``sizes[t]`` elements (a multiple of ``8 n``; the rest is zero padding)."""

    numels: tuple[int, ...]
    sizes: tuple[int, ...]
    n: int

    @classmethod
    def flat(cls, numel: int, n: int) -> Layout:
        """One segment of ``numel`` elements (a multiple of ``8 n``)."""
        return cls((numel,), (numel,), n)

    @classmethod
    def per_tensor(cls, numels: Sequence[int], n: int) -> Layout:
        """A segment per tensor, each padded alone (:func:`per_tensor_padded_size`)."""
        return cls(tuple(numels), tuple(per_tensor_padded_size(x, n) for x in numels), n)

    @property
    def segments(self) -> int:
        return len(self.sizes)

    @property
    def width(self) -> int:
        """Elements of all segments, padding included (the worker error's size)."""
        return sum(self.sizes)

    @property
    def padded_width(self) -> int:
        """Elements of the segments that carry padding (a flat buffer's scratch for them)."""
        return sum(
            size for numel, size in zip(self.numels, self.sizes, strict=True) if numel != size
        )

    @property
    def chunks(self) -> tuple[int, ...]:
        """Each segment's chunk on one server, ``P_t / n`` (the server error holds these)."""
        return tuple(size // self.n for size in self.sizes)

    @property
    def chunk_bytes(self) -> tuple[int, ...]:
        return tuple(chunk // 8 for chunk in self.chunks)


@dataclass(frozen=True)
class SignRuns:
    """An exchange's result as the update reads it, whatever its packing: run ``r`` covers
    the decoded elements ``[bounds[r], bounds[r + 1])`` (the runs partition the result, in
    element order), each ``+-scales[r]``; element ``bounds[r] + k``'s sign is bit
    ``first_bits[r] + k`` of ``signs`` (MSB first, 1 is ``+``)."""

    bounds: np.ndarray  # [runs + 1] int64
    first_bits: np.ndarray  # [runs] int64
    scales: Tensor  # [runs]
    signs: Tensor  # uint8, flat

    @property
    def numel(self) -> int:
        return int(self.bounds[-1])

    @property
    def chunk_elements(self) -> int | None:
        """``C`` where run ``r`` is elements ``[rC, (r + 1)C)`` at bits ``rC ..`` (element
        ``e``'s scale is ``scales[e // C]``, its bit ``e``), else ``None``."""
        lengths = np.diff(self.bounds)
        if (lengths == lengths[0]).all() and (self.first_bits == self.bounds[:-1]).all():
            return int(lengths[0])
        return None

    def sign_runs(self) -> SignRuns:
        """Itself: runs are a result too (:class:`ExchangeResult`), as a checkpoint keeps one."""
        return self

    def decode(self, out: Tensor) -> Tensor:
        """Element ``e`` of run ``r``, ``+scales[r]`` where its bit is 1 and ``-scales[r]``
        where it is 0, into ``out`` (at least :attr:`numel` elements); returns ``out``."""
        device = self.signs.device
        lengths = torch.from_numpy(np.diff(self.bounds)).to(device)
        runs = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        starts = torch.from_numpy(self.bounds[:-1]).to(device)[runs]
        first_bits = torch.from_numpy(self.first_bits).to(device)[runs]
        bits = first_bits + torch.arange(self.numel, device=device) - starts
        signs = unpack_signs(self.signs, 8 * self.signs.numel(), dtype=self.scales.dtype)
        out.view(-1)[: self.numel].copy_(signs[bits] * self.scales[runs])
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """The runs as tensors (a copy), for a checkpoint."""
        return {
            "bounds": torch.from_numpy(self.bounds.copy()),
            "first_bits": torch.from_numpy(self.first_bits.copy()),
            "scales": self.scales.clone(),
            "signs": self.signs.clone(),
        }

    @staticmethod
    def from_state_dict(state: dict[str, Tensor], device: torch.device) -> SignRuns:
        return SignRuns(
            state["bounds"].numpy().astype(np.int64),
            state["first_bits"].numpy().astype(np.int64),
            state["scales"].to(device, copy=True),
            state["signs"].to(device, copy=True),
        )

    @staticmethod
    def concatenate(parts: Sequence[tuple[int, SignRuns]]) -> SignRuns:
        """The runs of results that cover elements from ``start`` on, in element order, as one
        (their signs one after another)."""
        bits = np.cumsum([0] + [8 * runs.signs.numel() for _, runs in parts[:-1]])
        last_start, last = parts[-1]
        return SignRuns(
            np.concatenate(
                [start + runs.bounds[:-1] for start, runs in parts] + [[last_start + last.numel]]
            ).astype(np.int64),
            np.concatenate(
                [shift + runs.first_bits for shift, (_, runs) in zip(bits, parts, strict=True)]
            ),
            torch.cat([runs.scales for _, runs in parts]),
            torch.cat([runs.signs for _, runs in parts]),
        )


class ExchangeResult(Protocol):
    """An exchange's result before decoding (:class:`onebit.exchange.PackedResult`,
    :class:`onebit.exchange.BucketedResult`): read as :class:`SignRuns` by the update kernels
    that decode on the fly, or decoded into a buffer."""

    def sign_runs(self) -> SignRuns: ...

    def decode(self, out: Tensor) -> Tensor:
        """The result, every element, into ``out``; returns ``out``."""
