"""The test oracle: single-process models of the 1-bit exchanges over ``n`` workers.

The distributed exchanges (``onebit.exchange``, and the functions of ``onebit.collectives``)
are tested against these models, which are written independently of them: a loop over the
workers and then over the servers, calling only a backend's five stage kernels (each tested
against the pure-torch reference in test_kernels.py), so a fused backend's scales are summed
as the distributed run sums them and results agree bit for bit. Nothing in ``src/onebit``
imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from onebit import kernels as backends
from onebit.compression import per_tensor_padded_size, scale_dtype


def oracle_compressed_allreduce(
    buffers: Tensor,
    worker_errors: Tensor,
    server_errors: Tensor,
    *,
    kernels: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Single-process model of ``onebit.compressed_allreduce`` over ``n`` workers.

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
    backend = backends.select(buffers, kernels).compression
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


def oracle_compressed_allreduce_per_tensor(
    buffers: Sequence[Tensor],
    worker_errors: Tensor,
    server_errors: Tensor,
    *,
    kernels: str | None = None,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Single-process model of ``onebit.compressed_allreduce_per_tensor`` over ``n`` workers.

    Args:
        buffers: tensor ``t`` as ``[n, N_t]``, row ``i`` is worker ``i``'s copy.
        worker_errors: ``[n, W]``, row ``i`` holds worker ``i``'s errors of every tensor, each
            padded alone to ``P_t = per_tensor_padded_size(N_t, n)``, one after another.
        server_errors: ``[n, W / n]``, row ``j`` holds server ``j``'s error of chunk ``j`` of
            every tensor (``P_t / n`` elements each), one after another.
        kernels: the backend of the local work, as in :func:`oracle_compressed_allreduce`.

    Returns:
        ``(results, new_worker_errors, new_server_errors)``; ``results[t]`` has ``N_t``
        elements. Tensor by tensor this is :func:`oracle_compressed_allreduce` of the tensor
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
            oracle_compressed_allreduce(
                padded,
                worker_errors[:, worker_part].contiguous(),
                server_errors[:, server_part].contiguous(),
                kernels=kernels,
            )
        )
        results.append(result[: buffer.shape[1]])
        worker_offset, server_offset = worker_offset + size, server_offset + chunk
    return results, new_worker_errors, new_server_errors


def oracle_hierarchical_compressed_allreduce(
    buffers: Tensor,
    worker_errors: Tensor,
    server_errors: Tensor,
    ranks_per_node: int,
    *,
    kernels: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Single-process model of ``onebit.hierarchical_compressed_allreduce``.

    Args:
        buffers: ``[W, N]``, row ``r`` is rank ``r``'s buffer; ``W = M * L`` ranks, rank
            ``node * L + l``; ``N`` a multiple of ``8 * W``.
        worker_errors: ``[W, N / L]``; server_errors: ``[W, N / W]``.
        ranks_per_node: ``L``.

    Returns ``(result, new_worker_errors, new_server_errors)`` as
    :func:`oracle_compressed_allreduce` does: per node the mean of each shard, summed in
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
        shard_result, errors, server = oracle_compressed_allreduce(
            means[:, index], worker_errors[members], server_errors[members], kernels=kernels
        )
        result[index * shard : (index + 1) * shard] = shard_result
        new_worker_errors[members], new_server_errors[members] = errors, server
    return result, new_worker_errors, new_server_errors
