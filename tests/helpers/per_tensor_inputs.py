"""The tensors the per-tensor compressed allreduce is tested on, in one process and on real
ranks: one of each kind of padding, and every rank's seeded inputs for each of ``CALLS``
calls."""

from __future__ import annotations

import math

import torch

SHAPES = [(7, 5), (5,), (300,), (1,), (6, 2), (0,)]  # one tensor of each kind of padding
CALLS = 4


def seeded_inputs(n: int, call: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Every rank's tensors for one call (row i = rank i), the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(100 * n + call)
    magnitudes = torch.linspace(0.5, 2.0, n).unsqueeze(1)
    return [
        (torch.randn(n, math.prod(shape), generator=gen) * magnitudes * (index + 1)).to(dtype)
        for index, shape in enumerate(SHAPES)
    ]
