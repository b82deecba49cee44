"""The bucketed exchange (ALGORITHM.md, "Bucketed exchange") in one process: its bucket
ranges, another layout restarting the error buffers, its options, the pipelining of the
buckets' phases, and where the error updates run."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.onebit_problem import FREEZE, build, set_grads

import onebit
from onebit import kernels
from onebit.exchange import BucketedExchange, PerTensorBucketedExchange, TrafficCounter
from onebit.exchange.bucketed import bucket_ranges


def test_bucket_ranges():
    assert bucket_ranges(152, 50, 2) == [(0, 48), (48, 96), (96, 144), (144, 152)]
    assert bucket_ranges(152, 5, 2) == [(s, s + 16) for s in range(0, 144, 16)] + [(144, 152)]
    assert bucket_ranges(152, 1000, 2) == [(0, 152)]


@pytest.mark.slow
def test_another_bucket_layout_restarts_the_error_buffers_with_a_warning():
    params, optimizer = build("lamb", torch.float64, bucket_cap_mb=16 * 8 / 2**20)
    for _ in range(FREEZE + 2):
        set_grads(params, 0)
        optimizer.step()
    state = optimizer.state_dict()
    assert state["onebit"]["buckets"] == [16, 16, 16, 8]
    for other in (None, 24 * 8 / 2**20):
        _, fresh = build("lamb", torch.float64, bucket_cap_mb=other)
        with pytest.warns(UserWarning, match="saved with buckets of \\[16, 16, 16, 8\\]"):
            fresh.load_state_dict(state)
        assert fresh.error_feedback == (None, None)
    _, same = build("lamb", torch.float64, bucket_cap_mb=16 * 8 / 2**20)
    _, again = build("lamb", torch.float64, bucket_cap_mb=16 * 8 / 2**20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(state)
        again.load_state_dict(same.state_dict())  # saved again before any step
    assert torch.equal(same.error_feedback[0], optimizer.error_feedback[0])
    assert torch.equal(again.error_feedback[0], optimizer.error_feedback[0])


def test_bad_bucket_options_are_named():
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="Invalid bucket_cap_mb=0"):
        onebit.OneBitLamb([param], bucket_cap_mb=0)
    with pytest.raises(ValueError, match="not with node_groups"):
        onebit.OneBitAdam([param], bucket_cap_mb=1.0, node_groups=(None, None))


def test_the_buckets_phases_are_pipelined(monkeypatch):
    """Bucket k's server phase runs after bucket k+2's worker phase (what runs during
    backward with overlap_backward), and bucket k+1's server phase before bucket k finishes
    (the order of the steps, recorded in one process)."""
    from onebit.exchange import over_group

    steps = []
    for name in ("send_workers", "send_servers", "finish"):
        original = getattr(over_group.Round, name)

        def record(self, original=original, name=name):
            steps.append((name, self.segments[0].data_ptr()))
            return original(self)

        monkeypatch.setattr(over_group.Round, name, record)
    exchange = BucketedExchange(None, 8)
    exchange.bind(
        [40], torch.float32, torch.device("cpu"), kernels.select(torch.zeros(8)), TrafficCounter()
    )
    buffer = torch.randn(exchange.buffer_size([40]))
    exchange.exchange(buffer)
    starts = {ptr: index for index, ptr in enumerate(dict.fromkeys(p for _, p in steps))}
    order = [(name, starts[ptr]) for name, ptr in steps]
    assert order == [
        ("send_workers", 0), ("send_workers", 1),
        ("send_workers", 2), ("send_servers", 0),
        ("send_workers", 3), ("send_servers", 1),
        ("send_workers", 4), ("send_servers", 2),
        ("finish", 0), ("finish", 1),
        ("send_servers", 3), ("finish", 2),
        ("send_servers", 4), ("finish", 3),
        ("finish", 4),
    ]  # fmt: skip


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("kind", [BucketedExchange, PerTensorBucketedExchange])
def test_error_updates_run_while_the_bytes_travel_only_for_the_exchanges_own_buffer(
    monkeypatch, own, kind
):
    """With ``send_buffer()`` every bucket's worker error update runs right after its worker
    phase is sent and its server update right after its server phase, before ``complete()``;
    the error state changes only when the exchange completes (the storages swapped: fused,
    with the send buffer's; per tensor, with a scratch buffer's). With a caller's buffer
    every update waits for ``complete()``."""
    from onebit.exchange.protocol import Stages

    done = {"worker": 0, "server": 0}
    for side in done:
        original = getattr(Stages, f"update_{side}_errors")

        def count(self, *args, original=original, side=side):
            done[side] += 1
            return original(self, *args)

        monkeypatch.setattr(Stages, f"update_{side}_errors", count)
    numels = [40] if kind is BucketedExchange else [8, 5, 11, 8, 8]  # 5 buckets either way
    exchange = kind(None, 8)
    exchange.bind(
        numels, torch.float32, torch.device("cpu"), kernels.select(torch.zeros(8)), TrafficCounter()
    )
    buffer = exchange.send_buffer() if own else torch.empty(exchange.buffer_size(numels))
    buffer.copy_(torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(3)))
    pipeline = exchange.begin(buffer)
    errors = [e.clone() for e in exchange.errors()]
    while pipeline.next_bucket is not None:
        pipeline.start_next()
    buckets = len(exchange.buckets())
    # 5 buckets; with the lag of 2 the first 3 server phases are sent with the worker phases
    assert (done["worker"], done["server"]) == ((buckets, buckets - 2) if own else (0, 0))
    assert all(torch.equal(a, b) for a, b in zip(errors, exchange.errors(), strict=True))
    pipeline.complete()
    assert (done["worker"], done["server"]) == (buckets, buckets)
    assert not torch.equal(errors[0], exchange.worker_error)  # (one rank: server error 0)
    if own:  # the tensor is the same, its memory (fused) the former worker error's
        assert exchange.send_buffer() is buffer
        if kind is BucketedExchange:
            assert torch.equal(buffer, errors[0])
