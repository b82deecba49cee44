"""Faults on real gloo processes: non-finite gradients, a dying rank, drifting replicas."""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest
import torch

import onebit
from onebit.collectives import NonFiniteError
from onebit.testing import spawn_workers

FREEZE = 3


def _model_and_optimizer(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, onebit.OneBitLamb(model.parameters(), lr=0.01, freeze_step=FREEZE, **kwargs)


def _backward(model, rank, step, poison=False):
    gen = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(32, 8, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    if poison:
        loss = loss * float("inf")
    model.zero_grad()
    loss.backward()


def _inject_inf(rank, world_size, bad_step, policy):
    """Rank 1 sees an Inf gradient at `bad_step`; the others do not."""
    model, opt = _model_and_optimizer(on_nonfinite=policy)
    raised = None
    for step in range(1, 9):
        _backward(model, rank, step, poison=(rank == 1 and step == bad_step))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
        except NonFiniteError as error:
            raised = str(error)
            break
    worker_error = opt.state_dict()["onebit"]["worker_error"]
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "skipped": opt.skipped_steps,
        "steps": opt.step_count,
        "raised": raised,
        "errors_finite": worker_error is None or bool(torch.isfinite(worker_error).all()),
    }


@pytest.mark.parametrize(
    "bad_step",
    [pytest.param(2, marks=pytest.mark.slow, id="warmup"), pytest.param(6, id="compression")],
)
def test_inf_on_one_rank_skips_the_step_on_every_rank(bad_step):
    results = spawn_workers(_inject_inf, 3, args=(bad_step, "skip"), timeout_s=120)
    for result in results:
        assert result["skipped"] == 1 and result["steps"] == 7 and result["raised"] is None
        assert result["errors_finite"]
        assert all(torch.isfinite(p).all() for p in result["params"])
        for a, b in zip(result["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_inf_on_one_rank_raises_on_every_rank_when_asked():
    results = spawn_workers(_inject_inf, 3, args=(6, "raise"), timeout_s=120)
    for result in results:
        assert result["raised"] is not None and "step 6" in result["raised"]
        assert result["steps"] == 5 and result["errors_finite"]


def _grad_scaler(rank, world_size):
    model, opt = _model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales = []
    for step in range(1, 9):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(32, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        if rank == 0 and step == 5:
            loss = loss * float("inf")  # an overflow on one rank only
        model.zero_grad()
        scaler.scale(loss).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], opt.skipped_steps, scales


def _without_scaler(rank, world_size):
    model, opt = _model_and_optimizer()
    for step in range(1, 9):
        if step == 5:
            continue  # the step the scaler skips
        _backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_grad_scaler_keeps_every_rank_consistent():
    scaled = spawn_workers(_grad_scaler, 2, timeout_s=120)
    plain = spawn_workers(_without_scaler, 2, timeout_s=120)
    for (params, skipped, _scales), reference in zip(scaled, plain, strict=True):
        assert skipped == 1
        for a, b, c in zip(params, scaled[0][0], reference, strict=True):
            assert torch.equal(a, b)
            # Power-of-two loss scales unscale exactly: the same trajectory as without AMP.
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)
    assert scaled[0][2][4] < scaled[0][2][3]  # rank 0 backed off its scale


def _killed_mid_run(rank, world_size):
    model, opt = _model_and_optimizer()
    started = None
    for step in range(1, 30):
        if rank == 2 and step == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        _backward(model, rank, step)
        try:
            started = time.monotonic()
            opt.step()
        except onebit.CommunicationError as error:
            return str(error), time.monotonic() - started
        time.sleep(0.01)
    return None, 0.0


def test_killed_worker_makes_the_others_stop_with_a_clear_error():
    results = spawn_workers(_killed_mid_run, 3, timeout_s=120, collective_timeout_s=20, may_die={2})
    assert results[2] is None
    for message, seconds in results[:2]:
        assert message is not None, "the survivors must not carry on or hang"
        assert "step 6" in message and "died or stopped responding" in message
        assert seconds < 20


def _drift(rank, world_size):
    model, opt = _model_and_optimizer(verify_every=2)
    for step in range(1, 9):
        _backward(model, rank, step)
        try:
            opt.step()
        except onebit.ReplicaMismatchError as error:
            return step, str(error)
        if rank == 1 and step == 3:
            with torch.no_grad():
                model[2].bias.add_(1e-6)  # a replica drifts
    return None, None


def test_replica_drift_is_detected_at_the_next_check():
    for step, message in spawn_workers(_drift, 2, timeout_s=60):
        assert step == 5
        assert "parameter 3 (shape (1,) on this rank)" in message and "at step 5" in message
