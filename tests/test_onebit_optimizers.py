"""OneBitLamb and OneBitAdam on real gloo processes against the float64 model of the spec."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from helpers.onebit_problem import (
    FREEZE,
    GROUP_HYPER,
    HYPER,
    MASK,
    STEPS,
    _uninterrupted_and_resumed,
    assert_follows_model_and_ranks_agree,
    assert_resumed_runs_are_exact,
    build,
    grad_fn,
    initial_params,
    set_grads,
)
from helpers.oracle_onebit import oracle_run

import onebit
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE
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
        gradient_check = 8 * (n - 1)  # one int64 checksum per peer, at the first compression step
        assert run["bytes"] == {
            "warmup": FREEZE * dense,
            "compression": (STEPS - FREEZE) * compressed + gradient_check,
        }
        if kind == "lamb":
            assert len(run["coeffs"]) == 4


def test_resume_from_compression_stage_checkpoint_is_bit_identical(tmp_path):
    runs = spawn_workers(
        _uninterrupted_and_resumed, 2, args=(str(tmp_path), FREEZE + 7), timeout_s=120
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


# ------------------------------------------------------------------ single-process edges


@pytest.mark.parametrize("compression", ["fused", "per_tensor"])
@pytest.mark.parametrize("kind", ["lamb", "adam"])
def test_world_size_one_matches_the_model(kind, compression):
    params, opt = build(kind, torch.float64, compression)
    expected = oracle_run(
        kind,
        initial_params(),
        grad_fn,
        1,
        STEPS,
        FREEZE,
        GROUP_HYPER,
        HYPER,
        [None, None, None, MASK],
        compression=compression,
    )
    for step in range(STEPS):
        set_grads(params, 0)
        opt.step()
        for got, ref in zip(params, expected[step], strict=True):
            torch.testing.assert_close(got.detach(), ref, rtol=1e-9, atol=1e-9)


def test_parameters_without_gradients_are_left_alone():
    used = torch.nn.Parameter(torch.randn(10))
    unused = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    before = (unused.detach().clone(), frozen.detach().clone())
    opt = onebit.OneBitLamb([used, unused, frozen], freeze_step=3, weight_decay=0.1)
    for _ in range(8):
        used.grad = torch.randn(10)
        opt.step()
    assert torch.equal(unused, before[0]) and torch.equal(frozen, before[1])
    assert opt.stage == "compression" and opt.step_count == 8


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: onebit.OneBitLamb(ps, lr=0.01, freeze_step=4),
        lambda ps: onebit.OneBitAdam(ps, lr=0.01, freeze_step=4, compression="fused"),
        lambda ps: onebit.OneBitAdam(ps, lr=0.01, freeze_step=4),  # per tensor
        lambda ps: onebit.ZeroOneAdam(
            ps, lr=0.01, var_update_scaler=2, **(DEEPSPEED_SCHEDULE | {"var_freeze_step": 8})
        ),
    ],
)
def test_an_embedding_row_no_input_reads_stays_where_it_is(make):
    """Its gradient, and so its variance, is always 0; the 1-bit exchange gives it ±scale,
    which the mask [v > 0] keeps out (without it the row moves by scale/eps: ~1e5 here)."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(5, 8)
    read, unread = embedding.weight.detach()[:4].clone(), embedding.weight.detach()[4].clone()
    optimizer = make(embedding.parameters())
    for _ in range(16):
        optimizer.zero_grad()
        embedding(torch.randint(0, 4, (32,))).square().sum().backward()
        optimizer.step()
    assert optimizer.step_count == 16
    assert torch.equal(embedding.weight.detach()[4], unread)
    moved = (embedding.weight.detach()[:4] - read).norm()
    assert 0 < moved < 100  # the read rows learn, by ordinary steps


