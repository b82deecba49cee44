"""The guard after the freeze (ALGORITHM.md, "The guard after the freeze").

For each tensor j in the compression stage, after every applied compression step (0/1 Adam:
every synchronisation after the freeze), with ``m_j`` the exchanged momentum (0/1 Adam's
rebuilt one; identical on every rank) and ``lr_j`` its group's rate::

    E_j = ||m_j||²,   S_j = lr_j² E_j
    G_j = min(mean E_j / baseline E_j,  mean S_j / baseline S_j)

means over the last W compression steps, baselines over the first W after the freeze. With
the variance frozen, ``E_j`` grows as the tensor's steps ``m / (sqrt(v) + eps)`` do against
a variance that no longer follows, and ``S_j`` as the steps themselves: a growth the learning
rate has since cut back, or one of the learning rate alone, is not the variance falling
behind. A check every W steps after the baseline reads one number on the host, ``max_j G_j``;
above :data:`GROWTH_LIMIT` the variance has fallen behind. Sharded tensors are observed on
their local slices, their energies summed over the shard group at the baseline and at each
check.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from onebit.optim._flat import FlatState

__all__ = [
    "GROWTH_LIMIT",
    "GUARD_MODES",
    "GUARD_WINDOW",
    "MODE_OFF",
    "MODE_REFRESH",
    "MODE_WARN",
    "VarianceGuard",
    "check_mode",
]

#: What a finding does: dense steps until the variance has caught up, a warning, nothing.
MODE_REFRESH = "refresh"
MODE_WARN = "warn"
MODE_OFF = "off"
GUARD_MODES = (MODE_REFRESH, MODE_WARN, MODE_OFF)
#: Compression steps the momentum's energy is averaged over (the baseline, each check).
GUARD_WINDOW = 10
#: The largest growth of a tensor's momentum energy since the freeze that is let pass: its
#: steps about sqrt(8) = 2.8 times their size when the variance was frozen.
GROWTH_LIMIT = 8.0


def check_mode(variance_guard: object) -> str:
    """``variance_guard`` if it is one of :data:`GUARD_MODES`; ``ValueError`` otherwise."""
    if variance_guard not in GUARD_MODES:
        raise ValueError(
            f"Invalid variance_guard={variance_guard!r}: use 'refresh' (dense steps until the "
            "variance has caught up, the default), 'warn' or 'off'"
        )
    return str(variance_guard)


class VarianceGuard:
    """The statistic of the module docstring over the compression steps since the last
    freeze; ``mode`` is what a finding does (:data:`GUARD_MODES`), ``owner`` names the
    optimizer in messages."""

    def __init__(self, owner: str, mode: str) -> None:
        self.owner = owner
        self.mode = check_mode(mode)
        self.warned = False  # with "warn": the one warning was given
        self.restart()

    def restart(self) -> None:
        """At a freeze: a new baseline from the next :data:`GUARD_WINDOW` steps."""
        self._sums: Tensor | None = None  # the window's sums of E_j and S_j (local slices)
        self._observed = 0  # compression steps observed since the freeze
        self._baseline: Tensor | None = None  # the baselines of E_j and S_j (whole tensors)

    @property
    def watching(self) -> bool:
        return self.mode == MODE_REFRESH or (self.mode == MODE_WARN and not self.warned)

    def observe(self, flat: FlatState) -> Tensor | None:
        """After an applied compression step: record ``E_j`` and ``S_j``; at the end of a
        window, set the baselines or check; returns ``G_j`` of every tensor where the check
        finds the variance fallen behind, else ``None``."""
        if not self.watching:
            return None
        energy = torch.stack(torch._foreach_norm(flat.views(flat.exp_avg))).double() ** 2
        rate = flat.segment_values(lambda group: group["lr"]).double()
        sums = torch.stack([energy, rate**2 * energy])
        self._sums = sums if self._sums is None else self._sums + sums
        self._observed += 1
        if self._observed % GUARD_WINDOW:
            return None
        window = self._sums / GUARD_WINDOW
        if flat.shards is not None:
            window = flat.shards.sum_(window)
        self._sums = None
        if self._baseline is None:
            self._baseline = window
            return None
        baseline = self._baseline
        tiny = torch.finfo(baseline.dtype).tiny
        growth = torch.where(baseline > 0, window / baseline.clamp(min=tiny), 0.0).amin(dim=0)
        if float(growth.max()) <= GROWTH_LIMIT:
            return None
        return growth

    def after_compression_step(self, step: int, flat: FlatState, warn: bool) -> bool:
        """:meth:`observe` after compression step ``step``; where the check finds the variance
        fallen behind, warn (where ``warn``: on the logging rank) and return whether a refresh
        starts at the next step (``"refresh"``; ``"warn"`` stops watching)."""
        growth = self.observe(flat)
        if growth is None:
            return False
        self.warned = True
        refresh = self.mode == MODE_REFRESH
        if warn:
            then = (
                f"Steps from {step + 1} on are dense, refreshing the variance, until it has "
                "caught up; then it freezes again (variance_guard='warn' only warns)."
                if refresh
                else "Nothing changes (variance_guard='warn')."
            )
            self._warn(step, growth, flat, then)
        return refresh

    def _warn(self, step: int, growth: Tensor, flat: FlatState, then: str) -> None:
        """The finding after ``step``, warned about; ``then`` says what follows."""
        index = int(growth.argmax())
        value = float(growth[index])
        warnings.warn(
            f"{self.owner}: the frozen variance has fallen behind after step {step}: parameter "
            f"{index} (shape {list(flat.params[index].shape)}) carries {value:.3g}x the momentum "
            f"energy it had after the freeze over the last {GUARD_WINDOW} steps (learning rate "
            f"included), so its steps are about {value**0.5:.2g}x their size then against a "
            f"variance that no longer follows (the limit is {GROWTH_LIMIT:g}x). "
            f"{then} (ALGORITHM.md, 'The guard after the freeze')",
            RuntimeWarning,
            stacklevel=8,  # the caller of optimizer.step(), through torch's two wrappers
        )

    def state_dict(self) -> dict[str, Any]:
        def cpu(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.cpu()

        return {
            "sums": cpu(self._sums),
            "observed": self._observed,
            "baseline": cpu(self._baseline),
            "warned": self.warned,
        }

    def load_state_dict(self, state: dict[str, Any] | None, device: torch.device) -> None:
        """Restore the statistic (``None``: a checkpoint without it, started anew)."""
        self.restart()
        self.warned = False
        if state is None:
            return

        def to(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.to(device)

        self._sums, self._baseline = to(state["sums"]), to(state["baseline"])
        self._observed, self.warned = int(state["observed"]), bool(state["warned"])
