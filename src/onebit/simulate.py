"""Many data-parallel workers simulated in one process, with the optimizers' own maths.

:class:`SimulatedDataParallel` trains with ``W = M * L`` simulated workers (``M`` nodes of
``L``; ``L = 1`` is the flat exchange) around *one* optimizer: :class:`onebit.OneBitLamb`,
:class:`onebit.OneBitAdam`, :class:`onebit.Lamb` or any other. In data-parallel 1-bit LAMB and
1-bit Adam every replica holds the same parameters and moments; only the local gradients, the
local momenta before the exchange and the error-feedback buffers differ between workers. So
one optimizer suffices, holding the error state of all ``W`` workers, and a step runs:

* **averaged steps** (the warm-up, and every step of a dense optimizer): worker ``i``'s
  gradient from its own micro-batch, summed in rank order into one buffer, divided by ``W``
  (what ``onebit.allreduce_mean_`` computes), clipped, then ``optimizer.step()``;
* **compression steps**: for each worker but the last, in rank order, its gradient, clipped,
  its local momentum from :meth:`OneBitOptimizer.local_momentum` (the optimizer's code),
  compressed at once with its worker error (for ``L > 1`` each node's ranks are first
  averaged densely); then the last worker's gradient and ``optimizer.step()``, whose
  exchange (given to the optimizer with :meth:`OneBitOptimizer.use_exchange`) takes that
  worker's momentum, runs the servers and returns the result to the optimizer's own update.
  The exchange is the optimizer's: each tensor compressed alone
  (:class:`onebit.exchange.PerTensorSimulatedExchange`, the default) or the fused buffer
  (:class:`onebit.exchange.SimulatedExchange`), flat or hierarchical.

The exchange runs the same stages of the two-phase protocol (:mod:`onebit.exchange.protocol`)
in the same order as a distributed exchange, flat or hierarchical, so the parameters equal
those of a real run of ``W`` processes bit for bit when the averaged gradients agree
(tests/distributed/test_simulate_on_ranks.py).

**Memory** (``N_pad`` = the trainable parameters padded to a multiple of ``8 W``, 4 bytes an
element in fp32): the worker errors, ``M N_pad`` elements (``W`` buffers of ``N_pad / L``);
the server errors, ``N_pad``; the packed signs of every worker, ``M N_pad / 8`` bytes; one
node mean of ``N_pad`` when ``L > 1``; the sum of the gradients (``N``); plus the optimizer's
own state and the model's gradients of one worker at a time. Workers are streamed: at most
one worker's gradients and momentum exist at once. At ``W = 256`` (flat) and 4M parameters
that is 4.1 GB of worker errors and 128 MB of signs (:meth:`memory_bytes`).

With ``delayed_exchange=True`` each worker's pass runs at its own prediction of the last
step (:meth:`OneBitOptimizer.predicted_weights`, made from its momentum as a real rank's
``step()`` makes it; one copy of the weights per worker is kept), then the update the last
step's exchange left pending is applied before the workers' momenta are formed
(ALGORITHM.md, "Delayed exchange"). ``prediction="mean"`` makes every worker's prediction
from the mean of the workers' momenta instead: an oracle no real rank has (it would need the
exchange the delay runs behind), which measures what the workers' own gradients in their
predictions cost.

:class:`SimulatedDiLoCo` simulates DiLoCo (:class:`onebit.DiLoCo`) the same way, except that
DiLoCo's workers do differ between exchanges: each simulated worker keeps its own weights and
its own state of the inner optimizer (the one optimizer object, its ``state`` swapped in for
the worker's step), and one module runs every worker's passes. A round's end takes each
worker's pseudo-gradient in rank order: summed and divided by ``W`` (the dense exchange), or
streamed through the simulated 1-bit exchange; DiLoCo's own outer step follows once. Memory:
``W`` copies of the weights and of the inner optimizer's state.

A compression step cannot be skipped the way a distributed run skips one with a non-finite
momentum (its worker errors are updated while the workers stream): a non-finite local momentum
raises :class:`SimulationDiverged` instead, with the error state of the earlier workers of the
step already updated.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from onebit.clipping import clip_grad_norm_
from onebit.collectives import TrafficCounter, allreduce_bytes
from onebit.diloco import DiLoCo
from onebit.exchange import PerTensorSimulatedExchange, SimulatedExchange, SimulationDiverged
from onebit.optim import COMPRESSION, OneBitOptimizer
from onebit.optim.onebit_adam import OneBitAdam
from onebit.optim.onebit_lamb import OneBitLamb

__all__ = ["SimulatedDataParallel", "SimulatedDiLoCo", "SimulatedExchange", "SimulationDiverged"]

#: What a simulated worker's prediction of the delayed exchange is made from.
PREDICTIONS = ("own", "mean")

Result = TypeVar("Result")


class SimulatedDataParallel:
    """Train ``optimizer``'s parameters with ``workers`` simulated data-parallel workers.

    Args:
        optimizer: the one optimizer of all workers, in a single process (no process group of
            more than one rank, no ``node_groups``). A :class:`onebit.OneBitLamb` or
            :class:`onebit.OneBitAdam` exchanges through a :class:`SimulatedExchange` from
            then on (its error state holds every worker's; its checkpoints too); any other
            optimizer gets the workers' averaged gradients at every step.
        workers: ``W``, the number of simulated workers.
        node_size: ``L``, workers per node of the hierarchical exchange (1: flat).
        max_grad_norm: if positive, clip with :func:`onebit.clip_grad_norm_` where a
            data-parallel job does: the averaged gradient at ``max_grad_norm`` in averaged
            steps, each worker's own at ``max_grad_norm·√W`` in compression steps.
        prediction: with ``delayed_exchange``, the momentum each worker's prediction is
            made from: ``"own"``, its own (what a real rank does), or ``"mean"``, the mean of
            the workers' (an oracle; the parameters after :meth:`step` still hold the last
            worker's own prediction, the next step takes the mean one).

    Use: ``losses = simulation.step(worker_backward)``, where ``worker_backward(rank)`` runs
    worker ``rank``'s forward and backward pass on its micro-batch (leaving its gradients in
    ``.grad``, zeroed before each call) and returns whatever the caller wants back (e.g. its
    loss); ``step`` then updates the parameters once, as ``W`` real workers would. A checkpoint
    holds the optimizer's ``state_dict()``, the model's and, with ``delayed_exchange``,
    :meth:`state_dict` (the workers' predictions).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        workers: int,
        node_size: int = 1,
        *,
        max_grad_norm: float = 0.0,
        prediction: str = "own",
    ) -> None:
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
        if prediction != "own" and not getattr(optimizer, "delayed_exchange", False):
            raise ValueError(
                f"prediction={prediction!r} chooses the predictions of delayed_exchange=True, "
                f"which {type(optimizer).__name__} does not have"
            )
        per_tensor = (
            isinstance(optimizer, OneBitOptimizer) and optimizer.compression == "per_tensor"
        )
        simulated = PerTensorSimulatedExchange if per_tensor else SimulatedExchange
        self.exchange: SimulatedExchange | PerTensorSimulatedExchange = simulated(
            workers, node_size
        )
        if max_grad_norm < 0 or not math.isfinite(max_grad_norm):
            raise ValueError(f"max_grad_norm must be >= 0 (0: no clipping), got {max_grad_norm}")
        if isinstance(optimizer, OneBitOptimizer):
            if not isinstance(optimizer, OneBitLamb | OneBitAdam):
                raise ValueError(f"{type(optimizer).__name__} cannot be simulated (yet)")
            optimizer.use_exchange(self.exchange)
            self._onebit: OneBitOptimizer | None = optimizer
        else:
            self._onebit = None
        self.optimizer = optimizer
        self.workers = workers
        self.max_grad_norm = max_grad_norm
        self.params = [
            p for group in optimizer.param_groups for p in group["params"] if p.requires_grad
        ]
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("the simulated parameters must share one dtype and one device")
        self.traffic = TrafficCounter()  # the averaged steps' dense allreduce, per worker
        self._gradient_sum: Tensor | None = None
        # delayed_exchange: each worker's prediction of the last step (None: the parameters)
        self._predicted: list[list[Tensor] | None] = [None] * workers
        self.prediction = prediction

    @property
    def compressing(self) -> bool:
        """Whether the next step exchanges compressed momenta."""
        return self._onebit is not None and self._onebit.stage == COMPRESSION

    def step(self, worker_backward: Callable[[int], Result]) -> list[Result]:
        """One step of all workers; returns ``worker_backward(rank)`` of each rank."""
        if self.compressing and self._delayed:
            results = self._delayed_compression_step(worker_backward)
        elif self.compressing:
            results = []
            for rank in range(self.workers):
                results.append(self._backward(rank, worker_backward))
                self._clip()
                if rank < self.workers - 1:  # the last one's momentum goes in through step()
                    self.exchange.add_worker(rank, self._onebit.local_momentum())
        else:
            results = self._average_gradients(worker_backward)
            self._clip()
        self.optimizer.step()
        return results

    @property
    def _delayed(self) -> bool:
        return self._onebit is not None and self._onebit.delayed_exchange

    def _delayed_compression_step(self, worker_backward: Callable[[int], Result]) -> list[Result]:
        """Every worker's gradient at its prediction of the last step; the pending update
        applied; each worker's momentum formed at the shared weights and, but the last
        one's (``step()`` predicts that one), its prediction kept before its exchange (with
        ``prediction="mean"``: one prediction for all, from the mean of their momenta)."""
        optimizer = self._onebit
        assert optimizer is not None
        mean = self.prediction == "mean" and self.workers > 1  # one worker: its own
        if not optimizer.update_pending:  # the stage's first step (or after a refresh)
            self._predicted = [None] * self.workers
        elif not mean:  # the last worker's prediction: the parameters now
            self._predicted[-1] = [param.detach().clone() for param in self.params]
        optimizer.finish_exchange()
        shared = [param.detach().clone() for param in self.params]
        results = []
        total: Tensor | None = None  # "mean": the workers' momenta summed in rank order
        for rank in range(self.workers):
            _copy_into(self.params, self._predicted[rank] or shared)
            results.append(self._backward(rank, worker_backward))
            self._clip()
            _copy_into(self.params, shared)
            last = rank == self.workers - 1
            if last and not mean:
                continue  # its momentum goes in through step(), which predicts from it
            momentum = optimizer.local_momentum()
            if mean:
                total = momentum.clone() if total is None else total.add_(momentum)
            else:
                self._predicted[rank] = optimizer.predicted_weights(momentum)
            if not last:
                self.exchange.add_worker(rank, momentum)
        if total is not None:
            self._predicted = [optimizer.predicted_weights(total.div_(self.workers))]
            self._predicted *= self.workers
        return results

    def _backward(self, rank: int, worker_backward: Callable[[int], Result]) -> Result:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            return worker_backward(rank)

    def _clip(self) -> None:
        if self.max_grad_norm > 0:
            clip_grad_norm_(self.params, self.max_grad_norm, self.optimizer, workers=self.workers)

    def _average_gradients(self, worker_backward: Callable[[int], Result]) -> list[Result]:
        """``.grad = (1/W) sum_i g_i``, summed in rank order into one flat buffer (a missing
        gradient counts as zero; a parameter no worker has a gradient for keeps none)."""
        if self._gradient_sum is None:
            self._gradient_sum = torch.empty(
                sum(p.numel() for p in self.params),
                dtype=self.params[0].dtype,
                device=self.params[0].device,
            )
        sums, offset = [], 0
        for param in self.params:
            sums.append(self._gradient_sum[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        started = [False] * len(self.params)
        results = []
        for rank in range(self.workers):
            results.append(self._backward(rank, worker_backward))
            for index, (param, total) in enumerate(zip(self.params, sums, strict=True)):
                if param.grad is None:
                    continue
                if started[index]:
                    total.add_(param.grad)
                else:
                    total.copy_(param.grad)
                    started[index] = True
        for param, total, has_gradient in zip(self.params, sums, started, strict=True):
            param.grad = total.div_(self.workers) if has_gradient else None
        if self.workers > 1:
            self.traffic.record("allreduce", allreduce_bytes(self._gradient_sum, self.workers))
        return results

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs beside the optimizer's and the model's (the last worker's
        prediction is the parameters): with ``delayed_exchange``, the other workers'
        predictions of the last step (``None`` where there is none)."""
        return {"predicted": self._predicted[:-1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take :meth:`state_dict`'s; raises ``ValueError`` for another number of workers."""
        predicted = list(state["predicted"])
        if len(predicted) != self.workers - 1:
            raise ValueError(
                f"the checkpoint holds the predictions of {len(predicted) + 1} simulated "
                f"workers, this simulation has {self.workers}"
            )
        last = predicted[0] if self.prediction == "mean" and predicted else None
        self._predicted = [*predicted, last]

    def memory_bytes(self) -> dict[str, Any]:
        """Bytes the simulation holds now beyond one optimizer's usual state: every worker's
        error buffers, the exchange's scratch (packed signs, node mean), the gradient sum,
        and with ``delayed_exchange`` the workers' predictions."""
        worker_error, server_error = self.exchange.worker_error, self.exchange.server_error

        def size(tensor: Tensor | None) -> int:
            return 0 if tensor is None else tensor.numel() * tensor.element_size()

        return {
            "worker_errors": size(worker_error),
            "server_errors": size(server_error),
            "exchange_scratch": self.exchange.nbytes(),
            "gradient_sum": size(self._gradient_sum),
            "predictions": sum(size(t) for kept in self._predicted for t in kept or ()),
        }


class SimulatedDiLoCo:
    """DiLoCo over ``params`` with ``workers`` simulated workers in one process.

    Args:
        params: the parameters of the one module that runs every worker's passes.
        inner_optimizer: the inner optimizer over ``params``; each worker has its own state
            of it (its ``state`` is swapped per worker), the hyper-parameters are shared.
        workers: ``W``.
        sync_every, exchange, compression, outer_optimizer, kernels: as
            :class:`onebit.DiLoCo`'s.
        fragments, delay, local_share: Streaming DiLoCo's, as :class:`onebit.DiLoCo`'s.
        worker_residual: as :class:`onebit.DiLoCo`'s (the 1-bit exchange's default
            ``"local"``): each simulated worker is moved by its own residual, as each rank is.
        block_size: as :class:`onebit.DiLoCo`'s, blocks of ``block_size·workers`` elements.
        reference_share: as :class:`onebit.DiLoCo`'s, the same reference taken out of every
            simulated worker's pseudo-gradient.

    Use: ``results = simulation.step(worker_backward)``, where ``worker_backward(rank)`` runs
    worker ``rank``'s forward and backward pass at its own weights (which the parameters hold
    then; gradients zeroed before each call), clipping if the job clips, and returns what the
    caller wants back; ``step`` then takes every worker's inner step and ends the turns as
    DiLoCo does (the exchange, instantaneous here, taken where the distributed one starts and
    applied where it completes). :attr:`diloco` holds the start weights, the outer optimizer,
    the pending average and the bytes, as a distributed DiLoCo does.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        inner_optimizer: torch.optim.Optimizer,
        workers: int,
        *,
        sync_every: int,
        exchange: str = "1bit",
        compression: str = "per_tensor",
        outer_optimizer: torch.optim.Optimizer | None = None,
        kernels: str | None = None,
        fragments: int | Sequence[Iterable[Tensor]] = 1,
        delay: int = 0,
        local_share: float = 0.0,
        worker_residual: str | None = None,
        block_size: int | None = None,
        reference_share: float = 0.0,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        self.diloco = DiLoCo(
            params,
            inner_optimizer,
            sync_every=sync_every,
            exchange=exchange,
            compression=compression,
            outer_optimizer=outer_optimizer,
            kernels=kernels,
            fragments=fragments,
            delay=delay,
            local_share=local_share,
            worker_residual=worker_residual,
            block_size=block_size,
            reference_share=reference_share,
        )
        self.diloco.close()  # every worker's inner step runs here: the turns are ended below
        self.exchanges: list[SimulatedExchange | PerTensorSimulatedExchange] = []
        if exchange == "1bit":
            per_tensor = compression == "per_tensor"
            for index in range(len(self.diloco.fragments)):
                simulated = (PerTensorSimulatedExchange if per_tensor else SimulatedExchange)(
                    workers
                )
                self.diloco.use_exchange(simulated, index)
                self.exchanges.append(simulated)
        self.inner_optimizer = inner_optimizer
        self.workers = workers
        self.params = self.diloco.params
        self._weights = [[p.detach().clone() for p in self.params] for _ in range(workers)]
        self._states: list[defaultdict[Tensor, Any]] = [defaultdict(dict) for _ in range(workers)]

    def step(self, worker_backward: Callable[[int], Result]) -> list[Result]:
        """One inner step of every worker, in rank order; the turn's exchange taken after the
        last where it starts, applied where it completes."""
        results = []
        for rank in range(self.workers):
            with self._worker(rank):
                self.inner_optimizer.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    results.append(worker_backward(rank))
                self.inner_optimizer.step()
        diloco = self.diloco
        starts, ends = diloco.advance()
        if starts:
            diloco.hold(self._average(diloco.fragment))
        if ends:
            self._end_turn(diloco.local_share)
        return results

    @torch.no_grad()
    def sync(self, deliver_errors: bool = False) -> None:
        """End the current turn now, and with it every fragment's round (as
        :meth:`onebit.DiLoCo.sync`, which leaves out a fragment whose residual moves have
        just been made: they are undone); every worker then holds the start weights. With
        ``deliver_errors``, as :meth:`onebit.DiLoCo.sync`'s: every worker's share of the
        undelivered errors summed in rank order, their mean delivered to every worker."""
        diloco = self.diloco
        if deliver_errors:
            diloco.check_deliverable()
        index, just_ended = diloco.fragment, diloco.residual_move_to_undo()
        if just_ended is not None:
            diloco.undo_residual_moves(just_ended, self._rows(just_ended))
        if just_ended != index:
            self._end_turn(local_share=0.0, residual=False)
        for other in range(len(diloco.fragments)):
            if other not in (index, just_ended):
                self._apply(self._average(other), other, local_share=0.0, residual=False)
        if deliver_errors:
            means = []
            for other, fragment in enumerate(diloco.fragments):
                mean = fragment.error_share(0, 0)
                for rank in range(1, self.workers):
                    mean.add_(fragment.error_share(rank, rank))
                means.append(mean.div_(self.workers))
                diloco.count_dense_average(other, mean, self.workers)
            diloco.deliver_errors(means, [self._rows(i) for i in range(len(diloco.fragments))])
        _copy_into(self.params, self._weights[-1])

    @torch.no_grad()
    def _average(self, fragment: int) -> Tensor:
        """Every worker's pseudo-gradient of ``fragment`` in rank order, averaged as the
        outer exchange averages them."""
        diloco = self.diloco
        exchange = self.exchanges[fragment] if self.exchanges else None
        diloco.take_residual_moves(fragment, rows=self.workers)
        size = diloco.buffer_size(fragment)
        work = torch.zeros(size, dtype=torch.float32, device=self.params[0].device)
        average = torch.zeros_like(work)
        part = diloco.fragments[fragment]
        for rank in range(self.workers):
            _copy_into(self.params, self._weights[rank])
            diloco.pseudo_gradient(work, fragment)
            part.subtract_reference(work)
            if exchange is None:
                average.add_(work)
            elif rank < self.workers - 1:
                exchange.add_worker(rank, work)
            else:
                exchange.exchange(work).decode(average)
        part.add_reference(average)
        if exchange is None:
            average.div_(self.workers)
            diloco.count_dense_average(fragment, average, self.workers)
            diloco.check_finite(average)
        return average  # the parameters hold the last worker's weights, as after a step

    @torch.no_grad()
    def _end_turn(self, local_share: float, residual: bool = True) -> None:
        diloco = self.diloco
        if not diloco.exchange_started:
            diloco.hold(self._average(diloco.fragment))
        self._apply(diloco.wait_exchange(), diloco.fragment, local_share, residual)
        diloco.turn_ended()

    def _apply(
        self, average: Tensor, fragment: int, local_share: float, residual: bool = True
    ) -> None:
        """``fragment``'s outer step from ``average``; every worker's weights of it set to
        the result, plus ``local_share`` of the worker's own move since the exchange started
        (where there is a delay); with ``worker_residual="local"`` and ``residual``, each
        worker then moved by its residual."""
        diloco = self.diloco
        diloco.outer_step(average, fragment)
        keep = local_share if diloco.delay else 0.0
        for weights in self._weights:
            for i in diloco.fragments[fragment].indices:
                result = self.params[i].detach()
                weights[i].copy_(result.lerp(weights[i], keep) if keep else result)
        if residual:
            diloco.move_by_residuals(fragment, self._rows(fragment))
        _copy_into(self.params, self._weights[-1])

    def _rows(self, fragment: int) -> list[list[Tensor]]:
        """Every worker's weights of ``fragment``, in rank order."""
        indices = self.diloco.fragments[fragment].indices
        return [[weights[i] for i in indices] for weights in self._weights]

    def worker_weights(self, rank: int) -> list[Tensor]:
        """Worker ``rank``'s weights, a tensor per parameter (the parameters hold the last
        worker's between steps)."""
        return self._weights[rank]

    @contextlib.contextmanager
    def _worker(self, rank: int) -> Iterator[None]:
        """Inside the block the parameters hold worker ``rank``'s weights and the inner
        optimizer its state; both are kept for the worker when it ends."""
        _copy_into(self.params, self._weights[rank])
        self.inner_optimizer.state = self._states[rank]
        try:
            yield
        finally:
            self._states[rank] = self.inner_optimizer.state
        _copy_into(self._weights[rank], self.params)

    def memory_bytes(self) -> dict[str, Any]:
        """Bytes the simulation holds beyond one worker's: every worker's weights and inner
        optimizer state, and the simulated exchange's errors and scratch."""

        def size(tensors: Iterable[Any]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))

        errors = [e for ex in self.exchanges for e in (ex.worker_error, ex.server_error)]
        entries = [entry for state in self._states for entry in state.values()]
        return {
            "worker_weights": size(w for weights in self._weights for w in weights),
            "worker_optimizer_states": size(v for entry in entries for v in entry.values()),
            "errors": size(errors),
            "exchange_scratch": sum(ex.nbytes() for ex in self.exchanges),
        }

    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's state (round, start weights, outer optimizer, every worker's errors,
        bytes) and each worker's weights and inner optimizer state."""
        inner = []
        for rank in range(self.workers):
            self.inner_optimizer.state = self._states[rank]
            inner.append(self.inner_optimizer.state_dict())
        return {
            "diloco": self.diloco.state_dict(),
            "weights": [[w.clone() for w in weights] for weights in self._weights],
            "inner": inner,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; ``ValueError`` naming what does not fit, before
        anything changes."""
        if len(state["weights"]) != self.workers or len(state["inner"]) != self.workers:
            raise ValueError(
                f"checkpoint of {len(state['weights'])} simulated DiLoCo workers; this "
                f"simulation has {self.workers}"
            )
        shapes = [tuple(p.shape) for p in self.params]
        for weights in state["weights"]:
            if [tuple(w.shape) for w in weights] != shapes:
                raise ValueError(f"checkpoint's worker weights have other shapes than {shapes}")
        self.diloco.load_state_dict(state["diloco"])
        for rank, (weights, inner) in enumerate(zip(state["weights"], state["inner"], strict=True)):
            _copy_into(self._weights[rank], weights)
            self.inner_optimizer.load_state_dict(inner)
            self._states[rank] = self.inner_optimizer.state
        _copy_into(self.params, self._weights[-1])


def _copy_into(params: list[Tensor], values: list[Tensor]) -> None:
    with torch.no_grad():
        for param, value in zip(params, values, strict=True):
            param.copy_(value)
