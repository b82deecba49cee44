"""The hierarchical exchange on real gloo processes against its single-process simulation."""

from __future__ import annotations

import pytest
import torch

import onebit
from onebit.collectives import NonFiniteError, TrafficCounter, padded_size
from onebit.compression import (
    simulate_compressed_allreduce,
    simulate_hierarchical_compressed_allreduce,
)
from onebit.hierarchical import hierarchical_bytes, node_groups
from onebit.testing import spawn_workers

CALLS = 4


def _inputs(world: int, numel: int, call: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * world + call)
    return torch.randn(world, numel, generator=gen) * torch.linspace(0.5, 2.0, world)[:, None]


def _exchange(rank: int, world: int, local: int, numel: int):
    intra, inter = node_groups(local)
    worker_error = torch.zeros(numel // local)
    server_error = torch.zeros(numel // world)
    sim = (torch.zeros(world, numel // local), torch.zeros(world, numel // world))
    flat_sim = (torch.zeros(world, numel), torch.zeros(world, numel // world))
    traffic = TrafficCounter()
    workspace = onebit.HierarchicalWorkspace()
    for call in range(CALLS):
        inputs = _inputs(world, numel, call)
        result = onebit.hierarchical_compressed_allreduce(
            inputs[rank].clone(),
            worker_error,
            server_error,
            intra,
            inter,
            workspace=workspace,
            traffic=traffic,
        )
        expected, *sim = simulate_hierarchical_compressed_allreduce(inputs, *sim, local)
        assert torch.equal(result, expected), f"call {call}: result differs from the simulation"
        assert torch.equal(worker_error, sim[0][rank]), f"call {call}: worker_error differs"
        assert torch.equal(server_error, sim[1][rank]), f"call {call}: server_error differs"
        if local == 1:  # the flat exchange, bit for bit
            flat, *flat_sim = simulate_compressed_allreduce(inputs, *flat_sim)
            assert torch.equal(result, flat)
    return result, dict(traffic.bytes_sent)


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (3, 1), (1, 3)])
def test_matches_the_simulation_bit_for_bit_and_ranks_agree(nodes, local):
    world = nodes * local
    numel = padded_size(1000, world)
    outputs = spawn_workers(_exchange, world, args=(local, numel), timeout_s=120)
    expected_bytes = hierarchical_bytes(numel, local, nodes, torch.float32)
    for rank, (result, sent) in enumerate(outputs):
        assert torch.equal(result, outputs[0][0]), f"rank {rank} got a different result"
        counted = {kind: nbytes for kind, nbytes in expected_bytes.items() if nbytes}
        assert sent == {kind: CALLS * nbytes for kind, nbytes in counted.items()}


def test_inter_node_bytes_are_one_over_l_of_the_flat_exchange():
    """Per node and step: L ranks x their inter-node bytes, against the flat exchange's share
    that leaves the node (8 nodes of 8 ranks, 100M elements)."""
    numel, local, nodes = padded_size(10**8, 64), 8, 8
    hierarchical = local * hierarchical_bytes(numel, local, nodes, torch.float32)["inter_node"]
    flat_per_rank = onebit.collectives.compressed_allreduce_bytes(numel, 64, torch.float32)
    leaving_node = local * flat_per_rank * (64 - local) / (64 - 1)
    assert hierarchical <= 1.05 * leaving_node / local


def _non_finite(rank: int, world: int):
    intra, inter = node_groups(2)
    buffer = torch.randn(64, generator=torch.Generator().manual_seed(rank))
    if rank == 3:
        buffer[5] = float("nan")  # shard 0 of node 1: only local index 0 sees it directly
    worker_error, server_error = torch.full((32,), 0.5), torch.full((16,), 0.25)
    try:
        onebit.hierarchical_compressed_allreduce(buffer, worker_error, server_error, intra, inter)
    except NonFiniteError:
        return bool((worker_error == 0.5).all() and (server_error == 0.25).all())
    return None


def test_non_finite_input_anywhere_raises_on_every_rank_without_touching_state():
    assert spawn_workers(_non_finite, 4, timeout_s=60) == [True] * 4
