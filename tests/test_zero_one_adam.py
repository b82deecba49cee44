"""ZeroOneAdam on real gloo processes against the float64 model of ALGORITHM.md's "0/1 Adam".

The schedule below puts every phase in 32 steps: variance updates at steps 1, 2, 4, 6, 8
and 12 (kappa = 2, freeze after 12), 1-bit gradients at 3, 5, 7, 9, 10 and 11, then
synchronisations every step (13-15), every 2 (16, 18) and every 4 steps (20, 24, 28, 32)
with local steps in between. With ``pre_freeze_exchange="momentum"`` the 1-bit gradient steps
are synchronisations instead.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections import defaultdict

import pytest
import torch
from helpers.oracle_zero_one_adam import oracle_zero_one_adam, padded
from helpers.traffic_probe import TrafficProbe

import onebit
from onebit.optim.zero_one_adam import (
    DEEPSPEED_SCHEDULE,
    is_variance_update_step,
    local_step_interval,
    step_kind,
)
from onebit.testing import spawn_workers

STEPS = 32
SCHEDULE = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
VARIANCE = {1, 2, 4, 6, 8, 12}
SYNCS = {13, 14, 15, 16, 18, 20, 24, 28, 32}
SHAPES = [(7, 5), (5,), (4,), (6, 2)]  # 56 elements in 4 tensors
BASE_LR = [0.02, 0.02, 0.01, 0.01]
DECAY = [0.01, 0.01, 0.0, 0.0]
MASK = torch.tensor([[1.0, 0.0]] * 6)  # the second column's momentum stays zero
HYPER = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=DECAY, **SCHEDULE)


EXCHANGES = ("gradient", "momentum")
#: The same as test parameters: DeepSpeed's (gradient) in the slow group, the default in both.
EXCHANGE_PARAMS = [pytest.param("gradient", marks=pytest.mark.slow), "momentum"]


def kind_of(t, exchange="gradient"):
    if t <= 12:
        if t in VARIANCE:
            return "variance_update"
        return "gradient_1bit" if exchange == "gradient" else "sync"
    return "sync" if t in SYNCS else "local"


def lr_fn(t, index):
    """A learning rate that changes every step (0.5, 1, 1.5 times the base, in turn), so
    that the accumulated update must weigh each step by its own rate."""
    return BASE_LR[index] * (0.5 + 0.5 * (t % 3))


def initial_params():
    gen = torch.Generator().manual_seed(42)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def grad_fn(rank, index, param):
    """Worker rank's gradient of tensor index at its own weights: a per-rank quadratic, zero
    in tensor 0's last row (a row that no input reads: variance 0, masked)."""
    gen = torch.Generator().manual_seed(1000 + 10 * rank + index)
    a = torch.rand(param.shape, generator=gen, dtype=torch.float64) + 0.5
    c = torch.randn(param.shape, generator=gen, dtype=torch.float64)
    grad = a.to(param.dtype) * (param - c.to(param.dtype))
    if index == 0:
        grad[-1] = 0
    return grad


def build(dtype, **options):
    params = [torch.nn.Parameter(p.clone().to(dtype)) for p in initial_params()]
    groups = [
        {"params": params[:2], "lr": BASE_LR[0], "weight_decay": DECAY[0]},
        {"params": params[2:], "lr": BASE_LR[2], "exp_avg_mask": [torch.ones(4), MASK]},
    ]
    options = DEEPSPEED_SCHEDULE | SCHEDULE | options
    return params, onebit.ZeroOneAdam(groups, betas=HYPER["betas"], **options)


def train_step(params, opt, rank, t):
    for group, first in zip(opt.param_groups, (0, 2), strict=True):
        group["lr"] = lr_fn(t, first)
    for index, p in enumerate(params):
        p.grad = grad_fn(rank, index, p.detach().double()).to(p.dtype)
    opt.step()


# ------------------------------------------------------------------ the schedules