def test_bf16_parameters_track_fp32_parameters():
    torch.manual_seed(0)
    init = torch.randn(64)
    targets = torch.randn(64)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(init.clone().to(dtype))
        opt = onebit.OneBitLamb([p], lr=0.01, freeze_step=5)
        for _ in range(20):
            p.grad = (p.detach().float() - targets).to(dtype)
            opt.step()
        runs[dtype] = (p, opt)
    p16, opt16 = runs[torch.bfloat16]
    assert opt16.state[p16]["master_param"].dtype == torch.float32
    assert opt16.state[p16]["exp_avg"].dtype == torch.float32
    p32 = runs[torch.float32][0].detach()
    # bf16 rounding of the parameters (2^-8 relative) changes the gradients a little and a
    # few signs in the 1-bit exchange; the trajectories must still agree closely.
    assert ((p16.float() - p32).norm() / p32.norm()).item() < 0.02


def test_loading_into_another_world_size_resets_error_buffers_once():
    params, opt = build("lamb", torch.float32)
    for _ in range(FREEZE + 3):
        set_grads(params, 0)
        opt.step()
    state = opt.state_dict()
    assert state["onebit"]["worker_error"].abs().sum() > 0
    state["onebit"]["world_size"] = 4  # as if saved by a 4-rank job
    params2, opt2 = build("lamb", torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(state)
    assert sum("world size 4" in str(w.message) for w in caught) == 1
    set_grads(params2, 0)
    opt2.step()  # runs with fresh, correctly sized error buffers
    assert opt2.state_dict()["onebit"]["worker_error"].numel() == onebit.padded_size(56, 1)


def test_only_lamb_optimizers_have_trust_ratio_coefficients():
    params, adam = build("adam", torch.float32)
    assert not hasattr(adam, "get_lamb_coeffs")  # 1-bit Adam has no trust ratio


def test_checkpoint_from_another_optimizer_is_rejected():
    _, lamb = build("lamb", torch.float32)
    _, adam = build("adam", torch.float32)
    with pytest.raises(ValueError, match="saved by OneBitAdam, not by OneBitLamb"):
        lamb.load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="not by OneBitLamb"):
        lamb.load_state_dict(onebit.Lamb([torch.nn.Parameter(torch.zeros(1))]).state_dict())


def test_checkpoint_loads_with_weights_only():
    params, opt = build("lamb", torch.float32)
    for _ in range(FREEZE + 2):
        set_grads(params, 0)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    _, opt2 = build("lamb", torch.float32)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt2.step_count == FREEZE + 2 and opt2.stage == "compression"


def test_wrong_mask_shape_is_rejected_at_construction():
    p = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"exp_avg_mask .* shape \(2, 3\).*shape \(3, 2\)"):
        onebit.OneBitLamb([{"params": [p], "exp_avg_mask": torch.ones(2, 3)}])
    optimizer = onebit.OneBitLamb([torch.nn.Parameter(torch.zeros(4))])
    later = (q for q in [p])  # a generator, as model.parameters() is
    with pytest.raises(ValueError, match="exp_avg_mask must be a tensor or a list"):
        optimizer.add_param_group({"params": later, "exp_avg_mask": [torch.ones(3, 2)] * 2})
    assert len(optimizer.param_groups) == 1  # the rejected group was not added
    optimizer.add_param_group({"params": (q for q in [p]), "exp_avg_mask": torch.ones(3, 2)})
    assert optimizer.param_groups[1]["params"] == [p]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"freeze_step": 0}, "freeze_step"),
        ({"freeze_step": -5}, "freeze_step"),
        ({"lr": -0.1}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"factor_min": 2.0, "factor_max": 1.0}, "factor_min"),
        ({"coeff_beta": 1.0}, "coeff_beta"),
        ({"factor_threshold": -0.1}, "factor_threshold"),
        ({"min_coeff": 0.0}, "min_coeff"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        onebit.OneBitLamb([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_sparse_gradients_are_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = onebit.OneBitAdam(emb.parameters(), freeze_step=2)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()


def test_spawn_failure_is_reported():
    with pytest.raises(WorkerError):
        spawn_workers(_mismatched_start, 2, args=("values",), timeout_s=0.001)
