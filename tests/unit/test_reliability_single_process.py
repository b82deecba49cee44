"""Properties of the 1-bit exchange's pure maths over random sizes (hypothesis): the padded
size, and the invariants of the library's exchange simulated in one process."""

from __future__ import annotations

import torch
from helpers.simulated_exchange import exchange_once, simulated_exchange
from hypothesis import given, settings
from hypothesis import strategies as st

import onebit


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(0, 10**6), world=st.integers(1, 64))
def test_padded_size_properties(numel, world):
    size = onebit.padded_size(numel, world)
    assert size >= max(numel, 1) and size % (8 * world) == 0
    assert size - numel < 8 * world or numel == 0


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 6),
    units=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    calls=st.integers(1, 3),
)
def test_simulation_invariants_over_random_sizes(world, units, seed, calls):
    """In the library's exchange (simulated over ``world`` workers, float64): every chunk of
    the result is +-b_j, and error feedback loses nothing: the worker and server errors
    account exactly for what the result did not deliver."""
    numel = 8 * world * units
    gen = torch.Generator().manual_seed(seed)
    buffers = torch.randn(world, numel, generator=gen, dtype=torch.float64)
    exchange = simulated_exchange(world, numel, torch.float64)
    delivered = torch.zeros(numel, dtype=torch.float64)
    for _ in range(calls):
        result = exchange_once(exchange, buffers)
        delivered += result
        chunks = result.view(world, -1).abs()
        assert torch.equal(chunks, chunks[:, :1].expand_as(chunks))
    we, se = exchange.worker_error.view(world, -1), exchange.server_error
    torch.testing.assert_close(
        delivered + we.mean(0) + se.reshape(-1), calls * buffers.mean(0), rtol=1e-9, atol=1e-9
    )
