"""onebit.clip_grad_norm_: the mean gradient at max_norm, a rank's own at max_norm·√W
(ALGORITHM.md, "Gradient clipping when step() uses each rank's own gradient")."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.gradients import params_with_gradient, set_gradient

import onebit
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE


def _norm(params: list[torch.nn.Parameter]) -> float:
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))


def _compressing(optimizer: onebit.OneBitLamb | onebit.OneBitAdam, norm: float) -> None:
    """Run the optimizer's warm-up (world of one rank), then give its parameters a gradient
    of the given norm for its first compression step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    while optimizer.stage != "compression":
        set_gradient(params, 1.0)
        optimizer.step()
    set_gradient(params, norm)


@pytest.mark.parametrize("workers", [1, 4, 64])
@pytest.mark.parametrize("kind", [onebit.OneBitLamb, onebit.OneBitAdam])
def test_own_gradients_are_clipped_at_max_norm_times_root_workers(kind, workers):
    params = params_with_gradient(1.0)
    optimizer = kind(params, freeze_step=2)
    _compressing(optimizer, 100.0)
    returned = onebit.clip_grad_norm_(params, 0.5, optimizer, workers=workers)
    assert float(returned) == pytest.approx(100.0, rel=1e-6)
    assert _norm(params) == pytest.approx(0.5 * math.sqrt(workers), rel=1e-5)


def test_a_small_own_gradient_is_left_alone():
    params = params_with_gradient(1.0)
    optimizer = onebit.OneBitLamb(params, freeze_step=1)
    _compressing(optimizer, 3.0)
    before = [p.grad.clone() for p in params]
    onebit.clip_grad_norm_(params, 1.0, optimizer, workers=16)  # threshold 4 > 3
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: onebit.Lamb(ps),
        lambda ps: onebit.OneBitLamb(ps, freeze_step=5),  # warm-up: averaged gradients
        lambda ps: onebit.ZeroOneAdam(ps),  # its first steps update the variance
        lambda ps: torch.optim.SGD(ps, lr=0.1),
    ],
)
def test_averaged_gradients_are_clipped_as_torch_clips_them(make):
    params, reference = params_with_gradient(10.0), params_with_gradient(10.0)
    returned = onebit.clip_grad_norm_(params, 0.5, make(params), workers=64)
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    assert torch.equal(returned, expected)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(params, reference, strict=True))


def test_zero_one_adam_clips_its_one_bit_gradient_steps_locally():
    params = params_with_gradient(1.0)
    optimizer = onebit.ZeroOneAdam(params, var_update_scaler=1, **DEEPSPEED_SCHEDULE)
    for _ in range(2):  # with κ = 1 steps 1, 2, 4, 8, ... update the variance; 3 does not
        optimizer.step()
    assert not optimizer.needs_averaged_gradients
    set_gradient(params, 10.0)
    onebit.clip_grad_norm_(params, 0.5, optimizer, workers=9)
    assert _norm(params) == pytest.approx(0.5 * 3, rel=1e-5)


@pytest.mark.parametrize(
    ("max_norm", "workers", "message"),
    [
        (0.0, None, "max_norm"),
        (-1.0, None, "max_norm"),
        (float("nan"), None, "max_norm"),
        (float("inf"), None, "max_norm"),
        (1.0, 0, "workers"),
        (1.0, 2.0, "workers"),
        (1.0, True, "workers"),
    ],
)
def test_bad_arguments_name_the_problem_and_leave_the_gradients(max_norm, workers, message):
    params = params_with_gradient(10.0)
    before = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match=message):
        onebit.clip_grad_norm_(params, max_norm, onebit.Lamb(params), workers=workers)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True))
