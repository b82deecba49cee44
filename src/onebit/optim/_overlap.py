"""The bucketed exchange started during backward (ALGORITHM.md, "Exchange overlapped with
backward")."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from onebit.exchange import BucketedResult, BucketPipeline

__all__ = ["BackwardOverlap", "bucket_members"]

#: Forms ``buffer[t] = s_t (b1 m_t + (1 - b1) g_t)`` for the tensors ``only`` (the
#: optimizer's local momentum, written tensor by tensor).
FormMomentum = Callable[[Sequence[int]], None]


def bucket_members(offsets: np.ndarray, buckets: Sequence[tuple[int, int]]) -> list[list[int]]:
    """For every bucket ``[s, e)`` of the flat buffer, the tensors (``offsets``: their starts
    and the end) with an element in it."""
    starts, ends = offsets[:-1], offsets[1:]
    return [
        [int(t) for t in np.flatnonzero((starts < end) & (ends > start))] for start, end in buckets
    ]


@dataclass
class _InFlight:
    """One step's exchange in progress: which tensors' gradients are in, which tensors'
    momenta are formed, and how many tensors each bucket still waits for."""

    pipeline: BucketPipeline
    members: list[list[int]]
    form: FormMomentum
    ready: list[bool]
    formed: list[bool] = field(init=False)
    waiting: list[int] = field(init=False)  # per bucket: its tensors without a gradient yet
    buckets_of: list[list[int]] = field(init=False)  # per tensor: the buckets it is in

    def __post_init__(self) -> None:
        self.formed = [False] * len(self.ready)
        self.waiting = [sum(not self.ready[t] for t in ts) for ts in self.members]
        self.buckets_of = [[] for _ in self.ready]
        for bucket, tensors in enumerate(self.members):
            for t in tensors:
                self.buckets_of[t].append(bucket)

    def gradient_ready(self, index: int) -> None:
        if self.ready[index]:
            return
        self.ready[index] = True
        for bucket in self.buckets_of[index]:
            self.waiting[bucket] -= 1
        self.start_ready_buckets()

    def start_ready_buckets(self, everything: bool = False) -> None:
        """Start the buckets, in the pipeline's order, as long as the next one has all its
        gradients (``everything``: start them all, the missing gradients counting as 0)."""
        pipeline = self.pipeline
        while pipeline.failure is None and pipeline.next_bucket is not None:
            bucket = pipeline.next_bucket
            if self.waiting[bucket] and not everything:
                return
            new = [t for t in self.members[bucket] if not self.formed[t]]
            if new:
                self.form(new)
                for t in new:
                    self.formed[t] = True
            pipeline.start_next()


class BackwardOverlap:
    """Hooks on the optimizer's parameters (``register_post_accumulate_grad_hook``) that,
    on the steps ``due()`` allows, start the bucketed exchange during backward: once every
    tensor with elements in the next bucket (last bucket first) has its gradient, that
    bucket's local momentum is formed and its worker phase sent (compressed, its signs
    handed to the network), followed by the server phase of the bucket two places before it
    (:class:`~onebit.exchange.BucketPipeline`), so the link carries both while backward goes
    on. :meth:`complete`, in ``step()``, does the same for the buckets left (tensors without
    a gradient count as zero), then runs the server phases left. The same in a plain loop
    and under ``DistributedDataParallel`` (whose own synchronisation onebit's hook switches
    off in this stage)."""

    def __init__(
        self,
        due: Callable[[], bool],
        begin: Callable[[], tuple[BucketPipeline, list[list[int]], FormMomentum, list[bool]]],
    ) -> None:
        self._due, self._begin = due, begin
        self._index: dict[int, int] = {}
        self._in_flight: _InFlight | None = None
        self._paused = 0
        # The hooks hold the overlap weakly: an optimizer that is gone starts nothing, and
        # its hooks leave the parameters with it.
        self._hook = functools.partial(_on_gradient, weakref.ref(self))
        self._handles: list[RemovableHandle] = []
        weakref.finalize(self, _remove, self._handles)

    def watch(self, params: Sequence[Tensor]) -> None:
        """Hook ``params``: the optimizer's next tensors, in its order (each group's)."""
        for param in params:
            self._index[id(param)] = len(self._index)
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook))

    def relayout(self, params: Sequence[Tensor]) -> None:
        """The optimizer's tensors are ``params`` now, in this order (some joined): hook the
        new ones."""
        new = [param for param in params if id(param) not in self._index]
        self._index = {id(param): index for index, param in enumerate(params)}
        self._handles.extend(param.register_post_accumulate_grad_hook(self._hook) for param in new)

    @property
    def buckets_started(self) -> int:
        """Buckets of the coming step whose exchange has started (0 when none is in flight)."""
        return 0 if self._in_flight is None else self._in_flight.pipeline.started

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the next one outside starts
        the exchange (gradient accumulation)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _on_gradient(self, param: Tensor) -> None:
        if self._paused:
            return
        in_flight = self._in_flight
        if in_flight is None:
            if not self._due():
                return
            in_flight = self._in_flight = _InFlight(*self._begin())
        index = self._index[id(param)]
        if in_flight.formed[index]:
            self.cancel()
            raise RuntimeError(
                f"a second gradient for parameter {index} of the optimizer arrived after its "
                "bucket's exchange had started (overlap_backward=True sends each bucket as "
                "soon as backward finishes it): call step() after every backward pass, or run "
                "the passes that only accumulate gradients under optimizer.no_sync()"
            )
        in_flight.gradient_ready(index)

    def complete(self) -> BucketedResult:
        """The step's exchange: every bucket not yet started is started (its momentum formed
        from the gradients there are now), then all are waited for. Raises what any bucket
        raised, error state unchanged."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            in_flight = _InFlight(*self._begin())
        in_flight.start_ready_buckets(everything=True)
        return in_flight.pipeline.complete()

    def cancel(self) -> None:
        """Drop an exchange in flight, waiting for its collectives (error state unchanged)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.pipeline.cancel()


def _on_gradient(overlap: weakref.ref, param: Tensor) -> None:
    live = overlap()
    if live is not None:
        live._on_gradient(param)


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
