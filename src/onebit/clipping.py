"""Gradient clipping for data-parallel training with onebit's optimizers (ALGORITHM.md,
"Gradient clipping when step() uses each rank's own gradient")."""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import Tensor
from torch.optim import Optimizer

from onebit.optim import OneBitOptimizer, clip_by_total_norm_


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

    In a plain loop of several ranks (no DDP hook) a onebit optimizer averages the gradients
    of its dense steps itself, inside ``step()``, after this call: clipping then would clip
    each rank's own gradient, not their mean, so it raises; give the optimizer
    ``max_grad_norm`` instead, which clips what the update uses.
    """
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ValueError(
            f"workers must be an int >= 1 (the data-parallel world size), got {workers!r}"
        )
    if not isinstance(optimizer, OneBitOptimizer):  # it steps on the gradients as they are
        averaged, averages_itself, world = True, False, 1
    else:
        averaged = optimizer.needs_averaged_gradients
        averages_itself = not optimizer.gradients_averaged_by_ddp
        world = optimizer.world_size
    if averaged and averages_itself and world > 1:
        raise ValueError(
            f"the next {type(optimizer).__name__}.step() averages the gradients over its "
            f"{world} ranks itself, after this call, so clip_grad_norm_ would "
            "clip each rank's own gradient instead of their mean: construct the optimizer "
            f"with max_grad_norm={max_norm} instead (it clips after the average), or use "
            "DistributedDataParallel with onebit.ddp.register_comm_hook"
        )
    if not averaged:
        max_norm *= math.sqrt(world if workers is None else workers)
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return clip_by_total_norm_([p.grad for p in parameters if p.grad is not None], max_norm)
