"""One optimizer through every implementation of the exchange seam (onebit.exchange), each
against the independent float64 model of the spec (oracle_onebit.py, whose exchange is
the test oracle's): flat and per tensor over a process group, hierarchical over nodes, and
many workers simulated in one process, flat and by node."""

from __future__ import annotations

import pytest
import torch
from helpers.onebit_problem import (
    FREEZE,
    GROUP_HYPER,
    HYPER,
    MASK,
    STEPS,
    assert_follows_model_and_ranks_agree,
    build,
    grad_fn,
    initial_params,
    set_grads,
)
from helpers.oracle_onebit import oracle_run

import onebit
from onebit.exchange import (
    FlatExchange,
    HierarchicalExchange,
    PerTensorExchange,
    SimulatedExchange,
)
from onebit.simulate import SimulatedDataParallel
from onebit.testing import spawn_workers

WORKERS, NODE = 4, 2
MASKS = [None, None, None, MASK]
# (exchange, compression of OneBitAdam, ranks per node of the model's exchange)
CASES = {
    "flat": (FlatExchange, "fused", 1),
    "per_tensor": (PerTensorExchange, "per_tensor", 1),
    "hierarchical": (HierarchicalExchange, "fused", NODE),
}


def _run(params, step):
    history = []
    for _ in range(STEPS):
        step()
        history.append([p.detach().clone() for p in params])
    return history


def _over_groups(rank: int, world_size: int):
    """Each case's trajectory on this rank, and the exchange its optimizer was built with."""
    out = {}
    groups = onebit.node_groups(NODE)
    for name, (_, compression, node_size) in CASES.items():
        options = {"node_groups": groups} if node_size > 1 else {}
        params, optimizer = build("adam", torch.float64, compression, **options)

        def step(params=params, optimizer=optimizer):
            set_grads(params, rank)
            optimizer.step()

        history = _run(params, step)
        out[name] = (history, type(optimizer.exchange).__name__, optimizer.traffic_by_kind)
    return out


def _expected(compression: str, node_size: int):
    return oracle_run(
        "adam",
        initial_params(),
        grad_fn,
        WORKERS,
        STEPS,
        FREEZE,
        GROUP_HYPER,
        HYPER,
        MASKS,
        compression=compression,
        node_size=node_size,
    )


def test_every_group_exchange_follows_the_model_and_ranks_agree():
    results = spawn_workers(_over_groups, WORKERS, timeout_s=240)
    for name, (exchange, compression, node_size) in CASES.items():
        histories = [results[rank][name][0] for rank in range(WORKERS)]
        assert results[0][name][1] == exchange.__name__
        expected = _expected(compression, node_size)
        assert_follows_model_and_ranks_agree(histories, expected, 1e-9, name)
    kinds = {name: set(results[0][name][2]) for name in CASES}
    assert kinds["hierarchical"] == {
        "allreduce",
        "intra_node",
        "inter_node",
        "gradient_check",
        "gradient_flags",
    }
    assert (
        kinds["flat"]
        == kinds["per_tensor"]
        == {
            "allreduce",
            "compressed_allreduce",
            "gradient_check",
            "gradient_flags",
        }
    )


@pytest.mark.parametrize("node_size", [1, NODE])
def test_the_simulated_exchange_follows_the_model(node_size):
    params, optimizer = build("adam", torch.float64)
    simulation = SimulatedDataParallel(optimizer, WORKERS, node_size)
    assert isinstance(optimizer.exchange, SimulatedExchange)
    history = _run(params, lambda: simulation.step(lambda rank: set_grads(params, rank)))
    expected = _expected("fused", node_size)
    assert_follows_model_and_ranks_agree([history], expected, 1e-9, f"simulated L={node_size}")
    assert optimizer.topology == (node_size, WORKERS // node_size)
