"""Update rules: the maths each optimizer applies on each kind of step, over the flat state,
through the update kernels (:mod:`onebit.optim.functional` or a fused backend). A rule holds
no state of its own beyond the per-parameter scalars it names (:attr:`scalars`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from onebit.coefficients import TrustBound
from onebit.compression import ExchangeResult
from onebit.kernels import UpdateKernels
from onebit.optim._flat import FlatState

__all__ = [
    "AdamRule",
    "LambRule",
    "OneBitLambRule",
    "UpdateRule",
    "ZeroOneAdamRule",
    "last_coefficients",
]


def record_coefficients(flat: FlatState, coeff: Tensor, present: Sequence[bool]) -> None:
    """Store the step's per-parameter coefficient (``lamb_coeff``) for the parameters that
    took part."""
    last = flat.scalars["lamb_coeff"]
    taking_part = torch.tensor(list(present), device=coeff.device)
    last.copy_(torch.where(taking_part, coeff, last))


def last_coefficients(flat: FlatState | None, has_state: Sequence[bool]) -> list[float]:
    """The last step's per-parameter coefficients of the parameters that have state."""
    if flat is None:
        return []
    values = flat.scalars["lamb_coeff"].tolist()
    return [value for value, has in zip(values, has_state, strict=True) if has]


class UpdateRule:
    """The dense update, and the update with the exchanged momentum (1-bit steps)."""

    #: Per-parameter scalar state and its initial value.
    scalars: dict[str, float] = {}

    def dense(
        self,
        updates: UpdateKernels,
        flat: FlatState,
        grads: Sequence[Tensor | None],
        present: Sequence[bool],
    ) -> bool:
        """The update with averaged gradients; ``False`` (nothing changed) if one of them
        is not finite."""
        raise NotImplementedError

    def start_compression(self, flat: FlatState) -> None:
        """What the rule keeps from the switch to 1-bit steps on (nothing by default)."""

    def prediction_coefficients(self, flat: FlatState) -> Tensor | None:
        """Per parameter, the coefficient the delayed exchange predicts the next update with
        (the last one's; ``None``: 1)."""
        return None

    def compressed(
        self,
        updates: UpdateKernels,
        flat: FlatState,
        packed: ExchangeResult,
        scratch: Tensor,
        limit: Tensor | None,
        active: Sequence[bool],
        per_tensor: bool,
    ) -> None:
        """The update with the exchanged (scaled) momentum ``packed``, decoded on the fly or
        into ``scratch``; ``flat.exp_avg`` still holds the previous momentum."""
        raise NotImplementedError


class LambRule(UpdateRule):
    """LAMB (ALGORITHM.md, "LAMB"): ``p <- p - lr c u``, ``c`` the clamped trust ratio."""

    scalars = {"lamb_coeff": 1.0}

    def dense(self, updates, flat, grads, present) -> bool:
        coeff, _ = updates.lamb_step_(flat, grads, present, False)
        record_coefficients(flat, coeff, present)
        return True


