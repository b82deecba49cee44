"""Checkpoints written by an earlier release of onebit (format 1: the library at commit
13ebdb0, file ``fixtures/checkpoints_v1.pt``) load into today's optimizers, and the run goes
on bit for bit: each optimizer took 10 steps from the same weights and gradients, its state
saved after step 5; loaded after step 5 here, steps 6-10 must end at the weights it ended at."""

from __future__ import annotations

import pytest
import torch
from helpers.paths import FIXTURES

import onebit

FIXTURE = FIXTURES / "checkpoints_v1.pt"
SHAPES = [(6, 4), (5,), (3, 3)]
BUILD = {
    "Lamb": lambda p: onebit.Lamb(p, lr=1e-2, weight_decay=0.01),
    "OneBitLamb": lambda p: onebit.OneBitLamb(p, lr=1e-2, freeze_step=3, weight_decay=0.01),
    "OneBitLamb-fused": lambda p: onebit.OneBitLamb(p, lr=1e-2, freeze_step=3, compression="fused"),
    "OneBitAdam": lambda p: onebit.OneBitAdam(p, lr=1e-2, freeze_step=3),
    "ZeroOneAdam": lambda p: onebit.ZeroOneAdam(
        p,
        lr=1e-2,
        var_freeze_step=4,
        var_warmup_steps=2,
        local_step_clipper=2,
        local_step_scaler=1,
    ),
}


def gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


@pytest.fixture(scope="module")
def saved() -> dict:
    return torch.load(FIXTURE, weights_only=True)


@pytest.mark.parametrize("name", sorted(BUILD))
def test_a_format_1_checkpoint_resumes_bit_for_bit(saved: dict, name: str) -> None:
    case = saved[name]
    params = [torch.nn.Parameter(p.clone()) for p in case["initial"]]
    optimizer = BUILD[name](params)
    with torch.no_grad():
        for param, value in zip(params, case["at_5"]["params"], strict=True):
            param.copy_(value)
    optimizer.load_state_dict(case["at_5"]["optimizer"])
    for step in range(6, 11):
        for param, grad in zip(params, gradients(step), strict=True):
            param.grad = grad
        optimizer.step()
    for param, expected in zip(params, case["after_10"], strict=True):
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=0)


def test_a_checkpoint_of_a_newer_format_is_refused_naming_it(saved: dict) -> None:
    case = saved["OneBitLamb"]
    params = [torch.nn.Parameter(p.clone()) for p in case["initial"]]
    optimizer = BUILD["OneBitLamb"](params)
    newer = {**case["at_5"]["optimizer"]}
    newer["onebit"] = {**newer["onebit"], "format": 99}
    with pytest.raises(ValueError, match="format 99"):
        optimizer.load_state_dict(newer)
    assert optimizer.step_count == 0
