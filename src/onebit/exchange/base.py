"""The exchange seam: what an optimizer needs of a 1-bit exchange, whatever its topology."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from onebit.exchange.protocol import PackedResult
from onebit.exchange.transport import TrafficCounter
from onebit.kernels import Backend

__all__ = ["Exchange", "swap_storages"]


def swap_storages(a: Tensor, b: Tensor) -> None:
    """Exchange the memory of two contiguous tensors of one size in place: each object keeps
    its identity and takes the other's storage (no copy)."""
    if a.shape != b.shape or not (a.is_contiguous() and b.is_contiguous()):
        shapes = f"{tuple(a.shape)} and {tuple(b.shape)}"
        raise ValueError(f"cannot swap the storages of tensors {shapes}")
    storage_a, offset_a = a.untyped_storage(), a.storage_offset()
    a.set_(b.untyped_storage(), b.storage_offset(), b.shape, b.stride())
    b.set_(storage_a, offset_a, a.shape, a.stride())


class Exchange(ABC):
    """A 1-bit exchange with two-sided error feedback, owning its error state.

    Built once from what the user asked for (flat over a process group, hierarchical over
    nodes, per tensor, or many workers simulated in one process), then bound (:meth:`bind`)
    to the sizes of the tensors it carries, their dtype and device, the backend and the
    counter its bytes go to. :meth:`exchange` takes the caller's buffer
    (:meth:`buffer_size` elements) and returns the result in packed form; the error buffers
    (:meth:`error_sizes`) start at zero on the first call and are updated by every call.
    :meth:`state_dict` and :meth:`load_state_dict` carry them across checkpoints."""

    def __init__(self) -> None:
        self.worker_error: Tensor | None = None
        self.server_error: Tensor | None = None
        self.numels: tuple[int, ...] | None = None
        self._send_buffer: Tensor | None = None

    # ----------------------------------------------------------------- what it is
    @property
    @abstractmethod
    def topology(self) -> tuple[int, int]:
        """``(L, M)``: ranks per node and nodes (``L = 1`` for a flat exchange)."""

    @property
    def world_size(self) -> int:
        return self.topology[0] * self.topology[1]

    @abstractmethod
    def buffer_size(self, numels: Sequence[int]) -> int:
        """Elements of the buffer :meth:`exchange` takes for tensors of these sizes (one
        after another, then zero padding)."""

    @abstractmethod
    def error_sizes(self, numels: Sequence[int]) -> tuple[int, int]:
        """``(worker_error, server_error)`` elements for tensors of these sizes."""

    @abstractmethod
    def bytes_per_call(self) -> dict[str, int]:
        """Bytes one rank sends per :meth:`exchange`, by kind of traffic."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of scratch held now (the error buffers not included)."""

    def layout_key(self, numels: Sequence[int]) -> list[int] | None:
        """What, beyond the topology, fixes where each error value belongs (the bucketed
        exchange's bucket sizes); ``None`` for the one-buffer layout. Checkpoints save it."""
        return None

    # ----------------------------------------------------------------- use
    def bind(
        self,
        numels: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        backend: Backend,
        traffic: TrafficCounter,
    ) -> None:
        """Carry tensors of ``numels`` elements of ``dtype`` on ``device``, with ``backend``'s
        kernels, counting bytes in ``traffic``. Binding again with other sizes is an error."""
        numels = tuple(int(n) for n in numels)
        if self.numels is not None and self.numels != numels:
            raise ValueError(
                f"this exchange carries tensors of {sum(self.numels)} elements; it cannot be "
                f"bound again to {sum(numels)}"
            )
        self.numels, self.dtype, self.device = numels, dtype, device
        self.backend, self.traffic = backend, traffic

    def carry_errors(
        self,
        numels: Sequence[int],
        worker_error: Tensor,
        server_error: Tensor,
        backend: Backend,
        traffic: TrafficCounter | None = None,
    ) -> None:
        """:meth:`bind` to tensors of ``numels`` elements of the error buffers' dtype and
        device, and take the caller's error buffers (contiguous, of :meth:`error_sizes`) as
        the error state: every exchange updates them in place (the collectives over
        caller-held error state, :mod:`onebit.collectives`). Bytes are counted in ``traffic``
        (nowhere if ``None``)."""
        counter = TrafficCounter() if traffic is None else traffic
        self.bind(numels, worker_error.dtype, worker_error.device, backend, counter)
        sizes = self.error_sizes(self.numels)
        names = ("worker_error", "server_error")
        for name, tensor, size in zip(names, (worker_error, server_error), sizes, strict=True):
            if tensor.numel() != size:
                raise ValueError(
                    f"{name} has {tensor.numel()} elements; this exchange needs {size}"
                )
        self.worker_error, self.server_error = worker_error.view(-1), server_error.view(-1)

    def errors(self) -> tuple[Tensor, Tensor]:
        """The error buffers, created (zero) at the first call."""
        self._require_bound()
        worker, server = self.error_sizes(self.numels)
        if self.worker_error is None or self.worker_error.numel() != worker:
            zeros = dict(dtype=self.dtype, device=self.device)
            self.worker_error = torch.zeros(worker, **zeros)
            self.server_error = torch.zeros(server, **zeros)
        return self.worker_error, self.server_error

    def send_buffer(self) -> Tensor:
        """This exchange's own buffer of :meth:`buffer_size` elements (zero at first), for the
        caller to fill and pass to :meth:`exchange`. An exchange of it may leave its error
        updates in it and take its storage as the error state, giving this tensor the former
        error storage (ALGORITHM.md, "Error updates while the bytes travel"): it stays the
        same tensor, with contents that are scratch after every exchange, like any buffer's."""
        self._require_bound()
        size = self.buffer_size(self.numels)
        if self._send_buffer is None or self._send_buffer.numel() != size:
            self._send_buffer = torch.zeros(size, dtype=self.dtype, device=self.device)
        return self._send_buffer

    def _owns(self, buffer: Tensor) -> bool:
        """Whether ``buffer`` is :meth:`send_buffer` (or a flat view of all of it)."""
        own = self._send_buffer
        return (
            own is not None
            and buffer.data_ptr() == own.data_ptr()
            and buffer.numel() == own.numel()
        )

    def moved_errors(
        self, origin: Sequence[int | None], numels: Sequence[int]
    ) -> tuple[Tensor, Tensor]:
        """The error buffers for tensors of ``numels`` elements, where new tensor ``i`` is
        bound tensor ``origin[i]`` (``None``: a new one, whose errors are zero). Only where
        each tensor's errors are its own (:class:`~onebit.exchange.flat.PerTensorExchange`);
        elsewhere the errors of a buffer whose layout changes belong to no element."""
        raise ValueError(
            f"{type(self).__name__} keeps the error feedback of one buffer: it cannot follow "
            "its tensors into another layout"
        )

    def reset_errors(self) -> None:
        """Error feedback restarts from zero (nothing is carried into the next call)."""
        for error in (self.worker_error, self.server_error):
            if error is not None:
                error.zero_()

    def exchange(self, buffer: Tensor) -> PackedResult:
        """The exchanged average of ``buffer`` over the ranks (identical on every rank), in
        packed form; ``buffer`` is scratch afterwards. Raises
        :class:`~onebit.exchange.transport.NonFiniteError` on every rank, error state
        unchanged, when any rank's buffer is not finite."""
        return self._counted(self._exchange, self._checked(buffer))

    def _counted(self, step, *buffers: Tensor):
        """``step(*buffers, worker_error, server_error)``, one exchange with the error buffers
        (:meth:`errors`), its bytes counted once it has run."""
        result = step(*buffers, *self.errors())
        self.traffic.record_all(self.bytes_per_call())
        return result

    def _checked(self, buffer: Tensor) -> Tensor:
        """``buffer`` flat, once it is known to be of :meth:`buffer_size` elements."""
        self._require_bound()
        if buffer.numel() != self.buffer_size(self.numels):
            raise ValueError(
                f"the buffer has {buffer.numel()} elements; this exchange takes "
                f"{self.buffer_size(self.numels)}"
            )
        return buffer.view(-1)

    @abstractmethod
    def _exchange(self, buffer: Tensor, worker_error: Tensor, server_error: Tensor) -> PackedResult:
        """One exchange of the flat ``buffer`` with these error buffers."""

    def _require_bound(self) -> None:
        if self.numels is None:
            raise RuntimeError(f"{type(self).__name__} is used before bind()")

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self, numels: Sequence[int] | None = None) -> dict[str, Any]:
        """The error buffers and the topology (and layout, for tensors of ``numels``
        elements, default the bound ones) they belong to."""
        state = {
            "world_size": self.world_size,
            "ranks_per_node": self.topology[0],
            "worker_error": self.worker_error,
            "server_error": self.server_error,
        }
        numels = self.numels if numels is None else numels
        if numels is not None and self.layout_key(numels) is not None:
            state["buckets"] = self.layout_key(numels)
        return state

    def restart_reason(self, state: dict[str, Any], numels: Sequence[int]) -> str | None:
        """Why the error buffers of ``state`` (from :meth:`state_dict`) cannot be used here
        (another topology or layout), or ``None``."""
        saved = (state.get("ranks_per_node", 1), state["world_size"])
        if saved != (self.topology[0], self.world_size):
            return (
                f"saved with world size {saved[1]} in nodes of {saved[0]} ranks, now "
                f"{self.world_size} in nodes of {self.topology[0]}"
            )
        if state.get("buckets") != self.layout_key(numels):
            return (
                f"saved with buckets of {state.get('buckets') or 'one buffer'}, now "
                f"{self.layout_key(numels) or 'one buffer'}"
            )
        return None

    def check_state(self, state: dict[str, Any], numels: Sequence[int]) -> bool:
        """Whether ``state`` (from :meth:`state_dict`) holds error buffers of this topology
        and layout, to be loaded; ``False`` for none or another one (they restart from zero).
        Raises ``ValueError`` naming the buffer for sizes these tensors cannot have."""
        worker_error, server_error = state["worker_error"], state["server_error"]
        if worker_error is None or self.restart_reason(state, numels) is not None:
            return False
        expected = dict(
            zip(("worker_error", "server_error"), self.error_sizes(numels), strict=True)
        )
        for name, tensor in (("worker_error", worker_error), ("server_error", server_error)):
            if tensor is None or tensor.numel() != expected[name]:
                size = None if tensor is None else tensor.numel()
                raise ValueError(
                    f"checkpoint's {name} has {size} elements; this optimizer's parameters "
                    f"({sum(numels)} elements, world size {self.world_size}, nodes of "
                    f"{self.topology[0]}) need {expected[name]}"
                )
        return True

    def load_state_dict(self, state: dict[str, Any] | None, device: torch.device) -> None:
        """Take the error buffers of ``state`` (checked by :meth:`check_state`), copied to
        ``device``; ``None`` restarts them from zero."""
        if state is None:
            self.worker_error = self.server_error = None
            return
        self.worker_error = state["worker_error"].to(device, copy=True)
        self.server_error = state["server_error"].to(device, copy=True)
