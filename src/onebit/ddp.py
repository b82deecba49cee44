"""A ``DistributedDataParallel`` communication hook that follows a 1-bit optimizer's stage.

Usage::

    model = DistributedDataParallel(model)
    optimizer = onebit.OneBitLamb(model.parameters(), freeze_step=1000)
    onebit.ddp.register_comm_hook(model, optimizer)

In the warm-up stage (and on the variance-update steps of :class:`onebit.ZeroOneAdam`: every
step whose ``optimizer.needs_averaged_gradients``) the hook is a mean allreduce of each
gradient bucket (what DDP does by default). On the other steps DDP's gradient
synchronisation is switched off for the backward passes (``require_backward_grad_sync =
False``, what ``model.no_sync()`` does), so each rank's local gradients stay where autograd
put them, without DDP's copies into and out of its buckets, and the optimizer exchanges at 1
bit (or not at all, in 0/1 Adam's local steps) instead; should DDP still call the hook then,
it passes the bucket through untouched. The optimizer is told that DDP averages those
gradients, so nothing is averaged twice.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebit.collectives import allreduce_bytes, world_size
from onebit.optim import OneBitOptimizer

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
    """Mean allreduce of the bucket when the optimizer's next step needs averaged gradients
    (counted under its stage); no communication otherwise."""
    buffer = bucket.buffer()
    if not state.optimizer.needs_averaged_gradients:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future
    n = world_size(state.process_group)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True)
    state.optimizer.count_bytes_sent(state.optimizer.stage, allreduce_bytes(buffer, n))
    return work.get_future().then(lambda done: done.value()[0].div_(n))


def register_comm_hook(model: DistributedDataParallel, optimizer: OneBitOptimizer) -> None:
    """Register :func:`onebit_hook` on ``model`` and tell ``optimizer`` that DDP averages
    its warm-up gradients. Call once, before the first backward pass."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"model must be a DistributedDataParallel module, got {type(model)}")
    if not isinstance(optimizer, OneBitOptimizer):
        raise TypeError(
            "optimizer must be a OneBitLamb, OneBitAdam or ZeroOneAdam, got "
            f"{type(optimizer).__name__}"
        )
    group = model.process_group
    optimizer.attach_to_ddp(group)
    model.register_comm_hook(OneBitHookState(optimizer, group), onebit_hook)
    model.register_forward_pre_hook(_SyncFollowsStage(optimizer))


class _SyncFollowsStage:
    """A forward pre-hook of the DDP model: no gradient synchronisation in the coming
    backward pass unless the optimizer's next step needs averaged gradients (the warm-up,
    0/1 Adam's variance updates); back to DDP's default when it does. A user's own
    ``no_sync()`` works as before on every step."""

    def __init__(self, optimizer: OneBitOptimizer) -> None:
        self.optimizer = optimizer
        self.switched_off = False

    def __call__(self, model: DistributedDataParallel, inputs: object) -> None:
        if not self.optimizer.needs_averaged_gradients:
            model.require_backward_grad_sync = False
            self.switched_off = True
        elif self.switched_off:
            model.require_backward_grad_sync = True
            self.switched_off = False
