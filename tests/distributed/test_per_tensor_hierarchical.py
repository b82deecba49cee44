"""The hierarchical exchange with every tensor compressed alone (ALGORITHM.md, "Hierarchical
exchange", "Per tensor") on gloo processes: per tensor, the single-process model of the
hierarchical exchange of that tensor padded alone, bit for bit (result and error slices);
the bytes it counts; inside 1-bit LAMB, the default with ``node_groups``."""

from __future__ import annotations

import pytest
import torch
from helpers.oracle import oracle_hierarchical_compressed_allreduce

from onebit import kernels
from onebit.compression import Layout
from onebit.exchange import (
    PerTensorHierarchicalExchange,
    TrafficCounter,
    node_groups,
    per_tensor_hierarchical_bytes,
)
from onebit.testing import spawn_workers

NUMELS = [37, 100, 13, 5, 64]
CALLS = 3


def _inputs(world: int, call: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * world + call)
    return torch.randn(world, sum(NUMELS), generator=gen)


def _exchange(rank: int, world: int, local: int, backend: str):
    groups = node_groups(local)
    exchange = PerTensorHierarchicalExchange(groups)
    traffic = TrafficCounter()
    chosen = kernels.select(torch.zeros(8), backend)
    exchange.bind(NUMELS, torch.float32, torch.device("cpu"), chosen, traffic)
    results = []
    for call in range(CALLS):
        buffer = _inputs(world, call)[rank].clone()
        results.append(exchange.exchange(buffer).decode(torch.empty(sum(NUMELS))))
    errors = exchange.worker_error.clone(), exchange.server_error.clone()
    return results, errors, dict(traffic.bytes_sent)


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), pytest.param(3, 1, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "backend",
    [
        name if name == "numba" else pytest.param(name, marks=pytest.mark.slow)
        for name in kernels.available()
        if name != "triton"
    ],
)
def test_each_tensor_is_the_hierarchical_exchange_of_it_padded_alone(nodes, local, backend):
    world = nodes * local
    ranks = spawn_workers(_exchange, world, args=(local, backend), timeout_s=180)
    layout = Layout.per_tensor(NUMELS, world)
    starts = [sum(NUMELS[:t]) for t in range(len(NUMELS))]
    expected = torch.zeros(CALLS, sum(NUMELS))
    worker_errors, server_errors = [], []
    for t, (numel, padded) in enumerate(zip(NUMELS, layout.sizes, strict=True)):
        sim = [torch.zeros(world, padded // local), torch.zeros(world, padded // world)]
        for call in range(CALLS):
            inputs = torch.zeros(world, padded)
            inputs[:, :numel] = _inputs(world, call)[:, starts[t] : starts[t] + numel]
            result, *sim = oracle_hierarchical_compressed_allreduce(
                inputs, *sim, local, kernels=backend
            )
            expected[call, starts[t] : starts[t] + numel] = result[:numel]
        worker_errors.append(sim[0])
        server_errors.append(sim[1])
    for rank, (results, (worker, server), sent) in enumerate(ranks):
        for call in range(CALLS):
            assert torch.equal(results[call], expected[call]), (rank, call)
        assert torch.equal(worker, torch.cat([e[rank] for e in worker_errors])), rank
        assert torch.equal(server, torch.cat([e[rank] for e in server_errors])), rank
        per_call = per_tensor_hierarchical_bytes(NUMELS, local, nodes, torch.float32)
        assert sent == {kind: CALLS * n for kind, n in per_call.items() if n}
