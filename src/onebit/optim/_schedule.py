"""Schedules: the kind of every step of a 1-bit optimizer, and when its variance freezes.

A schedule answers, for a step ``t`` counted from 1, what kind of step it is (:meth:`kind`):
a *dense* kind (gradients averaged at full precision, the variance updated) or one that
exchanges 1-bit values or nothing. It also owns the freeze: ``freeze_step`` (the last step
that may update the variance; with ``"auto"``, the bound until the variance has caught up,
then the step it froze after), the dense steps after which an unready variance is warned
about, and what a readiness decision does (ALGORITHM.md, "Variance readiness").

:class:`FreezeSchedule` is 1-bit LAMB's and 1-bit Adam's (``"warmup"``, then
``"compression"``); :class:`ZeroOneSchedule` is 0/1 Adam's four kinds (ALGORITHM.md, "0/1 Adam").
"""

from __future__ import annotations

from typing import Any, Protocol

from onebit.optim import checks
from onebit.optim._readiness import AUTO, DEFAULT_MAX_FREEZE_STEP
from onebit.optim._zero_one_schedule import (
    GRADIENT_1BIT,
    LOCAL,
    PRE_FREEZE_EXCHANGES,
    STEP_KINDS,
    SYNC,
    VARIANCE_UPDATE,
    step_kind,
    variance_updates_until,
)

__all__ = [
    "COMPRESSION",
    "REFRESH",
    "WARMUP",
    "FreezeSchedule",
    "Refreshes",
    "Schedule",
    "ZeroOneSchedule",
    "GRADIENT_1BIT",
    "LOCAL",
    "SYNC",
    "VARIANCE_UPDATE",
]

#: 1-bit LAMB's and 1-bit Adam's kinds: dense steps, then the momentum exchanged at 1 bit,
#: and the dense steps of a refresh (ALGORITHM.md, "The guard after the freeze").
WARMUP = "warmup"
COMPRESSION = "compression"
REFRESH = "refresh"

#: A check of the variance's readiness: what happens after that dense step, what to do.
Check = tuple[str, str]


class Schedule(Protocol):
    """What a 1-bit optimizer asks of its schedule."""

    #: The argument that sets ``freeze_step`` (named in messages).
    argument: str
    #: Every kind of step, the keys of ``bytes_sent``.
    kinds: tuple[str, ...]
    #: The kinds whose gradients are averaged at full precision.
    dense_kinds: frozenset[str]
    freeze_step: int
    auto_freeze: bool
    #: The refreshes the guard after the freeze returned to.
    refreshes: Refreshes
    #: Whether the error feedback restarts from zero at the freeze (it held other values
    #: before it, as 0/1 Adam's 1-bit gradient steps leave the gradients' errors).
    errors_restart_at_freeze: bool

    def kind(self, step: int) -> str: ...

    def variance_updates(self, step: int) -> int:
        """How many steps up to ``step`` updated the variance."""

    def readiness_checks(self) -> dict[int, Check]:
        """The dense steps (counted as :meth:`variance_updates`) after which an unready
        variance is warned about."""

    def last_freeze(self, step: int) -> int:
        """The step after which the variance was last frozen, as of ``step``."""

    def decision_pending(self, step: int) -> bool:
        """Whether the variance's readiness after dense step ``step`` decides something."""

    def caught_up(self, step: int) -> str:
        """Take the pending decision after ``step``; returns what it does."""

    def replicas_agree(self, last_step: int) -> bool:
        """Whether every rank's weights are bit-identical by design after ``last_step``."""

    @property
    def first_local_exchange(self) -> int:
        """The first step that exchanges each rank's own values (checked once for them)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...


def checked_freeze(argument: str, freeze_step: int | str, max_freeze_step: int | None) -> int:
    """``freeze_step`` as a step (with ``"auto"``: its bound ``max_freeze_step``, default
    :data:`DEFAULT_MAX_FREEZE_STEP`); ``ValueError`` naming the argument otherwise."""
    if freeze_step == AUTO:
        bound = DEFAULT_MAX_FREEZE_STEP if max_freeze_step is None else max_freeze_step
        checks.check_positive_int(
            f"max_{argument}", bound, f"the last step {argument}='auto' may freeze after"
        )
        return bound
    if max_freeze_step is not None:
        raise ValueError(
            f"max_{argument}={max_freeze_step!r} bounds {argument}='auto'; with {argument}="
            f"{freeze_step!r} the variance freezes there: give one of them"
        )
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(
            f"Invalid {argument}={freeze_step!r}: it must be an int >= 1 (the last step that "
            "updates the variance before it is frozen) or 'auto'"
        )
    return freeze_step


def _freeze_check(argument: str, freeze_step: int) -> Check:
    return (
        f"freezes the variance (exp_avg_sq) after step {freeze_step}",
        f"Freeze later (a larger {argument}) or pass {argument}='auto', which freezes once the "
        "variance has caught up",
    )


class Refreshes:
    """The refreshes the guard after the freeze returned to (ALGORITHM.md, "The guard after
    the freeze"): each a run of dense ``"refresh"`` steps ``first .. last`` (``last`` is
    ``None`` while it lasts), after which the variance is frozen again."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int | None]] = []

    def of(self, step: int) -> int | None:
        """The first step of the refresh ``step`` belongs to, or ``None``."""
        for first, last in self.spans:
            if first <= step and (last is None or step <= last):
                return first
        return None

    def steps_until(self, step: int) -> int:
        """How many of the steps ``1 .. step`` were refresh steps."""
        return sum(
            max(0, min(step, step if last is None else last) - first + 1)
            for first, last in self.spans
        )

    def last_freeze(self, first_freeze: int, step: int) -> int:
        """The step after which the variance was last frozen, as of ``step``: the last step
        of the latest refresh that ended before ``step``, else ``first_freeze``."""
        ends = [last for _, last in self.spans if last is not None and last < step]
        return max([first_freeze, *ends])

    def start(self, step: int) -> None:
        """Steps from ``step`` on are refresh steps, until :meth:`end`."""
        self.spans.append((step, None))

    def end(self, step: int) -> None:
        """The variance freezes again after ``step``."""
        first, _ = self.spans[-1]
        self.spans[-1] = (first, step)

    def state_dict(self) -> list[list[int | None]]:
        return [list(span) for span in self.spans]

    def load_state_dict(self, saved: list[list[int | None]]) -> None:
        self.spans = [(int(first), last) for first, last in saved]


