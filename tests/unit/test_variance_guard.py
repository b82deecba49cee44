"""The guard after the freeze (ALGORITHM.md, "The guard after the freeze"), in one process: when
it finds the frozen variance fallen behind and when the refresh ends, against a float64 model
of both statistics from the recorded momenta and the gradients; the learning rate's part; what
the return and the second freeze do to the state; "warn" and "off"; resume; argument errors.
The refresh's trajectory against the model of the whole algorithm, on real ranks:
distributed/test_variance_guard_on_ranks.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import onebit
from onebit.optim._readiness import READINESS_WINDOW, READY_RATIO
from onebit.optim._variance_guard import GROWTH_LIMIT, GUARD_WINDOW

SHAPES = [(6, 4), (5,), (3, 3)]
BETA2 = 0.999
FREEZE = 10
STEPS = 90
LR = 1e-4


def scale(step: int) -> float:
    """The gradients' size: constant, then growing 25 % a step from step 25 to 45, then
    constant at that size (a growth that starts after the freeze and ends)."""
    return 1.25 ** (min(max(step, 25), 45) - 25)


def gradient(step: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + index)
    return torch.randn(SHAPES[index], generator=generator, dtype=torch.float64) * scale(step)


def build(optimizer=onebit.OneBitAdam, **options):
    """The optimizer with its variance frozen after step FREEZE, every step before dense (0/1
    Adam: a synchronisation every step after it, its default local_step_scaler)."""
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    if optimizer is onebit.ZeroOneAdam:
        freeze = {"var_freeze_step": FREEZE, "var_warmup_steps": FREEZE}
    else:
        freeze = {"freeze_step": FREEZE}
    options = {"lr": LR, "betas": (0.9, BETA2), **freeze, **options}
    return params, optimizer(params, **options)


#: The kinds of step whose momentum the guard observes: the exchanged one, or 0/1 Adam's rebuilt.
OBSERVED = ("compression", "sync")


def run(optimizer, params, steps, first=1, rate=None):
    """Steps ``first ..``; the momenta (float64) after each applied step the guard observes."""
    momenta = {}
    for step in range(first, first + steps):
        if rate is not None:
            for group in optimizer.param_groups:
                group["lr"] = rate(step)
        for index, p in enumerate(params):
            p.grad = gradient(step, index).float()
        kind = optimizer.stage
        optimizer.step()
        if kind in OBSERVED:
            momenta[step] = [optimizer.state[p]["exp_avg"].double().clone() for p in params]
    return momenta


def expected_refresh(momenta, rate=lambda step: LR):
    """The model: ``(first, last)`` of the first refresh, from the momenta of the compression
    steps since the freeze and the gradients (``last`` None if it does not end in the run)."""
    steps = sorted(momenta)
    energies = {s: torch.tensor([float(m.square().sum()) for m in momenta[s]]) for s in steps}

    def window(chunk):
        energy = sum(energies[s] for s in chunk) / GUARD_WINDOW
        stepped = sum(rate(s) ** 2 * energies[s] for s in chunk) / GUARD_WINDOW
        return energy, stepped

    base = window(steps[:GUARD_WINDOW])
    fired = None
    for end in range(2 * GUARD_WINDOW, len(steps) + 1, GUARD_WINDOW):
        now = window(steps[end - GUARD_WINDOW : end])
        growth = torch.minimum(now[0] / base[0], now[1] / base[1])
        if float(growth.max()) > GROWTH_LIMIT:
            fired = steps[end - 1]
            break
    if fired is None:
        return None
    first = fired + 1
    # The variance over every dense step: the warm-up, then the refresh's steps.
    v = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
    dense = list(range(1, FREEZE + 1))
    peak, step = 0.0, first
    while step <= STEPS:
        dense = [*range(1, FREEZE + 1), *range(first, step + 1)]
        if (step - first + 1) % READINESS_WINDOW == 0:
            v = [torch.zeros(shape, dtype=torch.float64) for shape in SHAPES]
            for t in dense:
                v = [BETA2 * x + (1 - BETA2) * gradient(t, i) ** 2 for i, x in enumerate(v)]
            held = [float(x.sum()) / (1 - BETA2 ** len(dense)) for x in v]
            recent = dense[-READINESS_WINDOW:]
            largest = max(
                sum(float(gradient(t, i).square().sum()) for t in recent) / READINESS_WINDOW / h
                for i, h in enumerate(held)
            )
            peak = max(peak, largest)
            if largest <= max(READY_RATIO, peak / 2):
                return first, step
        step += 1
    return first, None


@pytest.mark.parametrize("optimizer", [onebit.OneBitAdam, onebit.OneBitLamb, onebit.ZeroOneAdam])
def test_the_refresh_starts_and_ends_where_the_model_says(optimizer):
    params, opt = build(optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        momenta = run(opt, params, STEPS)
    before_refresh = {s: m for s, m in momenta.items() if s < opt.refreshes[0][0]}
    expected = expected_refresh(before_refresh)
    assert expected is not None and expected[1] is not None  # the run covers both decisions
    assert opt.refreshes == [expected]
    first, last = expected
    dense, observed = (
        ("variance_update", "sync")
        if optimizer is onebit.ZeroOneAdam
        else (
            "warmup",
            "compression",
        )
    )
    kinds = [opt.kind_of_step(t) for t in range(1, STEPS + 1)]
    assert kinds == (
        [dense] * FREEZE
        + [observed] * (first - 1 - FREEZE)
        + ["refresh"] * (last - first + 1)
        + [observed] * (STEPS - last)
    )
    assert opt.variance_updates(STEPS) == FREEZE + last - first + 1
    assert opt.freeze_step == FREEZE  # the first freeze
    guard = [w for w in caught if "fallen behind" in str(w.message)]
    assert len(guard) == 1 and f"after step {first - 1}" in str(guard[0].message)
    assert issubclass(guard[0].category, RuntimeWarning)
    assert guard[0].filename == __file__  # points at the caller of step()


def test_refresh_steps_update_the_variance_and_the_second_freeze_starts_the_stage_anew():
    params, opt = build(onebit.OneBitLamb)

    def state(name):
        return [opt.state[p][name].double().clone() for p in params]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while opt.stage != "refresh":  # up to the check that finds the variance behind
            run(opt, params, 1, first=opt.step_count + 1)
        assert any(bool(e.any()) for e in opt.error_feedback if e is not None)
        frozen = state("exp_avg_sq")
        run(opt, params, 1, first=opt.step_count + 1)
        # The return zeroed the error feedback; a refresh step updates v as the warm-up does.
        assert not any(bool(e.any()) for e in opt.error_feedback if e is not None)
        step = opt.step_count
        expected_v = [
            BETA2 * v + (1 - BETA2) * gradient(step, i).float().double() ** 2
            for i, v in enumerate(frozen)
        ]
        for got, want in zip(state("exp_avg_sq"), expected_v, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        while opt.stage == "refresh":
            run(opt, params, 1, first=opt.step_count + 1)
        v, m_prev = state("exp_avg_sq"), state("exp_avg")
        run(opt, params, 1, first=opt.step_count + 1)
    # The second freeze: v_fresh = copy(v), then one update with the gradient reconstructed
    # from the exchanged momentum; f_last from 1, so the factor is within 1 ± tau.
    for i, (fresh, m) in enumerate(zip(state("exp_avg_sq_fresh"), state("exp_avg"), strict=True)):
        g_hat = (m - 0.9 * m_prev[i]) / (1 - 0.9)
        torch.testing.assert_close(
            fresh, BETA2 * v[i] + (1 - BETA2) * g_hat**2, rtol=1e-4, atol=1e-12
        )
    factors = [float(opt.state[p]["last_factor"]) for p in params]
    assert all(0.9 - 1e-6 <= f <= 1.1 + 1e-6 for f in factors), factors
    assert opt.bytes_sent["refresh"] == 0  # one process sends nothing; the kind is counted


@pytest.mark.parametrize(
    "rate, fires",
    [
        (lambda step: LR, True),
        # The learning rate decays after the freeze faster than the momentum grows.
        (lambda step: LR * max(0.0, 1 - max(0, step - FREEZE) / 16), False),
    ],
)
def test_a_learning_rate_that_cut_the_steps_back_does_not_fire(rate, fires):
    params, opt = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        momenta = run(opt, params, 50, rate=rate)
    assert bool(opt.refreshes) == fires
    assert (expected_refresh(momenta, rate) is not None) == fires


def test_a_growth_of_the_learning_rate_alone_does_not_fire():
    """Gradients of constant size, the learning rate growing 30-fold after the freeze."""
    params, opt = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, 60):
            for group in opt.param_groups:
                group["lr"] = LR * min(30.0, 1.0 + max(0, step - FREEZE))
            for index, p in enumerate(params):
                generator = torch.Generator().manual_seed(100 * step + index)
                p.grad = torch.randn(SHAPES[index], generator=generator)
            opt.step()
    assert opt.refreshes == []


def test_warn_only_warns_once_and_changes_nothing():
    runs = {}
    for mode in ("off", "warn"):
        params, opt = build(variance_guard=mode)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(opt, params, STEPS)
        runs[mode] = [p.detach().clone() for p in params]
        found = [w for w in caught if "fallen behind" in str(w.message)]
        assert len(found) == (1 if mode == "warn" else 0)
        assert all("Nothing changes" in str(w.message) for w in found)
        assert opt.refreshes == [] and opt.variance_guard == mode
    assert all(torch.equal(a, b) for a, b in zip(runs["off"], runs["warn"], strict=True))


# In the baseline's window, in the window of the check that fires, at it, in the refresh.
@pytest.mark.parametrize(
    "optimizer, save_at",
    [(onebit.OneBitLamb, step) for step in (15, 35, 40, 45)]
    + [(onebit.ZeroOneAdam, step) for step in (35, 45)],
)
def test_a_resumed_run_takes_the_same_decisions(optimizer, save_at):
    params, opt = build(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(opt, params, save_at)
        saved = copy.deepcopy(opt.state_dict())  # the state holds views the run updates
        weights = [p.detach().clone() for p in params]
        run(opt, params, STEPS - save_at, first=save_at + 1)
        resumed_params, resumed = build(optimizer)
        with torch.no_grad():
            for p, w in zip(resumed_params, weights, strict=True):
                p.copy_(w)
        resumed.load_state_dict(saved)
        run(resumed, resumed_params, STEPS - save_at, first=save_at + 1)
    assert opt.refreshes and resumed.refreshes == opt.refreshes
    assert resumed.bytes_sent == opt.bytes_sent
    assert all(torch.equal(a, b) for a, b in zip(params, resumed_params, strict=True))


def test_a_checkpoint_without_the_guards_state_loads():
    """Checkpoints written before the guard: no refreshes, no "refresh" bytes, no statistic."""
    params, opt = build()
    run(opt, params, 12)
    saved = opt.state_dict()
    extra = saved["onebit"]
    del extra["variance_guard"], extra["refreshes"], extra["bytes_sent"]["refresh"]
    _, fresh = build()
    fresh.load_state_dict(saved)
    assert fresh.refreshes == [] and fresh.bytes_sent["refresh"] == 0


@pytest.mark.parametrize("value", ["refreshes", None, True, "Refresh"])
def test_an_unknown_mode_is_named_before_anything_changes(value):
    with pytest.raises(ValueError, match="variance_guard"):
        build(variance_guard=value)


def test_zero_one_adam_starts_its_local_intervals_again_after_a_refresh():
    """After the refresh's last step r the steps run as after T with T = r: a synchronisation
    when t mod H_t = 0, H_t = min(H, 2^floor((t - r - 1) / S)); the mask from the refreshed v;
    the refresh's steps dense, so the guard's refresh bytes are counted under "refresh"."""
    scaler, clipper = 4, 4
    params, opt = build(onebit.ZeroOneAdam, local_step_scaler=scaler, local_step_clipper=clipper)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(opt, params, 140)
    assert opt.refreshes and opt.refreshes[0][1] is not None
    first, last = opt.refreshes[0]

    def expected(t, freeze):
        interval = min(clipper, 2 ** ((t - freeze - 1) // scaler))
        return "sync" if t % interval == 0 else "local"

    assert [opt.kind_of_step(t) for t in range(FREEZE + 1, first)] == [
        expected(t, FREEZE) for t in range(FREEZE + 1, first)
    ]
    assert all(opt.kind_of_step(t) == "refresh" for t in range(first, last + 1))
    after = range(last + 1, 141)
    assert [opt.kind_of_step(t) for t in after] == [expected(t, last) for t in after]
    assert opt.kind_of_step(last + 1) == "sync"  # the interval starts at 1 again
    assert opt.var_freeze_step == FREEZE and opt.variance_updates(140) == FREEZE + last - first + 1
    assert set(opt.bytes_sent) == {"variance_update", "gradient_1bit", "local", "sync", "refresh"}


def test_zero_one_adam_watches_only_after_its_freeze():
    """Before T the variance is still updated on T_v: growing gradients among 1-bit steps
    there (DeepSpeed's spaced variance updates) start no refresh."""
    params, opt = build(
        onebit.ZeroOneAdam, var_freeze_step=STEPS, var_warmup_steps=4, var_update_scaler=2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(opt, params, STEPS)
    assert opt.refreshes == [] and opt.kind_of_step(STEPS - 1) in ("sync", "variance_update")
