"""The view of an exchange's result that the update kernels read
(:class:`onebit.compression.SignRuns`): read element by element, it gives what ``decode()``
gives, for a whole buffer's result, one segment per tensor, and buckets of different sizes;
so does the runs' own ``decode()``, also after a round trip through a checkpoint (as a
delayed exchange's pending update is saved)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onebit import kernels
from onebit.compression import Layout, SignRuns
from onebit.exchange import PackedResult
from onebit.exchange.bucketed import BucketedResult

BACKEND = kernels.select(torch.zeros(8), "torch")


def _result(layout: Layout, seed: int) -> PackedResult:
    """Random signs and scales in ``layout`` (rows: servers)."""
    gen = torch.Generator().manual_seed(seed)
    row_bytes = sum(layout.chunk_bytes)
    signs = torch.randint(0, 256, (layout.n, row_bytes), generator=gen, dtype=torch.uint8)
    scales = torch.rand(layout.n, layout.segments, generator=gen, dtype=torch.float64) + 0.1
    padding = torch.empty(max(layout.sizes), dtype=torch.float64)
    return PackedResult(signs, scales, layout, BACKEND, padding)


def _read(runs: SignRuns) -> torch.Tensor:
    """Every element of ``runs``, one at a time."""
    bits = np.unpackbits(runs.signs.numpy())
    values = torch.empty(runs.numel, dtype=runs.scales.dtype)
    for r, scale in enumerate(runs.scales.tolist()):
        for e in range(int(runs.bounds[r]), int(runs.bounds[r + 1])):
            bit = bits[runs.first_bits[r] + e - runs.bounds[r]]
            values[e] = scale if bit else -scale
    return values


def _whole(n: int) -> PackedResult:
    return _result(Layout.flat(8 * n * 5, n), 1)


def _per_tensor(n: int) -> PackedResult:
    return _result(Layout.per_tensor([37, 100, 13, 1], n), 2)


def _buckets(n: int) -> BucketedResult:
    sizes = [8 * n * 4, 8 * n * 4, 8 * n]  # the last bucket's chunks are smaller
    starts = np.cumsum([0] + sizes[:-1]).tolist()
    parts = [
        (start, _result(Layout.flat(size, n), 3 + k))
        for k, (start, size) in enumerate(zip(starts, sizes, strict=True))
    ]
    return BucketedResult(parts)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize(
    "make", [_whole, _per_tensor, _buckets], ids=["whole", "per_tensor", "buckets"]
)
def test_the_runs_read_element_by_element_are_the_decoded_result(make, n):
    result = make(n)
    runs = result.sign_runs()
    assert runs.bounds[0] == 0 and (np.diff(runs.bounds) > 0).all()
    decoded = result.decode(torch.empty(runs.numel, dtype=torch.float64))
    assert torch.equal(_read(runs), decoded)


def test_chunks_of_one_size_in_element_order_are_read_by_offset():
    assert _whole(2).sign_runs().chunk_elements == 40
    assert _buckets(1).sign_runs().chunk_elements is None  # 32, 32 and 8 elements
    assert _per_tensor(2).sign_runs().chunk_elements is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(
    "make", [_whole, _per_tensor, _buckets], ids=["whole", "per_tensor", "buckets"]
)
def test_the_runs_decode_what_the_result_decodes_also_from_a_checkpoint(make, n, dtype):
    result = make(n)
    runs = result.sign_runs()
    runs = SignRuns(runs.bounds, runs.first_bits, runs.scales.to(dtype), runs.signs)
    runs.scales[0] = 0.0  # a chunk of zeros: -0.0 where its signs are 0, as decode() gives
    expected = _read(runs)
    assert torch.equal(runs.decode(torch.empty(runs.numel, dtype=dtype)), expected)
    assert torch.equal(
        torch.signbit(runs.decode(torch.empty(runs.numel, dtype=dtype))), torch.signbit(expected)
    )
    saved = SignRuns.from_state_dict(runs.state_dict(), torch.device("cpu"))
    assert saved.sign_runs() is saved
    assert torch.equal(
        saved.decode(torch.empty(runs.numel + 5, dtype=dtype))[: runs.numel], expected
    )
