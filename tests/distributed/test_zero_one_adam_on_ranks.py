"""ZeroOneAdam on real gloo processes against the float64 model of ALGORITHM.md's "0/1 Adam"
through every phase, resumed from every phase, and under DDP (the problem and its schedule:
helpers/zero_one_adam_problem.py).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import pytest
import torch
from helpers.oracle_zero_one_adam import oracle_zero_one_adam, padded
from helpers.traffic_probe import TrafficProbe
from helpers.zero_one_adam_problem import (
    EXCHANGE_PARAMS,
    HYPER,
    MASK,
    SCHEDULE,
    SHAPES,
    STEPS,
    SYNCS,
    build,
    grad_fn,
    initial_params,
    kind_of,
    lr_fn,
    train_step,
)

import onebit
from onebit.testing import spawn_workers

# ------------------------------------------------------------------ against the model


def _trajectories(rank, world_size, dtypes, exchange):
    return [_trajectory(rank, dtype, exchange) for dtype in dtypes]


def _trajectory(rank, dtype, exchange):
    params, opt = build(dtype, verify_every=1, pre_freeze_exchange=exchange)
    history, kinds, sent, bytes_by_step = [], [], [], []
    with TrafficProbe() as probe:
        probe.optimizer = opt
        for t in range(1, STEPS + 1):
            kinds.append(opt.stage)
            before = sum(opt.bytes_sent.values())
            train_step(params, opt, rank, t)
            history.append([p.detach().clone() for p in params])
            bytes_by_step.append(sum(opt.bytes_sent.values()) - before)
            sent.append(dict(opt.bytes_sent))
    return dict(
        history=history,
        kinds=kinds,
        bytes_by_step=bytes_by_step,
        bytes_sent=opt.bytes_sent,
        records=probe.records,
    )


def _expected_bytes(n, elem):
    """Bytes per kind of step, from the text: the dense mean of the gradients and the flags
    (plain loop), or the per-tensor exchange (signs of every padded tensor, a worker scale
    per tensor and the backend code, a server scale per tensor, to n-1 peers, then a byte per
    tensor allreduced: whether a rank had its gradient)."""
    numel, k = sum(math.prod(s) for s in SHAPES), len(SHAPES)
    signs = 2 * (n - 1) * sum(padded(math.prod(s), n) for s in SHAPES) // n // 8
    one_bit = signs + (2 * k + 1) * elem * (n - 1) + 2 * (n - 1) * k // n
    dense = 2 * (n - 1) * (numel + k) * elem // n
    return {
        "variance_update": dense,
        "gradient_1bit": one_bit,
        "local": 0,
        "sync": one_bit,
        "refresh": dense,  # the guard after the freeze's dense steps (none here)
    }


@pytest.mark.parametrize("exchange", EXCHANGE_PARAMS)
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_follows_the_float64_model_through_every_phase(world_size, exchange):
    n = world_size
    dtypes = (torch.float64, torch.float32) if n == 2 else (torch.float64,)
    runs = spawn_workers(_trajectories, n, args=(dtypes, exchange), timeout_s=180)
    results = [run[0] for run in runs]  # float64
    hyper = dict(HYPER, pre_freeze_exchange=exchange)
    expected = oracle_zero_one_adam(
        initial_params(), grad_fn, lr_fn, n, STEPS, hyper, masks=[None, None, None, MASK]
    )
    if n == 2:
        for rank, run in enumerate(run[1] for run in runs):
            for t in range(1, STEPS + 1):
                for got, ref in zip(run["history"][t - 1], expected[t - 1][rank], strict=True):
                    # float32: rounding of ~1e-7 per operation over 32 steps, and a sign of
                    # the 1-bit exchange may flip where a value is within rounding of zero
                    # (the largest deviation seen: 1.7e-5); leaving out the weight decay moves
                    # the trajectory by up to 2.4.
                    torch.testing.assert_close(got.double(), ref, rtol=1e-3, atol=1e-3)
    kinds = [kind_of(t, exchange) for t in range(1, STEPS + 1)]
    for rank, run in enumerate(results):
        assert run["kinds"] == kinds
        for t in range(1, STEPS + 1):
            for index, (got, ref) in enumerate(
                zip(run["history"][t - 1], expected[t - 1][rank], strict=True)
            ):
                # float64 on both sides: only summation orders differ (~1e-16 relative); a
                # formula error shows at 1e-3 or more, so 1e-9 separates the two widely.
                torch.testing.assert_close(
                    got,
                    ref,
                    rtol=1e-9,
                    atol=1e-9,
                    msg=lambda m, r=rank, s=t, i=index: f"rank {r} step {s} tensor {i}: {m}",
                )
    for t in range(1, STEPS + 1):
        same = [
            all(
                torch.equal(a, b)
                for a, b in zip(results[0]["history"][t - 1], run["history"][t - 1], strict=True)
            )
            for run in results[1:]
        ]
        if t <= 12 or t in SYNCS:
            assert all(same), f"replicas differ after step {t} ({kinds[t - 1]})"
        else:
            assert not any(same), f"replicas agree after local step {t}"
    # The masked column's exchanged values are zero, so at every synchronisation those
    # entries return to their value at the freeze (weight decay 0 in their group).
    masked = [results[0]["history"][t - 1][3][:, 1] for t in (12, *sorted(SYNCS))]
    assert all(torch.equal(column, masked[0]) for column in masked)

    per_kind = _expected_bytes(n, elem=8)
    gradient_check = 8 * (n - 1)  # at the first 1-bit step, once
    for run in results:
        # Counted by the library, step by step.
        assert run["bytes_by_step"] == [
            per_kind[kinds[t - 1]] + gradient_check * (t == 3) for t in range(1, STEPS + 1)
        ]
        assert run["bytes_sent"] == {
            kind: sum(per_kind[kind] for k in kinds if k == kind)
            + gradient_check * (kind == kinds[2])
            for kind in per_kind
        }
        # Counted at torch.distributed: the same bytes, plus the replica checks of
        # verify_every=1 (list all-gathers), made exactly when replicas agree by design.
        exchanged, checked = defaultdict(int), set()
        for steps_before, collective, nbytes in run["records"]:
            if collective == "allgather":
                checked.add(steps_before + 1)
            else:
                exchanged[steps_before + 1] += nbytes
        assert [exchanged[t] for t in range(1, STEPS + 1)] == run["bytes_by_step"]
        assert checked == {t for t in range(1, STEPS + 1) if t <= 13 or t - 1 in SYNCS}


# ------------------------------------------------------------------ checkpoints


def _save(path, params, opt):
    torch.save(
        {"params": [p.detach().clone() for p in params], "optimizer": opt.state_dict()}, path
    )


def _resume_in_every_phase(rank, world_size, directory, save_at, exchange):
    """An uninterrupted run that saves after the steps in save_at, then a run resumed from
    each save as the training job resumes: the weights of rank 0's file on every rank (it
    saves the model once), this rank's own optimizer state."""
    params, opt = build(torch.float32, verify_every=4, pre_freeze_exchange=exchange)
    for t in range(1, STEPS + 1):
        train_step(params, opt, rank, t)
        if t in save_at:
            _save(os.path.join(directory, f"step{t}-rank{rank}.pt"), params, opt)
    uninterrupted = ([p.detach().clone() for p in params], opt.bytes_sent, opt.skipped_steps)
    resumed = {}
    for start in save_at:
        model = torch.load(os.path.join(directory, f"step{start}-rank0.pt"), weights_only=True)
        mine = torch.load(os.path.join(directory, f"step{start}-rank{rank}.pt"), weights_only=True)
        params, opt = build(torch.float32, verify_every=4, pre_freeze_exchange=exchange)
        with torch.no_grad():
            for p, value in zip(params, model["params"], strict=True):
                p.copy_(value)
        opt.load_state_dict(mine["optimizer"])
        assert opt.step_count == start
        for t in range(start + 1, STEPS + 1):
            train_step(params, opt, rank, t)
        resumed[start] = ([p.detach().clone() for p in params], opt.bytes_sent, opt.skipped_steps)
    return uninterrupted, resumed


