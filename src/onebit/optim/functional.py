"""The update rules of LAMB, 1-bit LAMB and 1-bit Adam as plain per-tensor functions.

The optimizer classes only validate, gather tensors and keep state; the maths lives here,
named after the paper's terms (ALGORITHM.md). Every function works in place on one tensor's
state and returns the scalar it decided (a trust ratio or a factor), so the classes can
record it. No bias correction anywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "update_moments_",
    "adam_direction",
    "trust_ratio",
    "lamb_step_",
    "adam_step_",
    "reconstruct_gradient",
    "update_fresh_variance_",
    "compression_factor",
    "onebit_lamb_compressed_step_",
]


def update_moments_(
    exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, beta1: float, beta2: float
) -> None:
    """``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``."""
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def adam_direction(
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    param: Tensor,
    eps: float,
    weight_decay: float,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """The (decoupled weight decay) Adam direction ``u = m / (sqrt(v) + eps) + wd p``.

    Written into ``out`` if given (no allocation)."""
    update = torch.sqrt(exp_avg_sq, out=out).add_(eps)
    torch.div(exp_avg, update, out=update)
    if weight_decay:
        update.add_(param, alpha=weight_decay)
    return update


def trust_ratio(param: Tensor, update: Tensor, min_coeff: float, max_coeff: float) -> float | None:
    """LAMB's layer-wise coefficient ``clamp(||p|| / ||u||, c_min, c_max)``; ``None`` where
    ``||p||`` or ``||u||`` is 0 (the step then uses ``c = 1``)."""
    param_norm = param.norm().item()
    update_norm = update.norm().item()
    if param_norm > 0 and update_norm > 0:
        return min(max(param_norm / update_norm, min_coeff), max_coeff)
    return None


def lamb_step_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    min_coeff: float,
    max_coeff: float,
    work: Tensor | None = None,
) -> float | None:
    """One LAMB step on one tensor; returns its trust ratio (``None`` if undefined).

    ``m, v <- moments(g)``; ``u = m / (sqrt(v) + eps) + wd p``;
    ``c = clamp(||p|| / ||u||, c_min, c_max)``, or 1 where a norm is 0; ``p <- p - lr c u``.
    ``work``: optional scratch of ``param``'s shape for ``u``.
    """
    update_moments_(exp_avg, exp_avg_sq, grad, beta1, beta2)
    update = adam_direction(exp_avg, exp_avg_sq, param, eps, weight_decay, out=work)
    coeff = trust_ratio(param, update, min_coeff, max_coeff)
    param.add_(update, alpha=-lr * (1.0 if coeff is None else coeff))
    return coeff


def adam_step_(
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    work: Tensor | None = None,
) -> None:
    """``p <- p - lr (m / (sqrt(v) + eps) + wd p)`` with moments already updated."""
    update = adam_direction(exp_avg, exp_avg_sq, param, eps, weight_decay, out=work)
    param.add_(update, alpha=-lr)


def reconstruct_gradient(
    exp_avg: Tensor, previous_exp_avg: Tensor, beta1: float, *, out: Tensor | None = None
) -> Tensor:
    """The averaged gradient implied by two momenta: ``g = (m_t - b1 m_{t-1}) / (1 - b1)``."""
    return torch.add(exp_avg, previous_exp_avg, alpha=-beta1, out=out).div_(1 - beta1)


def update_fresh_variance_(exp_avg_sq_fresh: Tensor, grad: Tensor, beta2: float) -> None:
    """``v_fresh = b2 v_fresh + (1-b2) g^2`` (the frozen ``v`` itself never changes)."""
    exp_avg_sq_fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def compression_factor(
    denom: Tensor,
    exp_avg_sq_fresh: Tensor,
    eps: float,
    *,
    work: Tensor | None = None,
    update_norm_ratio: float,
    last_factor: float,
    factor_min: float,
    factor_max: float,
    factor_threshold: float,
) -> float:
    """1-bit LAMB's per-layer factor ``f`` that lets the frozen trust ratio keep adapting.

    ``f = max(denom / (sqrt(v_fresh) + eps))``, pulled towards 1 by
    ``rho = ||u0|| / ||u||`` (``f = rho f + 1 - rho``, the weight-decay share), clamped to
    ``[f_min, f_max]`` and to within ``factor_threshold`` of the last step's factor.
    """
    ratio = torch.sqrt(exp_avg_sq_fresh, out=work).add_(eps)
    factor = torch.div(denom, ratio, out=ratio).max().item()
    factor = update_norm_ratio * factor + (1 - update_norm_ratio)
    factor = min(max(factor, factor_min), factor_max)
    return min(
        max(factor, last_factor * (1 - factor_threshold)), last_factor * (1 + factor_threshold)
    )


def onebit_lamb_compressed_step_(
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    exp_avg_sq_fresh: Tensor,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    lamb_coeff_freeze: float,
    last_factor: float,
    factor_min: float,
    factor_max: float,
    factor_threshold: float,
    work: tuple[Tensor, Tensor, Tensor] | None = None,
) -> float:
    """A compression-stage 1-bit LAMB step with the exchanged momentum; returns the factor.

    ``d = sqrt(v) + eps``; ``u0 = m / d``; ``u = u0 + wd p``; ``f`` from
    :func:`compression_factor`; ``p <- p - lr (c_frz f) u`` (no c_min/c_max clamp here).
    ``work``: optional three scratch tensors of ``param``'s shape.
    """
    denom_out, update_out, factor_out = work if work is not None else (None, None, None)
    denom = torch.sqrt(exp_avg_sq, out=denom_out).add_(eps)
    update = torch.div(exp_avg, denom, out=update_out)
    ratio = 1.0
    if weight_decay:
        base_norm = update.norm().item()
        update.add_(param, alpha=weight_decay)
        full_norm = update.norm().item()
        ratio = min(1.0, base_norm / full_norm) if full_norm > 0 else 1.0
    factor = compression_factor(
        denom,
        exp_avg_sq_fresh,
        eps,
        work=factor_out,
        update_norm_ratio=ratio,
        last_factor=last_factor,
        factor_min=factor_min,
        factor_max=factor_max,
        factor_threshold=factor_threshold,
    )
    param.add_(update, alpha=-lr * lamb_coeff_freeze * factor)
    return factor
