"""Streaming DiLoCo (ALGORITHM.md, "Streaming fragments and the delayed outer exchange") on 2
gloo ranks against a single-process model of both workers written here from the text: the
fragments' turns, the pseudo-gradient taken ``delay`` steps before the outer step, the mean
(or the per-tensor 1-bit oracle with each fragment's own errors), the outer SGD written out
and the local share kept; ranks agree bit for bit on the start weights; a run saved while an
exchange is in flight resumes bit for bit, also with each fragment's last average taken out
of the messages; the simulation computes what the ranks compute;
``sync`` ends every fragment's round; bad arguments are named before anything changes."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.diloco_problem import INNER, backward, inner_step, weights
from helpers.diloco_problem import model as _model
from helpers.oracle import oracle_compressed_allreduce_per_tensor

import onebit
from onebit.collectives import compressed_allreduce_per_tensor_bytes, ring_allreduce_bytes
from onebit.simulate import SimulatedDiLoCo
from onebit.testing import spawn_workers

WORLD, H, K, DELAY, TURNS = 2, 4, 2, 1, 7
SHAPES = [(6, 5), (6,), (2, 6), (2,)]
#: The int split of the four parameters (30, 6, 12 and 2 elements) into two runs: the cut
#: nearest to half of the 50 elements is after the first.
SPLIT = [[0], [1, 2, 3]]
#: Each exchange's default outer SGD (lr, Nesterov momentum).
OUTER = {"dense": (0.7, 0.9), "1bit": (0.7, 0.5)}
#: (exchange, local_share)
CASES = [("dense", 0.0), ("dense", 0.5), ("1bit", 0.0), ("1bit", 0.5)]


#: The streaming schedule of every run here.
STREAMING = dict(sync_every=H, kernels="torch", fragments=K, delay=DELAY)


def _streaming(
    model, inner, exchange: str, share: float, residual: str = "carried", reference: float = 0.0
) -> onebit.DiLoCo:
    return onebit.DiLoCo(
        model.parameters(),
        inner,
        exchange=exchange,
        local_share=share,
        worker_residual=residual,
        reference_share=reference,
        **STREAMING,
    )


def _start_weights(diloco: onebit.DiLoCo, model) -> list[torch.Tensor]:
    with diloco.round_start_weights():
        return weights(model)


def _train(
    rank: int,
    exchange: str,
    share: float,
    save_after: int | None = None,
    residual: str = "carried",
    reference: float = 0.0,
):
    """The start weights and this rank's weights after every turn, and the bytes; with
    ``save_after``, the run is saved after that inner step and continued by new objects."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    diloco = _streaming(model, inner, exchange, share, residual, reference)
    turns = []
    for step in range(H // K * TURNS):
        inner_step(model, inner, rank, step)
        if diloco.local_step == 0:
            own = weights(model)
            turns.append((_start_weights(diloco, model), own))
        if step + 1 == save_after:
            assert diloco.exchange_started  # saved while the exchange is in flight
            saved = (model.state_dict(), inner.state_dict(), diloco.state_dict())
            diloco.close()
            model = _model()
            inner = torch.optim.AdamW(model.parameters(), **INNER)
            diloco = _streaming(model, inner, exchange, share, residual, reference)
            model.load_state_dict(saved[0])
            inner.load_state_dict(saved[1])
            diloco.load_state_dict(saved[2])
    layout = [f.indices for f in diloco.fragments]
    return turns, diloco.bytes_sent, layout


def _synced(rank: int):
    """Two turns and a half, then ``sync()``: the weights after it and the next turn's."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    diloco = _streaming(model, inner, "1bit", 0.5)
    for step in range(5):
        inner_step(model, inner, rank, step)
    assert diloco.exchange_started and diloco.fragment == 0
    diloco.sync()
    after = weights(model)
    return after, _start_weights(diloco, model), diloco.fragment, diloco.local_step


def _synced_local(rank: int):
    """Each worker's residual in its weights, two turns, then ``sync()`` on the second turn's
    last step: the weights after it, the start weights and the bytes ``sync()`` sent."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    diloco = onebit.DiLoCo(
        model.parameters(), inner, exchange="1bit", worker_residual="local", **STREAMING
    )
    for step in range(2 * (H // K)):
        inner_step(model, inner, rank, step)
    sent = diloco.bytes_sent
    diloco.sync()
    after = weights(model)
    return after, _start_weights(diloco, model), diloco.bytes_sent - sent


def _runs(rank: int, world: int):
    turn = H // K
    results = {case: _train(rank, *case) for case in CASES}
    # saved after the second turn's exchange started, with it in flight
    results["resumed"] = _train(rank, "1bit", 0.5, save_after=2 * turn - DELAY)
    results["synced"] = _synced(rank)
    results["synced-local"] = _synced_local(rank)
    results["local"] = _train(rank, "1bit", 0.5, residual="local")
    results["reference"] = _train(rank, "1bit", 0.5, reference=0.5)
    results["reference-resumed"] = _train(
        rank, "1bit", 0.5, save_after=2 * turn - DELAY, reference=0.5
    )
    return results


def _model_of_both_workers(exchange: str, share: float):
    """Both workers in one process, from the text: the start weights and every worker's
    weights after every turn."""
    replicas = [_model() for _ in range(WORLD)]
    inners = [torch.optim.AdamW(m.parameters(), **INNER) for m in replicas]
    theta = weights(replicas[0])
    lr, momentum = OUTER[exchange]
    buffers: list[torch.Tensor | None] = [None] * len(theta)
    errors = []
    for members in SPLIT:
        width, server = onebit.per_tensor_error_sizes([math.prod(SHAPES[j]) for j in members], 2)
        errors.append((torch.zeros(WORLD, width), torch.zeros(WORLD, server)))
    turn, local, pending, turns = 0, 0, None, []
    for step in range(H // K * TURNS):
        for rank, (model, inner) in enumerate(zip(replicas, inners, strict=True)):
            inner_step(model, inner, rank, step)
        local += 1
        fragment = turn % K
        members = SPLIT[fragment]
        if local == H // K - DELAY:  # the pseudo-gradients, and their exchange
            rows = [
                torch.stack(
                    [(theta[j] - list(m.parameters())[j].detach()).reshape(-1) for m in replicas]
                )
                for j in members
            ]
            if exchange == "dense":
                pending = [r.sum(dim=0) / WORLD for r in rows]
            else:
                pending, *errors[fragment] = oracle_compressed_allreduce_per_tensor(
                    rows, *errors[fragment], kernels="torch"
                )
        if local == H // K:  # the outer step of the fragment, then the merge
            for j, average in zip(members, pending, strict=True):
                g = average.view_as(theta[j])
                buffers[j] = g.clone() if buffers[j] is None else momentum * buffers[j] + g
                theta[j] = theta[j] - lr * (g + momentum * buffers[j])
                for model in replicas:
                    param = list(model.parameters())[j]
                    param.data.copy_(theta[j] + share * (param.detach() - theta[j]))
            turn, local = turn + 1, 0
            turns.append(([t.clone() for t in theta], weights(replicas[0])))
    return turns


@pytest.fixture(scope="module")
def ranks():
    return spawn_workers(_runs, WORLD, timeout_s=300)


@pytest.mark.parametrize(("exchange", "share"), CASES)
def test_streaming_diloco_follows_the_model_of_both_workers(ranks, exchange, share):
    turns, _, layout = ranks[0][exchange, share]
    assert layout == SPLIT
    expected = _model_of_both_workers(exchange, share)
    assert len(turns) == len(expected) == TURNS
    for t, ((start, own), (want_start, want_own)) in enumerate(zip(turns, expected, strict=True)):
        for got, want in ((start, want_start), (own, want_own)):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(
                    a, b, rtol=1e-5, atol=1e-6, msg=lambda m, t=t: f"turn {t + 1}: {m}"
                )
    other = ranks[1][exchange, share][0]
    for t, ((start, own), (other_start, other_own)) in enumerate(zip(turns, other, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(start, other_start, strict=True))
        if share == 0.0:  # nothing of a worker's own move kept: they agree on the fragment
            assert all(torch.equal(own[j], other_own[j]) for j in SPLIT[t % K])


def test_the_local_share_keeps_part_of_each_workers_move(ranks):
    """With a share, the workers' weights of the fragment just exchanged differ from the
    start weights; without, they are the start weights."""
    kept = ranks[0]["dense", 0.5][0][0]
    dropped = ranks[0]["dense", 0.0][0][0]
    first = SPLIT[0][0]
    assert torch.equal(dropped[0][first], dropped[1][first])
    assert not torch.equal(kept[0][first], kept[1][first])


@pytest.mark.parametrize(
    ("straight_run", "resumed_run"),
    [(("1bit", 0.5), "resumed"), ("reference", "reference-resumed")],
)
def test_a_run_saved_with_an_exchange_in_flight_resumes_bit_for_bit(
    ranks, straight_run, resumed_run
):
    for rank in ranks:
        straight, sent, _ = rank[straight_run]
        resumed, resumed_sent, _ = rank[resumed_run]
        for (start, own), (r_start, r_own) in zip(straight[-1:], resumed[-1:], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(start, r_start, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(own, r_own, strict=True))
        assert sent == resumed_sent


def test_the_fragments_send_a_whole_models_bytes_per_round(ranks):
    """The dense exchanges of the K fragments in a round of H steps send what one exchange of
    the whole model sends."""
    numels = [math.prod(s) for s in SHAPES]
    per_fragment = [ring_allreduce_bytes(4 * sum(numels[j] for j in m), WORLD) for m in SPLIT]
    sent = ranks[0]["dense", 0.0][1]
    assert sent == sum(per_fragment[t % K] for t in range(TURNS))
    assert sum(per_fragment) == ring_allreduce_bytes(4 * sum(numels), WORLD)


def test_sync_ends_every_fragments_round_at_once(ranks):
    for rank in ranks:
        after, start, fragment, local_step = rank["synced"]
        assert fragment == 1 and local_step == 0  # the next turn is the next fragment's
        assert all(torch.equal(a, b) for a, b in zip(after, start, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(after, ranks[0]["synced"][0], strict=True))


def test_sync_exchanges_every_fragment_but_the_one_whose_local_residual_was_just_applied(ranks):
    fragment_0 = [math.prod(SHAPES[i]) for i in SPLIT[0]]
    for rank in ranks:
        after, start, sent = rank["synced-local"]
        assert sent == compressed_allreduce_per_tensor_bytes(fragment_0, WORLD, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(after, start, strict=True))
        assert all(
            torch.equal(a, b) for a, b in zip(after, ranks[0]["synced-local"][0], strict=True)
        )


def _simulated(exchange: str, share: float, residual: str = "carried", reference: float = 0.0):
    """The start weights and every worker's weights after every turn, and the bytes."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    simulation = SimulatedDiLoCo(
        model.parameters(),
        inner,
        WORLD,
        exchange=exchange,
        local_share=share,
        worker_residual=residual,
        reference_share=reference,
        **STREAMING,
    )
    turns = []
    for step in range(H // K * TURNS):
        simulation.step(lambda rank, s=step: backward(model, rank, s))
        if simulation.diloco.local_step == 0:
            own = [[w.clone() for w in simulation.worker_weights(r)] for r in range(WORLD)]
            turns.append((_start_weights(simulation.diloco, model), own))
    return turns, simulation.diloco.bytes_sent


@pytest.mark.parametrize(
    ("case", "exchange", "share", "residual", "reference"),
    [((e, s), e, s, "carried", 0.0) for e, s in CASES]
    + [("local", "1bit", 0.5, "local", 0.0), ("reference", "1bit", 0.5, "carried", 0.5)],
)
def test_the_simulation_computes_what_the_ranks_compute(
    ranks, case, exchange, share, residual, reference
):
    turns, sent = _simulated(exchange, share, residual, reference)
    for rank, runs in enumerate(ranks):
        real, real_sent, _ = runs[case]
        assert sent == real_sent
        for (start, own), (real_start, real_own) in zip(turns, real, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(start, real_start, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(own[rank], real_own, strict=True))


def test_bad_streaming_arguments_are_named_before_anything_changes():
    model = _model()
    inner = torch.optim.AdamW(model.parameters())
    params = list(model.parameters())
    cases = [
        ({"sync_every": 3, "fragments": 2}, "multiple of the 2 fragments"),
        ({"sync_every": 4, "fragments": 5}, "between 1 and the 4 parameters"),
        ({"sync_every": 4, "fragments": 2, "delay": 2}, r"delay must be an int in \[0, 2\)"),
        ({"sync_every": 4, "delay": -1}, "delay"),
        ({"sync_every": 4, "delay": 1, "compression": "fused"}, "per-tensor"),
        ({"sync_every": 4, "local_share": 1.5}, "local_share"),
        ({"sync_every": 4, "fragments": [params[:2], params[1:]]}, r"in more than one"),
        ({"sync_every": 4, "fragments": [params[:2], params[3:]]}, r"parameters \[2\] are in none"),
        (
            {"sync_every": 4, "fragments": [params, [torch.zeros(2, requires_grad=True)]]},
            "not among",
        ),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            onebit.DiLoCo(model.parameters(), inner, **options)
    assert not inner._optimizer_step_post_hooks  # no hook left behind
    explicit = onebit.DiLoCo(
        model.parameters(), inner, sync_every=4, fragments=[params[2:], params[:2]]
    )
    assert [f.indices for f in explicit.fragments] == [[2, 3], [0, 1]]
    saved = explicit.state_dict()
    explicit.close()
    with pytest.raises(ValueError, match="fragments"):
        onebit.DiLoCo(model.parameters(), inner, sync_every=4, fragments=2).load_state_dict(saved)
    with pytest.raises(ValueError, match="lacks the average of an exchange in flight"):
        onebit.DiLoCo(
            model.parameters(), inner, sync_every=4, fragments=[params[2:], params[:2]], delay=1
        ).load_state_dict(saved | {"delay": 1, "local_step": 1})
