"""The guard against silent dense averaging: a 1-bit optimizer under a DDP model without
onebit's hook warns once, on rank 0; with the hook, and in the plain loop, it stays quiet."""

from __future__ import annotations

import warnings

import torch
from torch.nn.parallel import DistributedDataParallel

import onebit
from onebit.testing import spawn_workers

FREEZE, STEPS = 2, 6
GUARD = "bit-identical gradients"


def _train(rank, optimizer_class, mode):
    """Train a few steps past the switch; return the guard's warnings on this rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = optimizer_class(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    if mode != "plain loop":
        model = DistributedDataParallel(model)
    if mode == "ddp with hook":
        onebit.ddp.register_comm_hook(model, optimizer)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            optimizer.zero_grad()
            model(torch.randn(4, 8, generator=data)).pow(2).mean().backward()
            optimizer.step()
    assert optimizer.stage == "compression"
    return [str(w.message) for w in caught if GUARD in str(w.message)]


def _guard_worker(rank, world_size):
    return {
        mode: _train(rank, optimizer_class, mode)
        for mode, optimizer_class in [
            ("ddp without hook", onebit.OneBitAdam),
            ("ddp with hook", onebit.OneBitLamb),
            ("plain loop", onebit.OneBitLamb),
        ]
    }


def test_guard_warns_only_when_ddp_averaged_the_gradients():
    results = spawn_workers(_guard_worker, 2, timeout_s=90)
    (warning,) = results[0]["ddp without hook"]  # once, on rank 0
    assert "onebit.ddp.register_comm_hook(model, optimizer)" in warning
    assert "bytes_sent does not count" in warning and "onebit.integrations" in warning
    assert results[1]["ddp without hook"] == []
    for rank in range(2):
        assert results[rank]["ddp with hook"] == []
        assert results[rank]["plain loop"] == []
