"""compressed_allreduce on real gloo processes against the single-process simulation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.oracle import oracle_compressed_allreduce

import onebit
from onebit import kernels
from onebit.collectives import (
    KernelMismatchError,
    NonFiniteError,
    TrafficCounter,
    compressed_allreduce_bytes,
    padded_size,
)
from onebit.testing import WorkerError, spawn_workers

CALLS = 5
CPU_BACKENDS = [name for name in kernels.available() if name != "triton"]
# Without a GPU, triton runs on CPU in Triton's interpreter (see tests/conftest.py): slowly, so
# in small worlds only.
INTERPRETED = [
    name
    for name in kernels.available()
    if name == "triton" and kernels._load(name).supports(torch.zeros(8))
]


def _all_inputs(world_size: int, numel: int, call: int) -> torch.Tensor:
    """Every rank's buffer for one call, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(1000 * world_size + call)
    magnitudes = torch.linspace(0.5, 2.0, world_size).unsqueeze(1)
    return torch.randn(world_size, numel, generator=gen) * magnitudes


def _exchange_against_simulation(rank: int, world_size: int, numel: int, backend: str):
    worker_error = torch.zeros(numel)
    server_error = torch.zeros(numel // world_size)
    sim_we = torch.zeros(world_size, numel)
    sim_se = torch.zeros(world_size, numel // world_size)
    results = []
    traffic = TrafficCounter()
    workspace = onebit.CompressionWorkspace()
    for call in range(CALLS):
        inputs = _all_inputs(world_size, numel, call)
        buffer = inputs[rank].clone()
        result = onebit.compressed_allreduce(
            buffer,
            worker_error,
            server_error,
            workspace=workspace,
            traffic=traffic,
            kernels=backend,
        )
        assert torch.equal(buffer, inputs[rank]), "the input buffer must not be modified"
        expected, sim_we, sim_se = oracle_compressed_allreduce(
            inputs, sim_we, sim_se, kernels=backend
        )
        assert torch.equal(result, expected), f"call {call}: result differs from the simulation"
        assert torch.equal(worker_error, sim_we[rank]), f"call {call}: worker_error differs"
        assert torch.equal(server_error, sim_se[rank]), f"call {call}: server_error differs"
        results.append(result)
    in_place = onebit.compressed_allreduce(
        buffer, worker_error, server_error, out=buffer, traffic=traffic, kernels=backend
    )
    assert in_place.data_ptr() == buffer.data_ptr()
    return torch.stack(results), traffic.bytes_sent.get("compressed_allreduce", 0)


@pytest.mark.parametrize(
    ("world_size", "backend"),
    [(w, b) for w in (1, 2) for b in CPU_BACKENDS]
    + [
        (3, b) if b == CPU_BACKENDS[-1] else pytest.param(3, b, marks=pytest.mark.slow)
        for b in CPU_BACKENDS
    ]
    + [pytest.param(4, b, marks=pytest.mark.slow) for b in CPU_BACKENDS]
    + [(w, b) for w in (1, 2) for b in INTERPRETED],
)
def test_matches_simulation_and_is_identical_on_every_rank(world_size, backend):
    numel = padded_size(100_000 if world_size == 2 else 1000, world_size)
    outputs = spawn_workers(_exchange_against_simulation, world_size, args=(numel, backend))
    for rank, (results, _) in enumerate(outputs):
        assert torch.equal(results, outputs[0][0]), f"rank {rank} got a different result"
    chunk = numel // world_size
    expected_bytes = (CALLS + 1) * (2 * (world_size - 1) * chunk // 8 + 12 * (world_size - 1))
    assert all(sent == expected_bytes for _, sent in outputs)
    assert expected_bytes == (CALLS + 1) * compressed_allreduce_bytes(
        numel, world_size, torch.float32
    )


def _mixed_backends(rank: int, world_size: int):
    worker_error, server_error = torch.full((64,), 0.5), torch.full((32,), 0.25)
    try:
        onebit.compressed_allreduce(
            torch.randn(64),
            worker_error,
            server_error,
            kernels=CPU_BACKENDS[rank % len(CPU_BACKENDS)],
        )
    except KernelMismatchError as error:
        untouched = bool((worker_error == 0.5).all() and (server_error == 0.25).all())
        return str(error), untouched
    return None, None


@pytest.mark.skipif(len(CPU_BACKENDS) < 2, reason="needs two CPU backends (numba installed)")
def test_ranks_with_different_backends_get_a_clear_error_on_every_rank():
    for message, untouched in spawn_workers(_mixed_backends, 2, timeout_s=60):
        assert message is not None and "['torch', 'numba']" in message
        assert untouched


def _bad_sizes(rank: int, world_size: int):
    messages = []
    for buffer, we, se in (
        (torch.zeros(20), torch.zeros(20), torch.zeros(10)),  # not a multiple of 16
        (torch.zeros(32), torch.zeros(16), torch.zeros(16)),  # worker_error too small
        (torch.zeros(32), torch.zeros(32), torch.zeros(32)),  # server_error not N // n
    ):
        try:
            onebit.compressed_allreduce(buffer, we, se)
        except ValueError as error:
            messages.append(str(error))
    # The group still works after the rejected calls: nothing was half-sent.
    result = onebit.compressed_allreduce(torch.ones(32), torch.zeros(32), torch.zeros(16))
    return messages, result


def test_bad_sizes_raise_clear_errors_on_every_rank():
    outputs = spawn_workers(_bad_sizes, 2, timeout_s=60)
    for messages, result in outputs:
        assert len(messages) == 3
        assert "20 elements" in messages[0] and "padded_size(20, 2) = 32" in messages[0]
        assert "worker_error has 16 elements" in messages[1]
        assert "server_error has 32 elements" in messages[2] and "= 16" in messages[2]
        assert torch.equal(result, torch.ones(32))


def _non_finite_on_one_rank(rank: int, world_size: int, bad_value: float):
    buffer = torch.randn(48, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        buffer[5] = bad_value
    worker_error = torch.full((48,), 0.25)
    server_error = torch.full((48 // world_size,), 0.5)
    try:
        onebit.compressed_allreduce(buffer, worker_error, server_error)
    except NonFiniteError as error:
        message = str(error)
    else:
        message = None
    unchanged = bool(
        torch.equal(worker_error, torch.full((48,), 0.25))
        and torch.equal(server_error, torch.full((48 // world_size,), 0.5))
    )
    return message, unchanged


@pytest.mark.parametrize(
    "bad_value", [float("nan"), pytest.param(float("inf"), marks=pytest.mark.slow)]
)
def test_non_finite_input_raises_on_every_rank_without_touching_state(bad_value):
    outputs = spawn_workers(_non_finite_on_one_rank, 3, args=(bad_value,), timeout_s=60)
    for message, unchanged in outputs:
        assert message is not None and "rank(s) [1]" in message
        assert unchanged


def _raise_on_rank_one(rank: int, world_size: int):
    # Both ranks past the group's setup first: a rank 0 that returned and closed its group
    # while rank 1 still finished connecting would fail rank 1 before it could raise.
    dist.barrier()
    if rank == 1:
        raise RuntimeError("boom")
    return rank


def test_spawn_workers_reports_a_failing_rank():
    with pytest.raises(WorkerError, match="boom"):
        spawn_workers(_raise_on_rank_one, 2, timeout_s=60)