@pytest.mark.parametrize("exchange", EXCHANGE_PARAMS)
def test_resume_from_every_phase_is_bit_identical(tmp_path, exchange):
    # After a 1-bit step before the freeze (followed by a variance update), at the freeze,
    # after a synchronisation, and inside local intervals (17: between the syncs of 16 and
    # 18; 22: two steps into an interval of 4).
    save_at = (5, 12, 14, 17, 22)
    results = spawn_workers(
        _resume_in_every_phase, 2, args=(str(tmp_path), save_at, exchange), timeout_s=180
    )
    for uninterrupted, resumed in results:
        for start, run in resumed.items():
            assert run[1:] == uninterrupted[1:], f"counters differ resuming after step {start}"
            assert all(torch.equal(a, b) for a, b in zip(run[0], uninterrupted[0], strict=True)), (
                f"weights differ resuming after step {start}"
            )
    # Inside a local interval the ranks' weights differ, and the checkpoint holds this
    # rank's own (which the resumed runs above needed, starting from rank 0's weights).
    for start in save_at:
        saved = [
            torch.load(tmp_path / f"step{start}-rank{r}.pt", weights_only=True) for r in (0, 1)
        ]
        inside = start in (17, 22)
        same = all(
            torch.equal(a, b) for a, b in zip(saved[0]["params"], saved[1]["params"], strict=True)
        )
        assert same != inside
        assert all(
            ("local_param" in state) == inside for state in saved[1]["optimizer"]["state"].values()
        )


