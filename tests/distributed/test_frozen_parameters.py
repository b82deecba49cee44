"""Frozen, unfrozen and late parameters on 2 gloo ranks (ALGORITHM.md, "Parameters without
gradients"): a parameter frozen in the 1-bit steps stays put on both ranks, which stay
bit-identical (a replica check every step); unfrozen, it moves again alike on both; one that
was frozen at the first step and has a gradient later is refused on every rank."""

from __future__ import annotations

import pytest
import torch

import onebit
from onebit.testing import spawn_workers

SHAPES = [(6, 4), (4,), (3, 3)]


def _build(name: str, params):
    if name == "ZeroOneAdam":
        return onebit.ZeroOneAdam(
            params,
            lr=1e-2,
            var_freeze_step=2,
            var_warmup_steps=2,
            local_step_clipper=2,
            verify_every=1,
        )
    kind, compression = name.split(":")
    optimizer = {"OneBitLamb": onebit.OneBitLamb, "OneBitAdam": onebit.OneBitAdam}[kind]
    return optimizer(params, lr=1e-2, freeze_step=2, compression=compression, verify_every=1)


def _gradients(params, rank: int, step: int) -> None:
    generator = torch.Generator().manual_seed(100 * step + rank)  # each rank its own
    for param in params:
        if param.requires_grad:
            param.grad = torch.randn(param.shape, generator=generator)
        else:
            param.grad = None


def _frozen_then_unfrozen(rank: int, world: int, name: str) -> dict:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]
    optimizer = _build(name, params)
    for step in range(3):
        _gradients(params, rank, step)
        optimizer.step()
    params[1].requires_grad_(False)
    held = params[1].detach().clone()
    for step in range(3, 8):
        _gradients(params, rank, step)
        optimizer.step()
    stayed = torch.equal(params[1].detach(), held)
    params[1].requires_grad_(True)
    for step in range(8, 12):
        _gradients(params, rank, step)
        optimizer.step()
    return {
        "stayed": stayed,
        "moved_again": not torch.equal(params[1].detach(), held),
        "weights": [p.detach().clone() for p in params],
    }


@pytest.mark.parametrize(
    "name", ["OneBitLamb:per_tensor", "OneBitLamb:fused", "OneBitAdam:per_tensor", "ZeroOneAdam"]
)
def test_a_frozen_parameter_stays_put_on_both_ranks_and_moves_again_when_unfrozen(name):
    first, second = spawn_workers(_frozen_then_unfrozen, 2, args=(name,), timeout_s=240)
    assert first["stayed"] and second["stayed"]
    assert first["moved_again"] and second["moved_again"]
    for a, b in zip(first["weights"], second["weights"], strict=True):
        assert torch.equal(a, b)


def _unfrozen_late(rank: int, world: int) -> str:
    params = [torch.nn.Parameter(torch.ones(s)) for s in SHAPES]
    params[2].requires_grad_(False)
    optimizer = onebit.OneBitLamb(params, lr=1e-2, freeze_step=2)
    for step in range(3):
        _gradients(params, rank, step)
        optimizer.step()
    params[2].requires_grad_(True)
    _gradients(params, rank, 3)
    try:
        optimizer.step()
    except RuntimeError as error:
        return str(error)
    return "stepped"


def test_a_parameter_unfrozen_after_the_first_step_is_refused_on_every_rank():
    for message in spawn_workers(_unfrozen_late, 2, timeout_s=240):
        assert "parameter 2 of group 0" in message and "frozen" in message
