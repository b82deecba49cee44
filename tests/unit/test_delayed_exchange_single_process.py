"""The delayed exchange in one process (ALGORITHM.md, "Delayed exchange"): what it refuses,
by name, before anything changes; the first step of the stage applies nothing; the pending
update is applied by the next step or by ``finish_exchange()``, and a checkpoint carries it;
between steps the parameters hold the prediction, written out here in float64, which keeps
a quadratic converging where gradients one update behind do not, while the shared weights
kept aside take the updates (also under bfloat16 parameters); a step that raises changes
nothing."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from torch import nn

import onebit

FREEZE = 2


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]


def _gradients(params, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(overlap_backward=True), "overlap_backward"),
        (dict(node_groups=(None, None)), "node_groups"),
        (dict(delayed_exchange=1), "delayed_exchange must be True or False"),
    ],
)
def test_combinations_it_cannot_run_are_refused_by_name(options, named):
    options = {"delayed_exchange": True, **options}
    with pytest.raises(ValueError, match=named):
        onebit.OneBitLamb(_params(), freeze_step=FREEZE, **options)


def test_zero_one_adam_has_no_delayed_exchange():
    with pytest.raises(TypeError, match="delayed_exchange"):
        onebit.ZeroOneAdam(_params(), delayed_exchange=True)


@pytest.mark.parametrize("cls", [onebit.OneBitLamb, onebit.OneBitAdam])
def test_the_pending_update_lands_at_the_next_step_or_when_finished(cls):
    params = _params()
    optimizer = cls(params, lr=0.01, freeze_step=FREEZE, delayed_exchange=True)
    assert optimizer.delayed_exchange
    for step in range(1, FREEZE + 1):
        _gradients(params, step)
        optimizer.step()
        assert not optimizer.update_pending
    before = [p.detach().clone() for p in params]
    _gradients(params, FREEZE + 1)
    optimizer.step()  # the stage's first step: its exchange starts, nothing is applied
    assert optimizer.update_pending
    shared = optimizer.shared_weights()
    assert all(torch.equal(a, w) for a, w in zip(before, shared, strict=True))
    assert not any(torch.equal(a, p) for a, p in zip(before, params, strict=True))  # predicted
    predicted = [p.detach().clone() for p in params]
    with optimizer.holding_shared_weights():
        assert all(torch.equal(w, p) for w, p in zip(shared, params, strict=True))
    assert all(torch.equal(w, p) for w, p in zip(predicted, params, strict=True))
    with pytest.raises(RuntimeError, match="finish_exchange"):
        optimizer.local_momentum()
    optimizer.finish_exchange()
    assert not optimizer.update_pending
    assert not any(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    shared = optimizer.shared_weights()
    assert all(torch.equal(w, p) for w, p in zip(shared, params, strict=True))
    optimizer.finish_exchange()  # nothing pending: nothing to do
    assert all(torch.equal(w, p) for w, p in zip(shared, params, strict=True))


@pytest.mark.parametrize(
    ("cls", "options"),
    [
        (onebit.OneBitLamb, dict(weight_decay=0.1, momentum_bound=False)),
        (onebit.OneBitLamb, dict(compression="fused", momentum_bound=False)),
        (onebit.OneBitLamb, dict(weight_decay=0.1, trust_bound=1.0, momentum_bound=False)),
        (onebit.OneBitLamb, dict(weight_decay=0.1)),  # momentum_bound, the default
        (onebit.OneBitAdam, dict(weight_decay=0.1)),
    ],
)
def test_the_parameters_hold_the_prediction_from_this_ranks_momentum(cls, options):
    """After each stage step: p = w - lr c (mask (b1 m + (1 - b1) g) / (sqrt(v) + eps) + wd w),
    w the shared weights, m the landed momentum, c the last update's coefficient (1-bit LAMB:
    c_frz f, or the trust bound where it held) or 1; an element that never had a gradient
    (v = 0) is masked, one whose gradient is not finite stays. With ``momentum_bound`` (1-bit
    LAMB's default) the momentum is clamped to ``+-B sqrt(v)``: an element whose gradients grow
    10^6-fold after the freeze reaches it."""
    momentum_bound = options.get("momentum_bound", cls is onebit.OneBitLamb)
    bounded, clamped = [], []
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3, dtype=torch.float64)) for _ in range(2)]
    lr, eps, (beta1, _) = 0.01, 1e-8, (0.9, 0.999)
    optimizer = cls(params, lr=lr, eps=eps, freeze_step=FREEZE, delayed_exchange=True, **options)
    for step in range(1, FREEZE + 5):
        generator = torch.Generator().manual_seed(step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            param.grad[0, 0] = 0.0  # never a gradient: v = 0 there
            if step <= FREEZE and momentum_bound:
                param.grad[1, 2] *= 1e-6
        if step == FREEZE + 3:
            params[1].grad[2, 1] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the non-finite step's skip
            optimizer.step()
        if step <= FREEZE:
            continue
        decay = options.get("weight_decay", 0.0)
        for param, shared in zip(params, optimizer.shared_weights(), strict=True):
            state = optimizer.state[param]
            coeff = 1.0
            if cls is onebit.OneBitLamb:
                coeff = float(state["lamb_coeff"])
                unbounded = float(state["lamb_coeff_freeze"]) * float(state["last_factor"])
                assert coeff <= unbounded
                bounded.append(coeff < unbounded)
                if "trust_bound" not in options:
                    assert coeff == unbounded
            v = state["exp_avg_sq"]
            local = (beta1 * state["exp_avg"] + (1 - beta1) * param.grad) * (v > 0)
            if momentum_bound:
                limit = 0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999)) * v.sqrt()
                clamped.append(bool((local.abs() > limit).any()))
                local = local.clamp(-limit, limit)
            move = lr * coeff * (local / (v.sqrt() + eps) + decay * shared)
            expected = torch.where(move.isfinite(), shared - move, shared)
            torch.testing.assert_close(param.detach(), expected, rtol=1e-13, atol=1e-15)
            assert torch.equal(
                param.detach()[0, 0], shared[0, 0] - lr * coeff * decay * shared[0, 0]
            )
        assert torch.isfinite(params[1]).all()
    assert any(bounded) == ("trust_bound" in options)
    assert any(clamped) == momentum_bound


def test_half_precision_parameters_hold_the_prediction_and_take_the_shared_weights_back():
    """bfloat16 parameters (fp32 masters in the optimizer): after each stage step they hold
    this rank's prediction, rounded, while the shared weights (fp32) stay aside and take
    each landed update; ``finish_exchange()`` gives them the shared weights, the last update
    applied, rounded, as a run without the delay ends (its exchange run at once)."""

    def run(delayed: bool) -> tuple[list[nn.Parameter], onebit.OneBitLamb]:
        params = [nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params()]
        optimizer = onebit.OneBitLamb(params, lr=0.05, freeze_step=FREEZE, delayed_exchange=delayed)
        for step in range(1, FREEZE + 5):
            generator = torch.Generator().manual_seed(step)
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            optimizer.step()
            if delayed and step > FREEZE:
                shared = optimizer.shared_weights()
                assert all(w.dtype == torch.float32 for w in shared)
                assert not all(
                    torch.equal(p, w.to(torch.bfloat16))
                    for p, w in zip(params, shared, strict=True)
                )
                with optimizer.holding_shared_weights():
                    assert all(
                        torch.equal(p, w.to(torch.bfloat16))
                        for p, w in zip(params, shared, strict=True)
                    )
        optimizer.finish_exchange()
        return params, optimizer

    late, late_optimizer = run(True)
    plain, plain_optimizer = run(False)
    assert all(torch.equal(a, b) for a, b in zip(late, plain, strict=True))
    assert torch.equal(
        torch.cat([w.reshape(-1) for w in late_optimizer.shared_weights()]),
        torch.cat([w.reshape(-1) for w in plain_optimizer.shared_weights()]),
    )


def test_a_raising_step_changes_nothing():
    """With ``on_nonfinite="raise"`` the step that finds the last exchange failed raises
    before changing anything: the parameters keep their prediction, the shared weights and
    the momentum stay as they were."""
    params = _params()
    optimizer = onebit.OneBitAdam(
        params, freeze_step=FREEZE, delayed_exchange=True, on_nonfinite="raise"
    )
    for step in range(1, FREEZE + 3):
        _gradients(params, step)
        if step == FREEZE + 2:
            params[0].grad[1, 1] = float("nan")  # this step's exchange fails
        optimizer.step()
    predicted = [p.detach().clone() for p in params]
    shared = optimizer.shared_weights()
    momentum = [optimizer.state[p]["exp_avg"].clone() for p in params]
    _gradients(params, FREEZE + 3)
    with pytest.raises(onebit.NonFiniteError, match=f"step {FREEZE + 2}"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(predicted, params, strict=True))
    assert all(torch.equal(a, w) for a, w in zip(shared, optimizer.shared_weights(), strict=True))
    for before, param in zip(momentum, params, strict=True):
        assert torch.equal(before, optimizer.state[param]["exp_avg"])


def _quadratic(lr: float, gradients_at: str, steps: int = 250) -> float:
    """Final loss of 1-bit Adam, delayed where ``gradients_at`` is not ``"undelayed"``, on
    ``sum_i h_i |x_i|^2 / 2``: gradients taken at the parameters (the prediction) or at the
    shared weights (one update behind)."""
    curvatures = [1.0, 3.0, 10.0]
    params = [nn.Parameter(torch.ones(4, dtype=torch.float64)) for _ in curvatures]
    optimizer = onebit.OneBitAdam(
        params,
        lr=lr,
        freeze_step=10,
        delayed_exchange=gradients_at != "undelayed",
        variance_guard="off",
    )
    for _ in range(steps):
        at = optimizer.shared_weights() if gradients_at == "shared" else params
        for param, weights, h in zip(params, at, curvatures, strict=True):
            param.grad = h * weights.detach().clone()
        optimizer.step()
    optimizer.finish_exchange()
    return sum(
        0.5 * h * float((p.detach() ** 2).sum()) for p, h in zip(params, curvatures, strict=True)
    )


@pytest.mark.parametrize("lr", [0.05, 0.1])
def test_the_prediction_keeps_a_quadratic_converging_where_stale_gradients_do_not(lr):
    assert _quadratic(lr, "undelayed") < 1e-5
    assert _quadratic(lr, "parameters") < 1e-5
    assert _quadratic(lr, "shared") > 0.1


def _two_steps_into_the_stage() -> tuple[list[nn.Parameter], onebit.OneBitLamb]:
    """Delayed 1-bit LAMB after ``FREEZE + 2`` steps: the second stage step's update pending."""
    params = _params()
    optimizer = onebit.OneBitLamb(params, freeze_step=FREEZE, delayed_exchange=True)
    for step in range(1, FREEZE + 3):
        _gradients(params, step)
        optimizer.step()
    return params, optimizer


def test_a_pending_update_is_refused_by_an_optimizer_without_the_delay():
    _, optimizer = _two_steps_into_the_stage()
    saved = optimizer.state_dict()
    assert saved["onebit"]["format"] == 4
    assert saved["onebit"]["pending_update"]["step"] == FREEZE + 2
    shared = torch.cat([w.reshape(-1) for w in optimizer.shared_weights()])
    assert torch.equal(saved["onebit"]["pending_update"]["shared_weights"], shared)
    assert optimizer.update_pending  # saving changed nothing
    plain = onebit.OneBitLamb(_params(), freeze_step=FREEZE)
    before = plain.state_dict()
    with pytest.raises(ValueError, match=f"update of step {FREEZE + 2}.*delayed_exchange=True"):
        plain.load_state_dict(saved)
    assert plain.state_dict()["onebit"] == before["onebit"]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    resumed = onebit.OneBitLamb(_params(), freeze_step=FREEZE, delayed_exchange=True)
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.update_pending


def test_without_anything_pending_the_checkpoint_keeps_its_format():
    params = _params()
    optimizer = onebit.OneBitLamb(params, freeze_step=FREEZE, delayed_exchange=True)
    _gradients(params, 1)
    optimizer.step()
    saved = optimizer.state_dict()["onebit"]
    assert saved["format"] == 2 and "pending_update" not in saved


def test_an_update_loaded_from_a_checkpoint_can_be_finished_before_any_step():
    """``finish_exchange()`` right after loading applies the saved update, as the run that
    saved it applies it."""
    params, optimizer = _two_steps_into_the_stage()
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)  # the state's own tensors change in place
    weights = [p.detach().clone() for p in params]
    optimizer.finish_exchange()
    loaded_params = [torch.nn.Parameter(w.clone()) for w in weights]
    loaded = onebit.OneBitLamb(loaded_params, freeze_step=FREEZE, delayed_exchange=True)
    saved.seek(0)
    loaded.load_state_dict(torch.load(saved))
    loaded.finish_exchange()
    assert not loaded.update_pending
    assert all(torch.equal(a, b) for a, b in zip(params, loaded_params, strict=True))
    assert not any(torch.equal(a, w) for a, w in zip(loaded_params, weights, strict=True))


