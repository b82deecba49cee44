"""The library's exchange of ``n`` workers simulated in one process (flat), as the tests of the
compression maths drive it: bound to one buffer, fed every worker's buffer for each call."""

from __future__ import annotations

import torch

from onebit import kernels
from onebit.collectives import TrafficCounter
from onebit.exchange import SimulatedExchange


def simulated_exchange(n: int, numel: int, dtype: torch.dtype) -> SimulatedExchange:
    """The library's exchange of ``n`` workers simulated in one process (flat), bound to one
    buffer of ``numel`` elements, with the backend ``auto`` picks."""
    exchange = SimulatedExchange(n)
    backend = kernels.select(torch.zeros(8, dtype=dtype))
    exchange.bind([numel], dtype, torch.device("cpu"), backend, TrafficCounter())
    return exchange


def exchange_once(exchange: SimulatedExchange, buffers: torch.Tensor) -> torch.Tensor:
    """One exchange of the workers' buffers (row ``i``: worker ``i``'s), left unchanged."""
    for rank in range(exchange.workers - 1):
        exchange.add_worker(rank, buffers[rank].clone())
    last = buffers[-1].clone()
    return exchange.exchange(last).decode(torch.empty_like(last))
