"""OneBitLamb and OneBitAdam in one process (a world of one rank): the float64 model of the
spec, parameters without gradients, bf16, checkpoints, masks and argument errors."""

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
    build,
    grad_fn,
    initial_params,
    set_grads,
)
from helpers.oracle_onebit import oracle_run

import onebit
from onebit.coefficients import adam_momentum_bound
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE


def _model(kind, compression, hyper=HYPER):
    """The float64 model's parameters after every step of the problem, on one worker."""
    masks = [None, None, None, MASK]
    return oracle_run(
        kind, initial_params(), grad_fn, 1, STEPS, FREEZE, GROUP_HYPER, hyper, masks, compression
    )


def _assert_follows(params, opt, expected):
    for step in range(STEPS):
        set_grads(params, 0)
        opt.step()
        for got, ref in zip(params, expected[step], strict=True):
            torch.testing.assert_close(got.detach(), ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("compression", ["fused", "per_tensor"])
@pytest.mark.parametrize("kind", ["lamb", "adam"])
def test_world_size_one_matches_the_model(kind, compression):
    params, opt = build(kind, torch.float64, compression)
    _assert_follows(params, opt, _model(kind, compression))


@pytest.mark.parametrize("compression", ["fused", "per_tensor"])
def test_the_trust_bound_matches_the_model_and_changes_the_steps(compression):
    """With ``trust_bound`` the compression steps follow the model's
    ``min(c_frz f, κ ρ_0 ||p|| / ||u||)``, ρ_0 the stage's first ``c_frz f ||u|| / ||p||``;
    κ = 1.5 binds on this problem without ``momentum_bound`` (with it the steps stay below
    the bound), so the trajectory leaves the unbounded one."""
    unbounded_momentum = HYPER | {"momentum_bound": False}
    params, opt = build("lamb", torch.float64, compression, trust_bound=1.5, momentum_bound=False)
    expected = _model("lamb", compression, unbounded_momentum | {"trust_bound": 1.5})
    _assert_follows(params, opt, expected)
    unbounded = _model("lamb", compression, unbounded_momentum)
    assert max((a - b).abs().max() for a, b in zip(expected[-1], unbounded[-1], strict=True)) > 1e-3


def test_a_run_with_the_trust_bound_resumes_exactly():
    """The bound's base ρ_0 is in the checkpoint: a run resumed after the stage began (and
    before the bound first binds) ends bit for bit as the uninterrupted one."""

    def run(start, stop, saved=None):
        params, opt = build(
            "lamb", torch.float64, "per_tensor", trust_bound=1.5, momentum_bound=False
        )
        if saved is not None:
            with torch.no_grad():
                for p, value in zip(params, saved["params"], strict=True):
                    p.copy_(value)
            opt.load_state_dict(saved["optimizer"])
        checkpoint = None
        for step in range(start, stop):
            set_grads(params, 0)
            opt.step()
            if step + 1 == FREEZE + 2:
                buffer = io.BytesIO()
                torch.save(
                    {"params": [p.detach() for p in params], "optimizer": opt.state_dict()}, buffer
                )
                checkpoint = buffer.getvalue()
        return [p.detach().clone() for p in params], checkpoint

    straight, checkpoint = run(0, STEPS)
    saved = torch.load(io.BytesIO(checkpoint), weights_only=True)
    bases = [float(state["trust_base"]) for state in saved["optimizer"]["state"].values()]
    assert bases[2] == 0 and min(bases[:2] + bases[3:]) > 0  # tensor 2 never moves: no base
    resumed, _ = run(FREEZE + 2, STEPS, saved)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


@pytest.mark.parametrize("compression", ["fused", "per_tensor"])
def test_the_momentum_bound_matches_the_model_and_changes_the_steps(compression):
    """With ``momentum_bound`` (the default) every decoded momentum is clamped to
    ``+-B sqrt(v)`` (times the mask), as in the model, and without it it is not; on this
    problem the bound binds, so the two trajectories part."""
    trajectories = []
    for momentum_bound in (True, False):
        params, opt = build("lamb", torch.float64, compression, momentum_bound=momentum_bound)
        expected = _model("lamb", compression, HYPER | {"momentum_bound": momentum_bound})
        _assert_follows(params, opt, expected)
        trajectories.append(expected[-1])
    bounded, unbounded = trajectories
    assert max((a - b).abs().max() for a, b in zip(bounded, unbounded, strict=True)) > 1e-6


def test_adams_momentum_bound_holds_and_is_reached():
    """``|m| <= B sqrt(v)`` for Adam's moments of any gradients; gradients growing as
    ``(b2 / b1)^t`` come within 1e-3 of it (Cauchy-Schwarz is tight there)."""
    b1, b2 = 0.9, 0.999
    bound = adam_momentum_bound((b1, b2))
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(400, 64, generator=gen, dtype=torch.float64)]
    cases.append(cases[0] * torch.rand(400, 64, generator=gen, dtype=torch.float64) ** 8)
    cases.append(((b2 / b1) ** torch.arange(400, dtype=torch.float64))[:, None].expand(400, 64))
    for grads in cases:
        m, v, ratio = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64), 0
        for g in grads:
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            ratio = max(ratio, float((m.abs() / v.sqrt()).max()))
        assert ratio <= bound * (1 + 1e-12)
    assert ratio > bound * (1 - 1e-3)
    assert adam_momentum_bound((0.9, 0.8)) == float("inf")


def test_a_momentum_bound_that_cannot_hold_is_refused_by_name():
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"momentum_bound needs betas with beta1\*\*2 < beta2"):
        onebit.OneBitLamb([param], betas=(0.9, 0.8), momentum_bound=True)
    with pytest.raises(ValueError, match="momentum_bound must be True or False"):
        onebit.OneBitLamb([param], momentum_bound=1.0)
    opt = onebit.OneBitLamb([param], momentum_bound=True)
    with pytest.raises(ValueError, match="momentum_bound needs"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (0.5, 0.2)})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="groups do not take momentum_bound"):
        onebit.OneBitAdam([{"params": [param], "momentum_bound": True}])


def test_a_trust_bound_that_is_not_positive_is_refused_by_name():
    with pytest.raises(ValueError, match="trust_bound=0"):
        onebit.OneBitLamb([torch.nn.Parameter(torch.zeros(3))], trust_bound=0.0)


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
