"""The exchange of one step's momentum run behind the caller's next forward and backward,
and the shared weights kept aside while the parameters hold this rank's prediction
(ALGORITHM.md, "Delayed exchange")."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from onebit.compression import ExchangeResult, SignRuns
from onebit.exchange import NonFiniteError
from onebit.optim._flat import FlatState

__all__ = ["DelayedExchange", "Landed", "SharedWeights"]


@dataclass
class Landed:
    """An exchange that has completed: the step that started it, its result (``None``: some
    rank's momentum was not finite, the error state unchanged) and the parameters its update
    applies to (those some rank had a gradient for at that step)."""

    step: int
    result: ExchangeResult | None
    applies_to: list[bool]


@dataclass
class _InFlight:
    step: int
    future: Future
    applies_to: list[bool]
    device: torch.device
    done: torch.cuda.Event | None  # on CUDA: recorded on the side stream after the exchange


class DelayedExchange:
    """At most one exchange pending: :meth:`start` runs it (in a thread of its own when
    ``threaded``, on a side stream on CUDA; at once otherwise), :meth:`wait` gives it once
    it has completed. Its collectives must not share a process group with what the caller
    runs meanwhile. A checkpoint holds a pending exchange's result (:meth:`state_dict`)."""

    def __init__(self, threaded: bool) -> None:
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="onebit-exchange")
            if threaded
            else None
        )
        if self._executor is not None:
            weakref.finalize(self, self._executor.shutdown, wait=False)
        self._in_flight: _InFlight | None = None
        self._landed: Landed | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def step(self) -> int | None:
        """The step whose exchange is pending, in flight or completed (``None``: none is)."""
        if self._in_flight is not None:
            return self._in_flight.step
        return None if self._landed is None else self._landed.step

    def start(
        self,
        step: int,
        exchange: Callable[[], ExchangeResult],
        device: torch.device,
        applies_to: list[bool],
    ) -> None:
        """Start ``exchange()``, step ``step``'s, whose inputs are final on ``device``'s
        current stream now."""
        if self.step is not None:
            raise RuntimeError(f"the exchange of step {self.step} is pending: wait() for it first")
        done = None
        if self._executor is None:
            future: Future = Future()
            try:
                future.set_result(exchange())
            except BaseException as error:  # raised by wait(), as a thread's would be
                future.set_exception(error)
        else:
            run = exchange
            if device.type == "cuda":
                stream = self._side_stream(device)
                ready = torch.cuda.current_stream(device).record_event()
                done = torch.cuda.Event()
                run = _on_stream(exchange, stream, ready, done)
            future = self._executor.submit(_without_grad, run)
        self._in_flight = _InFlight(step, future, applies_to, device, done)

    def wait(self) -> Landed:
        """The pending exchange (:attr:`step` is not ``None``), once it has completed, its
        result ready on the caller's current stream; nothing is pending afterwards. Raises
        what it raised, other than a non-finite momentum."""
        self._settle()
        landed, self._landed = self._landed, None
        if landed is None:
            raise RuntimeError("no exchange is pending")
        return landed

    def _settle(self) -> None:
        """Wait for the exchange in flight and keep its result."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        try:
            result = in_flight.future.result()
        except NonFiniteError:
            result = None
        if in_flight.done is not None:
            torch.cuda.current_stream(in_flight.device).wait_event(in_flight.done)
        self._landed = Landed(in_flight.step, result, in_flight.applies_to)

    def cancel(self) -> None:
        """Drop the pending exchange, waiting for it if it is in flight, whatever it gave."""
        in_flight, self._in_flight, self._landed = self._in_flight, None, None
        if in_flight is not None:
            try:
                in_flight.future.result()
            except Exception:  # noqa: BLE001 - dropped: its result is not used
                pass

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        """The pending exchange, waited for: its step, the parameters its update applies to
        and its result as :class:`~onebit.compression.SignRuns` (``None`` where it failed);
        ``None`` when nothing is pending. Raises what :meth:`wait` raises."""
        self._settle()
        landed = self._landed
        if landed is None:
            return None
        result = None if landed.result is None else landed.result.sign_runs().state_dict()
        return {"step": landed.step, "applies_to": list(landed.applies_to), "result": result}

    def load_state_dict(self, state: dict[str, Any] | None, device: torch.device) -> None:
        """Drop what is pending and take ``state``'s pending exchange (from
        :meth:`state_dict`), its result on ``device``."""
        self.cancel()
        if state is not None:
            saved = state["result"]
            result = None if saved is None else SignRuns.from_state_dict(saved, device)
            self._landed = Landed(int(state["step"]), result, list(state["applies_to"]))

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream


class SharedWeights:
    """The weights every rank shares, kept aside while the parameters hold this rank's
    prediction (ALGORITHM.md, "Delayed exchange"): one flat copy, reused. The compression
    steps apply their updates to it there and predict from it; a step of another kind, or
    the optimizer's ``finish_exchange()``, puts it back into the parameters."""

    def __init__(self) -> None:
        self._copy: Tensor | None = None
        self.set_aside = False

    def keep(self, flat: FlatState) -> Tensor:
        """The copy of the shared weights: the flat weights copied aside where they are not
        set aside yet (the stage's first step, the first after they were put back or a load
        without them), before the prediction moves them."""
        if self.set_aside:
            return cast(Tensor, self._copy)
        weights = cast(Tensor, flat.weights)
        if self._copy is None or self._copy.shape != weights.shape:
            self._copy = torch.empty_like(weights)
        self._copy.copy_(weights)
        self.set_aside = True
        return self._copy

    def put_back(self, flat: FlatState) -> None:
        """The shared weights into the flat weights and the parameters (nothing to do
        unless they are set aside)."""
        if self.set_aside:
            cast(Tensor, flat.weights).copy_(cast(Tensor, self._copy))
            flat.refresh_half_params()
            self.set_aside = False

    def flat(self, flat: FlatState) -> Tensor:
        """The flat shared weights: the copy where set aside, else the weights themselves."""
        return cast(Tensor, self._copy if self.set_aside else flat.weights)

    def nbytes(self) -> int:
        return 0 if self._copy is None else self._copy.numel() * self._copy.element_size()

    def state_dict(self) -> Tensor | None:
        """The copy where the weights are set aside (``None``: they are not)."""
        return self._copy if self.set_aside else None

    def load_state_dict(self, saved: Tensor | None, device: torch.device) -> None:
        """Take ``saved`` (from :meth:`state_dict`) as the weights set aside, which the next
        step updates where they are kept (or puts back), whatever the parameters hold
        meanwhile."""
        self.set_aside = saved is not None
        self._copy = None if saved is None else saved.detach().to(device, copy=True)


def _without_grad(run: Callable[[], ExchangeResult]) -> ExchangeResult:
    with torch.no_grad():  # grad mode is per thread
        return run()


def _on_stream(
    exchange: Callable[[], ExchangeResult],
    stream: torch.cuda.Stream,
    ready: torch.cuda.Event,
    done: torch.cuda.Event,
) -> Callable[[], ExchangeResult]:
    """``exchange`` run on ``stream`` once ``ready`` has passed, ``done`` recorded after it."""

    def run() -> ExchangeResult:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            try:
                return exchange()
            finally:
                done.record(stream)

    return run
