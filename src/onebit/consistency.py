"""Checks that data-parallel replicas agree, and a helper to make them agree.

1-bit optimizers never broadcast parameters: every rank applies the same decoded update, so
replicas stay bit-identical only if they start identical and have the same tensors. These
checks make that an error with a message instead of a hang or a silent divergence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from onebit.collectives import world_size

__all__ = ["ReplicaMismatchError", "tensor_signatures", "verify_replicas", "broadcast_parameters"]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FIELDS = ("number of elements", "dtype", "shape", "bit checksum")


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different parameter lists, shapes, dtypes or values (raised on every rank)."""


def _shape_code(shape: torch.Size) -> int:
    code = len(shape)
    for size in shape:
        code = (code * 1_000_003 + size) % (1 << 61)
    return code


def _dtype_code(dtype: torch.dtype) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(str(dtype)))


def tensor_signatures(tensors: Sequence[Tensor]) -> Tensor:
    """``[len(tensors), 4]`` int64: numel, dtype code, shape code, and a checksum of the bits.

    The checksum is the wrapping int64 sum of the tensor's bit patterns, so any single
    changed element changes it.
    """
    rows = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        bits = flat.contiguous().view(_INT_VIEW[flat.element_size()])
        checksum = int(bits.sum(dtype=torch.int64)) if flat.numel() else 0
        rows.append([flat.numel(), _dtype_code(tensor.dtype), _shape_code(tensor.shape), checksum])
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 4)


def verify_replicas(
    tensors: Iterable[Tensor],
    group: dist.ProcessGroup | None = None,
    *,
    what: str = "parameter",
    step: int | None = None,
) -> None:
    """Raise :class:`ReplicaMismatchError` on every rank if ranks' tensors differ in any bit.

    Two small fixed-size all-gathers, on the CPU with gloo and on the current CUDA device with
    NCCL: first the count, then one signature row per tensor. Names the first mismatching
    tensor, what differs and on which rank.
    """
    tensors = list(tensors)
    n = world_size(group)
    if n == 1:
        return
    device = _collective_device(group)
    where = f" at step {step}" if step is not None else ""
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(counts, torch.tensor([len(tensors)], device=device), group=group)
    counts_list = [int(c) for c in counts]
    if len(set(counts_list)) > 1:
        raise ReplicaMismatchError(
            f"ranks hold different numbers of {what} tensors{where}: {counts_list} (by rank)"
        )
    local = tensor_signatures(tensors).to(device)
    gathered = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(gathered, local, group=group)
    reference = gathered[0].cpu()
    for rank in range(1, n):
        differs = (gathered[rank].cpu() != reference).nonzero()
        if len(differs):
            index, field = (int(v) for v in differs[0])
            tensor = tensors[index]
            raise ReplicaMismatchError(
                f"{what} {index} (shape {tuple(tensor.shape)} on this rank) differs between "
                f"rank 0 and rank {rank}{where}: {_FIELDS[field]} "
                f"{int(reference[index, field])} != {int(gathered[rank][index, field])}. "
                "Start every rank from the same weights (onebit.broadcast_parameters, or "
                "DistributedDataParallel) and the same model definition."
            )


def broadcast_parameters(
    tensors: Iterable[Tensor], src: int = 0, group: dist.ProcessGroup | None = None
) -> None:
    """Copy rank ``src``'s values into every rank's tensors (e.g. ``model.state_dict()``)."""
    if world_size(group) == 1:
        return
    for tensor in tensors:
        dist.broadcast(tensor.data, src=src, group=group)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
