"""Parameters sharded by FSDP2 (``fully_shard``, DTensors placed ``Shard(0)`` on a 1-D mesh):
each rank's slices, and the shard group over which whole-tensor quantities are reduced
(ALGORITHM.md, "Sharded parameters (FSDP2 and HSDP)")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["ShardGroup", "local_tensor"]

_HSDP_FORM = (
    "shard over the node only, fully_shard(module, mesh=mesh['shard']), and give the optimizer "
    "process_group=mesh['replicate'].get_group(): its exchange then replaces HSDP's "
    "cross-replica allreduce"
)


def local_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's local slice (sharing its storage); any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardGroup:
    """The ranks among which every parameter is sliced along dim 0 (FSDP2's shard group).

    A tensor's whole-tensor quantities are reduced over it: squared norms summed, maxima
    taken, finiteness agreed, one value per tensor in one small allreduce each.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    @classmethod
    def of(cls, params: Sequence[Tensor], replicated_mesh_dim: bool = False) -> ShardGroup | None:
        """The shard group of ``params`` (all DTensors on one 1-D mesh, placed ``Shard(0)``;
        with ``replicated_mesh_dim``, also FSDP's own HSDP: a 2-D mesh, placed
        ``(Replicate(), Shard(0))``, whose second dimension is the shard group), or ``None``
        when none is a DTensor. Raises ``ValueError`` naming what does not fit."""
        sharded = [p for p in params if isinstance(p, DTensor)]
        if not sharded:
            return None
        if len(sharded) != len(params):
            raise ValueError(
                f"{len(sharded)} of {len(params)} trainable parameters are DTensors: a onebit "
                "optimizer takes FSDP-sharded parameters or replicated ones, not both (apply "
                "fully_shard to the whole model)"
            )
        meshes = {p.device_mesh for p in sharded}
        if len(meshes) > 1:
            raise ValueError("the parameters are sharded over different device meshes")
        mesh = meshes.pop()
        hsdp = replicated_mesh_dim and mesh.ndim == 2
        if mesh.ndim != 1 and not hsdp:
            raise ValueError(
                f"the parameters are sharded over a {mesh.ndim}-D mesh (HSDP inside FSDP), "
                "where FSDP all-reduces every gradient across replicas densely at every step: "
                + _HSDP_FORM
            )
        placement = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
        for param in sharded:
            if tuple(param.placements) != placement:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} is placed {param.placements}; "
                    f"onebit optimizers take FSDP2's placement, {placement}"
                )
        return cls(mesh.get_group(mesh.ndim - 1))

    def local_slice(self, tensor: Tensor) -> Tensor:
        """This rank's slice of a whole ``tensor`` of a parameter's shape: FSDP2's chunk of
        dim 0 (``torch.chunk``; empty where the chunks run out)."""
        rank = dist.get_rank(self.group)
        chunks = torch.chunk(tensor, self.size, dim=0)
        return chunks[rank] if rank < len(chunks) else tensor[:0]

    def sum_(self, values: Tensor) -> Tensor:
        """``values`` summed over the shard group, in place."""
        dist.all_reduce(values, dist.ReduceOp.SUM, group=self.group)
        return values

    def max_(self, values: Tensor) -> Tensor:
        """The element-wise maximum of ``values`` over the shard group, in place."""
        dist.all_reduce(values, dist.ReduceOp.MAX, group=self.group)
        return values

    def norms(self, local_norms: Tensor, ord: int = 2) -> Tensor:
        """Whole-tensor norms from the slices' norms: ``sqrt(sum_s ||t_s||²)`` (``ord=2``) or
        ``sum_s ||t_s||_1`` (``ord=1``)."""
        if ord == 1:
            return self.sum_(local_norms.clone())
        return self.sum_(local_norms.square()).sqrt_()

    def any_(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on some rank of the shard group (one allreduce)."""
        value = torch.tensor([float(flag)], device=device)
        return bool(self.max_(value).item() > 0)