# ------------------------------------------------------------------ DDP


def _plain_or_ddp(rank, world_size, use_ddp, exchange):
    torch.manual_seed(0)  # identical initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = onebit.ZeroOneAdam(
        model.parameters(),
        lr=0.01,
        weight_decay=0.01,
        **SCHEDULE,
        pre_freeze_exchange=exchange,
        var_warmup_steps=None,
    )
    if use_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
        onebit.ddp.register_comm_hook(model, opt)
    gen = torch.Generator().manual_seed(100 + rank)
    history, synced, kinds = [], [], []
    for _ in range(20):
        x = torch.randn(16, 6, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        synced.append(getattr(model, "require_backward_grad_sync", None))
        kinds.append(opt.stage)
        loss.backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history, opt.bytes_sent, synced, kinds


def _plain_and_ddp(rank, world_size, exchange):
    return (
        _plain_or_ddp(rank, world_size, False, exchange),
        _plain_or_ddp(rank, world_size, True, exchange),
    )


@pytest.mark.parametrize("exchange", EXCHANGE_PARAMS)
def test_plain_loop_and_ddp_hook_give_the_same_trajectory(exchange):
    runs = spawn_workers(_plain_and_ddp, 2, args=(exchange,), timeout_s=120)
    plain, ddp = zip(*runs, strict=True)
    for rank in range(2):
        for t, (a, b) in enumerate(zip(plain[rank][0], ddp[rank][0], strict=True), start=1):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {t}"
        # DDP averages the gradients of the variance updates only.
        assert ddp[rank][2] == [kind == "variance_update" for kind in ddp[rank][3]]
        plain_bytes, ddp_bytes = plain[rank][1], ddp[rank][1]
        assert {k: v for k, v in ddp_bytes.items() if k != "variance_update"} == {
            k: v for k, v in plain_bytes.items() if k != "variance_update"
        }
        # The DDP path sends no flags (DDP knows which gradients exist).
        numel, tensors = 6 * 8 + 8 + 8 + 1, 4
        assert ddp_bytes["variance_update"] * (numel + tensors) == (
            plain_bytes["variance_update"] * numel
        )
