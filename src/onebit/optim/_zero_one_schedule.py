"""0/1 Adam's schedules (ALGORITHM.md, "0/1 Adam"): which steps update the variance, which
synchronise, and the kind of every step, as functions of the step alone."""

from __future__ import annotations

from onebit.optim._readiness import DEFAULT_MAX_FREEZE_STEP

#: The kinds of step, the keys of ``ZeroOneAdam.bytes_sent`` (ALGORITHM.md, "0/1 Adam").
VARIANCE_UPDATE = "variance_update"  # dense fp32 mean of the gradients, variance updated
GRADIENT_1BIT = "gradient_1bit"  # the gradients exchanged at 1 bit, variance unchanged
LOCAL = "local"  # after the freeze: local gradients, nothing sent
SYNC = "sync"  # after the freeze: the accumulated update exchanged at 1 bit
STEP_KINDS = (VARIANCE_UPDATE, GRADIENT_1BIT, LOCAL, SYNC)

#: The arguments that differ from DeepSpeed's ``ZeroOneAdam`` by default, at DeepSpeed's values:
#: the variance frozen after step 100000, its first 16 steps dense, then 1-bit gradients between
#: the variance updates, and no guard after the freeze. (Merge an explicit ``var_freeze_step``
#: in: ``DEEPSPEED_SCHEDULE | {...}``.)
DEEPSPEED_SCHEDULE = {
    "var_freeze_step": DEFAULT_MAX_FREEZE_STEP,
    "var_warmup_steps": None,
    "pre_freeze_exchange": "gradient",
    "variance_guard": "off",
}

#: What the 1-bit steps before the variance freeze exchange: ``"gradient"`` (DeepSpeed's
#: ``ZeroOneAdam``: the gradients, a ``gradient_1bit`` step) or ``"momentum"`` (the paper's
#: Algorithm 1: each rank's own momentum step, synchronised at 1 bit, a ``sync`` step).
PRE_FREEZE_EXCHANGES = ("gradient", "momentum")


def _variance_rounds(var_update_scaler: int, first_interval: int | None):
    """The rounds of T_v: ``(first, final, interval)``, round r on the multiples of 2^r from
    ``first`` to ``final``; round 0 holds ``first_interval`` updates (steps 1..first_interval;
    default kappa), each later round kappa."""
    last, interval = 0, 1
    updates = var_update_scaler if first_interval is None else first_interval
    while True:
        first = (last // interval + 1) * interval
        final = first + (updates - 1) * interval
        yield first, final, interval
        last, interval, updates = final, 2 * interval, var_update_scaler


def is_variance_update_step(
    step: int, var_update_scaler: int, first_interval: int | None = None
) -> bool:
    """Whether ``step`` (counted from 1) is in the variance-update schedule T_v, before the
    freeze is applied: ``var_update_scaler`` (kappa) updates at each interval 1, 2, 4, ...,
    on the multiples of the interval that follow the previous interval's last update
    (kappa = 16: steps 1-16, 18, 20, ..., 48, 52, ..., 112, 120, ...); the interval of 1
    holds ``first_interval`` updates instead where given (``var_warmup_steps``)."""
    for first, final, interval in _variance_rounds(var_update_scaler, first_interval):
        if step <= final:
            return step >= first and step % interval == 0


def variance_updates_until(
    step: int, var_update_scaler: int, first_interval: int | None = None
) -> int:
    """How many steps ``1 .. step`` are in T_v (before the freeze is applied)."""
    count = 0
    for first, final, interval in _variance_rounds(var_update_scaler, first_interval):
        if step <= final:
            return count + max(0, (step - first) // interval + 1)
        count += (final - first) // interval + 1


def local_step_interval(
    step: int, var_freeze_step: int, local_step_scaler: int, local_step_clipper: int
) -> int:
    """The local interval ``H_t = min(H, 2^floor((t - T - 1) / S))`` of a step ``t > T``."""
    doublings = (step - var_freeze_step - 1) // local_step_scaler
    return min(local_step_clipper, 2 ** min(doublings, local_step_clipper.bit_length()))


def step_kind(
    step: int,
    var_freeze_step: int,
    var_update_scaler: int,
    local_step_scaler: int,
    local_step_clipper: int,
    pre_freeze_exchange: str = "gradient",
    first_interval: int | None = None,
) -> str:
    """The kind of step ``step`` (counted from 1), one of :data:`STEP_KINDS`: up to the
    freeze a variance update, or else a 1-bit gradient step (``pre_freeze_exchange`` =
    ``"gradient"``) or a synchronisation (``"momentum"``); after it a synchronisation when
    ``t mod H_t = 0``, else a local step."""
    if step <= var_freeze_step:
        if is_variance_update_step(step, var_update_scaler, first_interval):
            return VARIANCE_UPDATE
        return GRADIENT_1BIT if pre_freeze_exchange == "gradient" else SYNC
    interval = local_step_interval(step, var_freeze_step, local_step_scaler, local_step_clipper)
    return SYNC if step % interval == 0 else LOCAL
