"""Lamb against an independent float64 implementation of ALGORITHM.md's warm-up stage."""

from __future__ import annotations

import io
import math

import pytest
import torch

import onebit


def reference_lamb(params, grads_per_step, groups, betas, eps, min_coeff, max_coeff):
    """Plain float64 LAMB, written from the formula, one tensor at a time."""
    params = [p.clone().double() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    history = []
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            lr, wd = groups[i]
            g = g.double()
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            u = m[i] / (v[i].sqrt() + eps) + wd * p
            pn, un = math.sqrt(float((p * p).sum())), math.sqrt(float((u * u).sum()))
            c = min(max(pn / un, min_coeff), max_coeff) if pn > 0 and un > 0 else 1.0
            params[i] = p - lr * c * u
        history.append([p.clone() for p in params])
    return history


def make_problem(seed=0, steps=12):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (4,), (3, 3), (5,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    params[1].zero_()  # a zero tensor: the trust ratio falls back to 1
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return params, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lamb_matches_float64_reference_with_two_groups(dtype):
    params, grads = make_problem()
    tensors = [torch.nn.Parameter(p.clone().to(dtype)) for p in params]
    groups = [
        {"params": tensors[:2], "weight_decay": 0.01},
        {"params": tensors[2:], "lr": 0.02},
    ]
    opt = onebit.Lamb(groups, lr=0.05, max_coeff=0.3, min_coeff=0.01)
    hyper = [(0.05, 0.01), (0.05, 0.01), (0.02, 0.0), (0.02, 0.0)]
    expected = reference_lamb(params, grads, hyper, (0.9, 0.999), 1e-8, 0.01, 0.3)
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    for step, step_grads in enumerate(grads):
        for p, g in zip(tensors, step_grads, strict=True):
            p.grad = g.to(dtype)
        opt.step()
        for p, ref in zip(tensors, expected[step], strict=True):
            torch.testing.assert_close(p.detach().double(), ref, rtol=tolerance, atol=tolerance)
    assert len(opt.get_lamb_coeffs()) == 4


def test_state_dict_round_trip_continues_identically():
    params, grads = make_problem(seed=1, steps=10)

    def fresh():
        tensors = [torch.nn.Parameter(p.clone()) for p in params]
        return tensors, onebit.Lamb(tensors, lr=0.01, weight_decay=0.01)

    tensors, opt = fresh()
    for step_grads in grads[:5]:
        for p, g in zip(tensors, step_grads, strict=True):
            p.grad = g
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": [p.detach() for p in tensors], "opt": opt.state_dict()}, buffer)
    for step_grads in grads[5:]:
        for p, g in zip(tensors, step_grads, strict=True):
            p.grad = g
        opt.step()

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, opt2 = fresh()
    with torch.no_grad():
        for p, value in zip(resumed, saved["model"], strict=True):
            p.copy_(value)
    opt2.load_state_dict(saved["opt"])
    for step_grads in grads[5:]:
        for p, g in zip(resumed, step_grads, strict=True):
            p.grad = g
        opt2.step()
    for a, b in zip(tensors, resumed, strict=True):
        assert torch.equal(a, b)


def test_bf16_parameters_keep_fp32_state_and_master_copy():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = onebit.Lamb([param], lr=1e-4)
    for _ in range(20):
        param.grad = torch.ones(64, dtype=torch.bfloat16)
        opt.step()
    state = opt.state[param]
    assert state["exp_avg"].dtype == torch.float32
    assert state["master_param"].dtype == torch.float32
    # 20 updates of ~1e-4 each: lost to bf16 rounding without the master copy.
    assert state["master_param"].max().item() < 1.0 - 1e-3
    assert torch.equal(param.detach(), state["master_param"].to(torch.bfloat16))
    # A checkpoint round trip keeps the state in fp32.
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    opt2 = onebit.Lamb([param], lr=1e-4)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt2.state[param]["master_param"].dtype == torch.float32
    assert torch.equal(opt2.state[param]["master_param"], state["master_param"])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (1.0, 0.999)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"min_coeff": 1.0, "max_coeff": 0.5}, "min_coeff"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        onebit.Lamb([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_checkpoint_for_another_model_is_rejected_and_leaves_state_untouched():
    a = torch.nn.Parameter(torch.ones(3))
    opt = onebit.Lamb([a])
    a.grad = torch.ones(3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[a].items() if torch.is_tensor(v)}
    other = onebit.Lamb([torch.nn.Parameter(torch.ones(4))])
    other.param_groups[0]["params"][0].grad = torch.ones(4)
    other.step()
    with pytest.raises(ValueError, match=r"shape \(4,\).*shape \(3,\)"):
        opt.load_state_dict(other.state_dict())
    two = onebit.Lamb([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="2 parameters"):
        opt.load_state_dict(two.state_dict())
    for key, value in before.items():
        assert torch.equal(opt.state[a][key], value)
