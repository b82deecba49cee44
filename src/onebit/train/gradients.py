"""The main job's optimizer and how its gradients are averaged: the optimizer built from the
registry, DDP's allreduce with its bytes counted (PowerSGD's: :mod:`onebit.train.powersgd`),
and the plain loop's own dense allreduce for the dense baselines (onebit's optimizers average
in ``step()``)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import onebit
from onebit.collectives import TrafficCounter, allreduce_bytes
from onebit.exchange import NodeGroups
from onebit.optim import AUTO
from onebit.optim.registry import optimizer_spec
from onebit.train.config import TrainConfig


def build_optimizer(
    config: TrainConfig,
    params: list[nn.Parameter],
    node_groups: NodeGroups | None = None,
    max_grad_norm: float = 0.0,
    process_group: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer`` (:data:`onebit.optim.registry.OPTIMIZERS`)
    with the config's hyper-parameters; the 1-bit optimizers exchange hierarchically over
    ``node_groups`` when given, over ``process_group`` (default: the world) otherwise;
    onebit's optimizers clip at ``max_grad_norm`` in ``step()`` (torch's AdamW does not
    clip)."""
    values = {
        **dataclasses.asdict(config),
        "node_groups": node_groups,
        "max_grad_norm": max_grad_norm,
        "process_group": process_group,
    }
    if config.freeze_step == AUTO:
        values["max_freeze_step"] = config.steps
    if config.var_freeze_step == AUTO:
        values["max_var_freeze_step"] = config.steps
    return optimizer_spec(config.optimizer).build(params, values)


def clips_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` clips the gradients in its ``step()`` (onebit's optimizers)."""
    return hasattr(optimizer, "max_grad_norm")


@dataclasses.dataclass
class CountedAllreduce:
    """The state of :func:`counted_allreduce_hook`: where its bytes are counted, and the
    group DDP averages over (``None``: the world)."""

    traffic: TrafficCounter
    group: dist.ProcessGroup | None = None


# No annotations: DistributedDataParallel inspects them and rejects postponed (string) ones.
def counted_allreduce_hook(state, bucket):
    """DDP's default mean allreduce over ``state.group``, its bytes counted in
    ``state.traffic`` (a :class:`CountedAllreduce`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ranks = dist.get_world_size(state.group)
    state.traffic.record("allreduce", allreduce_bytes(bucket.buffer(), ranks))
    return allreduce_hook(state.group, bucket)


def average_gradients(
    params: list[nn.Parameter],
    traffic: TrafficCounter,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Mean of every gradient over the ranks of ``group`` (``None``: the world) in one dense
    allreduce (what DDP does, without it), for the dense baselines of a plain loop and
    inside DiLoCo's nodes (onebit's optimizers average in ``step()``).

    Every parameter has its place whatever gradients this rank has, with one flag each that
    says whether it had one (so ranks that differ in which gradients exist still send the
    same buffer): a gradient missing on some ranks counts as zero, and a parameter no rank
    has a gradient for keeps none."""
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes) + len(params), dtype=params[0].dtype, device=params[0].device)
    values, flags = flat[: sum(sizes)].split(sizes), flat[sum(sizes) :]
    for index, (param, value) in enumerate(zip(params, values, strict=True)):
        if param.grad is not None:
            value.copy_(param.grad.reshape(-1))
            flags[index] = 1
    onebit.allreduce_mean_(flat, group, traffic=traffic)
    for param, value, flag in zip(params, values, flags.tolist(), strict=True):
        if flag > 0:
            param.grad = value.view_as(param).clone()