class FreezeSchedule:
    """Steps ``1 .. freeze_step`` are ``"warmup"`` (dense), the later ones ``"compression"``,
    except the ``"refresh"`` steps of each refresh (``first .. last``; ``last`` is ``None``
    while the refresh lasts): dense steps the guard after the freeze returned to."""

    argument = "freeze_step"
    kinds: tuple[str, ...] = (WARMUP, COMPRESSION, REFRESH)
    dense_kinds = frozenset({WARMUP, REFRESH})
    #: Whether the error feedback restarts from zero at the freeze (it held other values).
    errors_restart_at_freeze = False

    def __init__(self, freeze_step: int | str, max_freeze_step: int | None) -> None:
        self.auto_freeze = freeze_step == AUTO
        self.freeze_step = checked_freeze(self.argument, freeze_step, max_freeze_step)
        self.refreshes = Refreshes()

    def kind(self, step: int) -> str:
        if step <= self.freeze_step:
            return WARMUP
        return COMPRESSION if self.refreshes.of(step) is None else REFRESH

    def variance_updates(self, step: int) -> int:
        return min(step, self.freeze_step) + self.refreshes.steps_until(step)

    def last_freeze(self, step: int) -> int:
        """The step after which the variance was last frozen, as of ``step``: the warm-up's
        end, or that of the last refresh before ``step``."""
        return self.refreshes.last_freeze(self.freeze_step, step)

    def readiness_checks(self) -> dict[int, Check]:
        return {self.freeze_step: _freeze_check(self.argument, self.freeze_step)}

    def decision_pending(self, step: int) -> bool:
        return self.auto_freeze and step < self.freeze_step

    def caught_up(self, step: int) -> str:
        self.freeze_step = step
        return "it freezes"

    def replicas_agree(self, last_step: int) -> bool:
        return True

    @property
    def first_local_exchange(self) -> int:
        return self.freeze_step + 1

    def state_dict(self) -> dict[str, Any]:
        return {"freeze_step": self.freeze_step, "refreshes": self.refreshes.state_dict()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.auto_freeze and saved.get("freeze_step", self.freeze_step) < self.freeze_step:
            self.freeze_step = int(saved["freeze_step"])  # where "auto" froze
        self.refreshes.load_state_dict(saved.get("refreshes", []))


class ZeroOneSchedule:
    """0/1 Adam's: up to ``freeze_step`` (T) variance updates on exponentially spaced steps
    (the first ``first_interval`` steps all dense), 1-bit steps between them; after T local
    steps with a synchronisation every ``H_t`` steps (ALGORITHM.md, "0/1 Adam"), except the
    ``"refresh"`` steps of each refresh, after which the local intervals start again as
    after T ("The guard after the freeze", 0/1 Adam)."""

    argument = "var_freeze_step"
    kinds: tuple[str, ...] = (*STEP_KINDS, REFRESH)
    dense_kinds = frozenset({VARIANCE_UPDATE, REFRESH})

    def __init__(
        self,
        var_freeze_step: int | str,
        max_var_freeze_step: int | None,
        var_update_scaler: int,
        local_step_scaler: int,
        local_step_clipper: int,
        pre_freeze_exchange: str,
        var_warmup_steps: int | str | None,
    ) -> None:
        if var_warmup_steps not in (None, AUTO):
            checks.check_positive_int(
                "var_warmup_steps",
                var_warmup_steps,
                "the first steps, each a variance update; or 'auto', or None for var_update_scaler",
            )
        for name, value, meaning in (
            ("var_update_scaler", var_update_scaler, "variance updates at each interval"),
            ("local_step_scaler", local_step_scaler, "steps at each local interval"),
            ("local_step_clipper", local_step_clipper, "the longest local interval"),
        ):
            checks.check_positive_int(name, value, meaning)
        if pre_freeze_exchange not in PRE_FREEZE_EXCHANGES:
            raise ValueError(
                f"pre_freeze_exchange must be one of {list(PRE_FREEZE_EXCHANGES)}, "
                f"got {pre_freeze_exchange!r}"
            )
        self.auto_freeze = var_freeze_step == AUTO
        self.freeze_step = checked_freeze(self.argument, var_freeze_step, max_var_freeze_step)
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.pre_freeze_exchange = pre_freeze_exchange
        self.errors_restart_at_freeze = pre_freeze_exchange == "gradient"
        self.warmup_auto = var_warmup_steps == AUTO
        #: The variance updates at interval 1 (steps 1..first_interval): ``var_warmup_steps``,
        #: kappa where it is None; with ``"auto"`` the freeze's bound until the variance has
        #: caught up, then the step it did.
        self.first_interval = self.freeze_step if self.warmup_auto else var_warmup_steps
        self.refreshes = Refreshes()

    def kind(self, step: int) -> str:
        if step > self.freeze_step and self.refreshes.of(step) is not None:
            return REFRESH
        return step_kind(
            step,
            self.last_freeze(step),
            self.var_update_scaler,
            self.local_step_scaler,
            self.local_step_clipper,
            self.pre_freeze_exchange,
            self.first_interval,
        )

    def variance_updates(self, step: int) -> int:
        updates = variance_updates_until(
            min(step, self.freeze_step), self.var_update_scaler, self.first_interval
        )
        return updates + self.refreshes.steps_until(step)

    @property
    def first_local_exchange(self) -> int:
        """The first step up to the freeze that is not a variance update (steps 1..k are, k
        the first interval's updates, so it is k + 1 or, where that starts the interval of
        2, k + 2), else the first step after the freeze (a synchronisation)."""
        first = self.var_update_scaler if self.first_interval is None else self.first_interval
        return next(
            (
                t
                for t in (first + 1, first + 2)
                if t <= self.freeze_step and self.kind(t) != VARIANCE_UPDATE
            ),
            self.freeze_step + 1,
        )

    def readiness_checks(self) -> dict[int, Check]:
        """At the freeze, and before the first 1-bit step."""
        freeze = self.freeze_step
        checks = {self.variance_updates(freeze): _freeze_check(self.argument, freeze)}
        last_dense = self.first_local_exchange - 1
        if not self.warmup_auto and last_dense < self.freeze_step:
            checks.setdefault(
                self.variance_updates(last_dense),
                (
                    f"starts its 1-bit steps after step {last_dense}, updating the variance on "
                    "every 2nd step from there on and then ever more rarely,",
                    "Pass var_warmup_steps='auto', which keeps every step dense until the "
                    "variance has caught up, or a larger var_warmup_steps",
                ),
            )
        return checks

    def last_freeze(self, step: int) -> int:
        """T, or the last step of the last refresh before ``step``."""
        return self.refreshes.last_freeze(self.freeze_step, step)

    def decision_pending(self, step: int) -> bool:
        """With ``var_freeze_step="auto"`` or ``var_warmup_steps="auto"``: whether to freeze
        or to end the first interval after ``step``."""
        warmup = self.warmup_auto and step < self.first_interval
        return step < self.freeze_step and (self.auto_freeze or warmup)

    def caught_up(self, step: int) -> str:
        """``var_freeze_step="auto"``: the variance freezes after ``step``; else
        ``var_warmup_steps="auto"``: the first interval ends there."""
        if self.auto_freeze:
            self.freeze_step = step
            return "it freezes"
        self.first_interval = step
        return "the 1-bit steps start"

    def replicas_agree(self, last_step: int) -> bool:
        """Up to the freeze, and right after a synchronisation or a refresh step; not inside
        a local interval."""
        return last_step <= self.freeze_step or self.kind(last_step) in (SYNC, REFRESH)

    def state_dict(self) -> dict[str, Any]:
        return {
            "freeze_step": self.freeze_step,
            "first_interval": self.first_interval,
            "refreshes": self.refreshes.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.auto_freeze and saved.get("freeze_step", self.freeze_step) < self.freeze_step:
            self.freeze_step = int(saved["freeze_step"])
        interval = saved.get("first_interval")
        if self.warmup_auto and interval is not None and interval < self.first_interval:
            self.first_interval = int(interval)  # where "auto" ended the first interval
        self.refreshes.load_state_dict(saved.get("refreshes", []))