def test_schedules_follow_the_written_examples():
    assert [t for t in range(1, 130) if is_variance_update_step(t, 16)] == [
        *range(1, 17),
        *range(18, 49, 2),
        *range(52, 113, 4),
        120,
        128,
    ]
    for exchange in EXCHANGES:
        steps = range(1, STEPS + 1)
        kinds = [step_kind(t, **SCHEDULE, pre_freeze_exchange=exchange) for t in steps]
        assert kinds == [kind_of(t, exchange) for t in steps]
    assert [local_step_interval(t, 12, 3, 4) for t in range(13, 25)] == [1] * 3 + [2] * 3 + [4] * 6
    # DeepSpeed's defaults: a synchronisation every step for 32678 steps after the freeze,
    # intervals 2, 4, 8, then 16 for ever.
    assert [local_step_interval(10 + 32678 * k + 1, 10, 32678, 16) for k in range(6)] == [
        1,
        2,
        4,
        8,
        16,
        16,
    ]


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
    per tensor and the backend code, a server scale per tensor, to n-1 peers)."""
    numel, k = sum(math.prod(s) for s in SHAPES), len(SHAPES)
    signs = 2 * (n - 1) * sum(padded(math.prod(s), n) for s in SHAPES) // n // 8
    one_bit = signs + (2 * k + 1) * elem * (n - 1)
    return {
        "variance_update": 2 * (n - 1) * (numel + k) * elem // n,
        "gradient_1bit": one_bit,
        "local": 0,
        "sync": one_bit,
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


def test_a_checkpoint_inside_a_local_interval_survives_a_load_and_save():
    params, opt = build(torch.float32)
    for t in range(1, 18):  # 17: a local step
        train_step(params, opt, 0, t)
    saved = copy.deepcopy(opt.state_dict())  # as saved to a file
    own = [state["local_param"] for state in saved["state"].values()]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # whatever the model holds, the optimizer state restores them
    opt.load_state_dict(saved)
    assert all(torch.equal(p.detach(), weights) for p, weights in zip(params, own, strict=True))
    again = opt.state_dict()  # before any step
    assert all(
        torch.equal(state["local_param"], weights)
        for state, weights in zip(again["state"].values(), own, strict=True)
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


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("exchange", EXCHANGE_PARAMS)
def test_world_size_one_matches_the_model(exchange):
    params, opt = build(torch.float64, pre_freeze_exchange=exchange)
    hyper = dict(HYPER, pre_freeze_exchange=exchange)
    expected = oracle_zero_one_adam(
        initial_params(), grad_fn, lr_fn, 1, STEPS, hyper, masks=[None, None, None, MASK]
    )
    for t in range(1, STEPS + 1):
        train_step(params, opt, 0, t)
        for got, ref in zip(params, expected[t - 1][0], strict=True):
            torch.testing.assert_close(got.detach(), ref, rtol=1e-9, atol=1e-9)
    assert opt.bytes_sent == dict.fromkeys(("variance_update", "gradient_1bit", "local", "sync"), 0)


def test_a_non_finite_local_gradient_is_ignored_on_that_rank():
    params, opt = build(torch.float32)
    for t in range(1, 17):
        train_step(params, opt, 0, t)
    assert opt.stage == "local"
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite local gradients at step 17"):
        opt.step()
    assert opt.step_count == 17 and opt.skipped_steps == 1 and opt.stage == "sync"
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    train_step(params, opt, 0, 18)  # the synchronisation runs as on every other rank
    assert all(torch.isfinite(p).all() for p in params)
    strict_params, strict = build(torch.float32, on_nonfinite="raise")
    for t in range(1, 17):
        train_step(strict_params, strict, 0, t)
    for p in strict_params:
        p.grad = torch.full_like(p, float("inf"))
    with pytest.raises(onebit.NonFiniteError, match="on this rank"):
        strict.step()


def test_a_non_finite_gradient_in_a_synchronised_step_before_the_freeze():
    """With pre_freeze_exchange="momentum" a 1-bit step before the freeze uses this rank's
    own gradient, as a synchronisation after it does: a non-finite one is ignored here."""
    params, opt = build(torch.float32, pre_freeze_exchange="momentum")
    train_step(params, opt, 0, 1)
    train_step(params, opt, 0, 2)
    assert opt.stage == "sync"
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    with pytest.warns(RuntimeWarning, match="step 3 \\(a sync step"):
        opt.step()
    assert opt.step_count == 3 and opt.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in params)


def test_bf16_parameters_track_fp32_parameters():
    torch.manual_seed(0)
    init, targets = torch.randn(64), torch.randn(64)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(init.clone().to(dtype))
        opt = onebit.ZeroOneAdam([p], lr=0.01, **(DEEPSPEED_SCHEDULE | SCHEDULE))
        for _ in range(STEPS):
            p.grad = (p.detach().float() - targets).to(dtype)
            opt.step()
        runs[dtype] = (p, opt)
    p16, opt16 = runs[torch.bfloat16]
    assert opt16.state[p16]["master_param"].dtype == torch.float32
    assert opt16.state[p16]["synced_param"].dtype == torch.float32
    p32 = runs[torch.float32][0].detach()
    assert ((p16.float() - p32).norm() / p32.norm()).item() < 0.02


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"var_freeze_step": 0}, "var_freeze_step"),
        ({"var_update_scaler": 0}, "var_update_scaler"),
        ({"local_step_scaler": 1.5}, "local_step_scaler"),
        ({"local_step_clipper": True}, "local_step_clipper"),
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite"),
        ({"pre_freeze_exchange": "momentum_1bit"}, "pre_freeze_exchange"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_checkpoint_of_another_optimizer_is_rejected():
    _, zero_one = build(torch.float32)
    adam = onebit.OneBitAdam([torch.nn.Parameter(p) for p in initial_params()], freeze_step=2)
    with pytest.raises(ValueError, match="saved by OneBitAdam, not by ZeroOneAdam"):
        zero_one.load_state_dict(adam.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero_one.load_state_dict(zero_one.state_dict())


@pytest.mark.parametrize("pre_freeze_exchange", ["gradient", "momentum"])
def test_the_first_exchanging_step_is_found_without_walking_the_schedule(pre_freeze_exchange):
    """The step whose local values are checked first: the first 1-bit gradient or sync of
    the schedule, found from kappa and T (a walk took minutes with kappa = T = 10^9)."""
    from onebit.optim.zero_one_adam import GRADIENT_1BIT, SYNC

    def built(freeze: int, kappa: int):
        params = [torch.nn.Parameter(torch.zeros(3))]
        optimizer = onebit.ZeroOneAdam(
            params,
            var_freeze_step=freeze,
            var_update_scaler=kappa,
            pre_freeze_exchange=pre_freeze_exchange,
            var_warmup_steps=None,
        )
        return optimizer, optimizer._first_local_exchange

    for freeze in (1, 2, 3, 5, 16, 17, 18, 100):
        for kappa in (1, 2, 3, 4, 15, 16, 17, 200):
            optimizer, found = built(freeze, kappa)
            walked = next(
                t for t in range(1, 10**4) if optimizer.kind_of_step(t) in (GRADIENT_1BIT, SYNC)
            )
            assert found == walked, (freeze, kappa)
    assert built(10**9, 10**9)[1] == 10**9 + 1
