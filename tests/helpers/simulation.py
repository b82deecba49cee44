"""The model and runs the many-worker simulation (onebit.simulate) is tested on, in one
process and against real processes.

Equality of a simulated and a real run needs equal averaged gradients in the warm-up. gloo's
allreduce sums the ranks' gradients in an order of its own (and DDP divides before summing),
so the test model rounds every gradient to a multiple of 2^-12 below 2^8 in magnitude
(:func:`dyadic`): then every partial sum of up to 4 gradients is exact in float32, and so is
the division by 2 or 4, whatever the order. Everything after the averaging (moments, trust
ratios, the compressed exchange, clipping) is ordinary float arithmetic and must agree to the
last bit, which the tests check with ``torch.equal`` on the parameters after every step.
"""

from __future__ import annotations

import torch
from torch import nn

import onebit
from onebit.simulate import SimulatedDataParallel

STEPS = 8
FREEZE = 3
MICRO_BATCH = 4
GRID = 2.0**12  # gradients are multiples of 1 / GRID


def dyadic(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` rounded to the grid, so that sums of a few of them are exact in float32."""
    return torch.round(grad.clamp(-200, 200) * GRID) / GRID


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    for param in model.parameters():
        param.register_hook(dyadic)
    return model


def micro_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(MICRO_BATCH, 8, generator=generator)
    return inputs, torch.randn(MICRO_BATCH, 4, generator=generator) + inputs[:, :4]


def build_optimizer(
    name: str, params, kernels: str, node_groups=None, max_grad_norm: float = 0.0
) -> torch.optim.Optimizer:
    clip = dict(kernels=kernels, max_grad_norm=max_grad_norm)
    if name.endswith("-delayed"):  # ALGORITHM.md, "Delayed exchange"
        name = name.removesuffix("-delayed")
        clip["delayed_exchange"] = True
    if name.endswith("-unbounded"):  # 1-bit LAMB without momentum_bound
        name = name.removesuffix("-unbounded")
        clip["momentum_bound"] = False
    if name == "lamb":
        return onebit.Lamb(params, lr=0.02, weight_decay=0.01, **clip)
    clip["compression"] = "fused"
    if name.endswith("-per-tensor"):
        name = name.removesuffix("-per-tensor")
        clip["compression"] = "per_tensor"
    if name == "onebit-adam":
        return onebit.OneBitAdam(
            params, lr=0.01, freeze_step=FREEZE, node_groups=node_groups, **clip
        )
    return onebit.OneBitLamb(
        params,
        lr=0.02,
        freeze_step=FREEZE,
        weight_decay=0.01,
        max_coeff=0.5,
        node_groups=node_groups,
        **clip,
    )


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def shared_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The weights every rank shares: the parameters, but with ``delayed_exchange`` those the
    optimizer sets aside while the parameters hold the rank's prediction."""
    if getattr(optimizer, "delayed_exchange", False):
        return torch.cat([w.reshape(-1) for w in optimizer.shared_weights()])
    return flat_params(model)


def worker_backward(model: nn.Module, step: int):
    """Worker ``rank``'s forward and backward pass at ``step``; returns its loss."""

    def backward(rank: int) -> float:
        inputs, targets = micro_batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss.item()

    return backward


def simulated_run(
    name: str, workers: int, local: int, clip: float, kernels: str, prediction: str = "own"
):
    """The shared weights after every step, the parameters after every step (with
    ``delayed_exchange`` the last worker's prediction), the optimizer and the simulation."""
    model = build_model()
    optimizer = build_optimizer(name, model.parameters(), kernels)
    simulation = SimulatedDataParallel(
        optimizer, workers, local, max_grad_norm=clip, prediction=prediction
    )
    trajectory, predicted = [], []
    for step in range(STEPS):
        losses = simulation.step(worker_backward(model, step))
        assert len(losses) == workers
        trajectory.append(shared_params(model, optimizer))
        predicted.append(flat_params(model))  # the last worker's prediction, if delayed
    return trajectory, predicted, optimizer, simulation
