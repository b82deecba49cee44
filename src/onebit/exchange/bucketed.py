"""Exchanges in buckets, pipelined and startable during backward (ALGORITHM.md, "Bucketed
exchange"): the fused buffer cut into buckets, each compressed alone; or whole tensors in
buckets, each tensor compressed alone as the per-tensor exchange compresses it."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch import Tensor

from onebit.compression import SignRuns
from onebit.exchange.flat import FlatExchange, PerTensorExchange, fill_segments, segment_views
from onebit.exchange.over_group import Round
from onebit.exchange.protocol import Layout, PackedResult, exchange_bytes
from onebit.exchange.transport import GroupTransport
from onebit.exchange.workspace import CompressionWorkspace

__all__ = [
    "BucketPipeline",
    "BucketedExchange",
    "BucketedResult",
    "PerTensorBucketedExchange",
    "bucket_elements",
    "tensor_buckets",
    "bucket_ranges",
    "bucket_size",
]


def bucket_elements(bucket_cap_mb: float, element_bytes: int) -> int:
    """Elements of ``element_bytes`` each in ``bucket_cap_mb`` MiB (at least one)."""
    return max(1, int(bucket_cap_mb * 2**20) // element_bytes)


def bucket_size(bucket_elements: int, n: int) -> int:
    """``E``: ``bucket_elements`` rounded down to a multiple of ``8 n`` (at least ``8 n``)."""
    unit = 8 * n
    return max(unit, bucket_elements // unit * unit)


def bucket_ranges(numel: int, bucket_elements: int, n: int) -> list[tuple[int, int]]:
    """The buckets ``[k E, min((k + 1) E, numel))`` of a padded buffer of ``numel`` elements
    (a multiple of ``8 n``), ``E`` = :func:`bucket_size`."""
    size = bucket_size(bucket_elements, n)
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def _checked_bucket_elements(bucket_elements: int) -> int:
    if (
        isinstance(bucket_elements, bool)
        or not isinstance(bucket_elements, int)
        or bucket_elements < 1
    ):
        raise ValueError(f"bucket_elements must be a positive int, got {bucket_elements!r}")
    return bucket_elements


@dataclass
class BucketedResult:
    """The buckets' results, one after another (an :class:`~onebit.compression.ExchangeResult`,
    as a whole buffer's is): bucket ``k``'s :class:`~onebit.exchange.protocol.PackedResult`
    (a slice of the fused buffer, or whole tensors) covers the exchanged buffer's elements
    from ``start_k`` on."""

    parts: list[tuple[int, PackedResult]]  # (start, result), in element order

    def sign_runs(self) -> SignRuns:
        return SignRuns.concatenate([(start, part.sign_runs()) for start, part in self.parts])

    def decode(self, out: Tensor) -> Tensor:
        """Every bucket's result into its range of ``out`` (the exchanged buffer's size)."""
        flat = out.view(-1)
        for start, part in self.parts:
            part.decode(flat[start : start + sum(part.layout.numels)])
        return out


class BucketedExchange(FlatExchange):
    """The fused, padded buffer cut into buckets of ``bucket_elements`` (rounded down to a
    multiple of ``8 n``, :func:`bucket_ranges`), each exchanged alone over ``group``, the
    last bucket first and the buckets' phases pipelined; every bucket's checks come before
    any error state changes. One bucket
    is the flat exchange, bit for bit (the same buffer and error sizes as it)."""

    def __init__(self, group: dist.ProcessGroup | None, bucket_elements: int) -> None:
        super().__init__(group)
        self.bucket_elements = _checked_bucket_elements(bucket_elements)
        self._workspaces: list[CompressionWorkspace] = []

    def buckets(self, numels: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """``(start, end)`` of every bucket, in element order, for tensors of ``numels``
        elements (default: the bound ones)."""
        if numels is None:
            self._require_bound()
            numels = self.numels
        size = self.buffer_size(numels)
        return bucket_ranges(size, self.bucket_elements, self.world_size)

    def layout_key(self, numels: Sequence[int]) -> list[int] | None:
        sizes = [end - start for start, end in self.buckets(numels)]
        return sizes if len(sizes) > 1 else None

    def bytes_per_call(self) -> dict[str, int]:
        n = self.world_size
        total = sum(exchange_bytes(Layout.flat(e - s, n), self.dtype) for s, e in self.buckets())
        return {"compressed_allreduce": total}

    def _scratch_bytes(self) -> int:
        return sum(ws.nbytes() for ws in self._workspaces)

    def begin(self, buffer: Tensor) -> BucketPipeline:
        """An exchange of ``buffer`` whose buckets the caller starts one by one, in
        :attr:`BucketPipeline.order`, as their values become final (the exchange overlapped
        with backward); :meth:`BucketPipeline.complete` gives what :meth:`exchange` gives
        and counts its bytes. Until then ``buffer``'s started buckets must stay as they are."""
        return _counted_when_complete(self, self._pipeline(self._checked(buffer), *self.errors()))

    def _exchange_into(
        self, buffer: Tensor, scratch: Tensor, worker_error: Tensor, server_error: Tensor
    ):
        """Every bucket's exchange, pipelined (:class:`BucketPipeline`), started in order."""
        return self._pipeline(buffer, worker_error, server_error, scratch).complete()

    def _pipeline(
        self,
        buffer: Tensor,
        worker_error: Tensor,
        server_error: Tensor,
        scratch: Tensor | None = None,
    ):
        """The pipeline of every bucket's exchange, its intermediates in ``scratch`` (default
        ``buffer``), its error updates computed ahead where ``buffer`` is the exchange's own
        and its own scratch (taken as the error state when it completes)."""
        buckets, n = self.buckets(), self.world_size
        in_place = scratch is None or scratch is buffer
        ahead = self._errors_ahead(buffer) if in_place else None
        while len(self._workspaces) < len(buckets):
            self._workspaces.append(CompressionWorkspace())
        server_starts = np.concatenate([[0], np.cumsum([(e - s) // n for s, e in buckets])])
        transport = GroupTransport(self.group)
        order = list(reversed(range(len(buckets))))  # the order backward finishes them in
        rounds = []
        for k in order:
            start, end = buckets[k]
            ws = self._workspaces[k].prepare(
                Layout.flat(end - start, n), self.dtype, self.device, self.backend
            )
            segment = buffer[start:end]
            x = segment if in_place else scratch[start:end]
            chunk = slice(int(server_starts[k]), int(server_starts[k + 1]))
            bucket_ahead = None if ahead is None else (ahead[0][start:end], ahead[1][chunk])
            rounds.append(
                Round(
                    [segment],
                    [x],
                    worker_error[start:end],
                    server_error[chunk],
                    transport,
                    ws,
                    bucket_ahead,
                )
            )
        # Every message's receive posted now: gloo's notices then travel before any bytes.
        transport.post_receives([out for r in rounds for out in r.ws.incoming()])
        pipeline = BucketPipeline(buckets, order, rounds, transport)
        if ahead is not None:
            pipeline.on_complete = self._take_errors_ahead
        return pipeline


def tensor_buckets(numels: Sequence[int], bucket_elements: int) -> list[tuple[int, int]]:
    """Buckets of whole tensors, ``(first, end)`` tensor indices in order: tensors are added to
    a bucket while it holds at most ``bucket_elements`` elements (a larger tensor alone)."""
    buckets, first, held = [], 0, 0
    for index, numel in enumerate(numels):
        if index > first and held + numel > bucket_elements:
            buckets.append((first, index))
            first, held = index, 0
        held += numel
    buckets.append((first, len(numels)))
    return buckets


class PerTensorBucketedExchange(PerTensorExchange):
    """Each tensor compressed alone, as :class:`~onebit.exchange.flat.PerTensorExchange`
    compresses it (its worker scale, server scales, signs and slices of the error buffers,
    laid out alike), the tensors grouped in buckets of whole tensors
    (:func:`tensor_buckets`), each bucket exchanged alone over ``group`` and pipelined as
    :class:`BucketedExchange`'s buckets are (the last first, startable during backward with
    :meth:`begin`). Buckets only group the messages: every tensor's result and errors are the
    per-tensor exchange's, bit for bit."""

    def __init__(self, group: dist.ProcessGroup | None, bucket_elements: int) -> None:
        super().__init__(group)
        self.bucket_elements = _checked_bucket_elements(bucket_elements)
        self._workspaces: list[CompressionWorkspace] = []

    def _tensor_buckets(self) -> list[tuple[int, int]]:
        self._require_bound()
        return tensor_buckets(self.numels, self.bucket_elements)

    def buckets(self, numels: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """``(start, end)`` of every bucket in the buffer (the tensors one after another),
        in element order, for tensors of ``numels`` elements (default: the bound ones)."""
        if numels is None:
            self._require_bound()
            numels = self.numels
        offsets = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
        return [
            (int(offsets[first]), int(offsets[end]))
            for first, end in tensor_buckets(numels, self.bucket_elements)
        ]

    def bytes_per_call(self) -> dict[str, int]:
        n, numels = self.world_size, self.numels
        total = sum(
            exchange_bytes(Layout.per_tensor(numels[first:end], n), self.dtype)
            for first, end in self._tensor_buckets()
        )
        return {"compressed_allreduce": total}

    def _scratch_bytes(self) -> int:
        return sum(ws.nbytes() for ws in self._workspaces)

    def begin(self, buffer: Tensor) -> BucketPipeline:
        """An exchange of ``buffer`` whose buckets the caller starts one by one, as
        :meth:`BucketedExchange.begin`'s."""
        return _counted_when_complete(self, self._pipeline(self._checked(buffer), *self.errors()))

    def _exchange(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor):
        return self._pipeline(buffer, worker_error, server_error).complete()

    def _pipeline(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor):
        """The pipeline of every bucket's exchange (its tensors padded alone in its
        workspace, intermediates in place: ``buffer`` is scratch afterwards), over its slices
        of the error buffers; its error updates computed ahead where ``buffer`` is the
        exchange's own (taken as the error state when it completes)."""
        n, numels = self.world_size, list(self.numels)
        whole = Layout.per_tensor(numels, n)
        elements = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
        workers = np.concatenate([[0], np.cumsum(whole.sizes)]).astype(np.int64)
        servers = np.concatenate([[0], np.cumsum(whole.chunks)]).astype(np.int64)
        tensors = self._tensor_buckets()
        ahead = self._errors_ahead(buffer)
        while len(self._workspaces) < len(tensors):
            self._workspaces.append(CompressionWorkspace())
        transport = GroupTransport(self.group)
        order = list(reversed(range(len(tensors))))
        rounds, paddings = [], []
        for k in order:
            first, end = tensors[k]
            layout = Layout.per_tensor(numels[first:end], n)
            ws = self._workspaces[k].prepare(layout, self.dtype, self.device, self.backend)
            values = buffer[int(elements[first]) : int(elements[end])].split(numels[first:end])
            segments, padding = segment_views(values, layout, ws)
            worker = slice(int(workers[first]), int(workers[end]))
            server = slice(int(servers[first]), int(servers[end]))
            bucket_ahead = None if ahead is None else (ahead[0][worker], ahead[1][server])
            rounds.append(
                Round(
                    segments,
                    segments,
                    worker_error[worker],
                    server_error[server],
                    transport,
                    ws,
                    bucket_ahead,
                    # the padded copies, once the bucket's values are final
                    refill=functools.partial(fill_segments, values, segments),
                )
            )
            paddings.append(padding)
        transport.post_receives([out for r in rounds for out in r.ws.incoming()])
        buckets = [(int(elements[first]), int(elements[end])) for first, end in tensors]
        pipeline = BucketPipeline(buckets, order, rounds, transport, paddings)
        if ahead is not None:
            pipeline.on_complete = self._take_errors_ahead
        return pipeline


def _counted_when_complete(exchange, pipeline: BucketPipeline) -> BucketPipeline:
    """``pipeline``, which counts ``exchange``'s bytes once it completes, after what it does
    then already (taking the error updates computed ahead)."""
    take_errors = pipeline.on_complete

    def on_complete() -> None:
        take_errors()
        exchange.traffic.record_all(exchange.bytes_per_call())

    pipeline.on_complete = on_complete
    return pipeline


#: Bucket ``i``'s server phase is sent right after the worker phase of the bucket
#: :data:`SERVER_LAG` places after it (ALGORITHM.md, "Bucketed exchange").
SERVER_LAG = 2


class BucketPipeline:
    """One bucketed exchange in progress, over the buckets in :attr:`order`:

    1. :meth:`start_next` sends :attr:`next_bucket`'s worker phase (its worker compression,
       its scales and signs, asynchronously) as soon as that bucket's values are final, then
       the server phase of the bucket :data:`SERVER_LAG` places before it (which waits for
       that bucket's signs), so that during backward the link carries server signs too;
    2. :meth:`complete` sends the worker phases still to run, the same way, then bucket
       ``i``'s server phase where it is not yet sent and bucket ``i - 1``'s result, for
       ``i = 0, 1, ...``, so one bucket's server signs travel while the next bucket's server
       compresses.

    Every rank issues the same collectives in the same order (fixed by the buckets' places,
    wherever each step runs). A failed step drains what is in flight, sends what is left of
    the messages whose receives ``transport`` posted ahead, and is raised by
    :meth:`complete`; no error state changes before every bucket's checks have passed."""

    def __init__(
        self,
        buckets: list[tuple[int, int]],
        order: list[int],
        rounds: list[Round],
        transport: GroupTransport,
        paddings: Sequence[Tensor | None] | None = None,
    ) -> None:
        self.buckets, self.order, self.rounds = buckets, order, rounds
        self.transport = transport
        #: Per round, the scratch its result decodes padded segments through (per tensor).
        self.paddings = [None] * len(rounds) if paddings is None else list(paddings)
        self._finished: list = [None] * len(rounds)
        self._sent = 0  # buckets whose worker phase has run
        self._served = 0  # buckets whose server phase has run
        self.on_complete = lambda: None  # called once the result is in
        self.failure: BaseException | None = None

    @property
    def started(self) -> int:
        """Buckets whose worker phase has been sent."""
        return self._sent

    @property
    def next_bucket(self) -> int | None:
        """The bucket the next :meth:`start_next` starts (``None``: all are started)."""
        return self.order[self._sent] if self._sent < len(self.rounds) else None

    def start_next(self) -> None:
        """Send :attr:`next_bucket`'s worker phase (its range of the buffer final now), then
        the server phase of the bucket :data:`SERVER_LAG` places before it. After a failure,
        nothing more is sent."""
        if self.failure is None and self._sent < len(self.rounds):
            self._run(self.rounds[self._sent].send_workers)
            self._sent += 1
            if self.failure is None and self._sent - SERVER_LAG > self._served:
                self._run(self._serve_next)

    def _serve_next(self) -> None:
        self.rounds[self._served].send_servers()
        self._served += 1

    def complete(self) -> BucketedResult:
        """Send every worker phase not yet sent, run the server phases, wait for all and
        apply every bucket's error updates; the result. Raises a failure of any step, error
        state unchanged."""
        while self.failure is None and self._sent < len(self.rounds):
            self.start_next()
        for i in range(len(self.rounds) + 1):
            if self.failure is None:
                self._run(lambda i=i: self._server_phase(i))
        if self.failure is not None:
            raise self.failure
        parts = []
        for k, pending, padding in zip(self.order, self._finished, self.paddings, strict=True):
            result = pending.commit()
            result.padding = padding
            parts.append((self.buckets[k][0], result))
        parts.sort(key=lambda part: part[0])
        self.on_complete()
        return BucketedResult(parts)

    def cancel(self) -> None:
        """Wait for what is in flight and drop the exchange (error state unchanged)."""
        self._drain()
        self._sent = len(self.rounds)
        self.failure = self.failure or RuntimeError("the exchange was cancelled")

    def _server_phase(self, i: int) -> None:
        """Bucket ``i``'s server phase unless it is sent, then bucket ``i - 1``'s result."""
        if i < len(self.rounds) and self._served == i:
            self._serve_next()
        if i > 0:
            self._finished[i - 1] = self.rounds[i - 1].finish()

    def _run(self, step) -> None:
        try:
            step()
        except BaseException as error:
            self._drain()
            self.failure = error

    def _drain(self) -> None:
        """Wait for every message in flight, and send and wait for every message posted
        ahead and not sent (every rank drops the exchange at the same message)."""
        for exchange in self.rounds:
            exchange.drain()
        self.transport.settle()
