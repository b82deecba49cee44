"""Gradient clipping for data-parallel training with onebit's optimizers (ALGORITHM.md,
"Gradient clipping when step() uses each rank's own gradient")."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    optimizer: Optimizer,
    *,
    workers: int | None = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for the gradients the next ``optimizer.step()`` uses.

    At ``max_norm`` when that step averages the gradients over the ranks (an optimizer
    without ``needs_averaged_gradients``, such as :class:`onebit.Lamb`, or a step for which
    it is true); at ``max_norm·√W`` when the step uses each rank's own gradient (the
    compression stage, 0/1 Adam's 1-bit and local steps), W = ``workers``, by default the
    optimizer's data-parallel world size: the norm one of W gradients has when their mean
    has norm ``max_norm`` and sampling noise dominates them. Clipping a rank's own gradient
    at ``max_norm`` instead shrinks the frozen-variance update as W grows. Returns the total
    norm of the gradients before clipping, as torch's does.
    """
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ValueError(
            f"workers must be an int >= 1 (the data-parallel world size), got {workers!r}"
        )
    if not getattr(optimizer, "needs_averaged_gradients", True):
        max_norm *= math.sqrt(optimizer.world_size if workers is None else workers)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
