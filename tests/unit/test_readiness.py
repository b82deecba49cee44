"""Variance readiness (ALGORITHM.md, "Variance readiness"): the statistic against a float64
model, the warning of a fixed freeze, ``freeze_step="auto"``, 0/1 Adam's first interval, resume,
argument errors, the job's freeze options (on the plateau task with real ranks:
distributed/test_readiness_on_ranks.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import onebit
from onebit.optim._readiness import READINESS_WINDOW, READY_RATIO
from onebit.optim.zero_one_adam import (
    DEEPSPEED_SCHEDULE,
    GRADIENT_1BIT,
    VARIANCE_UPDATE,
    is_variance_update_step,
    step_kind,
    variance_updates_until,
)

SHAPES = [(6, 4), (5,), (3, 3)]
BETA2 = [0.999, 0.99]


def scale(step: int, growth: str) -> float:
    """The gradients' size at ``step``: constant, growing 20% a step, or growing 20% a step
    from step 20 to 40 and then constant (a growth that ends)."""
    if growth == "none":
        return 1.0
    if growth == "steady":
        return 1.2**step
    return 1.2 ** (min(max(step, 20), 40) - 20)


def gradient(step: int, index: int, growth: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + index)
    return torch.randn(SHAPES[index], generator=generator, dtype=torch.float64) * scale(
        step, growth
    ) ** (1 + index / 4)


def build(freeze_step, **options):
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    groups = [
        {"params": params[:2], "betas": (0.9, BETA2[0])},
        {"params": params[2:], "betas": (0.9, BETA2[1])},
    ]
    return params, onebit.OneBitAdam(groups, lr=1e-4, freeze_step=freeze_step, **options)


def reference_ratios(step: int, growth: str) -> torch.Tensor:
    """R_j after ``step`` dense steps, from the gradients alone (float64)."""
    ratios = []
    for index in range(len(SHAPES)):
        beta2 = BETA2[0] if index < 2 else BETA2[1]
        v = torch.zeros(SHAPES[index], dtype=torch.float64)
        for t in range(1, step + 1):
            v = beta2 * v + (1 - beta2) * gradient(t, index, growth) ** 2
        window = range(step - READINESS_WINDOW + 1, step + 1)
        energy = sum(float(gradient(t, index, growth).square().sum()) for t in window)
        ratios.append(energy / READINESS_WINDOW / (float(v.sum()) / (1 - beta2**step)))
    return torch.tensor(ratios, dtype=torch.float64)


def run(optimizer, params, steps, growth, first=1):
    for step in range(first, first + steps):
        for index, p in enumerate(params):
            p.grad = gradient(step, index, growth).float()
        optimizer.step()


def test_statistic_equals_the_float64_model():
    params, optimizer = build(freeze_step=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(optimizer, params, 30, "steady")
    measured = optimizer.variance_readiness()
    assert measured is not None and measured.dtype == torch.float64
    torch.testing.assert_close(measured, reference_ratios(30, "steady"), rtol=2e-6, atol=0)


@pytest.mark.parametrize("growth", ["none", "steady"])
def test_a_fixed_freeze_warns_while_the_variance_falls_behind(growth):
    params, optimizer = build(freeze_step=30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(optimizer, params, 32, growth)  # and two compression steps
    messages = [str(w.message) for w in caught if "has settled" in str(w.message)]
    if growth == "none":
        assert messages == []
        assert float(reference_ratios(30, growth).max()) <= READY_RATIO
        return
    (message,) = messages
    expected = reference_ratios(30, growth)
    largest = int(expected.argmax())
    assert "freezes the variance (exp_avg_sq) after step 30" in message
    assert f"parameter {largest} (shape {list(SHAPES[largest])})" in message
    assert f"R = {float(expected.max()):.3g}" in message and "freeze_step='auto'" in message
    assert float(reference_ratios(20, growth).max()) < float(expected.max())  # still rising


def test_auto_freezes_at_the_first_check_after_the_growth_has_ended():
    params, optimizer = build(freeze_step="auto", max_freeze_step=200)
    peak, expected = 0.0, None
    for check in range(READINESS_WINDOW, 200, READINESS_WINDOW):
        largest = float(reference_ratios(check, "ends").max())
        peak = max(peak, largest)
        if peak > READY_RATIO and largest <= max(READY_RATIO, peak / 2):
            expected = check
            break
    assert expected is not None and expected > 40  # the growth ends at step 40
    run(optimizer, params, expected + 2, "ends")
    assert optimizer.freeze_step == expected
    assert optimizer.kind_of_step(expected + 1) == "compression"
    assert optimizer.bytes_sent["compression"] == 0  # world of one rank: counted, nothing sent
    assert optimizer.step_count == expected + 2


def test_auto_without_a_growth_freezes_at_its_bound():
    params, optimizer = build(freeze_step="auto", max_freeze_step=40)
    run(optimizer, params, 45, "none")
    assert optimizer.freeze_step == 40 and optimizer.stage == "compression"


def test_auto_resumes_exactly_from_a_checkpoint_taken_before_the_decision():
    params, straight = build(freeze_step="auto", max_freeze_step=200)
    run(straight, params, 100, "ends")
    first_params, first = build(freeze_step="auto", max_freeze_step=200)
    run(first, first_params, 35, "ends")  # after the peak's first check, before the decision
    assert first._readiness.statistic.peak > READY_RATIO and first.freeze_step == 200
    saved = first.state_dict()
    resumed_params, resumed = build(freeze_step="auto", max_freeze_step=200)
    for p, q in zip(resumed_params, first_params, strict=True):
        p.data.copy_(q.detach())
    resumed.load_state_dict(saved)
    run(resumed, resumed_params, 65, "ends", first=36)
    assert resumed.freeze_step == straight.freeze_step < 100
    for p, q in zip(resumed_params, params, strict=True):
        assert torch.equal(p, q)
    after = resumed.state_dict()  # a checkpoint after the decision restores where it froze
    _, again = build(freeze_step="auto", max_freeze_step=200)
    again.load_state_dict(after)
    assert again.freeze_step == straight.freeze_step


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"freeze_step": "sometimes"}, "Invalid freeze_step='sometimes'"),
        ({"freeze_step": 10, "max_freeze_step": 20}, "max_freeze_step=20 bounds freeze_step="),
        ({"freeze_step": "auto", "max_freeze_step": 0}, "Invalid max_freeze_step=0"),
    ],
)
def test_freeze_arguments_are_checked(kwargs, match):
    for cls in (onebit.OneBitLamb, onebit.OneBitAdam):
        with pytest.raises(ValueError, match=match):
            cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"var_freeze_step": "x"}, "Invalid var_freeze_step='x'"),
        ({"var_freeze_step": 5, "max_var_freeze_step": 9}, "max_var_freeze_step=9 bounds"),
        ({"var_warmup_steps": 0}, "Invalid var_warmup_steps=0"),
        ({"var_warmup_steps": "soon"}, "var_warmup_steps"),
    ],
)
def test_zero_one_adam_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize("kappa", [1, 2, 3, 16])
@pytest.mark.parametrize("first", [None, 1, 5, 23])
def test_variance_updates_count_the_schedule(kappa, first):
    for step in range(1, 300):
        brute = sum(is_variance_update_step(t, kappa, first) for t in range(1, step + 1))
        assert variance_updates_until(step, kappa, first) == brute
    first_steps = [t for t in range(1, 40) if is_variance_update_step(t, kappa, first)]
    holds = kappa if first is None else first
    assert first_steps[:holds] == list(range(1, holds + 1))
    assert first_steps[holds] == holds + 2 - holds % 2  # the interval of 2 follows


def zero_one(**options):
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    schedule = dict(var_update_scaler=3, local_step_scaler=4, local_step_clipper=4)
    return params, onebit.ZeroOneAdam(params, lr=1e-4, **schedule, **options)


def stages_of_a_growth_that_ends(optimizer, params, steps: int = 100) -> list[str]:
    """The stage of each of ``steps`` steps on gradients whose growth ends at step 40."""
    kinds = []
    for step in range(1, steps + 1):
        kinds.append(optimizer.stage)
        for index, p in enumerate(params):
            p.grad = gradient(step, index, "ends").float()
        optimizer.step()
    return kinds


def test_zero_one_adam_first_interval_lasts_until_the_variance_has_caught_up():
    params, optimizer = zero_one(var_freeze_step=150)
    assert optimizer.warmup_auto and optimizer.pre_freeze_exchange == "momentum"
    kinds = stages_of_a_growth_that_ends(optimizer, params)
    decided = optimizer.first_interval
    assert 40 < decided < 100 and decided % READINESS_WINDOW == 0
    assert set(kinds[:decided]) == {VARIANCE_UPDATE} and kinds[decided] == "sync"
    expected = [
        step_kind(t, 150, 3, 4, 4, "momentum", first_interval=decided) for t in range(1, 101)
    ]
    assert kinds == expected
    saved = optimizer.state_dict()
    _, resumed = zero_one(var_freeze_step=150)
    resumed.load_state_dict(saved)
    assert resumed.first_interval == decided and resumed.stage == optimizer.stage


def test_zero_one_adam_by_default_freezes_once_the_variance_has_caught_up():
    """Both "auto" (the defaults): every step dense until the variance has caught up, then
    frozen there; the synchronisation schedule counts from that step."""
    params, optimizer = zero_one()
    assert optimizer.auto_freeze and optimizer.freeze_step == DEEPSPEED_SCHEDULE["var_freeze_step"]
    kinds = stages_of_a_growth_that_ends(optimizer, params)
    frozen = optimizer.freeze_step
    assert 40 < frozen < 100 and frozen % READINESS_WINDOW == 0
    expected = [
        step_kind(t, frozen, 3, 4, 4, "momentum", first_interval=frozen) for t in range(1, 101)
    ]
    assert kinds == expected
    assert set(kinds[:frozen]) == {VARIANCE_UPDATE} and {"sync", "local"} <= set(kinds[frozen:])
    _, resumed = zero_one()
    resumed.load_state_dict(optimizer.state_dict())
    assert resumed.freeze_step == frozen and resumed.stage == optimizer.stage


def test_zero_one_adam_with_deepspeeds_schedule_warns_before_its_first_one_bit_step():
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    optimizer = onebit.ZeroOneAdam(params, var_update_scaler=23, **DEEPSPEED_SCHEDULE)
    assert optimizer.kind_of_step(24) == VARIANCE_UPDATE  # kappa = 23: the interval of 2 at 24
    assert optimizer.kind_of_step(25) == GRADIENT_1BIT
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(optimizer, params, 26, "steady")
    (message,) = [str(w.message) for w in caught if "has settled" in str(w.message)]
    assert "starts its 1-bit steps after step 24" in message
    assert "var_warmup_steps='auto'" in message


def test_from_deepspeed_config_builds_deepspeeds_schedule(caplog):
    config = {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 9}}}
    with caplog.at_level("INFO", logger="onebit"):
        optimizer = onebit.from_deepspeed_config(config, [torch.nn.Parameter(torch.zeros(2))])
    assert not optimizer.warmup_auto and optimizer.first_interval is None
    assert optimizer.pre_freeze_exchange == "gradient"
    assert optimizer.variance_guard == "off"
    assert (
        "DeepSpeed's choice (var_warmup_steps=None, pre_freeze_exchange='gradient', "
        "variance_guard='off')" in caplog.text
    )
    caplog.clear()
    config["optimizer"]["params"].pop("var_freeze_step")  # DeepSpeed's default T, not "auto"
    with caplog.at_level("INFO", logger="onebit"):
        optimizer = onebit.from_deepspeed_config(config, [torch.nn.Parameter(torch.zeros(2))])
    assert not optimizer.auto_freeze and optimizer.var_freeze_step == 100000
    assert "DeepSpeed's choice (var_freeze_step=100000, var_warmup_steps=None" in caplog.text
    optimizer = onebit.from_deepspeed_config(
        config, [torch.nn.Parameter(torch.zeros(2))], var_freeze_step="auto"
    )
    assert optimizer.auto_freeze and not optimizer.warmup_auto  # an option chooses onebit's


# ------------------------------------------------------------------ the job


def test_the_job_freezes_by_readiness_with_freeze_step_auto():
    from onebit.train.config import TrainConfig
    from onebit.train.gradients import build_optimizer
    from onebit.train.report import frozen_after

    config = TrainConfig(optimizer="onebit-adam", steps=90, freeze_step="auto").resolved()
    optimizer = build_optimizer(config, [torch.nn.Parameter(torch.zeros(3))])
    assert optimizer.auto_freeze and optimizer.freeze_step == 90  # bounded by --steps
    rows = [{"step": t, "stage": "warmup" if t <= 40 else "compression"} for t in range(1, 91)]
    assert frozen_after(config, rows) == 40
    assert frozen_after(TrainConfig(freeze_step=7).resolved(), rows) == 7
    zero_one = TrainConfig(optimizer="zero-one-adam", steps=90, freeze_step="auto").resolved()
    assert (zero_one.var_freeze_step, zero_one.local_step_scaler) == ("auto", 90 // 8)
    optimizer = build_optimizer(zero_one, [torch.nn.Parameter(torch.zeros(3))])
    assert optimizer.auto_freeze and optimizer.freeze_step == 90
    kinds = [{"step": t, "stage": VARIANCE_UPDATE if t <= 30 else "sync"} for t in range(1, 91)]
    assert frozen_after(zero_one, kinds) == 30
    for bad, match in (
        ({"freeze_step": 0}, "--freeze-step must be a positive integer"),
        ({"optimizer": "zero-one-adam", "var_freeze_step": "soon"}, "--var-freeze-step"),
        (
            {"optimizer": "zero-one-adam", "steps": 250, "var_freeze_step": 300},
            "--var-freeze-step must be in",
        ),
        ({"optimizer": "zero-one-adam", "var_warmup_steps": 0}, "--var-warmup-steps"),
    ):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad).resolved()
