"""`onebit.testing.spawn_workers` itself: what a rank starts from."""

from __future__ import annotations

import os

import torch.distributed as dist

from onebit.testing import spawn_workers

VARIABLE = "ONEBIT_SPAWN_WORKERS_PROBE"


def _environment_and_group(rank, world_size):
    return os.environ.get(VARIABLE), dist.get_rank(), dist.get_world_size(), os.getcwd()


def test_ranks_see_the_callers_environment_at_each_call(monkeypatch, tmp_path):
    # The fork server starts (at this call or an earlier one) without the variable; later
    # calls must still hand each rank the caller's environment and working directory.
    monkeypatch.delenv(VARIABLE, raising=False)
    assert [r[0] for r in spawn_workers(_environment_and_group, 2)] == [None, None]
    monkeypatch.setenv(VARIABLE, "set after the first call")
    monkeypatch.chdir(tmp_path)
    results = spawn_workers(_environment_and_group, 2)
    assert results == [("set after the first call", rank, 2, str(tmp_path)) for rank in range(2)]
    monkeypatch.delenv(VARIABLE)
    assert [r[0] for r in spawn_workers(_environment_and_group, 2)] == [None, None]
