"""ZeroOneAdam in one process: its schedules as written, a world of one rank against the
float64 model of ALGORITHM.md's "0/1 Adam", non-finite gradients, bf16, checkpoints and
argument errors (the problem and its schedule: helpers/zero_one_adam_problem.py).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers.oracle_zero_one_adam import oracle_zero_one_adam
from helpers.zero_one_adam_problem import (
    EXCHANGE_PARAMS,
    EXCHANGES,
    HYPER,
    MASK,
    SCHEDULE,
    STEPS,
    build,
    grad_fn,
    initial_params,
    kind_of,
    lr_fn,
    train_step,
)

import onebit
from onebit.optim.zero_one_adam import (
    DEEPSPEED_SCHEDULE,
    is_variance_update_step,
    local_step_interval,
    step_kind,
)

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
    kinds = ("variance_update", "gradient_1bit", "local", "sync", "refresh")
    assert opt.bytes_sent == dict.fromkeys(kinds, 0)


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
        return optimizer, optimizer.schedule.first_local_exchange

    for freeze in (1, 2, 3, 5, 16, 17, 18, 100):
        for kappa in (1, 2, 3, 4, 15, 16, 17, 200):
            optimizer, found = built(freeze, kappa)
            walked = next(
                t for t in range(1, 10**4) if optimizer.kind_of_step(t) in (GRADIENT_1BIT, SYNC)
            )
            assert found == walked, (freeze, kappa)
    assert built(10**9, 10**9)[1] == 10**9 + 1
