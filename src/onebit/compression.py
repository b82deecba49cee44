"""Pure tensor maths of 1-bit compression with error feedback.

Everything here is local to one process: signs, bit packing, scales, the error-feedback
compression step, and :func:`simulate_compressed_allreduce`, a single-process model of the
whole two-phase exchange over ``n`` workers. The distributed implementation in
:mod:`onebit.collectives` is built from the same pieces and is tested against the simulation.

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
    "simulate_compressed_allreduce",
    "simulate_compressed_allreduce_per_tensor",
    "simulate_hierarchical_compressed_allreduce",
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


def update_error(error: Tensor, x: Tensor, packed: Tensor, x_scale: Tensor) -> Tensor:
    """Error feedback: ``error = x - scale * sign(x)``, with ``sign(x)`` read from ``packed``.

    Two passes and no scratch memory: ``error = -scale * sign(x)`` from a scaled lookup
    table, then ``error += x``. The product ``scale * (+-1)`` is exact, so this equals
    ``x - scale * sign(x)`` to the last bit. ``error`` must not overlap ``x``.
    """
    unpack_signs(packed, x.numel(), out=error.view(-1), scale=-x_scale)
    return error.add_(x.view_as(error))


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


def simulate_compressed_allreduce(
    buffers: Tensor,
    worker_errors: Tensor,
    server_errors: Tensor,
    *,
    kernels: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Single-process model of :func:`onebit.compressed_allreduce` over ``n`` workers.

    Args:
        buffers: ``[n, N]``, row ``i`` is worker ``i``'s buffer; ``N`` a multiple of ``8 * n``.
        worker_errors: ``[n, N]``, each worker's error-feedback state.
        server_errors: ``[n, N // n]``, row ``j`` is the server error of chunk ``j``.
        kernels: the backend of the local work (:func:`onebit.kernels.select`); the
            distributed exchange with the same backend gives the same bits.

    Returns:
        ``(result, new_worker_errors, new_server_errors)``; ``result`` has ``N`` elements and
        is what every worker receives. The inputs are left unchanged.

    Per worker ``i``: ``x_i = buf_i + e_i``, ``a_i = ||x_i|| / sqrt(N)``,
    ``e_i <- x_i - a_i sign(x_i)``. Per chunk ``j``:
    ``y_j = (1/n) sum_i a_i sign(x_i)[chunk j] + s_j``, ``b_j = ||y_j|| / sqrt(N / n)``,
    ``s_j <- y_j - b_j sign(y_j)``. The result is ``concat_j b_j sign(y_j)``.
    """
    from onebit import kernels as backends

    if buffers.dim() != 2 or worker_errors.shape != buffers.shape:
        raise ValueError(
            f"buffers and worker_errors must both be [n, N]; got {tuple(buffers.shape)} and "
            f"{tuple(worker_errors.shape)}"
        )
    n, numel = buffers.shape
    if numel % (8 * n):
        raise ValueError(f"N={numel} must be a multiple of 8 * n = {8 * n}")
    chunk = numel // n
    if server_errors.shape != (n, chunk):
        raise ValueError(
            f"server_errors must be [n, N // n] = [{n}, {chunk}], got {tuple(server_errors.shape)}"
        )
    backend = backends.select(buffers, kernels)
    device, dtype = buffers.device, buffers.dtype
    scratch = backend.scratch(numel, n, dtype, device)
    new_worker_errors = worker_errors.clone()
    new_server_errors = server_errors.clone()
    worker_packed = torch.empty(n, numel // 8, dtype=torch.uint8, device=device)
    worker_scales = torch.empty(n, dtype=scale_dtype(dtype), device=device)
    x = torch.empty(numel, dtype=dtype, device=device)
    for i in range(n):
        buffer, error = buffers[i].contiguous(), new_worker_errors[i]
        worker_scales[i] = backend.worker_compress(buffer, error, worker_packed[i], x, scratch)
        backend.worker_error_update(buffer, error, worker_packed[i], worker_scales[i], x, scratch)

    server_packed = torch.empty(n, chunk // 8, dtype=torch.uint8, device=device)
    server_scales = torch.empty(n, dtype=scale_dtype(dtype), device=device)
    for j in range(n):
        received = worker_packed[:, j * chunk // 8 : (j + 1) * chunk // 8].contiguous()
        error = new_server_errors[j]
        server_scales[j] = backend.server_compress(
            received, worker_scales, error, server_packed[j], scratch
        )
        backend.server_error_update(
            received, worker_scales, error, server_packed[j], server_scales[j], scratch
        )
    result = torch.empty(numel, dtype=dtype, device=device)
    backend.decode(server_packed, server_scales, result)
    return result, new_worker_errors, new_server_errors


def per_tensor_padded_size(numel: int, n: int) -> int:
    """The size a tensor of ``numel`` elements is padded to alone in the per-tensor exchange:
    the smallest multiple of ``n * lcm(n, 8)`` (DeepSpeed's unit) that is ``>= numel``, and at
    least one unit (ALGORITHM.md, "Per-tensor compression")."""
    if numel < 0 or n < 1:
        raise ValueError(f"need numel >= 0 and n >= 1, got numel={numel}, n={n}")
    unit = n * math.lcm(n, 8)
    return max(unit, -(-numel // unit) * unit)


def simulate_compressed_allreduce_per_tensor(
    buffers: Sequence[Tensor],
    worker_errors: Tensor,
    server_errors: Tensor,
    *,
    kernels: str | None = None,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Single-process model of :func:`onebit.compressed_allreduce_per_tensor` over ``n`` workers.

    Args:
        buffers: tensor ``t`` as ``[n, N_t]``, row ``i`` is worker ``i``'s copy.
        worker_errors: ``[n, W]``, row ``i`` holds worker ``i``'s errors of every tensor, each
            padded alone to ``P_t = per_tensor_padded_size(N_t, n)``, one after another.
        server_errors: ``[n, W / n]``, row ``j`` holds server ``j``'s error of chunk ``j`` of
            every tensor (``P_t / n`` elements each), one after another.
        kernels: the backend of the local work, as in :func:`simulate_compressed_allreduce`.

    Returns:
        ``(results, new_worker_errors, new_server_errors)``; ``results[t]`` has ``N_t``
        elements. Tensor by tensor this is :func:`simulate_compressed_allreduce` of the tensor
        zero-padded to ``P_t`` with its slices of the error buffers. The inputs are unchanged.
    """
    if not buffers:
        raise ValueError("buffers must hold at least one tensor")
    n = buffers[0].shape[0] if buffers[0].dim() == 2 else 0
    for index, buffer in enumerate(buffers):
        if buffer.dim() != 2 or buffer.shape[0] != n or buffer.dtype != worker_errors.dtype:
            raise ValueError(
                f"buffers[{index}] is {buffer.dtype} {tuple(buffer.shape)}; every buffer must be "
                f"[n, N_t] with the same n and the errors' dtype {worker_errors.dtype}"
            )
    sizes = [per_tensor_padded_size(buffer.shape[1], n) for buffer in buffers]
    width = sum(sizes)
    if worker_errors.shape != (n, width) or server_errors.shape != (n, width // n):
        raise ValueError(
            f"worker_errors must be [{n}, {width}] and server_errors [{n}, {width // n}]; got "
            f"{tuple(worker_errors.shape)} and {tuple(server_errors.shape)}"
        )
    new_worker_errors = torch.empty_like(worker_errors)
    new_server_errors = torch.empty_like(server_errors)
    results = []
    worker_offset = server_offset = 0
    for buffer, size in zip(buffers, sizes, strict=True):
        chunk = size // n
        worker_part = slice(worker_offset, worker_offset + size)
        server_part = slice(server_offset, server_offset + chunk)
        padded = buffer.new_zeros(n, size)
        padded[:, : buffer.shape[1]] = buffer
        result, new_worker_errors[:, worker_part], new_server_errors[:, server_part] = (
            simulate_compressed_allreduce(
                padded,
                worker_errors[:, worker_part].contiguous(),
                server_errors[:, server_part].contiguous(),
                kernels=kernels,
            )
        )
        results.append(result[: buffer.shape[1]])
        worker_offset, server_offset = worker_offset + size, server_offset + chunk
    return results, new_worker_errors, new_server_errors


def simulate_hierarchical_compressed_allreduce(
    buffers: Tensor,
    worker_errors: Tensor,
    server_errors: Tensor,
    ranks_per_node: int,
    *,
    kernels: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Single-process model of :func:`onebit.hierarchical_compressed_allreduce`.

    Args:
        buffers: ``[W, N]``, row ``r`` is rank ``r``'s buffer; ``W = M * L`` ranks, rank
            ``node * L + l``; ``N`` a multiple of ``8 * W``.
        worker_errors: ``[W, N / L]``; server_errors: ``[W, N / W]``.
        ranks_per_node: ``L``.

    Returns ``(result, new_worker_errors, new_server_errors)`` as
    :func:`simulate_compressed_allreduce` does: per node the mean of each shard, summed in
    rank order and divided by ``L``; per local index ``l`` the flat exchange of shard ``l``
    among the ``M`` nodes; the result, the concatenation of the ``L`` shards' results.
    """
    local = ranks_per_node
    ranks, numel = buffers.shape
    if local < 1 or ranks % local or numel % (8 * ranks):
        raise ValueError(
            f"need W = {ranks} ranks in nodes of L = {local} and N = {numel} a multiple of 8 W"
        )
    nodes, shard = ranks // local, numel // local
    if worker_errors.shape != (ranks, shard) or server_errors.shape != (ranks, shard // nodes):
        raise ValueError(
            f"worker_errors must be [{ranks}, {shard}] and server_errors [{ranks}, "
            f"{shard // nodes}]; got {tuple(worker_errors.shape)} and {tuple(server_errors.shape)}"
        )
    by_node = buffers.view(nodes, local, local, shard)  # [node, rank in node, shard, ...]
    means = by_node[:, 0].clone()  # [node, shard l, shard elements]
    for rank in range(1, local):
        means.add_(by_node[:, rank])
    means.div_(local)
    result = torch.empty(numel, dtype=buffers.dtype, device=buffers.device)
    new_worker_errors = torch.empty_like(worker_errors)
    new_server_errors = torch.empty_like(server_errors)
    for index in range(local):
        members = [node * local + index for node in range(nodes)]
        shard_result, errors, server = simulate_compressed_allreduce(
            means[:, index], worker_errors[members], server_errors[members], kernels=kernels
        )
        result[index * shard : (index + 1) * shard] = shard_result
        new_worker_errors[members], new_server_errors[members] = errors, server
    return result, new_worker_errors, new_server_errors
