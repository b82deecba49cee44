"""Whether the variance is ready to be frozen (ALGORITHM.md, "Variance readiness").

For each tensor j, over the last ``W`` dense steps (steps whose gradients are averaged over the
ranks at full precision)::

    R_j = mean_s ||g_j(s)||² / (Σ_i v_ji / (1 - β2^k))

the gradients' recent energy against the energy the variance holds (``v`` bias-corrected
after its ``k`` updates: the variance's long average of ``g²``, summed over the tensor). R_j is
about 1 when the variance has caught up with the gradients; above 1 the gradients have grown
faster than ``v`` (an average over ``1/(1-β2)`` steps) follows, and a variance frozen now gives
the tensor steps about ``√R_j`` times larger than Adam's with a variance that kept up. The
statistic costs one squared norm per tensor per observed step and one sum of ``v`` per tensor
per check, all on the device; the decision is one host read per check. It is computed from
the averaged gradients and the variance, which are bit-identical on every rank in the
warm-up, so every rank decides the same without communicating.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from onebit.optim._flat import FlatState

logger = logging.getLogger("onebit")

#: Dense steps the gradients' energy is averaged over, and steps between two checks of
#: ``freeze_step="auto"``.
READINESS_WINDOW = 10
#: The largest R_j of a variance that has caught up: steps at most √2 times Adam's.
READY_RATIO = 2.0
#: What a check finds (:meth:`VarianceReadiness.update`): some R_j above READY_RATIO and the
#: largest grown since the last check; after such a growth, the largest back to half its peak
#: or to READY_RATIO; neither.
FALLING_BEHIND = "falling behind"
CAUGHT_UP = "caught up"
CATCHING_UP = "catching up"
#: ``freeze_step`` asking the optimizer to freeze once the variance has caught up.
AUTO = "auto"
#: The bound of ``freeze_step="auto"`` when no ``max_freeze_step`` is given (DeepSpeed's
#: default ``freeze_step``).
DEFAULT_MAX_FREEZE_STEP = 100000


class VarianceReadiness:
    """The gradients' energy of the last :data:`READINESS_WINDOW` dense steps, per tensor, and
    the readiness statistic ``R`` computed from it (module docstring)."""

    def __init__(self) -> None:
        self._energies: list[Tensor] = []  # one float64 vector per observed step, newest last
        #: The largest R_j of any check so far, and of the last check (0.0: none yet).
        self.peak = 0.0
        self.last = 0.0

    def observe(
        self, flat: FlatState, grads: Sequence[Tensor | None], present: Sequence[bool]
    ) -> None:
        """Record ``||g_j||²`` of this dense step's averaged gradients (0 where absent)."""
        zero = flat.exp_avg.new_zeros(1)
        norms = flat.norms([g if has else zero for g, has in zip(grads, present, strict=True)])
        self._energies = [*self._energies[1 - READINESS_WINDOW :], norms.double() ** 2]

    @property
    def observed(self) -> int:
        """Dense steps in the current window."""
        return len(self._energies)

    def ratios(self, flat: FlatState, variance_updates: int) -> Tensor:
        """``R_j`` for every tensor (float64, on the device); 0 where the variance is 0."""
        held = flat.norms(flat.views(flat.exp_avg_sq), ord=1).double()
        beta2 = torch.tensor(
            [group["betas"][1] for group in flat.groups], dtype=torch.float64, device=held.device
        )
        held = held / (1 - beta2**variance_updates)
        energy = torch.stack(self._energies).mean(dim=0)
        return torch.where(held > 0, energy / held.clamp(min=torch.finfo(held.dtype).tiny), 0.0)

    def update(self, largest: float) -> str:
        """Record a check whose largest R_j is ``largest``; what it finds: the variance
        :data:`FALLING_BEHIND` (a growth under way), :data:`CAUGHT_UP` (one that has ended)
        or :data:`CATCHING_UP`."""
        rising = largest > self.last
        self.peak, self.last = max(self.peak, largest), largest
        if largest > READY_RATIO and rising:
            return FALLING_BEHIND
        if self.peak > READY_RATIO and largest <= max(READY_RATIO, self.peak / 2):
            return CAUGHT_UP
        return CATCHING_UP

    def settled(self, largest: float) -> bool:
        """Record a check of a refresh (ALGORITHM.md, "The guard after the freeze"): whether
        the variance has caught up, ``largest <= max(READY_RATIO, peak / 2)``."""
        self.peak, self.last = max(self.peak, largest), largest
        return largest <= max(READY_RATIO, self.peak / 2)

    def relayout(self, origin: Sequence[int | None]) -> None:
        """The tensors were laid out anew (``origin[i]``: new tensor ``i``'s old index): each
        tensor's energies move with it; a tensor that joined had 0."""
        self._energies = [
            torch.stack(
                [energy[old] if old is not None else energy.new_zeros(()) for old in origin]
            )
            for energy in self._energies
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"energies": [e.cpu() for e in self._energies], "peak": self.peak, "last": self.last}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self._energies = [e.to(device) for e in state["energies"]]
        self.peak, self.last = float(state["peak"]), float(state["last"])


