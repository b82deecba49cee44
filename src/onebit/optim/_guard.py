"""The step's guards: replicas checked for bit-identity, and non-finite gradients skipped (or
raised) on every rank alike."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import Tensor

from onebit.consistency import verify_replicas
from onebit.exchange import NonFiniteError

__all__ = ["NONFINITE_POLICIES", "StepGuard"]

NONFINITE_POLICIES = ("skip", "raise")


class StepGuard:
    """``verify_every``: every this many steps (and at the first), check that all ranks hold
    bit-identical weights, at the first step where they agree by design; ``on_nonfinite``:
    what a step whose gradients hold NaN or Inf does (``"skip"`` it with a warning, counted
    in :attr:`skipped_steps`, or ``"raise"``)."""

    def __init__(self, on_nonfinite: str, verify_every: int) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid on_nonfinite={on_nonfinite!r}: use 'skip' or 'raise'")
        if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
            raise ValueError(f"Invalid verify_every={verify_every}: it must be an int >= 0")
        self.on_nonfinite = on_nonfinite
        self.verify_every = verify_every
        self.skipped_steps = 0
        self._verified = False
        self._pending = False  # a check was due while the replicas differed by design
        self._left_out: set[int] = set()  # parameters warned about as left out

    def verify_if_due(
        self,
        last_step: int,
        replicas_agree: bool,
        tensors: Callable[[], Sequence[Tensor]],
        group: dist.ProcessGroup | None,
    ) -> None:
        """Before the step after ``last_step``: the replica check (one small all-gather of
        ``tensors()``) at the first step and every ``verify_every``, once ``replicas_agree``."""
        due = self.verify_every and last_step % self.verify_every == 0
        self._pending |= bool(due) or not self._verified
        if self._pending and replicas_agree:
            verify_replicas(tensors(), group, step=last_step + 1)
            self._verified, self._pending = True, False

    def restart(self) -> None:
        """After a checkpoint load: check again at the next step."""
        self._verified = False

    def skip(self, reason: str, step: int) -> bool:
        """A step whose gradients are not finite on some rank: raise, or count it skipped
        with a warning; returns ``False`` (nothing applied)."""
        message = f"non-finite gradients at step {step} ({reason})"
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message + "; raising on every rank (on_nonfinite='raise')")
        self.skipped_steps += 1
        warnings.warn(
            f"{message}: step skipped on every rank, state unchanged "
            f"({self.skipped_steps} skipped so far)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False

    def ignore_local(self, step: int, kind: str) -> None:
        """A step on each rank's own gradients whose gradients on this rank are not finite:
        they are ignored here (the step still counts, so the schedules stay aligned)."""
        message = (
            f"non-finite local gradients at step {step} (a {kind} step, which uses this "
            "rank's own gradients)"
        )
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message + " on this rank (on_nonfinite='raise')")
        self.skipped_steps += 1
        warnings.warn(
            f"{message}: ignored on this rank, its weights and momentum unchanged for this step",
            RuntimeWarning,
            stacklevel=4,
        )

    def relayout(self, origin: Sequence[int | None]) -> None:
        """The parameters were laid out anew (``origin[i]``: new parameter ``i``'s old index)."""
        self._left_out = {new for new, old in enumerate(origin) if old in self._left_out}

    def warn_left_out(self, step: int, kind: str, late: Sequence[tuple[int, tuple]]) -> None:
        """Parameters (index, shape) whose first gradient came in a 1-bit step, after the
        dense steps that give a parameter its state: they are left out, with a warning once
        each (ALGORITHM.md, "Parameters without gradients")."""
        new = [(index, shape) for index, shape in late if index not in self._left_out]
        if not new:
            return
        self._left_out.update(index for index, _ in new)
        named = ", ".join(f"parameter {index} (shape {list(shape)})" for index, shape in new)
        warnings.warn(
            f"{named} got a first gradient at step {step}, a {kind} step: a parameter gets "
            "its state (and its variance) in the dense steps before the freeze, so the 1-bit "
            "steps leave it out and it is not updated. Give it a gradient in the warm-up, or "
            "an optimizer of its own",
            RuntimeWarning,
            stacklevel=4,
        )
