"""DiLoCo (ALGORITHM.md, "DiLoCo with a 1-bit outer exchange") on 2 gloo ranks against a
single-process model of both workers written here from the text: AdamW inner steps on each
worker's own batches, the mean of the pseudo-gradients (or the per-tensor 1-bit oracle with
errors that persist from round to round, also with each worker moved by its residual, and
with the last round's average taken out of the messages) and
each exchange's default outer SGD written out (its lr also halved after every round);
ranks bit-identical after every round (their round start weights, where each is moved by its
residual); exact resume from a save in the middle of a round; the bytes of each exchange; bad
arguments named before anything changes."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.diloco_problem import INNER, backward, inner_step, weights
from helpers.diloco_problem import model as _model
from helpers.oracle import oracle_compressed_allreduce, oracle_compressed_allreduce_per_tensor

import onebit
from onebit.collectives import compressed_allreduce_per_tensor_bytes, ring_allreduce_bytes
from onebit.compression import per_tensor_padded_size
from onebit.testing import spawn_workers

WORLD, H, ROUNDS = 2, 3, 4
SHAPES = [(6, 5), (6,), (2, 6), (2,)]
#: Each outer exchange's default outer SGD (lr, Nesterov momentum), from the text: DiLoCo's
#: after the dense exchange, momentum 0.5 after the 1-bit one.
OUTER = {"dense": (0.7, 0.9), "1bit": (0.7, 0.5)}
#: The DiLoCos run: (name, exchange, its compression, where the worker's residual goes, the
#: factor of the outer lr after each round, the elements to each server scale: blocks of
#: 8·WORLD = 16 elements cut the tensors of 30, 6, 12 and 2 into 16+14, 6, 12 and 2; the
#: share of the last round's average taken out of the messages).
VARIANTS = [
    ("dense", "dense", "per_tensor", "carried", 1.0, None, 0.0),
    ("1bit", "1bit", "per_tensor", "carried", 1.0, None, 0.0),
    ("1bit-local", "1bit", "per_tensor", "local", 0.5, None, 0.0),
    ("1bit-fused-local", "1bit", "fused", "local", 1.0, None, 0.0),
    ("1bit-blocks-local", "1bit", "per_tensor", "local", 1.0, 8, 0.0),
    ("1bit-reference-local", "1bit", "per_tensor", "local", 1.0, None, 0.5),
    ("1bit-fused-reference", "1bit", "fused", "carried", 1.0, None, 0.75),
]


def _diloco(model, inner, exchange: str, **options) -> onebit.DiLoCo:
    """DiLoCo of this module's rounds over ``model``, the torch kernels, with ``options``."""
    return onebit.DiLoCo(
        model.parameters(), inner, sync_every=H, exchange=exchange, kernels="torch", **options
    )


def _schedule(diloco: onebit.DiLoCo, decay: float) -> None:
    """The outer lr of the rounds ended so far: the default's times ``decay`` per round."""
    for group in diloco.outer_optimizer.param_groups:
        group["lr"] = OUTER[diloco.exchange_kind][0] * decay**diloco.rounds


def _train(
    rank: int,
    world: int,
    exchange: str,
    compression: str,
    residual: str,
    decay: float,
    block: int | None,
    reference: float,
    save_at: int | None = None,
):
    """The round start weights and this rank's weights after every round; with ``save_at``,
    the run is saved after that inner step and continued by new objects that load the save."""

    def build():
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), **INNER)
        options = dict(
            compression=compression,
            worker_residual=residual,
            block_size=block,
            reference_share=reference,
        )
        return model, inner, _diloco(model, inner, exchange, **options)

    model, inner, diloco = build()
    rounds = []
    for step in range(H * ROUNDS):
        inner_step(model, inner, rank, step)
        _schedule(diloco, decay)
        if diloco.local_step == 0:
            own = weights(model)
            with diloco.round_start_weights():
                rounds.append((weights(model), own))
        if step + 1 == save_at:
            saved = (model.state_dict(), inner.state_dict(), diloco.state_dict())
            diloco.close()
            model, inner, diloco = build()
            model.load_state_dict(saved[0])
            inner.load_state_dict(saved[1])
            diloco.load_state_dict(saved[2])
            _schedule(diloco, decay)
    sent, count = diloco.bytes_sent, diloco.rounds
    diloco.sync()  # on a round's last step
    synced = weights(model), diloco.bytes_sent - sent
    return rounds, sent, count, synced


def _runs(rank: int, world: int):
    return {
        name: (
            _train(rank, world, *variant),
            _train(rank, world, *variant, save_at=H + 1),
        )
        for name, *variant in VARIANTS
    }