class ReadinessMonitor:
    """Watches the variance's readiness over the dense steps of a ``schedule`` (a
    :class:`~onebit.optim._schedule.Schedule`): observes the averaged gradients where the
    statistic needs them, warns after a check that finds the variance falling behind, and
    takes the schedule's pending decision (``"auto"``) once it has caught up. ``owner``
    names the optimizer in messages."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.statistic = VarianceReadiness()
        self._checks: tuple[tuple[int, ...], dict[int, tuple[str, str]]] | None = None

    def ratios(self, flat: FlatState | None, variance_updates: int) -> Tensor | None:
        """``R_j`` of every parameter, or ``None`` before a step that observed them."""
        if flat is None or not self.statistic.observed:
            return None
        return self.statistic.ratios(flat, variance_updates)

    def _checks_of(self, schedule) -> dict[int, tuple[str, str]]:
        key = (schedule.freeze_step, schedule.first_local_exchange)
        if self._checks is None or self._checks[0] != key:
            self._checks = (key, schedule.readiness_checks())
        return self._checks[1]

    def after_dense_step(
        self,
        step: int,
        schedule,
        flat: FlatState,
        grads: Sequence[Tensor | None],
        present: Sequence[bool],
        warn: bool,
    ) -> None:
        """After dense step ``step``: observe its gradients where the statistic needs them
        (every step while a readiness decision is pending, else the two windows of
        :data:`READINESS_WINDOW` dense steps before each check); every window, update the
        largest ``R_j``; at a check, warn (where ``warn``) if the variance is still falling
        behind; once it has caught up, take the pending decision."""
        if step > schedule.freeze_step or not any(present):
            return
        dense = schedule.variance_updates(step)
        checks = self._checks_of(schedule)
        window = READINESS_WINDOW
        pending = schedule.decision_pending(step)
        if not pending and not any(0 <= c - dense < 2 * window for c in checks):
            return
        self.statistic.observe(flat, grads, present)
        at_check = dense in checks
        due = at_check or any(c - dense == window for c in checks)
        if not (due or (pending and dense % window == 0)):
            return
        ratios = self.statistic.ratios(flat, dense)
        readiness = self.statistic.update(float(ratios.max()))
        if at_check and readiness == FALLING_BEHIND and warn:
            warn_not_ready(self.owner, *checks[dense], ratios, flat)
        if pending and readiness == CAUGHT_UP:
            what = schedule.caught_up(step)
            logger.info(
                "%s: the variance has caught up after step %d: %s (the largest R was %.3g; now %s)",
                self.owner,
                step,
                what,
                self.statistic.peak,
                describe(ratios, flat),
            )

    def after_refresh_step(
        self,
        step: int,
        schedule,
        flat: FlatState,
        grads: Sequence[Tensor | None],
        present: Sequence[bool],
        log: bool,
    ) -> None:
        """After refresh step ``step``: observe; every :data:`READINESS_WINDOW` steps of the
        refresh, end it once the variance has caught up (logged where ``log``)."""
        if not any(present):
            return
        self.statistic.observe(flat, grads, present)
        first = schedule.refreshes.of(step)
        if (step - first + 1) % READINESS_WINDOW:
            return
        ratios = self.statistic.ratios(flat, schedule.variance_updates(step))
        if not self.statistic.settled(float(ratios.max())):
            return
        schedule.refreshes.end(step)
        if log:
            logger.info(
                "%s: the variance has caught up after refresh step %d: it freezes again "
                "(dense steps %d-%d; the largest R was %.3g; now %s)",
                self.owner,
                step,
                first,
                step,
                self.statistic.peak,
                describe(ratios, flat),
            )

    def restart(self) -> None:
        """A refresh begins: a new window and peak."""
        self.statistic = VarianceReadiness()

    def relayout(self, origin: Sequence[int | None]) -> None:
        """The tensors were laid out anew (:meth:`VarianceReadiness.relayout`)."""
        self.statistic.relayout(origin)

    def state_dict(self) -> dict[str, Any]:
        return self.statistic.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None, device: torch.device) -> None:
        """Restore the statistic (``None``: start it anew)."""
        self.statistic = VarianceReadiness()
        if state is not None:
            self.statistic.load_state_dict(state, device)


def describe(ratios: Tensor, flat: FlatState) -> str:
    """The tensor with the largest R_j, its value and what it means."""
    index = int(ratios.argmax())
    value = float(ratios[index])
    return (
        f"parameter {index} (shape {list(flat.params[index].shape)}) had R = {value:.3g}: its "
        f"gradients carried {value:.3g}x the energy its variance holds over the last "
        f"{READINESS_WINDOW} dense steps (mean ||g||² / (sum(exp_avg_sq) / (1 - beta2^k))), "
        f"so a variance frozen now makes its steps about {value**0.5:.2g}x larger than Adam's"
    )


def warn_not_ready(
    optimizer: str, event: str, advice: str, ratios: Tensor, flat: FlatState
) -> None:
    """The warning of a step taken before the variance is ready: ``optimizer`` ``event``."""
    warnings.warn(
        f"{optimizer} {event} before the variance has settled: {describe(ratios, flat)}; "
        f"it has caught up where every R <= {READY_RATIO}. {advice} (ALGORITHM.md, "
        "'Variance readiness')",
        UserWarning,
        stacklevel=7,  # the caller of optimizer.step(), through torch's two wrappers
    )
