"""The delayed exchange in one process (ALGORITHM.md, "Delayed exchange"): what it refuses,
by name, before anything changes; the first step of the stage applies nothing; the pending
update is applied by the next step or by ``finish_exchange()``, and a checkpoint carries it."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import onebit

FREEZE = 2


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]


def _gradients(params, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(overlap_backward=True), "overlap_backward"),
        (dict(node_groups=(None, None)), "node_groups"),
        (dict(delayed_exchange=1), "delayed_exchange must be True or False"),
    ],
)
def test_combinations_it_cannot_run_are_refused_by_name(options, named):
    options = {"delayed_exchange": True, **options}
    with pytest.raises(ValueError, match=named):
        onebit.OneBitLamb(_params(), freeze_step=FREEZE, **options)


def test_zero_one_adam_has_no_delayed_exchange():
    with pytest.raises(TypeError, match="delayed_exchange"):
        onebit.ZeroOneAdam(_params(), delayed_exchange=True)


@pytest.mark.parametrize("cls", [onebit.OneBitLamb, onebit.OneBitAdam])
def test_the_pending_update_lands_at_the_next_step_or_when_finished(cls):
    params = _params()
    optimizer = cls(params, lr=0.01, freeze_step=FREEZE, delayed_exchange=True)
    assert optimizer.delayed_exchange
    for step in range(1, FREEZE + 1):
        _gradients(params, step)
        optimizer.step()
        assert not optimizer.update_pending
    before = [p.detach().clone() for p in params]
    _gradients(params, FREEZE + 1)
    optimizer.step()  # the stage's first step: its exchange starts, nothing is applied
    assert optimizer.update_pending
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    with pytest.raises(RuntimeError, match="finish_exchange"):
        optimizer.local_momentum()
    optimizer.finish_exchange()
    assert not optimizer.update_pending
    assert not any(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    optimizer.finish_exchange()  # nothing pending: nothing to do


def _two_steps_into_the_stage() -> tuple[list[nn.Parameter], onebit.OneBitLamb]:
    """Delayed 1-bit LAMB after ``FREEZE + 2`` steps: the second stage step's update pending."""
    params = _params()
    optimizer = onebit.OneBitLamb(params, freeze_step=FREEZE, delayed_exchange=True)
    for step in range(1, FREEZE + 3):
        _gradients(params, step)
        optimizer.step()
    return params, optimizer


def test_a_pending_update_is_refused_by_an_optimizer_without_the_delay():
    _, optimizer = _two_steps_into_the_stage()
    saved = optimizer.state_dict()
    assert saved["onebit"]["format"] == 3
    assert saved["onebit"]["pending_update"]["step"] == FREEZE + 2
    assert optimizer.update_pending  # saving changed nothing
    plain = onebit.OneBitLamb(_params(), freeze_step=FREEZE)
    before = plain.state_dict()
    with pytest.raises(ValueError, match=f"update of step {FREEZE + 2}.*delayed_exchange=True"):
        plain.load_state_dict(saved)
    assert plain.state_dict()["onebit"] == before["onebit"]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    resumed = onebit.OneBitLamb(_params(), freeze_step=FREEZE, delayed_exchange=True)
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.update_pending


def test_without_anything_pending_the_checkpoint_keeps_its_format():
    params = _params()
    optimizer = onebit.OneBitLamb(params, freeze_step=FREEZE, delayed_exchange=True)
    _gradients(params, 1)
    optimizer.step()
    saved = optimizer.state_dict()["onebit"]
    assert saved["format"] == 2 and "pending_update" not in saved


def test_an_update_loaded_from_a_checkpoint_can_be_finished_before_any_step():
    """``finish_exchange()`` right after loading applies the saved update, as the run that
    saved it applies it."""
    params, optimizer = _two_steps_into_the_stage()
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)  # the state's own tensors change in place
    weights = [p.detach().clone() for p in params]
    optimizer.finish_exchange()
    loaded_params = [torch.nn.Parameter(w.clone()) for w in weights]
    loaded = onebit.OneBitLamb(loaded_params, freeze_step=FREEZE, delayed_exchange=True)
    saved.seek(0)
    loaded.load_state_dict(torch.load(saved))
    loaded.finish_exchange()
    assert not loaded.update_pending
    assert all(torch.equal(a, b) for a, b in zip(params, loaded_params, strict=True))
    assert not any(torch.equal(a, w) for a, w in zip(loaded_params, weights, strict=True))
