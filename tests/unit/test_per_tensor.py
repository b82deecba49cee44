"""The per-tensor compressed allreduce (DeepSpeed's 1-bit Adam scheme, fused collectives):
the simulation against the flat exchange of each tensor padded alone, a world of one rank,
each tensor's own scale, and its errors (on gloo ranks: distributed/test_per_tensor_on_ranks.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.oracle import oracle_compressed_allreduce, oracle_compressed_allreduce_per_tensor
from helpers.per_tensor_inputs import CALLS, SHAPES, seeded_inputs

import onebit
from onebit import kernels
from onebit.compression import Layout, per_tensor_padded_size
from onebit.exchange.flat import fill_segments, segment_views
from onebit.exchange.workspace import CompressionWorkspace

CPU_BACKENDS = [name for name in kernels.available() if name != "triton"]
# Without a GPU, triton runs on CPU in Triton's interpreter (see tests/conftest.py): slowly, so in
# a world of one rank only, against the simulation (the layout is tested on the CPU backends).
INTERPRETED = [
    name
    for name in kernels.available()
    if name == "triton" and kernels._load(name).supports(torch.zeros(8))
]


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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_simulation_is_the_flat_exchange_of_each_tensor_padded_alone(n, backend):
    """The per-tensor model that the ranks' exchange is compared with
    (distributed/test_per_tensor_on_ranks.py) is what ALGORITHM.md says: the flat exchange of
    each tensor padded alone to the library's ``per_tensor_padded_size``, its errors at the
    library's offsets (``per_tensor_error_sizes``), with the backend's kernels."""
    numels = [math.prod(shape) for shape in SHAPES]
    padded = [per_tensor_padded_size(numel, n) for numel in numels]
    width, server = onebit.per_tensor_error_sizes(numels, n)
    worker_errors, server_errors = torch.zeros(n, width), torch.zeros(n, server)
    oracle = [(torch.zeros(n, size), torch.zeros(n, size // n)) for size in padded]
    for call in range(CALLS):
        buffers = seeded_inputs(n, call)
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
        inputs = seeded_inputs(1, call)
        tensors = [b[0].reshape(shape).clone() for b, shape in zip(inputs, SHAPES, strict=True)]
        onebit.compressed_allreduce_per_tensor(tensors, worker_error, server_error, kernels=backend)
        expected, sim_worker, sim_server = oracle_compressed_allreduce_per_tensor(
            inputs, sim_worker, sim_server, kernels=backend
        )
        assert all(torch.equal(t.reshape(-1), e) for t, e in zip(tensors, expected, strict=True))
        assert torch.equal(worker_error, sim_worker[0]) and torch.equal(server_error, sim_server[0])


def test_per_tensor_scales_differ_from_one_fused_buffer():
    # A small tensor beside a large one keeps its own scale: its result is +-(its own rms).
    # In the fused buffer (the two tensors one after another) both get the buffer's rms.
    # The library's exchanges in a world of one rank (no process group).
    small, large = torch.full((16,), 1e-3), torch.full((512,), 10.0)
    fused = torch.cat([small, large])  # 528 elements: a multiple of 8, no padding
    width, server = onebit.per_tensor_error_sizes([16, 512], 1)
    tensors = [small.clone(), large.clone()]
    onebit.compressed_allreduce_per_tensor(tensors, torch.zeros(width), torch.zeros(server))
    torch.testing.assert_close(tensors[0], torch.full((16,), 1e-3))
    torch.testing.assert_close(tensors[1], torch.full((512,), 10.0))
    result = onebit.compressed_allreduce(fused, torch.zeros(528), torch.zeros(528))
    rms = fused.double().square().mean().sqrt().item()  # 9.85: the large tensor's, about
    torch.testing.assert_close(result, torch.full((528,), rms), rtol=1e-5, atol=0)
    assert not torch.allclose(result[:16], tensors[0])  # the small tensor's scale is lost


def test_only_the_tensors_that_need_padding_are_copied_into_scratch():
    # n = 1: segments of a multiple of 8 elements. A contiguous tensor of that size is
    # compressed where it is; a shorter one, or a non-contiguous one, goes to scratch.
    layout = Layout.per_tensor([32, 15, 16, 7], 1)
    assert layout.sizes == (32, 16, 16, 8) and layout.padded_width == 16 + 8
    tensors = [torch.randn(32), torch.randn(15), torch.randn(4, 4).t(), torch.randn(7)]
    segments, padding = segment_views(tensors, layout, CompressionWorkspace())
    assert padding.numel() == 16 + 16 + 8
    assert segments[0].data_ptr() == tensors[0].data_ptr()
    assert [s.data_ptr() for s in segments[1:]] == [
        padding[offset:].data_ptr() for offset in (0, 16, 32)
    ]
    fill_segments(tensors, segments)
    for tensor, segment, size in zip(tensors, segments, layout.sizes, strict=True):
        expected = torch.zeros(size)
        expected[: tensor.numel()] = tensor.reshape(-1)
        assert torch.equal(segment, expected)


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
