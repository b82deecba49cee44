"""The per-tensor coefficients of LAMB and 1-bit LAMB, and 0/1 Adam's momentum rebuild
(ALGORITHM.md), on device vectors of one entry per parameter, and Adam's bound on
``|m| / sqrt(v)``: the maths every update backend shares (torch only, no other import)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "TrustBound",
    "adam_momentum_bound",
    "compression_factor",
    "momentum_rebuild",
    "trust_ratio",
]


def adam_momentum_bound(betas: Sequence[float]) -> float:
    """``B = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))``: Adam's momentum and variance, from
    zero and without bias correction, keep ``|m| <= B sqrt(v)`` whatever the gradients
    (Cauchy-Schwarz); ``inf`` where ``b1^2 >= b2`` (no such bound)."""
    beta1, beta2 = betas
    if beta1 * beta1 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 * beta1 / beta2))


def trust_ratio(
    param_norm: Tensor, update_norm: Tensor, min_coeff: Tensor, max_coeff: Tensor
) -> tuple[Tensor, Tensor]:
    """LAMB's ``c = clamp(||p|| / ||u||, c_min, c_max)`` per parameter, and where it is
    defined (both norms positive); ``c = 1`` elsewhere."""
    defined = (param_norm > 0) & (update_norm > 0)
    ratio = torch.where(defined, param_norm / torch.where(defined, update_norm, 1), 1)
    return torch.where(
        defined, torch.minimum(torch.maximum(ratio, min_coeff), max_coeff), 1
    ), defined


def compression_factor(
    max_ratio: Tensor,
    base_norm: Tensor,
    full_norm: Tensor,
    last_factor: Tensor,
    factor_min: Tensor,
    factor_max: Tensor,
    factor_threshold: Tensor,
) -> Tensor:
    """1-bit LAMB's per-parameter factor ``f`` that lets the frozen trust ratio adapt.

    ``f = max(d / (sqrt(v_fresh) + eps))`` (``max_ratio``), pulled towards 1 by
    ``rho = min(1, ||u0|| / ||u||)`` (``f = rho f + 1 - rho``; ``rho = 1`` where
    ``||u|| = 0``), clamped to ``[f_min, f_max]`` and to within ``factor_threshold`` of the
    last step's factor."""
    rho = torch.where(full_norm > 0, base_norm / torch.where(full_norm > 0, full_norm, 1), 1)
    rho = torch.clamp(rho, max=1)
    factor = rho * max_ratio + (1 - rho)
    factor = torch.minimum(torch.maximum(factor, factor_min), factor_max)
    low, high = last_factor * (1 - factor_threshold), last_factor * (1 + factor_threshold)
    return torch.minimum(torch.maximum(factor, low), high)


@dataclass(frozen=True)
class TrustBound:
    """1-bit LAMB's bound on the compression stage's coefficient, per parameter
    (ALGORITHM.md, "A bound on the frozen coefficient"): ``bound`` (κ; 0 where there is none),
    ``weight_norm`` (||p|| before the step) and ``base``, the stage's first ratio ρ of step to
    weights (0 until measured; updated in place by :meth:`apply`)."""

    bound: Tensor
    weight_norm: Tensor
    base: Tensor

    def apply(
        self,
        steps: Tensor,
        coefficient: Tensor,
        lr: Tensor,
        update_norm: Tensor,
        indices: list[int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``ρ = c_frz f ||u|| / ||p||`` measures ``base`` where it is still 0; then
        ``c = min(c_frz f, κ base ||p|| / ||u||)``: where that bound is smaller (κ > 0, both
        norms positive, a base), the step ``-lr c`` and ``c`` replace ``steps`` and
        ``coefficient`` (``c_frz f``); elsewhere they are kept, bit for bit. ``indices``: the
        parameters the other vectors hold (default: all)."""
        picked = slice(None) if indices is None else indices
        bound, weight_norm, base = self.bound[picked], self.weight_norm[picked], self.base[picked]
        defined = (bound > 0) & (weight_norm > 0) & (update_norm > 0)
        safe_weight = torch.where(defined, weight_norm, 1)
        safe_update = torch.where(defined, update_norm, 1)
        base = torch.where(defined & (base == 0), coefficient * update_norm / safe_weight, base)
        self.base[picked] = base
        bounded = bound * base * weight_norm / safe_update
        binds = defined & (base > 0) & (bounded < coefficient)
        return torch.where(binds, -lr * bounded, steps), torch.where(binds, bounded, coefficient)


def momentum_rebuild(lr_sum: Tensor) -> Tensor:
    """0/1 Adam's synchronisation: the factor ``-1 / lr_sum`` that turns the exchanged
    accumulated update into the momentum (0 where ``lr_sum = 0``)."""
    return torch.where(lr_sum > 0, -1 / torch.where(lr_sum > 0, lr_sum, 1), 0)
