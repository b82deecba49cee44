"""A ``DistributedDataParallel`` communication hook that follows a 1-bit optimizer's stage.

Usage::

    model = DistributedDataParallel(model)
    optimizer = onebit.OneBitLamb(model.parameters(), freeze_step=1000)
    onebit.ddp.register_comm_hook(model, optimizer)

In the warm-up stage the hook is a mean allreduce of each gradient bucket (what DDP does by
default). In the compression stage it sends nothing: each rank's local gradients pass
through untouched and the optimizer exchanges the 1-bit compressed momentum instead. The
optimizer is told that DDP averages its warm-up gradients, so nothing is averaged twice.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebit.collectives import allreduce_bytes, world_size
from onebit.optim._onebit import COMPRESSION, WARMUP, OneBitOptimizer

__all__ = ["OneBitHookState", "onebit_hook", "register_comm_hook"]


@dataclass
class OneBitHookState:
    """What the hook needs: the optimizer (for its stage) and DDP's process group."""

    optimizer: OneBitOptimizer
    process_group: dist.ProcessGroup | None

    def __getstate__(self) -> dict:
        # Process groups cannot be pickled; DDP re-registers hooks after unpickling.
        return {"optimizer": self.optimizer, "process_group": None}


def onebit_hook(
    state: OneBitHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Mean allreduce of the bucket in warm-up; no communication in the compression stage."""
    buffer = bucket.buffer()
    if state.optimizer.stage == COMPRESSION:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future
    n = world_size(state.process_group)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True)
    state.optimizer.count_bytes_sent(WARMUP, allreduce_bytes(buffer, n))
    return work.get_future().then(lambda done: done.value()[0].div_(n))


def register_comm_hook(model: DistributedDataParallel, optimizer: OneBitOptimizer) -> None:
    """Register :func:`onebit_hook` on ``model`` and tell ``optimizer`` that DDP averages
    its warm-up gradients. Call once, before the first backward pass."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"model must be a DistributedDataParallel module, got {type(model)}")
    if not isinstance(optimizer, OneBitOptimizer):
        raise TypeError(
            f"optimizer must be a OneBitLamb or OneBitAdam, got {type(optimizer).__name__}"
        )
    group = model.process_group
    if optimizer.process_group is None:
        optimizer.process_group = group
    elif optimizer.process_group != group:
        raise ValueError("the optimizer's process_group differs from the DDP model's")
    model.register_comm_hook(OneBitHookState(optimizer, group), onebit_hook)
    optimizer.gradients_averaged_by_ddp = True