class OneBitLambRule(UpdateRule):
    """1-bit LAMB (ALGORITHM.md, "1-bit LAMB"): LAMB recording ``c_frz``, an EMA of the trust
    ratio, then the frozen ratio times the factor ``f`` from the fresh variance."""

    scalars = {
        "scaling_coeff": 1.0,
        "lamb_coeff": 1.0,  # the last step's coefficient: c, or c_frz * f (bounded)
        "lamb_coeff_freeze": 0.0,  # c_frz
        "last_factor": 1.0,  # f_last
        "trust_base": 0.0,  # trust_bound's ρ at the stage's first step (0: not yet measured)
    }

    def dense(self, updates, flat, grads, present) -> bool:
        result = updates.lamb_step_(flat, grads, present, True)
        if result is None:
            return False
        coeff, defined = result
        # c_frz: an EMA of c where both norms were positive (c = 1 was used elsewhere).
        beta_c = flat.segment_values(lambda group: group["coeff_beta"])
        frozen = flat.scalars["lamb_coeff_freeze"]
        frozen.copy_(torch.where(defined, beta_c * frozen + (1 - beta_c) * coeff, frozen))
        record_coefficients(flat, coeff, present)
        return True

    def start_compression(self, flat: FlatState) -> None:
        """At every freeze: ``v_fresh = copy(v)``, ``f_last = 1``, the coefficient the next
        update is predicted with ``c_frz``, and ``trust_bound``'s base measured anew."""
        flat.enable_fresh_variance().copy_(flat.exp_avg_sq)
        flat.scalars["last_factor"].fill_(1.0)
        flat.scalars["lamb_coeff"].copy_(flat.scalars["lamb_coeff_freeze"])
        flat.scalars["trust_base"].zero_()

    def prediction_coefficients(self, flat: FlatState) -> Tensor:
        """The last compression step's coefficient (``c_frz f_last``, or the bound where it
        held); ``c_frz`` before the first."""
        return flat.scalars["lamb_coeff"]

    def compressed(self, updates, flat, packed, scratch, limit, active, per_tensor) -> None:
        scalars = flat.scalars
        factor, coefficient = updates.onebit_lamb_compressed_step_(
            flat,
            packed,
            scratch,
            scalars["scaling_coeff"],
            limit,
            active,
            scalars["lamb_coeff_freeze"],
            scalars["last_factor"],
            _trust_bound(flat),
        )
        scalars["last_factor"].copy_(factor)
        scalars["lamb_coeff"].copy_(coefficient)


def _trust_bound(flat: FlatState) -> TrustBound | None:
    """The groups' ``trust_bound`` with the weights' norms before the step and the base;
    ``None`` where no group has one."""
    if not any(group.get("trust_bound") for group in flat.groups):
        return None
    return TrustBound(
        flat.segment_values(lambda group: group.get("trust_bound") or 0.0),
        flat.norms(flat.weight_views()),
        flat.scalars["trust_base"],
    )


class AdamRule(UpdateRule):
    """Adam without bias correction, then with the variance frozen (1-bit Adam; 0/1 Adam's
    variance updates)."""

    scalars = {"scaling_coeff": 1.0}

    def dense(self, updates, flat, grads, present) -> bool:
        return updates.adam_step_(flat, grads, present, True)

    def compressed(self, updates, flat, packed, scratch, limit, active, per_tensor) -> None:
        if per_tensor:
            updates.onebit_adam_per_tensor_step_(flat, packed, scratch, limit, active)
        else:
            updates.onebit_adam_compressed_step_(
                flat, packed, scratch, flat.scalars["scaling_coeff"], limit, active
            )


class ZeroOneAdamRule(AdamRule):
    """0/1 Adam (ALGORITHM.md, "0/1 Adam"): Adam's update on the variance updates; on the
    other steps a momentum step (``m <- b1 m + (1 - b1) g``, the frozen variance), and at a
    synchronisation the accumulated update exchanged and applied on every rank alike.
    ``lr_sum`` is Gamma, the sum of the learning rates since the last synchronisation."""

    scalars = {"lr_sum": 0.0}

    def momentum_step(self, updates, flat, grads, active) -> None:
        """``m <- b1 m + (1 - b1) g``, ``p <- p - lr (m / (sqrt(v) + eps) + wd p)``."""
        updates.adam_momentum_step_(flat, grads, active)

    def accumulated_update(self, updates, flat, active, out: Tensor) -> None:
        """``out = (p - p_synced) (sqrt(v) + eps)``, the update since the synchronisation."""
        updates.accumulated_update(flat, active, out)

    def synchronised_update(self, updates, flat, exchanged: Tensor, active) -> None:
        """``m = -exchanged / Gamma``, ``p = p_synced + exchanged / (sqrt(v) + eps)``."""
        updates.synchronised_update_(flat, exchanged, active, flat.scalars["lr_sum"])
