"""Two parameter tensors with a seeded gradient of a given joint norm (the clipping tests')."""

from __future__ import annotations

import math

import torch


def params_with_gradient(norm: float) -> list[torch.nn.Parameter]:
    """Two tensors whose joint gradient has the given norm."""
    params = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in range(2)]
    set_gradient(params, norm)
    return params


def set_gradient(params: list[torch.nn.Parameter], norm: float) -> None:
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]
    total = math.sqrt(sum(float((g**2).sum()) for g in grads))
    for p, g in zip(params, grads, strict=True):
        p.grad = (g * (norm / total)).float()
