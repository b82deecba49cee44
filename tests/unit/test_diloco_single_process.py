"""DiLoCo in one process (a world of one worker, ALGORITHM.md, "DiLoCo with a 1-bit outer
exchange"): a non-finite pseudo-gradient raises before any weight changes, with either
exchange; the round's start weights inside a round; the outer SGD's rule; each exchange's
default outer SGD, in the optimizer and the job. The distributed behaviour is tested on
ranks in distributed/test_diloco.py and distributed/test_streaming_diloco.py."""

from __future__ import annotations

import pytest
import torch

import onebit
from onebit.train.config import TrainConfig


@pytest.mark.parametrize(
    ("exchange", "error"), [("dense", FloatingPointError), ("1bit", onebit.NonFiniteError)]
)
def test_a_non_finite_pseudo_gradient_raises_before_any_weight_changes(exchange, error):
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = onebit.DiLoCo(model.parameters(), inner, sync_every=2, exchange=exchange)
    model(torch.ones(2, 4)).sum().backward()
    inner.step()  # the first inner step of the round
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    held = [p.detach().clone() for p in model.parameters()]
    state = diloco.state_dict()
    with pytest.raises(error):
        inner.step()  # the second ends the round
    after = [p.detach() for p in model.parameters()]
    expected = [h - 0.1 * p.grad for h, p in zip(held, model.parameters(), strict=True)]
    for a, b in zip(after, expected, strict=True):  # the inner step, nothing of the outer one
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert diloco.rounds == 0 and diloco.state_dict()["rounds"] == state["rounds"]


def test_inside_round_start_weights_the_parameters_hold_the_rounds_start():
    """What the job evaluates in the middle of a round: the weights the round started from
    (the last outer step's result); this worker's own weights come back after the block, also
    when it raises."""
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = onebit.DiLoCo(model.parameters(), inner, sync_every=3, exchange="dense")
    start = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    inner.step()  # inside the round: the weights moved
    own = [p.detach().clone() for p in model.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(own, start, strict=True))
    with pytest.raises(RuntimeError, match="in the block"):
        with diloco.round_start_weights():
            assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
            raise RuntimeError("in the block")
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), own, strict=True))
    assert diloco.local_step == 1


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_outer_sgd_steps_by_nesterovs_rule_and_plainly_without_momentum(momentum):
    """Two outer steps against the rule written out: b = μ b + Δ, θ -= lr (Δ + μ b)."""
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    outer = onebit.diloco.outer_sgd([param], lr=0.7, momentum=momentum)
    theta, buf = param.detach().clone(), torch.zeros(2, dtype=torch.float64)
    for delta in (torch.tensor([0.5, 0.25]), torch.tensor([-0.125, 1.0])):
        param.grad = delta.to(torch.float64)
        outer.step()
        buf = momentum * buf + param.grad
        theta -= 0.7 * (param.grad + momentum * buf)
        torch.testing.assert_close(param.detach(), theta, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("exchange", "lr", "momentum", "nesterov", "residual"),
    [("dense", 0.7, 0.9, True, "carried"), ("1bit", 0.7, 0.5, True, "local")],
)
def test_each_exchange_has_its_own_default_outer_sgd_and_residual(
    exchange, lr, momentum, nesterov, residual
):
    # DiLoCo's Nesterov SGD after the dense exchange; momentum 0.5 after the 1-bit one, whose
    # error outer momentum multiplies by up to 1/(1 - momentum), and each worker moved by its
    # residual (ALGORITHM.md)
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.AdamW(model.parameters())
    diloco = onebit.DiLoCo(model.parameters(), inner, sync_every=2, exchange=exchange)
    group = diloco.outer_optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (lr, momentum, nesterov)
    assert diloco.worker_residual == residual
    config = TrainConfig(optimizer="adam", sync_every=2, outer_exchange=exchange).resolved()
    assert (config.outer_lr, config.outer_momentum) == (lr, momentum)
    assert config.worker_residual == residual
    assert TrainConfig(optimizer="adam").resolved().worker_residual is None  # no DiLoCo
    given = TrainConfig(optimizer="adam", sync_every=2, outer_exchange=exchange, outer_lr=0.5)
    assert (given.resolved().outer_lr, given.resolved().outer_momentum) == (0.5, momentum)
