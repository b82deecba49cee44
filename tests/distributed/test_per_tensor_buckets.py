"""Per-tensor compression in buckets of whole tensors (ALGORITHM.md, "Bucketed exchange"):
on gloo ranks, every tensor's result and error slices equal the per-tensor exchange's bit
for bit, whatever the buckets (one tensor each, several, all in one), whether the buckets
run in one call or are started one by one as backward would, and whether the error updates
wait for the last check (a caller's buffer) or run while the bytes travel (the exchange's
own); inside 1-bit LAMB and 1-bit Adam, buckets and the exchange overlapped with backward
leave the trajectory of the unbucketed per-tensor optimizer unchanged, bit for bit."""

from __future__ import annotations

import pytest
import torch

import onebit
from onebit import kernels
from onebit.exchange import PerTensorBucketedExchange, PerTensorExchange, TrafficCounter
from onebit.exchange.bucketed import tensor_buckets
from onebit.testing import spawn_workers

CPU_BACKENDS = [name for name in kernels.available() if name != "triton"]
NUMELS = [37, 100, 13, 5, 64]
BUCKETS = [1, 120, 10_000]  # one tensor a bucket; [37], [100, 13, 5], [64]; one bucket
#: No tensor padded at n = 2 or 3 (multiples of 48): the error updates computed ahead go
#: into the send buffer rather than scratch.
ALIGNED = [48, 96, 144, 48]
CALLS = 3


def test_tensor_buckets_hold_whole_tensors_in_order():
    assert tensor_buckets(NUMELS, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert tensor_buckets(NUMELS, 120) == [(0, 1), (1, 4), (4, 5)]
    assert tensor_buckets(NUMELS, 10_000) == [(0, 5)]


#: ``(bucket elements or None for the unbucketed exchange, stepwise, own)``: started one by
#: one as backward would, or in one call; with the exchange's own ``send_buffer()`` (error
#: updates computed while the bytes travel) or a buffer of the caller's.
VARIANTS = [(None, False, False), (None, False, True)] + [
    (bucket, stepwise, own)
    for bucket in BUCKETS
    for stepwise in (False, True)
    for own in (False, True)
]


def _calls(rank: int, world: int):
    out = {}
    for backend in CPU_BACKENDS:
        chosen = kernels.select(torch.zeros(8), backend)
        for numels in (NUMELS, ALIGNED):
            for bucket, stepwise, own in VARIANTS:
                out[backend, tuple(numels), bucket, stepwise, own] = _exchanges(
                    rank, chosen, numels, bucket, stepwise, own
                )
    return out


def _exchanges(rank: int, backend, numels: list[int], bucket, stepwise: bool, own: bool):
    """``CALLS`` exchanges of one variant: their results and the error state after them."""
    exchange = (
        PerTensorExchange(None) if bucket is None else PerTensorBucketedExchange(None, bucket)
    )
    exchange.bind(numels, torch.float32, torch.device("cpu"), backend, TrafficCounter())
    size, results = sum(numels), []
    for call in range(CALLS):
        values = torch.randn(size, generator=torch.Generator().manual_seed(100 * call + rank))
        buffer = exchange.send_buffer() if own else torch.zeros(size)
        if stepwise:  # as backward: begun first, values written, then started
            buffer.zero_()
            pipeline = exchange.begin(buffer)
            buffer.copy_(values)
            pipeline.start_next()
            result = pipeline.complete()
        else:
            buffer.copy_(values)
            result = exchange.exchange(buffer)
        results.append(result.decode(torch.empty(size)))
    return results, (exchange.worker_error.clone(), exchange.server_error.clone())


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_buckets_of_whole_tensors_are_the_per_tensor_exchange_bit_for_bit(world):
    for rank, calls in enumerate(spawn_workers(_calls, world, timeout_s=180)):
        for (backend, numels, bucket, stepwise, own), (got, got_errors) in calls.items():
            results, errors = calls[backend, numels, None, False, False]
            where = f"rank {rank} {backend} {numels} bucket {bucket} stepwise {stepwise} own {own}"
            assert all(torch.equal(a, b) for a, b in zip(got, results, strict=True)), where
            assert all(torch.equal(a, b) for a, b in zip(got_errors, errors, strict=True)), where


def _optimizer_runs(rank: int, world: int):
    """Each 1-bit optimizer per tensor: unbucketed, bucketed, and overlapped with backward
    (a real backward pass of a small network, so the hooks start the buckets)."""
    out = {}
    for name in ("OneBitLamb", "OneBitAdam"):
        for options in (
            {},
            {"bucket_cap_mb": 300 * 4 / 2**20},
            {"bucket_cap_mb": 300 * 4 / 2**20, "overlap_backward": True},
        ):
            torch.manual_seed(0)
            net = torch.nn.Sequential(
                torch.nn.Linear(6, 16),
                torch.nn.Tanh(),
                torch.nn.Linear(16, 16),
                torch.nn.Tanh(),
                torch.nn.Linear(16, 3),
            )
            kind = getattr(onebit, name)
            optimizer = kind(
                net.parameters(), lr=1e-2, freeze_step=2, compression="per_tensor", **options
            )
            history = []
            for step in range(8):
                gen = torch.Generator().manual_seed(10 * step + rank)
                x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(net(x), y).backward()
                optimizer.step()
                history.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
            out[name, tuple(sorted(options))] = history, optimizer.bytes_sent
    return out


def test_buckets_and_overlap_leave_the_per_tensor_optimizers_trajectory_unchanged():
    for rank, runs in enumerate(spawn_workers(_optimizer_runs, 2, timeout_s=240)):
        for name in ("OneBitLamb", "OneBitAdam"):
            plain, _ = runs[name, ()]
            for key, (history, _) in runs.items():
                if key[0] != name:
                    continue
                for step, (a, b) in enumerate(zip(history, plain, strict=True)):
                    assert torch.equal(a, b), f"rank {rank} {key} step {step + 1}"