def test_a_checkpoint_of_format_3_has_no_prediction_to_undo():
    """Format 3 (before the prediction) saved the shared weights in the parameters, with no
    copy: the update lands on the weights the model loads."""
    params, optimizer = _two_steps_into_the_stage()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    shared = optimizer.shared_weights()
    optimizer.finish_exchange()
    buffer.seek(0)
    saved = torch.load(buffer)
    for key in ("shared_weights", "bytes_sent"):
        del saved["onebit"]["pending_update"][key]
    for state in saved["state"].values():
        del state["local_param"]  # the prediction, which format 3 did not have
    saved["onebit"]["format"] = 3
    loaded_params = [torch.nn.Parameter(w.clone()) for w in shared]
    loaded = onebit.OneBitLamb(loaded_params, freeze_step=FREEZE, delayed_exchange=True)
    loaded.load_state_dict(saved)
    loaded.finish_exchange()
    assert all(torch.equal(a, b) for a, b in zip(params, loaded_params, strict=True))


def _fused_updates(name: str):
    if name == "numba":
        from onebit.kernels._numba_optim import NumbaUpdates

        return NumbaUpdates()
    from onebit.kernels._triton_optim import TritonUpdates

    return TritonUpdates()


@pytest.mark.parametrize("backend", ["numba", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_prediction_is_the_torch_references(backend, dtype):
    """numba's and Triton's one-pass prediction (Triton in its interpreter on CPU) against the
    reference, over two groups, the fused exchange's scaling, a mask, a parameter that takes
    no part and a non-finite momentum."""
    if backend not in onebit.kernels.available():
        pytest.skip(f"needs {backend}")
    from onebit.optim import functional
    from onebit.optim._flat import FlatState

    generator = torch.Generator().manual_seed(3)
    shapes = [(40, 30), (30,), (17, 5), (3,)]
    params = [nn.Parameter(torch.randn(s, generator=generator, dtype=dtype)) for s in shapes]
    groups = [
        {"lr": 0.02, "weight_decay": 0.01, "eps": 1e-8, "betas": (0.9, 0.999)},
        {"lr": 0.01, "weight_decay": 0.0, "eps": 1e-6, "betas": (0.8, 0.99)},
    ]
    flat = FlatState([(groups[index // 2], p) for index, p in enumerate(params)])
    flat.exp_avg_sq.copy_(torch.rand(flat.numel, generator=generator, dtype=dtype))
    flat.exp_avg_sq[::7] = 0
    mask = (flat.exp_avg_sq > 0).to(dtype)
    momentum = torch.randn(flat.numel + 5, generator=generator, dtype=dtype)
    momentum[11] = float("nan")
    scaling = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=dtype)
    coefficients = torch.rand(4, generator=generator, dtype=dtype)
    active = [True, True, False, True]
    shared = flat.weights.clone()
    out = {}
    for name, predict in (
        ("torch", functional.predict_weights_),
        (backend, _fused_updates(backend).predict_weights_),
    ):
        out[name] = torch.full_like(shared, 7.0)
        predict(flat, shared, out[name], momentum, scaling, mask, coefficients, active)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(out[backend], out["torch"], rtol=tolerance, atol=tolerance)
    inactive = flat.view(out[backend], 2)
    assert torch.equal(inactive, flat.view(shared, 2))
    assert out[backend][11] == shared[11] and out["torch"][11] == shared[11]
    assert not torch.equal(flat.view(out[backend], 0), flat.view(shared, 0))


def test_the_flat_weights_stand_in_a_buffer_only_inside_the_block():
    """``FlatState.weights_in``: inside it the update's weights are the buffer (the
    parameters keep theirs), after it the flat weights again, also when the block raises; a
    buffer of another size or dtype is refused before anything changes."""
    from onebit.optim._flat import FlatState

    params = _params()
    flat = FlatState([({}, p) for p in params])
    weights = flat.weights
    shared = torch.zeros_like(weights)
    with pytest.raises(RuntimeError, match="inside"):
        with flat.weights_in(shared):
            assert flat.weights is shared
            assert flat.weight_views()[0].data_ptr() == shared.data_ptr()
            assert params[0].data_ptr() == weights.data_ptr()
            raise RuntimeError("inside")
    assert flat.weights is weights
    views = flat.weight_views()
    assert all(p.data_ptr() == v.data_ptr() for p, v in zip(params, views, strict=True))
    for bad in (shared[:-1], shared.double()):
        with pytest.raises(ValueError, match="size and dtype"):
            with flat.weights_in(bad):
                pass
        assert flat.weights is weights
