"""max_grad_norm and onebit.clip_grad_norm_ on two gloo ranks: the same clipped trajectory in
a plain loop and under DDP, a gradient one rank lacks, and the refusal to clip before a step
that averages the gradients itself."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.gradients import params_with_gradient

import onebit
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE
from onebit.testing import spawn_workers


def _clipped_run(rank, kind, use_ddp, drop_on_rank_1, max_grad_norm):
    """12 steps of a small model on 2 ranks (4 dense, then 1-bit or 0/1 Adam's kinds), the
    gradients far above ``max_grad_norm``; with ``drop_on_rank_1`` rank 1 has no gradient
    for the first bias (``None``, or zeros when it is ``"zeros"``). Returns the parameters
    after every step, each step's kind and the steps whose gradients were above the
    threshold that step clips at (``max_grad_norm``, or ``·√2`` for a rank's own)."""
    torch.manual_seed(0)  # identical initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    options = dict(lr=0.01, weight_decay=0.01, max_grad_norm=max_grad_norm)
    if kind == "onebit-lamb":
        optimizer = onebit.OneBitLamb(model.parameters(), freeze_step=4, **options)
    else:
        schedule = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2)
        optimizer = onebit.ZeroOneAdam(
            model.parameters(), **(DEEPSPEED_SCHEDULE | schedule), **options
        )
    forward = model
    if use_ddp:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        onebit.ddp.register_comm_hook(forward, optimizer)
    gen = torch.Generator().manual_seed(100 + rank)
    history, kinds, above = [], [], 0
    for _ in range(12):
        x = torch.randn(16, 6, generator=gen)
        optimizer.zero_grad(set_to_none=True)
        kinds.append(optimizer.stage)
        loss = torch.nn.functional.mse_loss(forward(x), 100 * x.sum(1, keepdim=True))
        loss.backward()
        bias = model[0].bias
        if drop_on_rank_1 and rank == 1:
            bias.grad = torch.zeros_like(bias) if drop_on_rank_1 == "zeros" else None
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        dense = optimizer.needs_averaged_gradients
        above += norm > max_grad_norm * (1 if dense else math.sqrt(2))
        optimizer.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history, kinds, above


def _plain_ddp_and_missing(rank, world_size, kind):
    runs = {
        "plain": _clipped_run(rank, kind, False, None, 0.05),
        "ddp": _clipped_run(rank, kind, True, None, 0.05),
    }
    if kind == "onebit-lamb":
        runs["missing"] = _clipped_run(rank, kind, False, "none", 0.05)
        runs["zeros"] = _clipped_run(rank, kind, False, "zeros", 0.05)
    return runs


def _same(a, b):
    return all(
        torch.equal(x, y) for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True)
    )


@pytest.mark.parametrize(
    "kind", ["onebit-lamb", pytest.param("zero-one-adam", marks=pytest.mark.slow)]
)
def test_max_grad_norm_clips_alike_in_a_plain_loop_and_under_ddp(kind):
    """The same clipped trajectory both ways, clipping at every step (dense and not); and a
    gradient one rank lacks counts as zero, without a hang."""
    runs = spawn_workers(_plain_ddp_and_missing, 2, args=(kind,), timeout_s=120)
    assert len(set(runs[0]["plain"][1])) >= 2  # dense kinds and others
    for rank in range(2):
        assert _same(runs[rank]["plain"][0], runs[rank]["ddp"][0]), rank
        assert runs[rank]["plain"][2] == 12  # every step's gradient was clipped
    if kind == "onebit-lamb":
        for rank in range(2):
            assert _same(runs[rank]["missing"][0], runs[rank]["zeros"][0]), rank
        assert _same(runs[0]["missing"][0], runs[1]["missing"][0])


def _clip_before_a_self_averaged_step(rank, world_size):
    params = params_with_gradient(10.0)
    optimizer = onebit.OneBitLamb(params, freeze_step=2)
    before = [p.grad.clone() for p in params]
    try:
        onebit.clip_grad_norm_(params, 1.0, optimizer)
    except ValueError as error:
        unchanged = all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))
        return str(error), unchanged
    return None, None


def test_clip_grad_norm_refuses_to_clip_before_a_step_that_averages_itself():
    for message, unchanged in spawn_workers(_clip_before_a_self_averaged_step, 2, timeout_s=60):
        assert message is not None and "max_grad_norm=1.0" in message and unchanged
