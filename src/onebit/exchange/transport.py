"""How the exchange's bytes move: over a ``torch.distributed`` process group, and the
bookkeeping every exchange shares (traffic counters, the errors every rank raises together).

Only ``torch.distributed`` is used: collectives (``all_to_all_single``, ``all_gather_single``,
``all_reduce``), so the same code runs on gloo (CPU tensors) and NCCL (CUDA tensors), and, for
the messages whose receives an exchange posts ahead over gloo
(:meth:`GroupTransport.post_receives`), ``isend``/``irecv``. Without an initialised process
group, or with a group of one rank, everything runs locally with the same maths and no
communication.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "GroupTransport",
    "KernelMismatchError",
    "NonFiniteError",
    "TrafficCounter",
    "all_gather_into",
    "world_size",
]


class NonFiniteError(FloatingPointError):
    """A buffer taking part in a collective holds NaN or Inf (raised on every rank)."""


class KernelMismatchError(RuntimeError):
    """Ranks of a group run different compression backends (raised on every rank)."""


@dataclass
class TrafficCounter:
    """Bytes this process has sent, per kind of collective, and how many calls made them."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + int(nbytes)
            self.calls[kind] = self.calls.get(kind, 0) + 1

    def record_all(self, bytes_by_kind: dict[str, int]) -> None:
        """Record one call of each kind that sent bytes (kinds of 0 bytes are left out)."""
        for kind, nbytes in bytes_by_kind.items():
            if nbytes:
                self.record(kind, nbytes)

    def take(self, other: TrafficCounter) -> None:
        """Move ``other``'s bytes and calls into this counter (``other`` is left empty)."""
        with other._lock:
            moved = dict(other.bytes_sent), dict(other.calls)
            other.bytes_sent.clear()
            other.calls.clear()
        with self._lock:
            for kind, nbytes in moved[0].items():
                self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + nbytes
            for kind, calls in moved[1].items():
                self.calls[kind] = self.calls.get(kind, 0) + calls

    def total(self) -> int:
        """All bytes sent so far, every kind together."""
        with self._lock:
            return sum(self.bytes_sent.values())

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent.clear()
            self.calls.clear()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group``; 1 when ``torch.distributed`` is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


# `all_gather_single` supersedes `all_gather_into_tensor` in newer torch releases.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into(
    output: Tensor,
    local: Tensor,
    group: dist.ProcessGroup | None,
    n: int,
    async_op: bool = False,
):
    """``output`` (``n`` times ``local``'s size) = every rank's ``local``, in rank order;
    with ``async_op`` the collective's work to wait on (``None`` where nothing is sent)."""
    if n == 1:
        output.copy_(local.reshape(output.shape))
        return None
    return _all_gather_single(output.view(-1), local.reshape(-1), group=group, async_op=async_op)


_PROBLEMS = (NonFiniteError, KernelMismatchError)  # codes 1, 2; 0 is none

#: Tags of the messages posted ahead: ``POSTED_TAG_BASE + (e mod 2^14) 2^16 + place`` for the
#: ``e``-th exchange that posted over its group and the message's place in it (every rank
#: counts the same exchanges in the same order), so exchanges in flight together never take
#: each other's messages; far from the small tags of a program's own messages.
POSTED_TAG_BASE = 0x0B170000
_PLACES, _SERIALS = 1 << 16, 1 << 14
_posted_exchanges: dict[str, int] = {}  # by group name: exchanges that posted over it
_posted_lock = threading.Lock()


def _posted_serial(group: dist.ProcessGroup | None) -> int:
    """The number of exchanges that posted over ``group`` before this one."""
    name = (group or dist.group.WORLD).group_name
    with _posted_lock:
        serial = _posted_exchanges.get(name, 0)
        _posted_exchanges[name] = serial + 1
    return serial


@dataclass
class _Posted:
    """A message whose receives are posted: its tag, the receives, the tensor they fill."""

    tag: int
    receives: list
    output: Tensor


