"""DiLoCo with its workers simulated in one process (onebit.simulate.SimulatedDiLoCo) against
DiLoCo on real gloo ranks: every worker's weights after every round the rank's, bit for bit,
dense and 1-bit (each tensor alone, in blocks and fused, each worker also moved by its
residual, the last round's average also taken out of the messages); the same
bytes; a simulation saved inside a round and resumed by new objects goes on bit for bit;
``sync()`` on a round's last step undoes the residual moves as the ranks' does."""

from __future__ import annotations

import pytest
import torch
from helpers.diloco_problem import INNER, backward, inner_step, weights
from helpers.diloco_problem import model as _model

import onebit
from onebit.simulate import SimulatedDiLoCo
from onebit.testing import spawn_workers

H, ROUNDS = 3, 3
#: (outer exchange, compression, where each worker's residual goes, elements to each server
#: scale: 8, blocks of 16 elements at 2 workers, 24 at 3; the share of the last round's
#: average taken out of the messages)
CASES = [
    ("dense", "per_tensor", "carried", None, 0.0),
    ("1bit", "per_tensor", "carried", None, 0.0),
    ("1bit", "fused", "carried", None, 0.0),
    ("1bit", "per_tensor", "local", None, 0.0),
    ("1bit", "fused", "local", None, 0.0),
    ("1bit", "per_tensor", "local", 8, 0.0),
    ("1bit", "per_tensor", "local", None, 0.5),
    ("1bit", "fused", "carried", None, 0.5),
]


def _name(case: tuple) -> str:
    return "-".join(str(part) for part in case)


def _real(rank: int, world: int):
    """Every case on this rank: its weights after every round and after ``sync()`` on the
    last round's last step, and the bytes sent."""
    runs = {}
    for exchange, compression, residual, block, reference in CASES:
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        diloco = onebit.DiLoCo(
            model.parameters(),
            inner,
            sync_every=H,
            exchange=exchange,
            compression=compression,
            worker_residual=residual,
            block_size=block,
            reference_share=reference,
            kernels="torch",
        )
        rounds = []
        for step in range(H * ROUNDS):
            inner_step(model, inner, rank, step)
            if diloco.local_step == 0:
                rounds.append(weights(model))
        diloco.sync()
        runs[exchange, compression, residual, block, reference] = (
            rounds,
            weights(model),
            diloco.bytes_sent,
        )
    return runs


def _simulated(
    workers: int,
    exchange: str,
    compression: str,
    residual: str,
    block: int | None,
    reference: float,
    save_after: int | None = None,
):
    """The simulation of the same run: every worker's weights after every round and after
    ``sync()``; with ``save_after``, saved after that step and continued by new objects that
    load the save."""

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
            worker_residual=residual,
            block_size=block,
            reference_share=reference,
            kernels="torch",
        )
        return model, simulation

    def every_worker():
        return [[w.clone() for w in simulation.worker_weights(r)] for r in range(workers)]

    model, simulation = build()
    rounds = []
    for step in range(H * ROUNDS):
        simulation.step(lambda rank, s=step, m=model: backward(m, rank, s))
        if simulation.diloco.local_step == 0:
            rounds.append(every_worker())
        if step + 1 == save_after:
            saved = simulation.state_dict()
            model, simulation = build()
            simulation.load_state_dict(saved)
    simulation.sync()
    return rounds, every_worker(), simulation.diloco.bytes_sent


@pytest.fixture(scope="module")
def real_runs():
    return spawn_workers(_real, 2, timeout_s=240)


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_the_simulation_is_what_two_ranks_compute(real_runs, case):
    rounds, synced, sent = _simulated(2, *case)
    for rank, runs in enumerate(real_runs):
        real_rounds, real_synced, real_sent = runs[case]
        assert len(rounds) == len(real_rounds) == ROUNDS
        for r, (ours, theirs) in enumerate(zip(rounds, real_rounds, strict=True)):
            assert all(torch.equal(a, b) for a, b in zip(ours[rank], theirs, strict=True)), (
                f"round {r + 1} differs from rank {rank}"
            )
        assert all(torch.equal(a, b) for a, b in zip(synced[rank], real_synced, strict=True))
        assert sent == real_sent
    if case[2] == "local":  # each worker moved by its own residual; sync() undid it
        assert not torch.equal(rounds[-1][0][0], rounds[-1][1][0])
        assert all(torch.equal(a, b) for a, b in zip(*synced, strict=True))


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_a_simulation_resumed_inside_a_round_goes_on_bit_for_bit(case):
    straight, _, sent = _simulated(3, *case)
    resumed, _, resumed_sent = _simulated(3, *case, save_after=H + 1)
    for ours, theirs in zip(straight[-1], resumed[-1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
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