def _model_of_both_workers(
    exchange: str,
    node_size: int = 1,
    residual: str = "carried",
    compression: str = "per_tensor",
    decay: float = 1.0,
    block: int | None = None,
    reference: float = 0.0,
) -> list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
    """Both workers in one process, from the text: after every round, the start weights and
    each worker's weights. With ``node_size``, each worker a node whose inner steps take the
    mean of its ranks' gradients (DDP inside the node); with ``residual="local"``, each
    worker's weights move by its residual times κ = lr·(1 + momentum) after the outer step,
    and its error keeps 1 - κ of it for the next message (κ of that outer step, whatever the
    lr is when the message leaves); with ``compression="fused"``, the 1-bit oracle of one
    padded buffer; the outer lr multiplied by ``decay`` after every round; with ``block``,
    each tensor cut into blocks of ``block·WORLD`` elements, compressed as tensors of their own;
    with ``reference``, each message less that share of the last round's average, added back
    to the result."""
    replicas = [_model() for _ in range(WORLD)]
    inners = [torch.optim.AdamW(m.parameters(), **INNER) for m in replicas]
    theta = weights(replicas[0])
    buffers = None  # the outer momentum
    numels = [math.prod(s) for s in SHAPES]
    fused, total = compression == "fused", sum(numels)
    #: (tensor, offset, elements) of each run compressed alone
    runs = [
        (t, start, min(size, n - start))
        for t, n in enumerate(numels)
        for size in [n if block is None else block * WORLD]
        for start in range(0, n, size)
    ]
    padded = [per_tensor_padded_size(size, WORLD) for _, _, size in runs]
    width = onebit.padded_size(total, WORLD) if fused else sum(padded)
    worker_errors, server_errors = torch.zeros(WORLD, width), torch.zeros(WORLD, width // WORLD)
    lr, momentum = OUTER[exchange]
    kappa = 0.0  # of the last move by the residuals
    last = [torch.zeros(n) for n in numels]  # the last round's average

    def residuals(worker: int) -> list[torch.Tensor]:
        """Views of ``worker``'s error of each run, the padding left out."""
        errors = worker_errors[worker]
        if fused:
            return list(errors[:total].split(numels))
        return [e[:size] for e, (_, _, size) in zip(errors.split(padded), runs, strict=True)]

    def residual_of(worker: int, tensor: int) -> torch.Tensor:
        """``worker``'s error of ``tensor``, its runs' joined."""
        return torch.cat(
            [e for e, (t, _, _) in zip(residuals(worker), runs, strict=True) if t == tensor]
        )

    rounds = []
    for r in range(ROUNDS):
        for step in range(r * H, (r + 1) * H):
            for node, (model, inner) in enumerate(zip(replicas, inners, strict=True)):
                _node_step(model, inner, range(node * node_size, (node + 1) * node_size), step)
        deltas = [
            [(t - p.detach()).reshape(-1) for t, p in zip(theta, m.parameters(), strict=True)]
            for m in replicas
        ]
        per_tensor = [
            torch.stack([d[t] for d in deltas]) - reference * last[t] for t in range(len(theta))
        ]
        if exchange == "dense":
            average = [rows.sum(dim=0) / WORLD for rows in per_tensor]
        else:
            if residual == "local":  # κ·ρ is in the weights already
                for worker in range(WORLD):
                    for view in residuals(worker):
                        view.mul_(1 - kappa)
            if fused:
                flat = torch.zeros(WORLD, width)
                flat[:, :total] = torch.cat(per_tensor, dim=1)
                result, worker_errors, server_errors = oracle_compressed_allreduce(
                    flat, worker_errors, server_errors, kernels="torch"
                )
                average = list(result[:total].split(numels))
            else:
                pieces, worker_errors, server_errors = oracle_compressed_allreduce_per_tensor(
                    [per_tensor[t][:, start : start + size] for t, start, size in runs],
                    worker_errors,
                    server_errors,
                    kernels="torch",
                )
                average = [
                    torch.cat([p for p, (t, _, _) in zip(pieces, runs, strict=True) if t == tensor])
                    for tensor in range(len(numels))
                ]
            average = [a + reference * b for a, b in zip(average, last, strict=True)]
            last = average
        grads = [a.view_as(t) for a, t in zip(average, theta, strict=True)]
        if buffers is None:
            buffers = [g.clone() for g in grads]
        else:
            buffers = [momentum * b + g for b, g in zip(buffers, grads, strict=True)]
        theta = [t - lr * (g + momentum * b) for t, g, b in zip(theta, grads, buffers, strict=True)]
        kappa = lr * (1 + momentum)
        lr *= decay
        own = []
        for worker, model in enumerate(replicas):
            for index, (p, t) in enumerate(zip(model.parameters(), theta, strict=True)):
                move = kappa * residual_of(worker, index).view_as(t)
                p.data.copy_(t - move if residual == "local" else t)
            own.append(weights(model))
        rounds.append(([t.clone() for t in theta], own))
    return rounds


def _node_step(model, inner, ranks: range, step: int) -> None:
    """An inner step on the mean of the gradients of ``ranks``' batches."""
    grads = []
    for rank in ranks:
        inner.zero_grad()
        backward(model, rank, step)
        grads.append([p.grad.clone() for p in model.parameters()])
    for index, param in enumerate(model.parameters()):
        param.grad = torch.stack([g[index] for g in grads]).sum(dim=0) / len(grads)
    inner.step()


@pytest.fixture(scope="module")
def ranks():
    return spawn_workers(_runs, WORLD, timeout_s=240)


@pytest.mark.parametrize("name, exchange, compression, residual, decay, block, reference", VARIANTS)
def test_diloco_follows_the_model_of_both_workers_and_ranks_agree(
    ranks, name, exchange, compression, residual, decay, block, reference
):
    expected = _model_of_both_workers(
        exchange,
        residual=residual,
        compression=compression,
        decay=decay,
        block=block,
        reference=reference,
    )
    for rank in range(WORLD):
        (rounds, _, count, _), _ = ranks[rank][name]
        assert count == ROUNDS and len(rounds) == ROUNDS
        for r, ((start, own), (want_start, want_own)) in enumerate(
            zip(rounds, expected, strict=True)
        ):
            for index, (a, b) in enumerate(
                zip(start + own, want_start + want_own[rank], strict=True)
            ):
                torch.testing.assert_close(
                    a,
                    b,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, r=r, i=index: f"round {r + 1} {i}: {m}",
                )
    other = ranks[1][name][0][0]
    for (a, _), (b, _) in zip(ranks[0][name][0][0], other, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    if residual == "local":  # each worker is moved by its own residual
        assert not torch.equal(ranks[0][name][0][0][-1][1][0], other[-1][1][0])


def test_sync_on_a_rounds_last_step_undoes_the_residual_moves_and_sends_nothing(ranks):
    for rank in ranks:
        rounds, _, _, (weights, sent) = rank["1bit-local"][0]
        assert sent == 0
        assert all(torch.equal(a, b) for a, b in zip(weights, rounds[-1][0], strict=True))


@pytest.mark.parametrize("name", [name for name, *_ in VARIANTS])
def test_a_run_resumed_in_the_middle_of_a_round_is_bit_identical(ranks, name):
    for rank in ranks:
        (straight, sent, _, _), (resumed, resumed_sent, _, _) = rank[name]
        (start, own), (resumed_start, resumed_own) = straight[-1], resumed[-1]
        assert all(
            torch.equal(a, b) for a, b in zip(start + own, resumed_start + resumed_own, strict=True)
        )
        assert sent == resumed_sent


def test_the_bytes_of_each_outer_exchange(ranks):
    numels = [math.prod(s) for s in SHAPES]
    dense = ring_allreduce_bytes(4 * sum(numels), WORLD)
    one_bit = compressed_allreduce_per_tensor_bytes(numels, WORLD, torch.float32)
    assert ranks[0]["dense"][0][1] == ROUNDS * dense
    assert ranks[0]["1bit"][0][1] == ROUNDS * one_bit
    blocks = [16, 14, 6, 12, 2]  # VARIANTS' blocks of 16 elements
    in_blocks = compressed_allreduce_per_tensor_bytes(blocks, WORLD, torch.float32)
    assert ranks[0]["1bit-blocks-local"][0][1] == ROUNDS * in_blocks > ROUNDS * one_bit
    assert ranks[0]["1bit-reference-local"][0][1] == ROUNDS * one_bit  # the same messages
    # At a model's size the 1-bit exchange sends about 32 times fewer bytes a round.
    big = [4096 * 1024, 4096, 1024 * 1024]
    ratio = ring_allreduce_bytes(4 * sum(big), 4) / compressed_allreduce_per_tensor_bytes(
        big, 4, torch.float32
    )
    assert 31 < ratio <= 32


def test_bad_arguments_are_named_before_anything_changes():
    model = _model()
    inner = torch.optim.AdamW(model.parameters())
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    adam = torch.optim.Adam(model.parameters())
    damped = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, dampening=0.1)
    cases = [
        ({"sync_every": 0}, ValueError, "sync_every"),
        ({"sync_every": 2, "exchange": "2bit"}, ValueError, "exchange"),
        ({"sync_every": 2, "compression": "topk"}, ValueError, "compression"),
        ({"sync_every": 2, "outer_optimizer": other}, ValueError, "outer_optimizer"),
        ({"sync_every": 2, "worker_residual": "dropped"}, ValueError, "worker_residual"),
        ({"sync_every": 2, "exchange": "dense", "worker_residual": "local"}, ValueError, "1bit"),
        ({"sync_every": 2, "worker_residual": "local", "outer_optimizer": adam}, TypeError, "SGD"),
        (
            {"sync_every": 2, "worker_residual": "local", "outer_optimizer": damped},
            ValueError,
            "dampening=0.1",
        ),
        ({"sync_every": 2, "block_size": 12}, ValueError, "multiple of 8"),
        ({"sync_every": 2, "block_size": 8, "compression": "fused"}, ValueError, "'fused'"),
        ({"sync_every": 2, "block_size": 8, "exchange": "dense"}, ValueError, "'dense'"),
        ({"sync_every": 2, "reference_share": 1.5}, ValueError, "reference_share"),
        ({"sync_every": 2, "reference_share": True}, ValueError, "reference_share"),
        ({"sync_every": 2, "reference_share": "0.5"}, ValueError, "reference_share"),
        ({"sync_every": 2, "reference_share": 0.5, "exchange": "dense"}, ValueError, "'dense'"),
    ]
    for options, error, name in cases:
        with pytest.raises(error, match=name):
            onebit.DiLoCo(model.parameters(), inner, **options)
    with pytest.raises(ValueError, match="inner_optimizer"):
        onebit.DiLoCo(model.parameters(), other, sync_every=2)
    assert not inner._optimizer_step_post_hooks  # no hook left behind
    with pytest.raises(TypeError, match="worker_residual='carried'"):  # the default's "local"
        onebit.DiLoCo(model.parameters(), inner, sync_every=2, outer_optimizer=adam)
    carried = onebit.DiLoCo(
        model.parameters(), inner, sync_every=2, outer_optimizer=adam, worker_residual="carried"
    )
    carried.close()
    diloco = onebit.DiLoCo(model.parameters(), inner, sync_every=2, worker_residual="carried")
    saved = diloco.state_dict()
    with pytest.raises(ValueError, match="exchange"):
        onebit.DiLoCo(model.parameters(), inner, sync_every=2, exchange="dense").load_state_dict(
            saved
        )
    blocks = onebit.DiLoCo(
        model.parameters(), inner, sync_every=2, block_size=8, worker_residual="carried"
    )
    with pytest.raises(ValueError, match="block_size=None; this one has block_size=8"):
        blocks.load_state_dict(saved)
    referenced = onebit.DiLoCo(
        model.parameters(), inner, sync_every=2, reference_share=0.5, worker_residual="carried"
    )
    with pytest.raises(ValueError, match="reference_share=0.0; this one has reference_share=0.5"):
        referenced.load_state_dict(saved)
    with pytest.raises(ValueError, match="reference of a fragment holds None elements"):
        referenced.load_state_dict(saved | {"reference_share": 0.5})
    local = onebit.DiLoCo(model.parameters(), inner, sync_every=2)  # the default
    with pytest.raises(ValueError, match="worker_residual='carried'"):
        local.load_state_dict(saved)
    without_moves = {k: v for k, v in local.state_dict().items() if k != "residual_moves"}
    with pytest.raises(ValueError, match="residual moves"):
        local.load_state_dict(without_moves)
    local.close()
    with pytest.raises(ValueError, match="inner step 1 .* sync_every=1"):
        onebit.DiLoCo(
            model.parameters(), inner, sync_every=1, worker_residual="carried"
        ).load_state_dict(saved | {"local_step": 1})


def _nodes_of_two(rank: int, world: int, exchange: str):
    """Two nodes of two ranks: DDP inside each node, DiLoCo's outer exchange between them
    (over the group of the ranks with this rank's local index)."""
    intra, inter = onebit.node_groups(2)
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=intra)
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    diloco = _diloco(model, inner, exchange, process_group=inter)
    rounds = []
    for step in range(H * ROUNDS):
        inner_step(ddp, inner, rank, step)
        if diloco.local_step == 0:
            rounds.append(weights(model))
    return rounds


@pytest.mark.slow  # four processes
@pytest.mark.parametrize("exchange", ["dense", "1bit"])
def test_diloco_between_nodes_with_ddp_inside_them(exchange):
    """The exchange's default placement of the residual (the 1-bit one's "local": each node
    at its own weights), every rank at its node's weights, the ranks of a node identical."""
    ranks = spawn_workers(_nodes_of_two, 4, args=(exchange,), timeout_s=240)
    residual = onebit.diloco.RESIDUAL_DEFAULTS[exchange]
    expected = _model_of_both_workers(exchange, node_size=2, residual=residual)
    for rank, rounds in enumerate(ranks):
        node = rank // 2
        for r, (got, (_, workers)) in enumerate(zip(rounds, expected, strict=True)):
            for a, b in zip(got, workers[node], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            same_node = ranks[2 * node][r]
            assert all(torch.equal(a, b) for a, b in zip(got, same_node, strict=True)), (
                f"rank {rank} differs from its node's first rank after round {r + 1}"
            )
