"""Checks of the optimizers' arguments, each raising ``ValueError`` that names the argument and
the value that was wrong (also used by the tools that take the same arguments)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from onebit.coefficients import adam_momentum_bound

__all__ = [
    "check_max_grad_norm",
    "check_lr",
    "check_betas",
    "check_non_negative",
    "check_positive",
    "check_bucket_cap_mb",
    "check_positive_int",
    "check_unit_interval",
    "check_factor_bounds",
    "check_coeff_bounds",
    "check_momentum_bound",
    "check_group",
    "GROUP_OPTIONS",
]


def _check_number(name: str, value: object, *, tensor: bool = False) -> None:
    """``value`` a real number (not a bool), or with ``tensor`` a tensor of one element."""
    if tensor and isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"Invalid {name}: a tensor {name} must have one element, got shape "
                f"{tuple(value.shape)}"
            )
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Invalid {name}={value!r}: it must be a number")


def check_max_grad_norm(max_grad_norm: float) -> None:
    if not (max_grad_norm >= 0.0 and math.isfinite(max_grad_norm)):
        raise ValueError(
            f"Invalid max_grad_norm={max_grad_norm}: it must be a finite number >= 0 "
            "(0: no clipping)"
        )


def check_lr(lr: float | Tensor) -> None:
    """``lr >= 0``: a number, or a tensor of one element (as torch's optimizers take)."""
    _check_number("lr", lr, tensor=True)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate lr={lr}: it must be >= 0")


def check_betas(betas: tuple[float, float]) -> None:
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"Invalid betas={betas!r}: expected a pair (beta1, beta2)")
    for index, beta in enumerate(betas):
        _check_number(f"betas[{index}]", beta, tensor=True)
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid betas[{index}]={beta}: it must be in [0, 1)")


def check_non_negative(name: str, value: float) -> None:
    _check_number(name, value)
    if not value >= 0.0:
        raise ValueError(f"Invalid {name}={value}: it must be >= 0")


def check_positive(name: str, value: float) -> None:
    _check_number(name, value)
    if not value > 0.0:
        raise ValueError(f"Invalid {name}={value}: it must be > 0")


def check_bucket_cap_mb(name: str, value: float | None) -> None:
    """MiB per bucket of the bucketed exchange: a finite number > 0, or ``None`` (the whole
    buffer in one exchange)."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"Invalid {name}={value}: it must be a finite number of MiB > 0 (or None: the "
            "whole buffer in one exchange)"
        )


def check_positive_int(name: str, value: int, meaning: str) -> None:
    """``value`` an int >= 1 (not a bool); the error says what the argument ``means``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}={value!r}: it must be an int >= 1 ({meaning})")


def check_unit_interval(name: str, value: float) -> None:
    """``value`` in ``[0, 1)`` (an EMA factor)."""
    _check_number(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid {name}={value}: it must be in [0, 1)")


def check_factor_bounds(factor_min: float, factor_max: float) -> None:
    """1-bit LAMB's factor bounds: ``0 < factor_min <= factor_max``."""
    check_positive("factor_min", factor_min)
    _check_number("factor_max", factor_max)
    if not factor_min <= factor_max:
        raise ValueError(
            f"Invalid factor bounds: factor_min={factor_min} > factor_max={factor_max}"
        )


def check_coeff_bounds(min_coeff: float, max_coeff: float) -> None:
    check_positive("min_coeff", min_coeff)
    _check_number("max_coeff", max_coeff)
    if not min_coeff <= max_coeff:
        raise ValueError(
            f"Invalid coefficient bounds: min_coeff={min_coeff} > max_coeff={max_coeff}"
        )


def check_momentum_bound(momentum_bound: object, betas: Sequence[float]) -> None:
    """``momentum_bound`` is a bool, and where set the betas have Adam's bound
    (``b1^2 < b2``)."""
    if not isinstance(momentum_bound, bool):
        raise ValueError(f"momentum_bound must be True or False, got {momentum_bound!r}")
    if momentum_bound and not math.isfinite(adam_momentum_bound(betas)):
        raise ValueError(
            f"momentum_bound needs betas with beta1**2 < beta2 (Adam's |m| / sqrt(v) has no "
            f"bound otherwise), got betas={tuple(betas)}; pass momentum_bound=False to exchange "
            "the momentum unbounded"
        )


def _check_trust_bound(trust_bound: float | None) -> None:
    if trust_bound is not None:
        check_positive("trust_bound", trust_bound)


#: The hyper-parameters a parameter group may set, each with its check of the group (the
#: group merged with its optimizer's defaults); a pair is checked together.
_GROUP_CHECKS: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "lr": lambda group: check_lr(group["lr"]),
    "betas": lambda group: check_betas(group["betas"]),
    "eps": lambda group: check_positive("eps", group["eps"]),
    "weight_decay": lambda group: check_non_negative("weight_decay", group["weight_decay"]),
    "min_coeff": lambda group: check_coeff_bounds(group["min_coeff"], group["max_coeff"]),
    "max_coeff": lambda group: check_coeff_bounds(group["min_coeff"], group["max_coeff"]),
    "coeff_beta": lambda group: check_unit_interval("coeff_beta", group["coeff_beta"]),
    "factor_min": lambda group: check_factor_bounds(group["factor_min"], group["factor_max"]),
    "factor_max": lambda group: check_factor_bounds(group["factor_min"], group["factor_max"]),
    "factor_threshold": lambda group: check_non_negative(
        "factor_threshold", group["factor_threshold"]
    ),
    "trust_bound": lambda group: _check_trust_bound(group["trust_bound"]),
    "momentum_bound": lambda group: check_momentum_bound(group["momentum_bound"], group["betas"]),
}

#: Every option a parameter group of some onebit optimizer takes.
GROUP_OPTIONS = frozenset({*_GROUP_CHECKS, "exp_avg_mask"})


def check_group(group: Mapping[str, Any]) -> None:
    """Check each hyper-parameter ``group`` sets (a parameter group merged with its
    optimizer's defaults); other keys are not looked at."""
    for name, check in _GROUP_CHECKS.items():
        if name in group:
            check(group)
