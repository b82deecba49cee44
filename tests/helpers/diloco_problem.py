"""The small DiLoCo problem of the distributed tests: a 2-layer tanh network, MSE on batches
that depend only on (worker, step), AdamW as the inner optimizer."""

from __future__ import annotations

import torch

#: The inner AdamW's hyper-parameters.
INNER = dict(lr=0.01, weight_decay=0.01)


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def weights(net: torch.nn.Module) -> list[torch.Tensor]:
    """A copy of ``net``'s parameters."""
    return [p.detach().clone() for p in net.parameters()]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 5, generator=generator), torch.randn(8, 2, generator=generator)


def backward(net: torch.nn.Module, rank: int, step: int) -> None:
    """Worker ``rank``'s MSE loss at ``step``, backward."""
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(net(x), y).backward()


def inner_step(net: torch.nn.Module, inner: torch.optim.Optimizer, rank: int, step: int) -> None:
    inner.zero_grad()
    backward(net, rank, step)
    inner.step()
