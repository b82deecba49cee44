"""The per-tensor compressed allreduce (DeepSpeed's 1-bit Adam scheme, every tensor in the
same two messages per peer) on real gloo ranks: the distributed exchange against the
simulation, its bytes, its messages (one per peer and phase, point to point with their
receives posted ahead), and non-finite input on one rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers.oracle import oracle_compressed_allreduce_per_tensor
from helpers.per_tensor_inputs import CALLS, SHAPES, seeded_inputs

import onebit
from onebit import kernels
from onebit.collectives import NonFiniteError, TrafficCounter, compressed_allreduce_per_tensor_bytes
from onebit.exchange import transport
from onebit.testing import spawn_workers

CPU_BACKENDS = [name for name in kernels.available() if name != "triton"]

COLLECTIVES = (
    "allreduce",
    "allgather",
    "all_gather_single",
    "_allgather_base",
    "alltoall_base",
    "all_to_all_single",
    "broadcast",
    "send",
    "recv",
)


class CollectiveCounter:
    """Counts the calls of ``torch.distributed.ProcessGroup``'s collectives and point-to-point
    messages (every route through ``torch.distributed`` ends there), by name."""

    def __enter__(self) -> dict[str, int]:
        self.calls: dict[str, int] = {}
        self._originals = {
            name: vars(dist.ProcessGroup)[name]
            for name in COLLECTIVES
            if name in vars(dist.ProcessGroup)
        }
        for name, original in self._originals.items():
            setattr(dist.ProcessGroup, name, self._counting(name, original))
        return self.calls

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist.ProcessGroup, name, original)

    def _counting(self, name, original):
        def counted(group, *args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(group, *args, **kwargs)

        return counted


def _exchange_against_simulation(rank: int, n: int):
    """For each backend (and float64): CALLS exchanges, each checked against the simulation;
    the results, bytes, calls and collectives of each."""
    runs = {}
    for backend, dtype in [(b, torch.float32) for b in CPU_BACKENDS] + [("torch", torch.float64)]:
        numels = [math.prod(shape) for shape in SHAPES]
        width, server = onebit.per_tensor_error_sizes(numels, n)
        worker_error = torch.zeros(width, dtype=dtype)
        server_error = torch.zeros(server, dtype=dtype)
        sim_worker = torch.zeros(n, width, dtype=dtype)
        sim_server = torch.zeros(n, server, dtype=dtype)
        traffic, collectives, results = TrafficCounter(), [], []
        for call in range(CALLS):
            inputs = seeded_inputs(n, call, dtype)
            tensors = [
                b[rank].reshape(shape).clone() for b, shape in zip(inputs, SHAPES, strict=True)
            ]
            with CollectiveCounter() as counted:
                onebit.compressed_allreduce_per_tensor(
                    tensors, worker_error, server_error, traffic=traffic, kernels=backend
                )
            collectives.append(counted)
            expected, sim_worker, sim_server = oracle_compressed_allreduce_per_tensor(
                inputs, sim_worker, sim_server, kernels=backend
            )
            where = f"{backend} {dtype} call {call}"
            for t, (got, want) in enumerate(zip(tensors, expected, strict=True)):
                assert torch.equal(got.reshape(-1), want), f"{where} tensor {t}"
            assert torch.equal(worker_error, sim_worker[rank]), f"{where}: worker_error differs"
            assert torch.equal(server_error, sim_server[rank]), f"{where}: server_error differs"
            results.append(torch.cat([t.reshape(-1) for t in tensors]))
        runs[backend, dtype] = (
            torch.stack(results),
            traffic.bytes_sent,
            traffic.calls,
            collectives,
        )
    return runs


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_distributed_exchange_matches_simulation_in_a_message_per_peer_and_phase(n):
    outputs = spawn_workers(_exchange_against_simulation, n, timeout_s=120)
    numels = [math.prod(shape) for shape in SHAPES]
    _, server = onebit.per_tensor_error_sizes(numels, n)
    for (backend, dtype), (results, *_) in outputs[0].items():
        per_call = compressed_allreduce_per_tensor_bytes(numels, n, dtype)
        scale = 8 if dtype == torch.float64 else 4
        assert per_call == 2 * (n - 1) * server // 8 + (2 * len(SHAPES) + 1) * (n - 1) * scale
        for rank, runs in enumerate(outputs):
            rank_results, sent, calls, collectives = runs[backend, dtype]
            assert torch.equal(rank_results, results), f"{backend}: rank {rank} differs"
            assert sent == {"compressed_allreduce": CALLS * per_call}
            assert calls == {"compressed_allreduce": CALLS}
            for counted in collectives:  # a message per peer and phase, each way
                assert counted == {"send": 2 * (n - 1), "recv": 2 * (n - 1)}


def _nan_on_last_rank(rank: int, n: int):
    """A NaN on the last rank: the message raised, whether the tensors and the error state
    were kept, and whether the next exchange, given the failed one's tags, gives the
    oracle's result (every message posted ahead for the failed one was sent, none left for
    the next one's to land in)."""
    numels = [12, 40]
    width, server = onebit.per_tensor_error_sizes(numels, n)
    tensors = [torch.randn(12), torch.randn(4, 10)]
    worker_error, server_error = torch.full((width,), 0.5), torch.full((server,), 0.25)
    before = [t.clone() for t in tensors]
    if rank == n - 1:
        tensors[1][2, 3] = float("nan")
        before[1] = tensors[1].clone()
    group = dist.group.WORLD.group_name
    serial = transport._posted_exchanges.get(group, 0)
    try:
        onebit.compressed_allreduce_per_tensor(tensors, worker_error, server_error)
    except NonFiniteError as error:
        transport._posted_exchanges[group] = serial  # the tags again
        errors_kept = bool((worker_error == 0.5).all() and (server_error == 0.25).all())
        tensors_kept = all(
            torch.equal(a.nan_to_num(), b.nan_to_num())
            for a, b in zip(tensors, before, strict=True)
        )
        return str(error), errors_kept and tensors_kept, _next_exchange_is_the_oracles(rank, n)
    return None, None, None


def _next_exchange_is_the_oracles(rank: int, n: int) -> bool:
    inputs = seeded_inputs(n, 0, torch.float32)
    tensors = [b[rank].reshape(shape).clone() for b, shape in zip(inputs, SHAPES, strict=True)]
    width, server = onebit.per_tensor_error_sizes([math.prod(s) for s in SHAPES], n)
    onebit.compressed_allreduce_per_tensor(
        tensors, torch.zeros(width), torch.zeros(server), kernels="torch"
    )
    expected, _, _ = oracle_compressed_allreduce_per_tensor(
        inputs, torch.zeros(n, width), torch.zeros(n, server), kernels="torch"
    )
    return all(
        torch.equal(got.reshape(-1), want) for got, want in zip(tensors, expected, strict=True)
    )


def test_non_finite_input_on_one_rank_raises_on_every_rank_with_nothing_changed():
    for message, untouched, next_exact in spawn_workers(_nan_on_last_rank, 2, timeout_s=60):
        assert message is not None and "rank(s) [1]" in message
        assert untouched and next_exact
