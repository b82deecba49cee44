"""Frozen, unfrozen, gradient-less and late parameters on 2 gloo ranks (ALGORITHM.md,
"Parameters without gradients" and "Parameters that join late"), for every 1-bit optimizer,
the ranks kept bit-identical (a replica check every step): a frozen parameter, or one no rank
has a gradient for, stays put and keeps its state; one that only some ranks have a gradient
for moves alike on all; one unfrozen in the warm-up joins as if it had had no gradient
before; one unfrozen after the freeze is refused on every rank."""

from __future__ import annotations

import pytest
import torch

import onebit
from onebit.testing import spawn_workers

SHAPES = [(6, 4), (4,), (3, 3)]
NAMES = ["OneBitLamb:per_tensor", "OneBitLamb:fused", "OneBitAdam:per_tensor", "ZeroOneAdam"]


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


def _params(frozen: int | None = None) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]
    if frozen is not None:
        params[frozen].requires_grad_(False)
    return params


def _gradients(params, rank: int, step: int, without: tuple[int, ...] = ()) -> None:
    """Each rank its own gradients; none for frozen parameters and for those ``without``."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    for index, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator)
        param.grad = grad if param.requires_grad and index not in without else None


def _tensors(optimizer, param) -> dict[str, torch.Tensor]:
    """A parameter's state, but ``lr_sum``: 0/1 Adam's sum of the learning rates of the
    interval, counted for every parameter on every rank alike."""
    state = optimizer.state[param]
    return {k: v.clone() for k, v in state.items() if torch.is_tensor(v) and k != "lr_sum"}


def _kept(optimizer, params, rank: int, steps: range, without: int, frozen: bool) -> bool:
    """Steps in which parameter ``without`` has no gradient (``frozen``: and
    requires_grad=False): whether its weights and state stayed bit for bit."""
    params[without].requires_grad_(not frozen)
    weights, state = params[without].detach().clone(), _tensors(optimizer, params[without])
    for step in steps:
        _gradients(params, rank, step, without=(without,))
        optimizer.step()
    params[without].requires_grad_(True)
    after = _tensors(optimizer, params[without])
    return torch.equal(params[without].detach(), weights) and all(
        torch.equal(after[k], v) for k, v in state.items()
    )


def _scenarios(rank: int, world: int, name: str) -> dict:
    out = {}
    params = _params()
    optimizer = _build(name, params)
    for step in range(3):  # the warm-up and a first 1-bit step
        _gradients(params, rank, step)
        optimizer.step()
    out["frozen kept"] = _kept(optimizer, params, rank, range(3, 8), 1, frozen=True)
    out["no gradient kept"] = _kept(optimizer, params, rank, range(8, 13), 0, frozen=False)
    held = [p.detach().clone() for p in params]
    for step in range(13, 17):  # parameter 2's gradient on rank 0 only
        _gradients(params, rank, step, without=(2,) if rank == 1 else ())
        optimizer.step()
    out["one rank's moves"] = not torch.equal(params[2].detach(), held[2])
    out["weights"] = [p.detach().clone() for p in params]

    # Unfrozen at step 2 (in the warm-up), against trainable throughout without a gradient
    # at step 1: the same trajectory, bit for bit.
    trajectories = []
    for late in (True, False):
        params = _params(frozen=2 if late else None)
        optimizer = _build(name, params)
        trajectory = []
        for step in range(8):
            if step == 1:
                params[2].requires_grad_(True)
            _gradients(params, rank, step, without=(2,) if step == 0 else ())
            optimizer.step()
            trajectory.append([p.detach().clone() for p in params])
        trajectories.append(trajectory)
    out["late joins"] = trajectories

    params = _params(frozen=2)
    optimizer = _build(name, params)
    for step in range(3):
        _gradients(params, rank, step)
        optimizer.step()
    params[2].requires_grad_(True)
    _gradients(params, rank, 3)
    before = [p.detach().clone() for p in params]
    try:
        optimizer.step()
        out["after the freeze"] = "stepped"
    except RuntimeError as error:
        out["after the freeze"] = str(error)
    out["unchanged"] = all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_parameters_without_gradients_and_late_ones_on_two_ranks(name):
    ranks = spawn_workers(_scenarios, 2, args=(name,), timeout_s=240)
    for rank, out in enumerate(ranks):
        assert out["frozen kept"], f"rank {rank}: a frozen parameter moved or its state changed"
        assert out["no gradient kept"], f"rank {rank}: a parameter without gradients changed"
        assert out["one rank's moves"], f"rank {rank}: a gradient on one rank was not applied"
        late, throughout = out["late joins"]
        for step, (a, b) in enumerate(zip(late, throughout, strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (
                f"rank {rank} step {step + 1}: joining late differs from no gradient before"
            )
        message = out["after the freeze"]
        assert "parameter 2 of group 0" in message and "after the variance froze" in message
        assert out["unchanged"]
    first, second = ranks
    for a, b in zip(first["weights"], second["weights"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(first["late joins"][0][-1], second["late joins"][0][-1], strict=True):
        assert torch.equal(a, b)
