"""Variance readiness (ALGORITHM.md, "Variance readiness") on the plateau task with real
ranks (the end-to-end group): ``freeze_step="auto"`` and 0/1 Adam's defaults learn where an
early freeze without the guard after the freeze stalls, and the guard (the default) recovers
the early freeze."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import onebit
from onebit.plateau import PointerTask, train
from onebit.testing import spawn_workers


def _plateau(rank, world_size):
    torch.set_num_threads(1)
    arms = {
        "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
        "onebit-adam early": lambda p: onebit.OneBitAdam(
            p, lr=1e-3, freeze_step=70, variance_guard="off"
        ),
        "onebit-adam early, guarded": lambda p: onebit.OneBitAdam(p, lr=1e-3, freeze_step=70),
        "onebit-adam auto": lambda p: onebit.OneBitAdam(p, lr=1e-3, freeze_step="auto"),
        "zero-one-adam defaults": lambda p: onebit.ZeroOneAdam(p, lr=1e-3),
    }
    out = {}
    for name, make in arms.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train(PointerTask(), make)
        warned = any("has settled" in str(w.message) for w in caught)
        out[name] = (sum(losses[-25:]) / 25, warned)
    return out


@pytest.mark.slow
def test_on_the_plateau_task_auto_learns_where_an_early_freeze_stalls():
    """2 gloo ranks, 500 steps: the early freeze warns (on rank 0) and, without the guard
    after the freeze, stays at chance; with it (the default), and with ``"auto"`` and 0/1
    Adam's defaults, each ends within 15% of Adam's loss (or below it)."""
    results = spawn_workers(_plateau, 2, timeout_s=900)
    assert [loss for loss, _ in results[0].values()] == [loss for loss, _ in results[1].values()]
    assert not any(warned for _, warned in results[1].values())  # rank 0 warns, alone
    loss = {name: value for name, (value, _) in results[0].items()}
    chance = math.log(PointerTask().values)
    assert loss["adam"] < 0.1
    assert loss["onebit-adam early"] > 0.9 * chance and results[0]["onebit-adam early"][1]
    assert loss["onebit-adam early, guarded"] <= 1.15 * loss["adam"]
    assert loss["onebit-adam auto"] <= 1.15 * loss["adam"]
    assert not results[0]["onebit-adam auto"][1]
    assert loss["zero-one-adam defaults"] <= 1.15 * loss["adam"]
