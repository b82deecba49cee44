"""OneBitLamb and OneBitAdam on real gloo processes against the float64 model of the spec."""

from __future__ import annotations

import pytest
import torch
from helpers.onebit_problem import (
    FREEZE,
    GROUP_HYPER,
    HYPER,
    MASK,
    STEPS,
    assert_follows_model_and_ranks_agree,
    assert_resumed_runs_are_exact,
    build,
    grad_fn,
    initial_params,
    set_grads,
    uninterrupted_and_resumed,
)
from helpers.oracle_onebit import oracle_run

import onebit
from onebit.testing import WorkerError, spawn_workers


def _trajectories(rank, world_size):
    out = {}
    for kind, dtype in (("lamb", torch.float64), ("adam", torch.float64), ("lamb", torch.float32)):
        params, opt = build(kind, dtype)
        history, stages = [], []
        for _ in range(STEPS):
            stages.append(opt.stage)
            set_grads(params, rank)
            opt.step()
            history.append([p.detach().clone() for p in params])
        out[(kind, dtype)] = {
            "history": history,
            "stages": stages,
            "bytes": opt.bytes_sent,
            "coeffs": opt.get_lamb_coeffs() if kind == "lamb" else None,
        }
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_follows_float64_model_and_ranks_stay_bit_identical(world_size):
    results = spawn_workers(_trajectories, world_size, timeout_s=180)
    masks = [None, None, None, MASK]
    for (kind, dtype), run in results[0].items():
        expected = oracle_run(
            kind, initial_params(), grad_fn, world_size, STEPS, FREEZE, GROUP_HYPER, HYPER, masks
        )
        # float64 on both sides: the only differences are summation orders (~1e-16), so
        # 1e-9 catches any formula error (which shows at >= 1e-4) with a wide margin.
        # float32: rounding of ~1e-7 per operation over 32 steps, amplified by the trust
        # ratios; 2e-4 relative is still far below a formula error.
        tol = 1e-9 if dtype == torch.float64 else 2e-4
        histories = [results[rank][(kind, dtype)]["history"] for rank in range(world_size)]
        assert_follows_model_and_ranks_agree(histories, expected, tol, f"{kind} {dtype}")
        assert run["stages"] == ["warmup"] * FREEZE + ["compression"] * (STEPS - FREEZE)
        # The masked column's momentum stays zero, so those entries only follow weight decay 0.
        assert torch.equal(run["history"][-1][3][:, 1], run["history"][FREEZE - 1][3][:, 1])
        n = world_size
        elem = 8 if dtype == torch.float64 else 4
        dense = 2 * (n - 1) * (56 + 4) * elem // n
        padded = onebit.padded_size(56, n)
        compressed = 2 * (n - 1) * (padded // n) // 8 + 3 * elem * (n - 1)  # 3 scales a peer
        compressed += 2 * (n - 1) * 4 // n  # a byte per tensor: did a rank have its gradient
        gradient_check = 8 * (n - 1)  # one int64 checksum per peer, at the first compression step
        assert run["bytes"] == {
            "warmup": FREEZE * dense,
            "compression": (STEPS - FREEZE) * compressed + gradient_check,
            "refresh": 0,
        }
        if kind == "lamb":
            assert len(run["coeffs"]) == 4


def test_resume_from_compression_stage_checkpoint_is_bit_identical(tmp_path):
    runs = spawn_workers(
        uninterrupted_and_resumed, 2, args=(str(tmp_path), FREEZE + 7), timeout_s=120
    )
    assert_resumed_runs_are_exact(runs)


def _plain_or_ddp(rank, world_size, use_ddp):
    torch.manual_seed(0)  # identical initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = onebit.OneBitLamb(model.parameters(), lr=0.01, freeze_step=4, weight_decay=0.01)
    if use_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
        onebit.ddp.register_comm_hook(model, opt)
    gen = torch.Generator().manual_seed(100 + rank)
    history, synced = [], []
    for _ in range(12):
        x = torch.randn(16, 6, generator=gen)
        y = x.sum(1, keepdim=True)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        synced.append(getattr(model, "require_backward_grad_sync", None))
        loss.backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history, opt.bytes_sent, synced


def _plain_and_ddp(rank, world_size):
    return _plain_or_ddp(rank, world_size, False), _plain_or_ddp(rank, world_size, True)


def test_plain_loop_and_ddp_hook_give_the_same_trajectory():
    runs = spawn_workers(_plain_and_ddp, 2, timeout_s=120)
    plain, ddp = [run[0] for run in runs], [run[1] for run in runs]
    for rank in range(2):
        for step, (a, b) in enumerate(zip(plain[rank][0], ddp[rank][0], strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step + 1}"
        # DDP synchronises gradients in the warm-up only: no bucket copies afterwards.
        assert ddp[rank][2] == [True] * 4 + [False] * 8
        # The DDP path sends no flags (DDP knows which gradients exist) and the same
        # compressed bytes.
        assert ddp[rank][1]["compression"] == plain[rank][1]["compression"]
        assert 0 < ddp[rank][1]["warmup"] <= plain[rank][1]["warmup"]


def _mismatched_start(rank, world_size, mismatch):
    torch.manual_seed(rank if mismatch == "values" else 0)
    width = 3 + rank if mismatch == "shapes" else 3
    params = [torch.nn.Parameter(torch.randn(4, width)), torch.nn.Parameter(torch.randn(4))]
    if mismatch == "count" and rank == 1:
        params.append(torch.nn.Parameter(torch.randn(2)))
    opt = onebit.OneBitLamb(params, freeze_step=2)
    for p in params:
        p.grad = torch.ones_like(p)
    try:
        opt.step()
    except onebit.ReplicaMismatchError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    ("mismatch", "expected"),
    [
        ("values", "parameter 0 (shape (4, 3) on this rank) differs between rank 0 and rank 1"),
        ("shapes", "number of elements 12 != 16"),
        ("count", "different numbers of parameter tensors at step 1: [2, 3]"),
    ],
)
def test_ranks_that_start_differently_get_a_clear_error_on_every_rank(mismatch, expected):
    messages = spawn_workers(_mismatched_start, 2, args=(mismatch,), timeout_s=60)
    for message in messages:
        assert message is not None and expected in message


def test_spawn_failure_is_reported():
    with pytest.raises(WorkerError):
        spawn_workers(_mismatched_start, 2, args=("values",), timeout_s=0.001)
