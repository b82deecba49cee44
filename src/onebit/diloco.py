"""DiLoCo with a dense or a 1-bit outer exchange (ALGORITHM.md, "DiLoCo with a 1-bit outer
exchange").

Each worker takes ``sync_every`` steps of its own inner optimizer; then the workers average
their pseudo-gradients ``Δ_i = θ_r - θ_{r,i}`` (densely, or through onebit's 1-bit exchange
with error feedback that persists from round to round) and an outer optimizer (by default
DiLoCo's Nesterov SGD, with momentum 0.5 instead of 0.9 after the 1-bit exchange) applies the
average to the round's start weights. Optionally the model is exchanged in ``fragments`` that
take turns, each exchange running behind ``delay`` later inner steps (Streaming DiLoCo)::

    model = ...
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = onebit.DiLoCo(model.parameters(), inner, sync_every=100)
    for batch in data:
        loss(model, batch).backward()
        inner.step()          # every 100th step ends a round: the outer exchange and step
        inner.zero_grad()
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from onebit import kernels as backends
from onebit.collectives import allreduce_bytes, allreduce_mean_, padded_size
from onebit.exchange import (
    Exchange,
    FlatExchange,
    Layout,
    PerTensorExchange,
    TrafficCounter,
    world_size,
)
from onebit.optim import holding_weights

__all__ = [
    "DILOCO_OUTER",
    "DiLoCo",
    "EXCHANGES",
    "Fragment",
    "ONEBIT_OUTER",
    "OUTER_DEFAULTS",
    "RESIDUAL_DEFAULTS",
    "WORKER_RESIDUALS",
    "outer_sgd",
]

#: The outer exchanges: a mean allreduce, or the 1-bit exchange with error feedback.
EXCHANGES = ("dense", "1bit")
#: DiLoCo's outer optimizer: SGD with Nesterov momentum (Douillard et al.), the dense
#: exchange's default.
DILOCO_OUTER: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
#: The 1-bit exchange's default outer optimizer: SGD with Nesterov momentum 0.5, not 0.9,
#: since outer momentum multiplies the compression's error by up to 1/(1 - momentum)
#: (ALGORITHM.md, "DiLoCo with a 1-bit outer exchange").
ONEBIT_OUTER: dict[str, Any] = {"lr": 0.7, "momentum": 0.5, "nesterov": True}
#: Each outer exchange's default outer optimizer.
OUTER_DEFAULTS: dict[str, dict[str, Any]] = {"dense": DILOCO_OUTER, "1bit": ONEBIT_OUTER}
_COMPRESSIONS = ("per_tensor", "fused")
#: Where a worker's residual of the 1-bit exchange goes: into its next round's message (error
#: feedback) alone, or also into its own weights at once, as far as the outer step would have
#: moved them (ALGORITHM.md, "Where a worker's residual goes").
WORKER_RESIDUALS = ("carried", "local")
#: Each outer exchange's default ``worker_residual``: ``"carried"`` for the dense exchange,
#: which leaves no residual; ``"local"`` for the 1-bit one, which ended lower with it in every
#: run that compared them (ALGORITHM.md, "Where a worker's residual goes").
RESIDUAL_DEFAULTS: dict[str, str] = {"dense": "carried", "1bit": "local"}


def outer_sgd(
    params: Iterable[Tensor],
    lr: float = DILOCO_OUTER["lr"],
    momentum: float = DILOCO_OUTER["momentum"],
) -> torch.optim.SGD:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD at ``momentum=0``)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


class Fragment:
    """One fragment of the parameters DiLoCo exchanges together: its parameters (their
    indices into :attr:`DiLoCo.params`), its round's start weights, its outer exchange (the
    1-bit one with its own error buffers; ``None``: dense), its pseudo-gradient buffer and
    the bytes of its exchange not yet applied (:attr:`traffic`), and with
    ``worker_residual="local"`` the κ of each parameter by which this worker has moved by its
    residual since the fragment's last exchange (:attr:`residual_moves`; 0: not moved).
    The 1-bit exchange compresses each of :attr:`runs` alone: ``(parameter, offset,
    elements)``, a run per tensor, or with ``block_size = b`` each tensor's blocks of ``b·W``
    elements (ALGORITHM.md, "Blocks of one scale"). With ``reference_share = c > 0`` it
    holds :attr:`reference`, its last round's average ``Δ̂_{r-1}``, of which every worker
    sends its pseudo-gradient less ``c`` times (ALGORITHM.md, "The last round's average as a
    reference")."""

    def __init__(
        self,
        indices: list[int],
        params: list[Tensor],
        starts: list[Tensor],
        exchange: Exchange | None,
        backend: backends.Backend,
        per_tensor: bool = True,
        block_size: int | None = None,
        reference_share: float = 0.0,
    ) -> None:
        self.indices, self.params, self.starts = indices, params, starts
        self.per_tensor, self.block_size = per_tensor, block_size
        self.numels = [p.numel() for p in params]
        self.reference_share = reference_share
        self.reference = (
            torch.zeros(sum(self.numels), dtype=torch.float32, device=params[0].device)
            if reference_share
            else None
        )
        self.exchange = exchange
        self.traffic = TrafficCounter()
        self.runs = self._runs(1 if exchange is None else exchange.world_size)
        size = sum(self.numels)
        if exchange is not None:
            exchange.bind(self.segments, torch.float32, params[0].device, backend, self.traffic)
            size = exchange.buffer_size(self.segments)
        self.buffer = torch.zeros(size, dtype=torch.float32, device=params[0].device)
        self.residual_moves = [0.0] * len(params)

    def _runs(self, workers: int) -> list[tuple[int, int, int]]:
        """``(parameter, offset, elements)`` of each run compressed alone over ``workers``
        ranks: a tensor, or each block of ``block_size·workers`` elements of one."""
        runs = []
        for index, numel in enumerate(self.numels):
            block = numel if self.block_size is None else self.block_size * workers
            runs += [(index, start, min(block, numel - start)) for start in range(0, numel, block)]
        return runs

    @property
    def segments(self) -> list[int]:
        """Elements of each run, in order: the sizes the 1-bit exchange is bound to."""
        return [elements for _, _, elements in self.runs]

    @torch.no_grad()
    def pseudo_gradient(self, out: Tensor) -> None:
        """``out`` (:attr:`buffer`'s size, fp32) = this worker's pseudo-gradient ``θ_f - θ``,
        tensor after tensor, the padding zero."""
        total = sum(self.numels)
        for delta, start, param in zip(
            out[:total].split(self.numels), self.starts, self.params, strict=True
        ):
            delta.copy_((start - param.detach()).reshape(-1))
        out[total:].zero_()

    def subtract_reference(self, pseudo: Tensor) -> None:
        """``Δ_i - c·Δ̂_{r-1}`` in place: ``pseudo``, a pseudo-gradient in :attr:`buffer`'s
        layout, less the reference share of the last round's average (its first elements,
        the padding untouched); nothing without a reference."""
        if self.reference is not None:
            pseudo[: self.reference.numel()].sub_(self.reference, alpha=self.reference_share)

    def add_reference(self, average: Tensor) -> None:
        """``Δ̂_r = average + c·Δ̂_{r-1}`` in place: the exchange's result given back the
        share taken out, which becomes the next round's reference; nothing without one."""
        if self.reference is not None:
            head = average[: self.reference.numel()]
            head.add_(self.reference, alpha=self.reference_share)
            self.reference.copy_(head)

    def use_exchange(self, exchange: Exchange) -> None:
        """Exchange through ``exchange`` (bound here to this fragment's runs over its ranks)
        instead."""
        assert self.exchange is not None
        self.runs = self._runs(exchange.world_size)
        exchange.bind(
            self.segments, torch.float32, self.buffer.device, self.exchange.backend, self.traffic
        )
        self.exchange = exchange
        self.buffer = self.buffer.new_zeros(exchange.buffer_size(self.segments))

    def errors(self) -> tuple[Tensor | None, Tensor | None]:
        """This rank's worker and server errors (``None`` before the first 1-bit exchange,
        and for the dense exchange)."""
        if self.exchange is None:
            return None, None
        return self.exchange.worker_error, self.exchange.server_error

    def _layout(self) -> Layout:
        """The 1-bit exchange's segments: each run padded alone, or the runs in one padded
        buffer."""
        assert self.exchange is not None
        n, sizes = self.exchange.world_size, self.segments
        if self.per_tensor:
            return Layout.per_tensor(sizes, n)
        return Layout.flat(padded_size(sum(sizes), n), n)

    def _run_values(self, flat: Tensor) -> list[Tensor]:
        """Each run's elements (:attr:`runs`) of ``flat``, a tensor in the worker error's
        layout, as views: the padding left out."""
        sizes, layout = self.segments, self._layout()
        if self.per_tensor:  # each run padded alone
            padded = flat.split(list(layout.sizes))
            return [segment[:size] for segment, size in zip(padded, sizes, strict=True)]
        return list(flat[: sum(sizes)].split(sizes))

    def residuals(self, row: int = 0) -> list[Tensor]:
        """A worker's residual of each run (:attr:`runs`) in the last 1-bit exchange (its
        worker error, the padding left out), flat views; zeros before the first. ``row``: the
        worker, in an exchange that holds a row of errors per worker (a simulated one); a
        distributed exchange holds this rank's only, row 0."""
        assert self.exchange is not None
        worker, _ = self.exchange.errors()
        return self._run_values(worker.view(-1, self._layout().width)[row])

    def error_share(self, row: int, server: int) -> Tensor:
        """``u = ρ + W·s`` of each run's elements, one after another (the pseudo-gradient's
        layout, the padding left out), a new tensor: worker ``row``'s error plus ``W`` times
        the error of ``server``, the rank that serves chunk ``server`` of every segment,
        placed at that chunk. The mean of every rank's share is ``ē``, what the exchange has
        not delivered (ALGORITHM.md, "The errors delivered at the end"). ``row`` and
        ``server``: as in :meth:`residuals`; a distributed rank holds row 0 of each, and
        serves its own rank's chunks."""
        assert self.exchange is not None
        worker, server_error = self.exchange.errors()
        layout, n = self._layout(), self.exchange.world_size
        share = worker.view(-1, layout.width)[row].clone()
        chunks = server_error.view(-1, sum(layout.chunks))[row].split(layout.chunks)
        for segment, chunk in zip(share.split(list(layout.sizes)), chunks, strict=True):
            width = chunk.numel()
            segment[server * width : (server + 1) * width].add_(chunk, alpha=n)
        return torch.cat(self._run_values(share))

    def deliver(
        self, workers: Sequence[Sequence[Tensor]], mean_error: Tensor, moves: list[float]
    ) -> None:
        """``θ ← θ - κ ē``: each row of ``workers`` (a worker's weights of this fragment) and
        the start weights moved by ``mean_error`` (``ē``, laid out as :meth:`error_share`'s)
        times the κ of each parameter, ``moves``; the errors are then zero, delivered."""
        for (param, start, elements), error in zip(
            self.runs, mean_error.split(self.segments), strict=True
        ):
            for weights in (*workers, self.starts):
                weight = weights[param].view(-1)[start : start + elements]
                weight.add_(error.to(weight.dtype), alpha=-moves[param])
        assert self.exchange is not None
        for error in self.exchange.errors():
            error.zero_()

    def take_residual_moves(self, rows: int = 1) -> None:
        """The error of each of ``rows`` workers' residuals times ``1 - κ``, κ that of the
        move by it (:attr:`residual_moves`): that much of it is in the worker's weights
        already. The moves are spent."""
        for row in range(rows):
            for (param, _, _), residual in zip(self.runs, self.residuals(row), strict=True):
                residual.mul_(1.0 - self.residual_moves[param])
        self.residual_moves = [0.0] * len(self.params)

    def move_by_residuals(self, workers: Sequence[Sequence[Tensor]], moves: list[float]) -> None:
        """``θ ← θ - κ ρ``: each row of ``workers`` (a worker's weights of this fragment)
        moved by that worker's residual times the κ of its parameter, ``moves``, which are
        kept for the next exchange (:meth:`take_residual_moves`)."""
        for row, weights in enumerate(workers):
            for (param, start, elements), residual in zip(
                self.runs, self.residuals(row), strict=True
            ):
                weight = weights[param].view(-1)[start : start + elements]
                weight.add_(residual.to(weight.dtype), alpha=-moves[param])
        self.residual_moves = moves

    def undo_residual_moves(self, workers: Sequence[Sequence[Tensor]]) -> None:
        """Each row of ``workers`` set back to the start weights, as before the move by the
        residuals (which stay in the error buffer, undelivered)."""
        for weights in workers:
            for weight, start in zip(weights, self.starts, strict=True):
                weight.copy_(start)
        self.residual_moves = [0.0] * len(self.params)


class DiLoCo:
    """DiLoCo over ``process_group`` (``None``: the world) for ``params``, which
    ``inner_optimizer`` trains: every ``sync_every`` inner steps, a round's outer exchange
    (``exchange``: ``"dense"`` or ``"1bit"``, the latter each tensor alone or fused by
    ``compression``, on the backend ``kernels`` selects) and the step of
    ``outer_optimizer`` (built over the same parameters; default: the exchange's
    :data:`OUTER_DEFAULTS`, DiLoCo's Nesterov SGD for the dense exchange, with momentum 0.5
    for the 1-bit one). A step post-hook on the inner optimizer ends the rounds
    (:meth:`close` removes it); :meth:`sync` ends one at once, and with
    ``deliver_errors=True`` delivers the 1-bit exchange's errors at the end of training (one
    dense exchange; ALGORITHM.md, "The errors delivered at the end"). ``worker_residual`` (1-bit
    exchange): ``"carried"``, each worker's residual of the compression joins its next
    round's message (error feedback); ``"local"``, besides, each worker's next inner steps
    start where the outer step would have put it had its message carried the residual (the
    outer optimizer then must be ``torch.optim.SGD`` without dampening; ALGORITHM.md, "Where
    a worker's residual goes"); ``None`` (the default): the exchange's
    :data:`RESIDUAL_DEFAULTS`, ``"local"`` for the 1-bit one. ``block_size`` (1-bit
    exchange, per tensor): ``b``, each tensor compressed in blocks of ``b·W`` elements over
    ``W`` ranks, every block with its own scales, ``b`` elements to each server scale
    (ALGORITHM.md, "Blocks of one scale"); ``None``: one scale per tensor.
    ``reference_share`` (1-bit exchange): ``c`` in [0, 1], each worker sends its
    pseudo-gradient less ``c`` times the last round's average, which every rank adds back to
    the result (ALGORITHM.md, "The last round's average as a reference"); 0: sent whole.

    Streaming (ALGORITHM.md, "Streaming fragments and the delayed outer exchange"):
    ``fragments`` (an int K, the parameters cut in order into K runs of about equal size, or
    K lists of the parameters) take turns, one every ``sync_every / K`` inner steps, each
    fragment's exchange starting ``delay`` inner steps before its outer step and running
    behind them; at the outer step each worker keeps ``local_share`` of what those steps did
    to the fragment's weights.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        inner_optimizer: Optimizer,
        *,
        sync_every: int,
        exchange: str = "1bit",
        compression: str = "per_tensor",
        outer_optimizer: Optimizer | None = None,
        process_group: dist.ProcessGroup | None = None,
        kernels: str | None = None,
        fragments: int | Sequence[Iterable[Tensor]] = 1,
        delay: int = 0,
        local_share: float = 0.0,
        worker_residual: str | None = None,
        block_size: int | None = None,
        reference_share: float = 0.0,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo needs parameters that require gradients")
        if not _is_int(sync_every) or sync_every < 1:
            raise ValueError(
                f"sync_every must be an int >= 1 (inner steps per round), got {sync_every!r}"
            )
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be one of {_COMPRESSIONS}, got {compression!r}")
        if worker_residual is None:
            worker_residual = RESIDUAL_DEFAULTS[exchange]
        if worker_residual not in WORKER_RESIDUALS:
            raise ValueError(
                f"worker_residual must be one of {WORKER_RESIDUALS}, got {worker_residual!r}"
            )
        if block_size is not None:
            if not _is_int(block_size) or block_size < 8 or block_size % 8:
                raise ValueError(
                    "block_size must be a multiple of 8 (elements to each server scale), "
                    f"got {block_size!r}"
                )
            if exchange != "1bit" or compression != "per_tensor":
                raise ValueError(
                    "block_size cuts the tensors of the per-tensor 1-bit exchange into blocks: "
                    f"it needs exchange='1bit' and compression='per_tensor', not {exchange!r} "
                    f"and {compression!r}"
                )
        if worker_residual == "local" and exchange != "1bit":
            raise ValueError(
                "worker_residual='local' places the 1-bit exchange's residual: it needs "
                f"exchange='1bit', not {exchange!r}"
            )
        if (
            isinstance(reference_share, bool)
            or not isinstance(reference_share, (int, float))
            or not 0.0 <= reference_share <= 1.0
        ):
            raise ValueError(f"reference_share must be a float in [0, 1], got {reference_share!r}")
        if reference_share and exchange != "1bit":
            raise ValueError(
                "reference_share takes the last round's average out of the 1-bit exchange's "
                f"messages: it needs exchange='1bit', not {exchange!r}"
            )
        if not isinstance(inner_optimizer, Optimizer):
            raise TypeError(
                "inner_optimizer must be a torch.optim.Optimizer, got "
                f"{type(inner_optimizer).__name__}"
            )
        _check_covers("inner_optimizer", inner_optimizer, self.params)
        groups = _fragment_indices(fragments, self.params)
        if sync_every % len(groups):
            raise ValueError(
                f"sync_every={sync_every} must be a multiple of the {len(groups)} fragments "
                "(each fragment's turn is sync_every / fragments inner steps)"
            )
        turn_steps = sync_every // len(groups)
        if not _is_int(delay) or not 0 <= delay < turn_steps:
            raise ValueError(
                f"delay must be an int in [0, {turn_steps}) (inner steps, less than a "
                f"fragment's turn of sync_every / fragments = {turn_steps}), got {delay!r}"
            )
        if delay and exchange == "1bit" and compression != "per_tensor":
            raise ValueError(
                "a delayed 1-bit exchange is the per-tensor one: compression='per_tensor'"
            )
        if isinstance(local_share, bool) or not 0.0 <= float(local_share) <= 1.0:
            raise ValueError(f"local_share must be a float in [0, 1], got {local_share!r}")
        if outer_optimizer is None:
            default = OUTER_DEFAULTS[exchange]
            outer_optimizer = outer_sgd(self.params, default["lr"], default["momentum"])
        _check_covers("outer_optimizer", outer_optimizer, self.params)
        if worker_residual == "local":
            _check_residual_moves(outer_optimizer)
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(
                f"all parameters must be on one device, got {sorted(map(str, devices))}"
            )
        self.sync_every, self.turn_steps = sync_every, turn_steps
        self.delay, self.local_share = delay, float(local_share)
        self.exchange_kind, self.worker_residual = exchange, worker_residual
        self.block_size, self.reference_share = block_size, float(reference_share)
        self.inner_optimizer, self.outer_optimizer = inner_optimizer, outer_optimizer
        self.process_group = process_group
        self.traffic = TrafficCounter()
        self.local_step = 0  # inner steps of the current turn
        self.rounds = 0  # turns ended (with one fragment: rounds)
        self._round_start = [p.detach().clone() for p in self.params]
        # the delayed exchange runs in a thread, over a group of its own
        self._exchange_group = process_group
        if delay and world_size(process_group) > 1:
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            self._exchange_group = dist.new_group(ranks, use_local_synchronization=True)
        backend = _backend_for(next(iter(devices)), kernels)
        one_bit = PerTensorExchange if compression == "per_tensor" else FlatExchange
        self.fragments = [
            Fragment(
                indices,
                [self.params[i] for i in indices],
                [self._round_start[i] for i in indices],
                one_bit(self._exchange_group) if exchange == "1bit" else None,
                backend,
                per_tensor=compression == "per_tensor",
                block_size=block_size,
                reference_share=self.reference_share,
            )
            for indices in groups
        ]
        self._executor: ThreadPoolExecutor | None = None
        if delay:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onebit-diloco")
            weakref.finalize(self, self._executor.shutdown, wait=False)
        self._in_flight: Future | None = None  # the turn's exchange, once started
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    # ----------------------------------------------------------------- turns
    @property
    def fragment(self) -> int:
        """The fragment whose turn it is."""
        return self.rounds % len(self.fragments)

    def _after_inner_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        starts, ends = self.advance()
        if starts:
            self._start_exchange()
        if ends:
            self._end_turn(self.local_share)

    def advance(self) -> tuple[bool, bool]:
        """Count one inner step of the turn (the inner optimizer's hook does, and a caller
        that takes the steps itself, as the simulation): whether the turn's exchange starts
        after it, and whether the turn ends with it (then :meth:`turn_ended` follows its
        outer step)."""
        self.local_step += 1
        return self.local_step == self.turn_steps - self.delay, self.local_step >= self.turn_steps

    def turn_ended(self) -> None:
        """The turn's outer step is applied: the next turn begins."""
        self.local_step = 0
        self.rounds += 1

    def _start_exchange(self) -> None:
        """This worker's pseudo-gradient of the turn's fragment into its buffer, and the
        exchange that averages it there: in the thread with a delay, at once without."""
        fragment = self.fragments[self.fragment]
        fragment.pseudo_gradient(fragment.buffer)
        if self._executor is None:
            self._average(self.fragment)  # raises with nothing pending
            self._in_flight = _completed()
        else:
            # grad mode is per thread: the thread's exchange runs without autograd too
            self._in_flight = self._executor.submit(torch.no_grad()(self._average), self.fragment)

    def _average(self, index: int) -> None:
        """In place, the ranks' mean of fragment ``index``'s buffer: densely (a non-finite
        mean raises), or the 1-bit exchange's (its ``NonFiniteError``)."""
        fragment = self.fragments[index]
        if fragment.exchange is None:
            allreduce_mean_(fragment.buffer, self._exchange_group, traffic=fragment.traffic)
            self.check_finite(fragment.buffer)
            return
        self.take_residual_moves(index)
        fragment.subtract_reference(fragment.buffer)
        fragment.exchange.exchange(fragment.buffer).decode(fragment.buffer)
        fragment.add_reference(fragment.buffer)

    @property
    def exchange_started(self) -> bool:
        """Whether the current turn's exchange has started (and not yet been applied)."""
        return self._in_flight is not None

    def hold(self, average: Tensor) -> None:
        """Take ``average`` (:meth:`buffer_size` elements), the turn's averaged
        pseudo-gradient computed by the caller (the simulation), as its exchange's result."""
        self.fragments[self.fragment].buffer.copy_(average)
        self._in_flight = _completed()

    def count_dense_average(self, fragment: int, average: Tensor, workers: int) -> None:
        """Count the bytes of ``fragment``'s dense exchange whose mean over ``workers``
        ranks, ``average``, the caller computed (the simulation), as :meth:`outer_step` will
        apply it."""
        if workers > 1:
            self.fragments[fragment].traffic.record("allreduce", allreduce_bytes(average, workers))

    def wait_exchange(self) -> Tensor:
        """The turn's averaged pseudo-gradient once its exchange has completed (its
        fragment's buffer); raises what the exchange raised. Nothing is pending afterwards."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            raise RuntimeError("no outer exchange has started in this turn")
        in_flight.result()
        return self.fragments[self.fragment].buffer

    @torch.no_grad()
    def _end_turn(self, local_share: float, residual: bool = True) -> None:
        """The turn's exchange completed and its fragment's outer step; each worker keeps
        ``local_share`` of its own move since the exchange started, and, with
        ``worker_residual="local"`` and ``residual``, moves by its residual."""
        index = self.fragment
        fragment = self.fragments[index]
        if self._in_flight is None:
            self._start_exchange()
        average = self.wait_exchange()
        own = None
        if local_share and self.delay:
            own = [p.detach().clone() for p in fragment.params]
        self.outer_step(average, index)
        if own is not None:
            for param, mine in zip(fragment.params, own, strict=True):
                param.lerp_(mine, local_share)
        if residual:
            self.move_by_residuals(index)
        self.turn_ended()

    def move_by_residuals(
        self, fragment: int, workers: Sequence[Sequence[Tensor]] | None = None
    ) -> None:
        """With ``worker_residual="local"``, after ``fragment``'s outer step: ``θ ← θ - κ ρ``,
        each worker moved by its residual of the fragment's last exchange as the outer step
        moves the weights on a pseudo-gradient (:meth:`_residual_moves`); nothing otherwise.
        ``workers``: each worker's weights of the fragment, a row per worker of its exchange
        (the simulation's); default: this rank's parameters."""
        if self.worker_residual == "local":
            part = self.fragments[fragment]
            part.move_by_residuals(workers or [part.params], self._residual_moves(part))

    def take_residual_moves(self, fragment: int, rows: int = 1) -> None:
        """With ``worker_residual="local"``, as ``fragment``'s exchange starts: the error of
        each of ``rows`` workers' residuals times ``1 - κ`` of the move by it (the rest is in
        the worker's weights already); nothing otherwise."""
        if self.worker_residual == "local":
            self.fragments[fragment].take_residual_moves(rows)

    def undo_residual_moves(
        self, fragment: int, workers: Sequence[Sequence[Tensor]] | None = None
    ) -> None:
        """``fragment``'s workers (rows of weights as for :meth:`move_by_residuals`; default:
        this rank's parameters) set back to its start weights, the move by the residuals
        undone; the residuals stay in the error buffers, undelivered."""
        part = self.fragments[fragment]
        part.undo_residual_moves(workers or [part.params])

    def residual_move_to_undo(self) -> int | None:
        """With ``worker_residual="local"``, the fragment whose outer step has just moved the
        workers by their residuals, no inner step since (:meth:`sync` undoes that move);
        otherwise ``None``."""
        if self.worker_residual == "local" and self.local_step == 0 and self.rounds:
            return (self.fragment - 1) % len(self.fragments)
        return None

    def _residual_moves(self, fragment: Fragment) -> list[float]:
        """κ of each of ``fragment``'s parameters: the outer SGD's move of the weights per
        unit of the round's pseudo-gradient, ``lr·(1 + momentum)`` with Nesterov's momentum,
        ``lr`` without (its group's values now, at the outer step)."""
        moves: dict[int, float] = {}
        for group in self.outer_optimizer.param_groups:
            move = float(group["lr"]) * ((1.0 + group["momentum"]) if group["nesterov"] else 1.0)
            moves.update((id(param), move) for param in group["params"])
        return [moves[id(param)] for param in fragment.params]

    @torch.no_grad()
    def sync(self, deliver_errors: bool = False) -> None:
        """End the current turn now, and with it every fragment's round: the turn's exchange
        completes (or runs now) and its outer step runs, then every other fragment's exchange
        and outer step; every rank then holds the start weights. With
        ``worker_residual="local"``, the fragment whose outer step has just run (no inner step
        since) is not exchanged again: its weights are set back to its start weights, the
        move by the residual undone (the residual stays in the error buffer, undelivered).
        With ``deliver_errors`` (the 1-bit exchange, an outer SGD without dampening), each
        fragment's undelivered errors ``ē`` are then averaged densely and the weights moved
        by ``-κ ē`` (ALGORITHM.md, "The errors delivered at the end")."""
        if deliver_errors:
            self.check_deliverable()
        index, just_ended = self.fragment, self.residual_move_to_undo()
        if just_ended is not None:
            self.undo_residual_moves(just_ended)
        if just_ended != index:
            self._end_turn(local_share=0.0, residual=False)
        for other, fragment in enumerate(self.fragments):
            if other not in (index, just_ended):
                fragment.pseudo_gradient(fragment.buffer)
                self._average(other)
                self.outer_step(fragment.buffer, other)
        if deliver_errors:
            means = []
            for fragment in self.fragments:
                share = fragment.error_share(0, _group_rank(self._exchange_group))
                allreduce_mean_(share, self._exchange_group, traffic=fragment.traffic)
                means.append(share)
            self.deliver_errors(means)

    def check_deliverable(self) -> None:
        """``ValueError`` (``TypeError``: another outer optimizer) unless the errors can be
        delivered: the 1-bit exchange, an outer SGD without dampening."""
        if self.exchange_kind != "1bit":
            raise ValueError(
                "deliver_errors delivers what the 1-bit exchange has not: it needs "
                f"exchange='1bit', not {self.exchange_kind!r}"
            )
        _check_residual_moves(self.outer_optimizer, "deliver_errors")

    def deliver_errors(
        self,
        means: Sequence[Tensor],
        workers: Sequence[Sequence[Sequence[Tensor]]] | None = None,
    ) -> None:
        """Each fragment's weights (for fragment f, the rows ``workers[f]`` as for
        :meth:`move_by_residuals`; default: this rank's parameters) and start weights moved
        by ``-κ ē``, ``means[f]`` its ranks' mean undelivered error (any not finite:
        ``FloatingPointError``, nothing changed); the errors are then zero, and the bytes of
        the exchange that averaged them counted."""
        if not all(bool(torch.isfinite(mean).all()) for mean in means):
            raise FloatingPointError(
                "DiLoCo: the undelivered errors of the 1-bit exchange are not finite; the "
                "weights are left as they are"
            )
        for index, (part, mean) in enumerate(zip(self.fragments, means, strict=True)):
            rows = [part.params] if workers is None else workers[index]
            part.deliver(rows, mean, self._residual_moves(part))
            self.traffic.take(part.traffic)

    def pseudo_gradient(self, out: Tensor, fragment: int = 0) -> None:
        """``out`` (:meth:`buffer_size` fp32 elements) = this worker's pseudo-gradient
        ``θ_f - θ`` of ``fragment``, tensor after tensor, the padding zero."""
        self.fragments[fragment].pseudo_gradient(out)

    def check_finite(self, average: Tensor) -> None:
        """``FloatingPointError`` naming the turn if the averaged pseudo-gradient is not
        finite (the 1-bit exchange raises its own ``NonFiniteError``)."""
        if not bool(torch.isfinite(average).all()):
            raise FloatingPointError(
                f"DiLoCo: the averaged pseudo-gradient of round {self.rounds + 1} is not "
                "finite (a worker's inner steps diverged); the weights are left as they are"
            )

    @torch.no_grad()
    def outer_step(self, average: Tensor, fragment: int = 0) -> None:
        """``fragment``'s outer step from ``average``, the workers' averaged pseudo-gradient
        (laid out as :meth:`pseudo_gradient`'s): its weights set back to its round's start,
        their gradients to their parts of ``average`` (the other parameters' to ``None``), the
        outer optimizer's step; the fragment's next round starts from its result, and the
        inner loop's gradients are put back. The bytes of the exchange that gave ``average``
        are counted now (:attr:`bytes_sent`), where every rank applies it."""
        part = self.fragments[fragment]
        self.traffic.take(part.traffic)
        grads = [param.grad for param in self.params]
        for param in self.params:
            param.grad = None
        pseudo = average[: sum(part.numels)].split(part.numels)
        for delta, start, param in zip(pseudo, part.starts, part.params, strict=True):
            param.copy_(start)
            param.grad = delta.view_as(param).to(param.dtype, copy=True)
        self.outer_optimizer.step()
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad
        for param, start in zip(part.params, part.starts, strict=True):
            start.copy_(param)

    def buffer_size(self, fragment: int = 0) -> int:
        """Elements of ``fragment``'s pseudo-gradient buffer, which its exchange takes."""
        return self.fragments[fragment].buffer.numel()

    def use_exchange(self, exchange: Exchange, fragment: int = 0) -> None:
        """Average the pseudo-gradients of a 1-bit DiLoCo's ``fragment`` through
        ``exchange`` (a simulated one, :mod:`onebit.simulate`) instead of over the process
        group; before the first round only."""
        part = self.fragments[fragment]
        if part.exchange is None:
            raise ValueError("use_exchange replaces the 1-bit exchange; this DiLoCo is dense")
        if self.rounds or self.local_step or part.exchange.worker_error is not None:
            raise ValueError("use_exchange must come before the first round")
        part.use_exchange(exchange)

    # ----------------------------------------------------------------- what users see
    @contextlib.contextmanager
    def round_start_weights(self) -> Iterator[None]:
        """Inside the block the parameters hold the current round's start weights (the outer
        steps' results, the same on every rank: what to evaluate or export in the middle of a
        round); this rank's own weights are put back after it."""
        with holding_weights(self.params, self._round_start):
            yield

    @property
    def weights_shared(self) -> bool:
        """Whether the parameters hold the start weights, the same on every rank: at the
        start of a turn, with one fragment, where no local share was kept."""
        kept = self.rounds and (
            (self.delay and self.local_share) or self.worker_residual == "local"
        )
        return self.local_step == 0 and len(self.fragments) == 1 and not kept

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent in the outer exchanges so far."""
        return self.traffic.total()

    @property
    def world_size(self) -> int:
        return world_size(self.process_group)

    def close(self) -> None:
        """Remove the hook on the inner optimizer: its steps no longer end rounds. An
        exchange in flight is waited for and its result dropped (:meth:`sync` applies it)."""
        self._hook.remove()
        self._drop_in_flight()

    def _drop_in_flight(self) -> None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            with contextlib.suppress(Exception):
                in_flight.result()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The inner step within the turn, the turns ended, the round's start weights, the
        outer optimizer's state, this rank's error buffers of every fragment, the average of
        an exchange in flight (waited for: every rank saves at the same inner step) and the
        bytes sent, with ``worker_residual="local"`` the κ each fragment's residual moved
        this worker by, and with ``reference_share`` every fragment's reference (the model
        and the inner optimizer are saved by the caller)."""
        pending, pending_bytes = None, None
        if self._in_flight is not None:
            self._in_flight.result()
            fragment = self.fragments[self.fragment]
            pending, pending_bytes = fragment.buffer.clone(), dict(fragment.traffic.bytes_sent)
        errors = [fragment.errors() for fragment in self.fragments]
        return {
            "local_step": self.local_step,
            "rounds": self.rounds,
            "sync_every": self.sync_every,
            "exchange": self.exchange_kind,
            "worker_residual": self.worker_residual,
            "block_size": self.block_size,
            "fragments": [list(fragment.indices) for fragment in self.fragments],
            "delay": self.delay,
            "round_start": [start.clone() for start in self._round_start],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "worker_error": [None if w is None else w.clone() for w, _ in errors],
            "server_error": [None if s is None else s.clone() for _, s in errors],
            "pending_average": pending,
            "pending_bytes": pending_bytes,
            "bytes_sent": dict(self.traffic.bytes_sent),
            "residual_moves": [list(fragment.residual_moves) for fragment in self.fragments],
            "reference_share": self.reference_share,
            "references": [
                None if f.reference is None else f.reference.clone() for f in self.fragments
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; ``ValueError`` naming what does not fit, before
        anything changes."""
        if state.get("exchange") != self.exchange_kind:
            raise ValueError(
                f"checkpoint of a DiLoCo with exchange={state.get('exchange')!r}; this one has "
                f"exchange={self.exchange_kind!r}"
            )
        saved_residual = state.get("worker_residual", "carried")
        if saved_residual != self.worker_residual:
            raise ValueError(
                f"checkpoint of a DiLoCo with worker_residual={saved_residual!r}; this one has "
                f"worker_residual={self.worker_residual!r}"
            )
        if state.get("block_size") != self.block_size:
            raise ValueError(
                f"checkpoint of a DiLoCo with block_size={state.get('block_size')!r}; this one "
                f"has block_size={self.block_size!r}"
            )
        saved_share = float(state.get("reference_share", 0.0))
        if saved_share != self.reference_share:
            raise ValueError(
                f"checkpoint of a DiLoCo with reference_share={saved_share!r}; this one has "
                f"reference_share={self.reference_share!r}"
            )
        layout = [list(f.indices) for f in self.fragments]
        saved_layout = state.get("fragments", [list(range(len(self.params)))])
        if saved_layout != layout or state.get("delay", 0) != self.delay:
            raise ValueError(
                f"checkpoint of a DiLoCo with fragments {saved_layout} and delay "
                f"{state.get('delay', 0)}; this one has fragments {layout} and delay "
                f"{self.delay}"
            )
        starts = state["round_start"]
        shapes = [tuple(t.shape) for t in starts]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError(
                f"checkpoint's round start weights have shapes {shapes}; the parameters "
                f"{[tuple(p.shape) for p in self.params]}"
            )
        local_step = int(state["local_step"])
        if not 0 <= local_step < self.turn_steps:
            raise ValueError(
                f"checkpoint is at inner step {local_step} of a round; this DiLoCo has "
                f"sync_every={self.sync_every}"
                + (f" in {len(self.fragments)} fragments" if len(self.fragments) > 1 else "")
            )
        pending = state.get("pending_average")
        in_flight = self.delay > 0 and local_step >= self.turn_steps - self.delay
        if (pending is not None) != in_flight:
            raise ValueError(
                f"checkpoint at inner step {local_step} of a turn "
                f"{'lacks' if in_flight else 'holds'} the average of an exchange in flight"
            )
        if self.worker_residual == "local" and "residual_moves" not in state:
            raise ValueError("checkpoint of worker_residual='local' lacks its residual moves")
        moves = state.get("residual_moves", [[0.0] * len(f.params) for f in self.fragments])
        if [len(m) for m in moves] != [len(f.params) for f in self.fragments]:
            raise ValueError(
                f"checkpoint's residual moves are for {[len(m) for m in moves]} parameters per "
                f"fragment; this DiLoCo's fragments have {[len(f.params) for f in self.fragments]}"
            )
        errors = _saved_errors(state)
        for fragment, saved_errors in zip(self.fragments, errors, strict=True):
            if fragment.exchange is not None and saved_errors is not None:
                worker, server = saved_errors
                sizes = fragment.exchange.error_sizes(fragment.segments)
                if (worker.numel(), server.numel()) != sizes:
                    raise ValueError(
                        f"checkpoint's error buffers hold {(worker.numel(), server.numel())} "
                        f"elements; this exchange over {self.world_size} ranks needs {sizes}"
                    )
        references = state.get("references", [None] * len(self.fragments))
        for fragment, reference in zip(self.fragments, references, strict=True):
            if fragment.reference is not None and (
                reference is None or reference.numel() != fragment.reference.numel()
            ):
                raise ValueError(
                    f"checkpoint's reference of a fragment holds "
                    f"{None if reference is None else reference.numel()} elements; this "
                    f"fragment has {fragment.reference.numel()}"
                )
        self._drop_in_flight()
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for start, saved in zip(self._round_start, starts, strict=True):
            start.copy_(saved)
        self.local_step, self.rounds = local_step, int(state["rounds"])
        self.traffic.reset()
        for kind, nbytes in state["bytes_sent"].items():
            self.traffic.bytes_sent[kind] = int(nbytes)
        for fragment, saved_errors in zip(self.fragments, errors, strict=True):
            if fragment.exchange is not None and saved_errors is not None:
                worker, server = saved_errors
                fragment.exchange.carry_errors(
                    fragment.segments,
                    worker.to(fragment.buffer.device).clone(),
                    server.to(fragment.buffer.device).clone(),
                    fragment.exchange.backend,
                    fragment.traffic,
                )
        for fragment, reference in zip(self.fragments, references, strict=True):
            if fragment.reference is not None:
                fragment.reference.copy_(reference)
        for fragment, saved_moves in zip(self.fragments, moves, strict=True):
            fragment.traffic.reset()
            fragment.residual_moves = [float(move) for move in saved_moves]
        if pending is not None:
            self.hold(pending.to(self.fragments[self.fragment].buffer.device))
            for kind, nbytes in state["pending_bytes"].items():
                self.fragments[self.fragment].traffic.bytes_sent[kind] = int(nbytes)


def _check_residual_moves(optimizer: Optimizer, feature: str = "worker_residual") -> None:
    """``feature`` moves weights as the outer step moves them on a pseudo-gradient, which is
    known for SGD without dampening (κ, ALGORITHM.md, "Where a worker's residual goes")."""
    what, instead = {
        "worker_residual": (
            "worker_residual='local' (the 1-bit exchange's default) moves each worker",
            "pass worker_residual='carried'",
        ),
        "deliver_errors": ("deliver_errors moves the weights", "do not deliver the errors"),
    }[feature]
    if not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(
            f"{what} as the outer SGD would: the outer optimizer must be a torch.optim.SGD, "
            f"got {type(optimizer).__name__}; with another, {instead}"
        )
    for index, group in enumerate(optimizer.param_groups):
        if group["dampening"] or group["maximize"]:
            raise ValueError(
                f"{what} as the outer SGD would: param group {index} of the outer SGD has "
                f"dampening={group['dampening']} and maximize={group['maximize']}; it needs "
                f"dampening=0 and maximize=False (or {instead})"
            )


def _group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 outside ``torch.distributed``)."""
    return dist.get_rank(group) if world_size(group) > 1 else 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _saved_errors(state: dict[str, Any]) -> list[tuple[Tensor, Tensor] | None]:
    """A checkpoint's worker and server errors, per fragment (``None``: none yet); a save of
    one fragment may hold the two tensors themselves."""
    workers, servers = state["worker_error"], state["server_error"]
    if not isinstance(workers, list):
        workers, servers = [workers], [servers]
    return [None if w is None else (w, s) for w, s in zip(workers, servers, strict=True)]


def _fragment_indices(
    fragments: int | Sequence[Iterable[Tensor]], params: list[Tensor]
) -> list[list[int]]:
    """Each fragment's parameters as indices into ``params``: for an int K, K runs of
    consecutive parameters, each cut at the parameter boundary nearest to its share of the
    elements; else the given lists, which must hold each parameter once."""
    if _is_int(fragments):
        count = int(fragments)  # type: ignore[arg-type]
        if not 1 <= count <= len(params):
            raise ValueError(
                f"fragments must be between 1 and the {len(params)} parameters, got {count}"
            )
        ends = torch.tensor([p.numel() for p in params]).cumsum(0).tolist()
        cuts = [0]
        for j in range(1, count):
            target = ends[-1] * j / count
            candidates = range(cuts[-1] + 1, len(params) - (count - j) + 1)
            cuts.append(min(candidates, key=lambda cut: abs(ends[cut - 1] - target)))
        cuts.append(len(params))
        return [list(range(a, b)) for a, b in zip(cuts, cuts[1:], strict=False)]
    if isinstance(fragments, (str, bytes)) or not isinstance(fragments, Sequence):
        raise TypeError(
            f"fragments must be an int or a list of lists of parameters, got {fragments!r}"
        )
    where = {id(p): i for i, p in enumerate(params)}
    groups = []
    for number, group in enumerate(fragments):
        members = [p for p in group if p.requires_grad]
        unknown = [i for i, p in enumerate(members) if id(p) not in where]
        if unknown or not members:
            raise ValueError(
                f"fragment {number} is empty or holds tensors not among DiLoCo's parameters "
                f"(its entries {unknown[:5]})"
            )
        groups.append([where[id(p)] for p in members])
    counts = torch.bincount(torch.tensor([i for g in groups for i in g]), minlength=len(params))
    if not bool((counts == 1).all()):
        twice = (counts > 1).nonzero().flatten().tolist()
        missing = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(
            f"fragments must hold each parameter once: parameters {missing[:5]} are in none, "
            f"{twice[:5]} in more than one"
        )
    return groups


def _completed() -> Future:
    """An exchange that has completed."""
    done: Future = Future()
    done.set_result(None)
    return done


def _backend_for(device: torch.device, name: str | None) -> backends.Backend:
    """The compression backend for float32 buffers on ``device``."""
    return backends.select(torch.zeros(8, device=device), name)


def _check_covers(name: str, optimizer: Optimizer, params: list[Tensor]) -> None:
    """``optimizer`` must hold every one of ``params``."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [index for index, p in enumerate(params) if id(p) not in held]
    if missing:
        raise ValueError(
            f"{name} does not hold parameters {missing[:5]} of the {len(params)} given to "
            "DiLoCo: build it over the same parameters"
        )
