"""A ``DistributedDataParallel`` communication hook that follows a 1-bit optimizer's stage.

Usage::

    model = DistributedDataParallel(model)
    optimizer = onebit.OneBitLamb(model.parameters(), freeze_step=1000)
    onebit.ddp.register_comm_hook(model, optimizer)

In the warm-up stage the hook is a mean allreduce of each gradient bucket (what DDP does by
default). In the compression stage DDP's gradient synchronisation is switched off for the
backward passes (``require_backward_grad_sync = False``, what ``model.no_sync()`` does), so
each rank's local gradients stay where autograd put them, without DDP's copies into and out
of its buckets, and the optimizer exchanges the 1-bit compressed momentum instead; should
DDP still call the hook then, it passes the bucket through untouched. The optimizer is told
that DDP averages its warm-up gradients, so nothing is averaged twice.
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
    model.register_forward_pre_hook(_SyncFollowsStage(optimizer))
    optimizer.gradients_averaged_by_ddp = True


class _SyncFollowsStage:
    """A forward pre-hook of the DDP model: in the compression stage, no gradient
    synchronisation in the coming backward pass; back to DDP's default if the optimizer
    returns to the warm-up (a checkpoint of that stage loaded). A user's own ``no_sync()``
    works as before in either stage."""

    def __init__(self, optimizer: OneBitOptimizer) -> None:
        self.optimizer = optimizer
        self.switched_off = False

    def __call__(self, model: DistributedDataParallel, inputs: object) -> None:
        if self.optimizer.stage == COMPRESSION:
            model.require_backward_grad_sync = False
            self.switched_off = True
        elif self.switched_off:
            model.require_backward_grad_sync = True
            self.switched_off = False
