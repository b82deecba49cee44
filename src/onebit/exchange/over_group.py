"""The two-phase exchange (:mod:`onebit.exchange.protocol`) over a process group: the stages
with ``torch.distributed`` collectives between them (a
:class:`~onebit.exchange.transport.GroupTransport`), whole (:func:`exchange_over_group`), with
its error updates left for later (:func:`start_exchange`), or step by step with its
collectives in flight (:class:`Round`, which the bucketed exchange's pipeline interleaves)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from onebit.exchange.protocol import PackedResult
from onebit.exchange.transport import GroupTransport, finite_problem, worker_scales_problem
from onebit.exchange.workspace import CompressionWorkspace
from onebit.kernels import BACKENDS

__all__ = ["PendingExchange", "Round", "exchange_over_group", "start_exchange"]


@dataclass
class PendingExchange:
    """An exchange whose result is in, its error updates not yet applied (:meth:`commit`
    applies them; until then the segments, ``xs`` and the workspace must stay as they are)."""

    result: PackedResult
    _commit: object

    def commit(self) -> PackedResult:
        """Apply the error updates; the result."""
        self._commit()
        return self.result


def exchange_over_group(
    segments: Sequence[Tensor],
    xs: Sequence[Tensor],
    worker_error: Tensor,
    server_error: Tensor,
    transport: GroupTransport,
    workspace: CompressionWorkspace,
    errors_ahead: tuple[Tensor, Tensor] | None = None,
) -> PackedResult:
    """The two-phase exchange of this rank's ``segments`` (flat, ``P_t`` elements each, of
    the layout ``workspace`` was prepared for) over ``transport``'s group, with this rank's
    error state (``worker_error``: ``sum P_t``; ``server_error``: ``sum P_t / n``), updated
    in place. ``xs`` (one per segment, may be the segments themselves) holds intermediates.

    Every rank's scales and backend are checked after the worker compression and every
    server's scales after the server compression, before any error state changes: a
    :class:`~onebit.exchange.transport.NonFiniteError` or
    :class:`~onebit.exchange.transport.KernelMismatchError` is raised on every rank alike.
    With ``errors_ahead`` the error updates go to scratch instead (:class:`Round`)."""
    pending = start_exchange(
        segments, xs, worker_error, server_error, transport, workspace, errors_ahead
    )
    return pending.commit()


def start_exchange(
    segments: Sequence[Tensor],
    xs: Sequence[Tensor],
    worker_error: Tensor,
    server_error: Tensor,
    transport: GroupTransport,
    workspace: CompressionWorkspace,
    errors_ahead: tuple[Tensor, Tensor] | None = None,
) -> PendingExchange:
    """:func:`exchange_over_group` with the error updates left for the caller to apply
    (``commit()``), so that several exchanges can all be checked before any error state
    changes (the bucketed exchange). The error updates read only what the exchange leaves in
    ``xs``, the segments and the workspace, so applying them later gives the same bits. With
    ``errors_ahead`` they are computed ahead, into scratch (:class:`Round`).

    Over gloo the receives of both messages are posted first (ALGORITHM.md, "Receives posted
    ahead"); a failure drains what is in flight and sends the messages not yet sent."""
    exchange = Round(segments, xs, worker_error, server_error, transport, workspace, errors_ahead)
    transport.post_receives(workspace.incoming())
    try:
        exchange.send_workers()
        exchange.send_servers()
        return exchange.finish()
    except BaseException:
        exchange.drain()
        transport.settle()
        raise


class Round:
    """One exchange (the arguments of :func:`start_exchange`) in three steps, each ending
    with its collectives in flight, so that a caller can interleave the steps of several
    exchanges (the bucketed exchange's pipeline: bucket ``k + 1``'s signs on the wire while
    bucket ``k``'s server compresses):

    1. :meth:`send_workers`: worker compression; to each server, in one message (an
       all-to-all), this rank's scales and backend code, then the signs of its chunk;
    2. :meth:`send_servers`: every rank's scales and backend checked; the server
       compression; its signs and scales, in one message, gathered by every rank;
    3. :meth:`finish`: every server's scales checked; the result, its error updates
       pending.

    A check that fails raises on every rank alike (they all gathered the same values) with
    no error state changed; :meth:`drain` then waits for what is still in flight.

    With ``errors_ahead = (next_worker_error, next_server_error)`` (flat, as large as the
    error buffers; the worker's may be the one segment itself), the error updates are
    computed while each phase's collective travels, into them: the new worker errors after
    the worker signs are sent (each segment copied into its place first, where it is not
    there), the new server errors after the server signs are sent. Nothing is left to
    commit; the caller takes the two as the error state once every check has passed
    (ALGORITHM.md, "Error updates while the bytes travel").

    ``refill`` (where segments are padded copies of values that are final only when the
    worker phase starts, as in a bucket started during backward) copies them in then."""

    def __init__(
        self,
        segments: Sequence[Tensor],
        xs: Sequence[Tensor],
        worker_error: Tensor,
        server_error: Tensor,
        transport: GroupTransport,
        workspace: CompressionWorkspace,
        errors_ahead: tuple[Tensor, Tensor] | None = None,
        refill: Callable[[], object] | None = None,
    ) -> None:
        self.segments, self.xs, self.transport, self.ws = segments, xs, transport, workspace
        self.refill = refill
        self.worker_error, self.server_error = worker_error.view(-1), server_error.view(-1)
        self.device = worker_error.device
        if errors_ahead is not None:
            sizes = (self.worker_error.numel(), self.server_error.numel())
            if tuple(error.numel() for error in errors_ahead) != sizes:
                raise ValueError(f"the errors ahead must have {sizes} elements, as the errors")
        self.errors_ahead = errors_ahead
        self._works: list = []

    def drain(self) -> None:
        """Wait for this exchange's collectives in flight."""
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = []

    def send_workers(self) -> None:
        ws, stages = self.ws, self.ws.stages
        if self.refill is not None:
            self.refill()
        stages.compress_worker(
            self.segments, self.xs, self.worker_error, ws.worker_packed, ws.local_scales
        )
        ws.local_scales[stages.layout.segments] = stages.backend.code
        stages.fill_send(ws.worker_packed, ws.send)  # chunk j of every segment, for rank j
        ws.frame_worker_message()  # the scales travel with the signs: one message per peer
        self._works = [self.transport.all_to_all(ws.received_framed, ws.send_framed, async_op=True)]
        if self.errors_ahead is not None:
            self._update_worker_errors_ahead(self.errors_ahead[0])

    def send_servers(self) -> None:
        ws, stages = self.ws, self.ws.stages
        count = stages.layout.segments
        self.drain()
        ws.unframe_worker_messages()
        problem = worker_scales_problem(ws.worker_scales, stages.backend.name, BACKENDS)
        self.transport.agree(problem, self.device)
        self.received = stages.server_view(ws.received)
        self.worker_scales = ws.worker_scales[:, :count].T.contiguous()  # row t: a_0t ... a_(n-1)t
        stages.compress_server(
            self.received,
            self.worker_scales,
            self.server_error,
            ws.server_packed,
            ws.local_server_scales,
        )
        ws.frame_server_message()
        self._works = [
            self.transport.all_gather(ws.gathered_framed, ws.server_frame, async_op=True)
        ]
        if self.errors_ahead is not None:
            self._update_server_errors(self.errors_ahead[1])

    def finish(self) -> PendingExchange:
        ws, stages = self.ws, self.ws.stages
        self.drain()
        ws.unframe_server_messages()
        self.transport.agree(finite_problem(ws.server_scales.tolist(), "server scale"), self.device)

        def commit() -> None:
            if self.errors_ahead is None:
                stages.update_worker_errors(
                    self.segments, self.xs, self.worker_error, ws.worker_packed, ws.local_scales
                )
                self._update_server_errors(self.server_error)

        result = PackedResult(ws.gathered, ws.server_scales, stages.layout, stages.backend)
        return PendingExchange(result, commit)

    def _update_worker_errors_ahead(self, out: Tensor) -> None:
        """``out[S_t] = x - a_t sign(x)``, ``x = segment_t + worker_error[S_t]``: each segment
        copied into ``out`` where it is not there, then the update with the roles of the two
        summands swapped (the same bits: IEEE addition is commutative)."""
        sizes = self.ws.stages.layout.sizes
        for place, segment in zip(out.split(sizes), self.segments, strict=True):
            if place.data_ptr() != segment.data_ptr():
                place.copy_(segment)
        self.ws.stages.update_worker_errors(
            self.worker_error.split(sizes),
            self.xs,
            out,
            self.ws.worker_packed,
            self.ws.local_scales,
        )

    def _update_server_errors(self, out: Tensor) -> None:
        """``out = y - b sign(y)``, ``y`` formed from the server error (``out`` may be it)."""
        ws = self.ws
        own = ws.server_packed, ws.local_server_scales
        ws.stages.update_server_errors(
            self.received, self.worker_scales, self.server_error, *own, out
        )
