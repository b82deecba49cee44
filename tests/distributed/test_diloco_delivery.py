"""The errors delivered at the end (ALGORITHM.md, "The errors delivered at the end"):
``DiLoCo.sync(deliver_errors=True)`` on 3 gloo ranks and in the simulation. With the outer
SGD at lr 1 without momentum (κ = 1) nothing the workers did is lost: the final weights are
the initial ones minus the mean over workers of every inner step's move, summed in the test
from the inner optimizer's hooks, for each tensor alone, in blocks and fused, each worker's
residual carried or local, ending on a round's last step or inside a round; without the
delivery they are not. Ranks bit-identical; the simulation's weights the ranks'; the bytes
a dense round's; bad input named before anything changes."""

from __future__ import annotations

import pytest
import torch
from helpers.diloco_problem import INNER, backward, inner_step, weights
from helpers.diloco_problem import model as _model

import onebit
from onebit.collectives import ring_allreduce_bytes
from onebit.diloco import outer_sgd
from onebit.simulate import SimulatedDiLoCo
from onebit.testing import spawn_workers

WORLD, H, ROUNDS = 3, 3, 3
#: (compression, where each worker's residual goes, elements to each server scale, inner
#: steps: on the last round's last step, or one into the next round)
CASES = [
    ("per_tensor", "carried", None, H * ROUNDS + 1),
    ("per_tensor", "local", None, H * ROUNDS),
    ("per_tensor", "local", None, H * ROUNDS + 1),
    ("fused", "local", None, H * ROUNDS),
    ("per_tensor", "local", 8, H * ROUNDS),
]


class MoveCounter:
    """Every inner step's move of one worker's weights, summed: ``before - after``. Its
    hooks are registered before DiLoCo's, so that they see the inner step alone."""

    def __init__(self, inner: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self.params = params
        self.total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        self._before: list[torch.Tensor] = []
        inner.register_step_pre_hook(self._pre)
        inner.register_step_post_hook(self._post)

    def _pre(self, *_: object) -> None:
        self._before = [p.detach().to(torch.float64) for p in self.params]

    def _post(self, *_: object) -> None:
        for total, before, p in zip(self.total, self._before, self.params, strict=True):
            total.add_(before - p.detach().to(torch.float64))


def _options(model, compression, residual, block) -> dict:
    """Every case's DiLoCo: the 1-bit exchange, the outer SGD at lr 1 without momentum."""
    return dict(
        sync_every=H,
        exchange="1bit",
        compression=compression,
        outer_optimizer=outer_sgd(model.parameters(), lr=1.0, momentum=0.0),
        worker_residual=residual,
        block_size=block,
        kernels="torch",
    )


def _run(rank: int, compression, residual, block, steps, deliver: bool):
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    moves = MoveCounter(inner, list(model.parameters()))
    diloco = onebit.DiLoCo(
        model.parameters(), inner, **_options(model, compression, residual, block)
    )
    for step in range(steps):
        inner_step(model, inner, rank, step)
    before = diloco.bytes_sent
    diloco.sync(deliver_errors=deliver)
    return weights(model), moves.total, diloco.bytes_sent - before


def _ranks(rank: int, world: int):
    return {
        (case, deliver): _run(rank, *case, deliver=deliver)
        for case in CASES
        for deliver in (True, False)
    }


def _simulated(compression, residual, block, steps):
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    simulation = SimulatedDiLoCo(
        model.parameters(), inner, WORLD, **_options(model, compression, residual, block)
    )
    for step in range(steps):
        simulation.step(lambda rank, step=step: backward(model, rank, step))
    before = simulation.diloco.bytes_sent
    simulation.sync(deliver_errors=True)
    rows = [simulation.worker_weights(rank) for rank in range(WORLD)]
    return [[w.clone() for w in row] for row in rows], simulation.diloco.bytes_sent - before


@pytest.fixture(scope="module")
def ranks():
    return spawn_workers(_ranks, WORLD, timeout_s=240)


def _conserved(initial, totals):
    """The initial weights minus the workers' mean move."""
    return [p - sum(t[i] for t in totals).float() / WORLD for i, p in enumerate(initial)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_after_the_delivery_no_move_of_any_worker_is_lost(ranks, case):
    initial = weights(_model())
    for deliver in (True, False):
        totals = [ranks[rank][case, deliver][1] for rank in range(WORLD)]
        want = _conserved(initial, totals)
        final = ranks[0][case, deliver][0]
        gap = max(float((a - b).abs().max()) for a, b in zip(final, want, strict=True))
        if deliver:
            for a, b in zip(final, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
        else:  # the errors undelivered: the weights miss them
            assert gap > 1e-4
        for rank in range(1, WORLD):
            other = ranks[rank][case, deliver][0]
            assert all(torch.equal(a, b) for a, b in zip(final, other, strict=True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_simulation_delivers_as_the_ranks_do(ranks, case):
    rows, sent = _simulated(*case)
    final, _, real_sent = ranks[0][case, True]
    for row in rows:
        for a, b in zip(row, final, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    undelivered_sent = ranks[0][case, False][2]
    assert sent - undelivered_sent == real_sent - undelivered_sent > 0


def test_the_delivery_sends_a_dense_rounds_bytes(ranks):
    elements = sum(p.numel() for p in _model().parameters())
    for case in CASES:
        delivered, undelivered = ranks[0][case, True][2], ranks[0][case, False][2]
        assert delivered - undelivered == ring_allreduce_bytes(4 * elements, WORLD)


def test_bad_input_is_named_before_anything_changes():
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    adam = torch.optim.Adam(model.parameters())
    cases = [
        (dict(exchange="dense"), ValueError, "exchange='1bit'"),
        (dict(outer_optimizer=adam, worker_residual="carried"), TypeError, "SGD"),
    ]
    for options, error, name in cases:
        diloco = onebit.DiLoCo(model.parameters(), inner, sync_every=H, **options)
        for step in range(H + 1):
            inner_step(model, inner, 0, step)
        before, rounds = weights(model), diloco.rounds
        with pytest.raises(error, match=name):
            diloco.sync(deliver_errors=True)
        assert diloco.rounds == rounds and diloco.local_step == 1
        assert all(torch.equal(a, b) for a, b in zip(weights(model), before, strict=True))
        diloco.close()


def test_non_finite_errors_raise_and_leave_the_weights():
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    diloco = onebit.DiLoCo(model.parameters(), inner, sync_every=H, kernels="torch")
    for step in range(H):
        inner_step(model, inner, 0, step)
    worker, _ = diloco.fragments[0].exchange.errors()
    worker[0] = float("inf")
    with pytest.raises(FloatingPointError, match="not finite"):
        diloco.sync(deliver_errors=True)
    with diloco.round_start_weights():
        start = weights(model)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), start, strict=True))
