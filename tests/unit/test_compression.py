"""Compression maths, and the exchange simulated in one process, against independent float64 /
numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.simulated_exchange import exchange_once, simulated_exchange
from hypothesis import given, settings
from hypothesis import strategies as st

from onebit.collectives import compressed_allreduce
from onebit.compression import (
    _pack_bits_torch,
    pack_signs,
    scale,
    signs,
    unpack_signs,
    update_error,
)
from onebit.exchange.base import swap_storages


def reference_signs(x: np.ndarray) -> np.ndarray:
    """sign with sign(0) = sign(-0.0) = +1, written without torch."""
    return np.array([1.0 if v >= 0 else -1.0 for v in x.tolist()])


def test_sign_of_zero_and_negative_zero_is_plus_one():
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0, -2.0])
    assert signs(x).tolist() == [1.0, 1.0, 1.0, -1.0, 1.0, -1.0]
    assert unpack_signs(pack_signs(x), 6).tolist() == [1.0, 1.0, 1.0, -1.0, 1.0, -1.0]


def test_bit_order_is_msb_first_like_numpy_packbits():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1, -1])
    assert pack_signs(x).tolist() == [0b10000001, 0]


values = st.one_of(
    st.floats(allow_nan=False, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(values, min_size=1, max_size=100))
def test_pack_unpack_round_trip(data):
    x = torch.tensor(data, dtype=torch.float32)
    expected = reference_signs(np.array(data, dtype=np.float32))
    packed = pack_signs(x)
    assert packed.numel() == math.ceil(len(data) / 8)
    assert torch.equal(_pack_bits_torch(x >= 0), packed)  # the accelerator path agrees
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert unpack_signs(packed, len(data), dtype=dtype).tolist() == expected.tolist()


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=1, max_value=64).map(lambda k: 8 * k), st.integers(0, 2**31 - 1))
def test_unpack_into_preallocated_output(numel, seed):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    out = torch.empty(numel)
    result = unpack_signs(pack_signs(x), numel, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, signs(x))


def test_unpack_rejects_too_few_bytes():
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_signs(torch.zeros(1, dtype=torch.uint8), 9)


def test_scale_matches_float64():
    x = torch.randn(1000, dtype=torch.float64)
    expected = math.sqrt(float((x**2).sum()) / 1000)
    assert scale(x.float()).item() == pytest.approx(expected, rel=1e-6)


def reference_exchange(buffers, worker_errors, server_errors):
    """Independent float64 model of ALGORITHM.md's compressed allreduce, in numpy."""
    n, numel = buffers.shape
    chunk = numel // n
    worker_out, new_we = [], []
    scales = []
    for i in range(n):
        x = buffers[i] + worker_errors[i]
        a = np.linalg.norm(x) / math.sqrt(numel)
        s = reference_signs(x)
        scales.append(a)
        worker_out.append(a * s)
        new_we.append(x - a * s)
    result, new_se = [], []
    for j in range(n):
        sl = slice(j * chunk, (j + 1) * chunk)
        y = sum(worker_out[i][sl] for i in range(n)) / n + server_errors[j]
        b = np.linalg.norm(y) / math.sqrt(chunk)
        s = reference_signs(y)
        result.append(b * s)
        new_se.append(y - b * s)
    return np.concatenate(result), np.stack(new_we), np.stack(new_se)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_simulation_matches_float64_reference(n):
    """The library's exchange (simulated over n workers, float32), from non-zero error
    states, against the numpy model: the result and both error states after the call."""
    gen = torch.Generator().manual_seed(n)
    numel = 8 * n * 13
    buffers = torch.randn(n, numel, generator=gen) * torch.arange(1, n + 1).unsqueeze(1)
    worker_errors = torch.randn(n, numel, generator=gen) * 0.1
    server_errors = torch.randn(n, numel // n, generator=gen) * 0.1
    exchange = simulated_exchange(n, numel, torch.float32)
    we, se = exchange.errors()
    we.view(n, -1).copy_(worker_errors)
    se.view(n, -1).copy_(server_errors)  # row j: server j's chunk
    result = exchange_once(exchange, buffers)
    ref = reference_exchange(*(t.double().numpy() for t in (buffers, worker_errors, server_errors)))
    np.testing.assert_allclose(result.numpy(), ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        exchange.worker_error.view(n, -1).numpy(), ref[1], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        exchange.server_error.view(n, -1).numpy(), ref[2], rtol=1e-5, atol=1e-5
    )


def test_simulation_rejects_bad_shapes():
    """In one process: compressed_allreduce in a world of one rank (no process group) and the
    simulated exchange check their sizes before any work."""
    with pytest.raises(ValueError, match="multiple of 8"):
        compressed_allreduce(torch.zeros(12), torch.zeros(12), torch.zeros(12))
    with pytest.raises(ValueError, match="server_error has 8 elements"):
        compressed_allreduce(torch.zeros(16), torch.zeros(16), torch.zeros(8))
    exchange = simulated_exchange(2, 12, torch.float32)  # padded to 16 elements
    with pytest.raises(ValueError, match="the buffer has 12 elements; this exchange takes 16"):
        exchange.exchange(torch.zeros(12))


def test_error_feedback_running_mean_converges_to_true_mean():
    """Telescoping identity of two-sided error feedback, and its 1/T bound, in the library's
    exchange (simulated over 4 workers, float64).

    With constant inputs, sum_t result_t = T * mean_i(buf_i) - mean_i(e_i(T)) - s(T), so
    the running mean's error is ||mean_i e_i(T) + s(T)|| / T: it vanishes like 1/T as long
    as the error states stay bounded, which the test also checks.
    """
    n, numel, calls = 4, 8 * 4 * 64, 400
    gen = torch.Generator().manual_seed(0)
    buffers = torch.randn(n, numel, generator=gen, dtype=torch.float64)
    true_mean = buffers.mean(0)
    exchange = simulated_exchange(n, numel, torch.float64)
    total = torch.zeros(numel, dtype=torch.float64)
    max_error_norm = 0.0
    for t in range(1, calls + 1):
        total += exchange_once(exchange, buffers)
        residual = exchange.worker_error.view(n, -1).mean(0) + exchange.server_error
        max_error_norm = max(max_error_norm, residual.norm().item())
        torch.testing.assert_close(total, t * true_mean - residual, rtol=1e-9, atol=1e-9)
    relative_error = ((total / calls - true_mean).norm() / true_mean.norm()).item()
    assert max_error_norm < 10 * true_mean.norm().item() * math.sqrt(n)
    assert relative_error <= max_error_norm / calls / true_mean.norm().item() + 1e-12
    assert relative_error < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_error_update_in_place_equals_the_one_into_another_buffer(dtype):
    x = torch.randn(200, generator=torch.Generator().manual_seed(4)).to(dtype)
    x[::7] = 0.0  # zeros count as positive
    packed, a = pack_signs(x), scale(x)
    expected = update_error(torch.empty_like(x), x, packed, a)
    assert torch.equal(expected, x - a.to(dtype) * torch.where(x >= 0, 1.0, -1.0).to(dtype))
    in_place = x.clone()
    update_error(in_place, in_place, packed, a, work=torch.empty(24, dtype=dtype))  # 9 chunks
    assert torch.equal(in_place, expected)
    with pytest.raises(ValueError, match="needs work space of a multiple of 8"):
        update_error(in_place, in_place, packed, a, work=torch.empty(12, dtype=dtype))


def test_swapping_storages_keeps_each_tensor_and_exchanges_the_memory():
    a, b = torch.arange(6.0), torch.zeros(6)
    a_memory, b_memory = a.data_ptr(), b.data_ptr()
    view = a[2:]  # views made before keep the memory they saw
    swap_storages(a, b)
    assert torch.equal(a, torch.zeros(6)) and torch.equal(b, torch.arange(6.0))
    assert (a.data_ptr(), b.data_ptr()) == (b_memory, a_memory)
    assert torch.equal(view, torch.arange(2.0, 6.0))
    with pytest.raises(ValueError, match=r"cannot swap the storages of tensors \(6,\) and \(5,\)"):
        swap_storages(a, torch.zeros(5))