class _Works:
    """The sends and receives of one message, waited for together, each once (a gloo
    receive waited for twice waits for a second message)."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()


class GroupTransport:
    """The collectives of the two-phase exchange over ``group`` (default: the world).

    ``agree_on``, a second group whose ranks must all raise when any of them does (the
    hierarchical exchange's node), agrees on every check over it too, with one all-reduce
    of a small integer; the ranks of ``group`` itself see the same gathered values and so
    raise alike without it.

    Over gloo, a message's bytes leave only once the receiver's notice that it has posted
    the receive has arrived, and that notice waits behind the bytes already queued on the
    link in its direction. :meth:`post_receives` posts the receives of messages to come, so
    their notices travel before any bytes: those messages then go as point-to-point sends,
    and every message posted must be sent (:meth:`settle` sends the rest)."""

    def __init__(
        self, group: dist.ProcessGroup | None, agree_on: dist.ProcessGroup | None = None
    ) -> None:
        self.group, self.agree_on = group, agree_on
        self.n = world_size(group)
        self._posted: dict[int, _Posted] = {}  # by the address of the tensor it fills

    def post_receives(self, outputs: Sequence[Tensor]) -> None:
        """Post now the receives of the messages that will fill ``outputs`` (``[n, M]`` each:
        row ``i`` from rank ``i``), each to come from one :meth:`all_to_all` or
        :meth:`all_gather`; every rank lists the same messages in the same order. Nothing is
        posted but over a gloo group of CPU tensors (elsewhere the collectives run as ever)."""
        if self.n == 1 or not 0 < len(outputs) <= _PLACES or outputs[0].device.type != "cpu":
            return
        if dist.get_backend(self.group) != dist.Backend.GLOO:
            return
        first = POSTED_TAG_BASE + _posted_serial(self.group) % _SERIALS * _PLACES
        for place, output in enumerate(outputs):
            tag = first + place
            receives = [
                dist.irecv(output[i], src=self._global(i), group=self.group, tag=tag)
                for i in self._peers()
            ]
            self._posted[output.data_ptr()] = _Posted(tag, receives, output)

    def settle(self) -> None:
        """Send every message posted and not sent yet, its contents to be dropped (this rank's
        own row of the tensor it would fill; every rank settles the same messages after a
        failure), and wait for all of them, so no posted receive is left for a later message
        to land in."""
        unsent, self._posted = self._posted, {}
        works = []
        for posted in unsent.values():
            own = posted.output[dist.get_rank(self.group)]
            works.append(self._send_posted(posted, posted.output, [own] * self.n, async_op=True))
        for work in works:
            work.wait()

    def all_gather(self, output: Tensor, local: Tensor, async_op: bool = False):
        """:func:`all_gather_into` over this transport's group."""
        posted = self._posted.pop(output.data_ptr(), None)
        if posted is not None:
            return self._send_posted(posted, output, [local.reshape(-1)] * self.n, async_op)
        return all_gather_into(output, local, self.group, self.n, async_op)

    def all_to_all(self, output: Tensor, local: Tensor, async_op: bool = False):
        """Row ``j`` of ``local`` (``[n, ...]``) to rank ``j``; row ``i`` of ``output`` from
        rank ``i``; with ``async_op`` the work to wait on (``None`` where nothing is sent)."""
        if self.n == 1:
            output.copy_(local.view_as(output))
            return None
        posted = self._posted.pop(output.data_ptr(), None)
        if posted is not None:
            return self._send_posted(posted, output, list(local.view(self.n, -1)), async_op)
        return dist.all_to_all_single(
            output.view(-1), local.reshape(-1), group=self.group, async_op=async_op
        )

    def _send_posted(self, posted: _Posted, output: Tensor, rows: list[Tensor], async_op):
        """Row ``j`` of ``rows`` to rank ``j`` (this rank's own into ``output``), for a message
        whose receives are posted."""
        rank = dist.get_rank(self.group)
        output[rank].copy_(rows[rank])
        sends = [
            dist.isend(rows[j], dst=self._global(j), group=self.group, tag=posted.tag)
            for j in self._peers()
        ]
        works = _Works(posted.receives + sends)
        if async_op:
            return works
        works.wait()
        return None

    def _peers(self) -> list[int]:
        rank = dist.get_rank(self.group)
        return [i for i in range(self.n) if i != rank]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def agree(self, problem: Exception | None, device: torch.device) -> None:
        """Raise ``problem``, or the worst problem any rank of ``agree_on`` found, on every
        rank of ``agree_on`` (only ``problem`` itself when there is no such group)."""
        if self.agree_on is not None and world_size(self.agree_on) > 1:
            code = 0 if problem is None else _PROBLEMS.index(type(problem)) + 1
            flag = torch.tensor([code], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.agree_on)
            agreed = int(flag)
            if agreed and (problem is None or _PROBLEMS.index(type(problem)) + 1 != agreed):
                problem = _PROBLEMS[agreed - 1](
                    "compressed_allreduce: another rank of the agreeing group found a "
                    f"{_PROBLEMS[agreed - 1].__name__}; the error-feedback state was left "
                    "unchanged"
                )
        if problem is not None:
            raise problem


def worker_scales_problem(gathered: Tensor, backend_name: str, names) -> Exception | None:
    """The error every rank raises if ranks run different backends or a worker scale is not
    finite (one host read of the gathered ``[scales..., backend code]`` rows; ``names``: the
    backends' names by code, from 1)."""
    rows = gathered.tolist()
    codes = [int(row[-1]) if row[-1] == row[-1] else 0 for row in rows]
    if len(set(codes)) > 1:
        by_rank = [names[code - 1] if 0 < code <= len(names) else "?" for code in codes]
        return KernelMismatchError(
            f"compressed_allreduce: ranks use different compression backends {by_rank} (by "
            f"rank; this rank: {backend_name!r}). Install the same packages on every rank, or "
            "set ONEBIT_KERNELS to the same backend everywhere."
        )
    return finite_problem([row[:-1] for row in rows], "worker scale")


def finite_problem(scales: list, what: str) -> NonFiniteError | None:
    """The :class:`NonFiniteError` every rank raises if a gathered scale is not finite
    (``scales[rank]``: that rank's scale, or a list of its scales)."""
    bad = [
        rank
        for rank, values in enumerate(scales)
        if not all(map(math.isfinite, values if isinstance(values, list) else [values]))
    ]
    if bad:
        return NonFiniteError(
            f"compressed_allreduce: non-finite {what} on rank(s) {bad} "
            f"(NaN or Inf in the buffer); the error-feedback state was left unchanged"
        )
    return None
