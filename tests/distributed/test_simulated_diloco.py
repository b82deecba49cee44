"""DiLoCo with its workers simulated in one process (onebit.simulate.SimulatedDiLoCo) against
DiLoCo on real gloo ranks: the same weights after every round, bit for bit, dense and 1-bit
(each tensor alone and fused); the same bytes; a simulation saved inside a round and resumed
by new objects goes on bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers.diloco_problem import INNER, backward, inner_step, weights
from helpers.diloco_problem import model as _model

import onebit
from onebit.simulate import SimulatedDiLoCo
from onebit.testing import spawn_workers

H, ROUNDS = 3, 3
#: (outer exchange, compression)
CASES = [("dense", "per_tensor"), ("1bit", "per_tensor"), ("1bit", "fused")]


def _real(rank: int, world: int):
    """Every case on this rank: the weights after every round, and the bytes sent."""
    runs = {}
    for exchange, compression in CASES:
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        diloco = onebit.DiLoCo(
            model.parameters(),
            inner,
            sync_every=H,
            exchange=exchange,
            compression=compression,
            kernels="torch",
        )
        rounds = []
        for step in range(H * ROUNDS):
            inner_step(model, inner, rank, step)
            if diloco.local_step == 0:
                rounds.append(weights(model))
        runs[exchange, compression] = rounds, diloco.bytes_sent
    return runs


def _simulated(workers: int, exchange: str, compression: str, save_after: int | None = None):
    """The simulation of the same run; with ``save_after``, saved after that step and
    continued by new objects that load the save."""

    def build():
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        simulation = SimulatedDiLoCo(
            model.parameters(),
            inner,
            workers,
            sync_every=H,
            exchange=exchange,
            compression=compression,
            kernels="torch",
        )
        return model, simulation

    model, simulation = build()
    rounds = []
    for step in range(H * ROUNDS):
        simulation.step(lambda rank, s=step, m=model: backward(m, rank, s))
        if simulation.diloco.local_step == 0:
            rounds.append(weights(model))
        if step + 1 == save_after:
            saved = simulation.state_dict()
            model, simulation = build()
            simulation.load_state_dict(saved)
    return rounds, simulation.diloco.bytes_sent


@pytest.fixture(scope="module")
def real_runs():
    return spawn_workers(_real, 2, timeout_s=240)


@pytest.mark.parametrize(("exchange", "compression"), CASES)
def test_the_simulation_is_what_two_ranks_compute(real_runs, exchange, compression):
    rounds, sent = _simulated(2, exchange, compression)
    for rank, runs in enumerate(real_runs):
        real_rounds, real_sent = runs[exchange, compression]
        assert len(rounds) == len(real_rounds) == ROUNDS
        for r, (ours, theirs) in enumerate(zip(rounds, real_rounds, strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (
                f"round {r + 1} differs from rank {rank}"
            )
        assert sent == real_sent


@pytest.mark.parametrize(("exchange", "compression"), CASES)
def test_a_simulation_resumed_inside_a_round_goes_on_bit_for_bit(exchange, compression):
    straight, sent = _simulated(3, exchange, compression)
    resumed, resumed_sent = _simulated(3, exchange, compression, save_after=H + 1)
    for a, b in zip(straight[-1], resumed[-1], strict=True):
        assert torch.equal(a, b)
    assert sent == resumed_sent


def test_bad_input_is_named_before_anything_changes():
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    with pytest.raises(ValueError, match="workers must be an int >= 1, got 0"):
        SimulatedDiLoCo(model.parameters(), inner, 0, sync_every=H)
    simulation = SimulatedDiLoCo(model.parameters(), inner, 2, sync_every=H)
    other_model = _model()
    other_inner = torch.optim.AdamW(other_model.parameters(), **INNER)
    other = SimulatedDiLoCo(other_model.parameters(), other_inner, 3, sync_every=H)
    before = weights(model)
    with pytest.raises(ValueError, match="checkpoint of 3 simulated DiLoCo workers"):
        simulation.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model), strict=True))
