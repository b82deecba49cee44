"""The per-tensor compressed allreduce (DeepSpeed's 1-bit Adam scheme, fused collectives):
the simulation against the flat exchange of each tensor padded alone, the distributed
exchange against the simulation on gloo, its bytes, its collectives and its errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers.oracle import oracle_compressed_allreduce, oracle_compressed_allreduce_per_tensor

import onebit
from onebit import kernels
from onebit.collectives import NonFiniteError, TrafficCounter, compressed_allreduce_per_tensor_bytes
from onebit.compression import per_tensor_padded_size
from onebit.testing import spawn_workers

CPU_BACKENDS = [name for name in kernels.available() if name != "triton"]
# Without a GPU, triton runs on CPU in Triton's interpreter (see conftest.py): slowly, so in
# a world of one rank only, against the simulation (the layout is tested on the CPU backends).
INTERPRETED = [
    name
    for name in kernels.available()
    if name == "triton" and kernels._load(name).supports(torch.zeros(8))
]
SHAPES = [(7, 5), (5,), (300,), (1,), (6, 2), (0,)]  # one tensor of each kind of padding
CALLS = 4


def test_each_tensor_is_padded_alone_to_deepspeeds_unit():
    # DeepSpeed's unit n * lcm(n, 8): 8 n for n = 1, 2, 4, 8, more where n does not divide 8.
    assert [per_tensor_padded_size(1, n) for n in (1, 2, 3, 4, 8, 16)] == [8, 16, 72, 32, 64, 256]
    assert per_tensor_padded_size(0, 2) == 16
    assert per_tensor_padded_size(73, 3) == 144
    numels = [math.prod(shape) for shape in SHAPES]
    assert onebit.per_tensor_error_sizes(numels, 3) == (5 * 72 + 360, (5 * 72 + 360) // 3)
    assert onebit.per_tensor_error_sizes(numels, 2) == (48 + 16 + 304 + 16 + 16 + 16, 208)
    with pytest.raises(ValueError, match="n >= 1"):
        per_tensor_padded_size(5, 0)


def _inputs(n: int, call: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Every rank's tensors for one call (row i = rank i), the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(100 * n + call)
    magnitudes = torch.linspace(0.5, 2.0, n).unsqueeze(1)
    return [
        (torch.randn(n, math.prod(shape), generator=gen) * magnitudes * (index + 1)).to(dtype)
        for index, shape in enumerate(SHAPES)
    ]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_simulation_is_the_flat_exchange_of_each_tensor_padded_alone(n, backend):
    numels = [math.prod(shape) for shape in SHAPES]
    padded = [per_tensor_padded_size(numel, n) for numel in numels]
    width, server = onebit.per_tensor_error_sizes(numels, n)
    worker_errors, server_errors = torch.zeros(n, width), torch.zeros(n, server)
    oracle = [(torch.zeros(n, size), torch.zeros(n, size // n)) for size in padded]
    for call in range(CALLS):
        buffers = _inputs(n, call)
        results, worker_errors, server_errors = oracle_compressed_allreduce_per_tensor(
            buffers, worker_errors, server_errors, kernels=backend
        )
        worker_offset = server_offset = 0
        for t, (buffer, size) in enumerate(zip(buffers, padded, strict=True)):
            alone = torch.zeros(n, size)
            alone[:, : buffer.shape[1]] = buffer
            expected, *oracle[t] = oracle_compressed_allreduce(alone, *oracle[t], kernels=backend)
            assert torch.equal(results[t], expected[: buffer.shape[1]]), f"call {call} tensor {t}"
            assert torch.equal(worker_errors[:, worker_offset : worker_offset + size], oracle[t][0])
            chunk = size // n
            assert torch.equal(
                server_errors[:, server_offset : server_offset + chunk], oracle[t][1]
            )
            worker_offset, server_offset = worker_offset + size, server_offset + chunk
        assert not results[-1].numel()


@pytest.mark.parametrize("backend", INTERPRETED)
def test_interpreted_triton_in_a_world_of_one_rank_matches_the_simulation(backend):
    width, server = onebit.per_tensor_error_sizes([math.prod(s) for s in SHAPES], 1)
    worker_error, server_error = torch.zeros(width), torch.zeros(server)
    sim_worker, sim_server = torch.zeros(1, width), torch.zeros(1, server)
    for call in range(2):
        inputs = _inputs(1, call)
        tensors = [b[0].reshape(shape).clone() for b, shape in zip(inputs, SHAPES, strict=True)]
        onebit.compressed_allreduce_per_tensor(tensors, worker_error, server_error, kernels=backend)
        expected, sim_worker, sim_server = oracle_compressed_allreduce_per_tensor(
            inputs, sim_worker, sim_server, kernels=backend
        )
        assert all(torch.equal(t.reshape(-1), e) for t, e in zip(tensors, expected, strict=True))
        assert torch.equal(worker_error, sim_worker[0]) and torch.equal(server_error, sim_server[0])


def test_per_tensor_scales_differ_from_one_fused_buffer():
    # A small tensor beside a large one keeps its own scale: its result is +-(its own rms).
    n = 2
    buffers = [torch.full((n, 16), 1e-3), torch.full((n, 512), 10.0)]
    width, server = onebit.per_tensor_error_sizes([16, 512], n)
    results, _, _ = oracle_compressed_allreduce_per_tensor(
        buffers, torch.zeros(n, width), torch.zeros(n, server)
    )
    torch.testing.assert_close(results[0], torch.full((16,), 1e-3))
    torch.testing.assert_close(results[1], torch.full((512,), 10.0))


COLLECTIVES = (
    "allreduce",
    "allgather",
    "all_gather_single",
    "_allgather_base",
    "alltoall_base",
    "all_to_all_single",
    "broadcast",
)


class CollectiveCounter:
    """Counts the calls of ``torch.distributed.ProcessGroup``'s collectives (every route
    through ``torch.distributed`` ends there), by name."""

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
            inputs = _inputs(n, call, dtype)
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
def test_distributed_exchange_matches_simulation_in_two_collectives(n):
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
            for counted in collectives:  # the flat exchange's: a message per peer and phase
                assert counted == {"all_gather_single": 1, "all_to_all_single": 1}


def _nan_on_last_rank(rank: int, n: int):
    numels = [12, 40]
    width, server = onebit.per_tensor_error_sizes(numels, n)
    tensors = [torch.randn(12), torch.randn(4, 10)]
    worker_error, server_error = torch.full((width,), 0.5), torch.full((server,), 0.25)
    before = [t.clone() for t in tensors]
    if rank == n - 1:
        tensors[1][2, 3] = float("nan")
        before[1] = tensors[1].clone()
    try:
        onebit.compressed_allreduce_per_tensor(tensors, worker_error, server_error)
    except NonFiniteError as error:
        errors_kept = bool((worker_error == 0.5).all() and (server_error == 0.25).all())
        tensors_kept = all(
            torch.equal(a.nan_to_num(), b.nan_to_num())
            for a, b in zip(tensors, before, strict=True)
        )
        return str(error), errors_kept and tensors_kept
    return None, None


def test_non_finite_input_on_one_rank_raises_on_every_rank_with_nothing_changed():
    for message, untouched in spawn_workers(_nan_on_last_rank, 2, timeout_s=60):
        assert message is not None and "rank(s) [1]" in message
        assert untouched


@pytest.mark.parametrize(
    ("tensors", "worker", "server", "error", "match"),
    [
        ([], 16, 8, ValueError, "at least one tensor"),
        ([torch.zeros(3)], 15, 8, ValueError, "worker_error has 15 elements; .* need 16"),
        ([torch.zeros(3)], 16, 9, ValueError, "server_error has 9 elements; .* need 8"),
        ([torch.zeros(3, dtype=torch.float64)], 16, 8, TypeError, r"tensors\[0\] is torch.float64"),
        ([torch.zeros(3, dtype=torch.int64)], 16, 8, TypeError, r"tensors\[0\] is torch.int64"),
        ([torch.zeros(3), "x"], 32, 16, TypeError, r"tensors\[1\] is str"),
    ],
)
def test_bad_input_is_a_clear_error(tensors, worker, server, error, match, monkeypatch):
    monkeypatch.setattr("onebit.collectives.world_size", lambda group=None: 2)
    with pytest.raises(error, match=match):
        onebit.compressed_allreduce_per_tensor(tensors, torch.zeros(worker), torch.zeros(server))


def test_errors_of_another_dtype_are_rejected():
    with pytest.raises(ValueError, match="server_error is torch.float64"):
        onebit.compressed_allreduce_per_tensor(
            [torch.zeros(3)], torch.zeros(8), torch.zeros(8, dtype=torch.float64)
        )
    with pytest.raises(TypeError, match="worker_error must be a floating-point"):
        onebit.compressed_allreduce_per_tensor(
            [torch.zeros(3)], torch.zeros(8, dtype=torch.int32), torch.zeros(8)
        )
