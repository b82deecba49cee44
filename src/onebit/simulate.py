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
* **compression steps**: for each worker in rank order, its gradient, clipped, its local
  momentum from :meth:`OneBitOptimizer.local_momentum` (the optimizer's code), compressed at
  once with its worker error (for ``L > 1`` each node's ranks are first averaged densely);
  then ``optimizer.step()``, whose exchange (:class:`SimulatedExchange`) runs the servers and
  returns the result to the optimizer's own update.

The exchange runs the same backend stages in the same order as
:func:`onebit.compressed_allreduce` and :func:`onebit.hierarchical_compressed_allreduce`, so
the parameters equal those of a real run of ``W`` processes bit for bit when the averaged
gradients agree (tests/test_simulate.py).

**Memory** (``N_pad`` = the trainable parameters padded to a multiple of ``8 W``, 4 bytes an
element in fp32): the worker errors, ``M N_pad`` elements (``W`` buffers of ``N_pad / L``);
the server errors, ``N_pad``; the packed signs of every worker, ``M N_pad / 8`` bytes; one
node mean of ``N_pad`` when ``L > 1``; the sum of the gradients (``N``); plus the optimizer's
own state and the model's gradients of one worker at a time. Workers are streamed: at most
one worker's gradients and momentum exist at once. At ``W = 256`` (flat) and 4M parameters
that is 4.1 GB of worker errors and 128 MB of signs (:meth:`memory_bytes`).

A compression step cannot be skipped the way a distributed run skips one with a non-finite
momentum (its worker errors are updated while the workers stream): a non-finite local momentum
raises :class:`SimulationDiverged` instead, with the error state of the earlier workers of the
step already updated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from onebit import kernels as backends
from onebit.clipping import clip_grad_norm_
from onebit.collectives import (
    PackedResult,
    TrafficCounter,
    allreduce_bytes,
    compressed_allreduce_bytes,
    world_size,
)
from onebit.compression import scale_dtype
from onebit.hierarchical import hierarchical_bytes
from onebit.optim._onebit import COMPRESSION, OneBitOptimizer
from onebit.optim.onebit_adam import OneBitAdam
from onebit.optim.onebit_lamb import OneBitLamb

__all__ = ["SimulatedDataParallel", "SimulatedExchange", "SimulationDiverged"]

Result = TypeVar("Result")


class SimulationDiverged(FloatingPointError):
    """A simulated worker's momentum (or a server's average) is not finite."""


class SimulatedExchange:
    """The compressed exchange of ``M`` nodes of ``L`` simulated workers, fed worker by worker.

    :meth:`add_worker` takes rank ``r = node * L + l``'s buffer, in rank order; with
    ``L > 1`` the ranks of a node are averaged densely (summed in rank order, divided by
    ``L``) and each of the node's ``L`` shards compressed with its worker error (the
    inter-node exchange of local index ``l``); with ``L = 1`` the buffer itself. Then
    :meth:`exchange` runs every server and returns the result in the layout of
    :func:`onebit.hierarchical_compressed_allreduce` (chunk ``l * M + j`` is server ``j``'s
    chunk of shard ``l``; the flat layout for ``L = 1``). Error buffers are ``[W, N / L]``
    and ``[W, N / W]``, row ``r`` for rank ``r``.
    """

    def __init__(self, workers: int, node_size: int = 1, *, kernels: str | None = None) -> None:
        for name, value in (("workers", workers), ("node_size", node_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if workers % node_size:
            raise ValueError(
                f"node_size={node_size} must divide workers={workers} (nodes of equal size)"
            )
        self.workers, self.local, self.nodes = workers, node_size, workers // node_size
        self.kernels = kernels
        self._key: tuple | None = None
        self._added = 0  # workers added since the last exchange

    @property
    def topology(self) -> tuple[int, int]:
        """``(L, M)``: ranks per node and nodes."""
        return self.local, self.nodes

    def _prepare(self, buffer: Tensor) -> None:
        numel, dtype, device = buffer.numel(), buffer.dtype, buffer.device
        if numel % (8 * self.workers):
            raise ValueError(
                f"buffer has {numel} elements; it must be a multiple of 8 * workers = "
                f"{8 * self.workers}"
            )
        backend = backends.select(buffer, self.kernels)
        key = (numel, dtype, device, backend.name)
        if key == self._key:
            return
        shard = numel // self.local
        self.backend = backend
        self.signs = torch.empty(
            self.local, self.nodes, shard // 8, dtype=torch.uint8, device=device
        )
        self.scales = torch.empty(self.local, self.nodes, dtype=scale_dtype(dtype), device=device)
        chunk = shard // self.nodes
        self.server_signs = torch.empty(
            self.local, self.nodes, chunk // 8, dtype=torch.uint8, device=device
        )
        self.server_scales = torch.empty_like(self.scales)
        self.node_mean = torch.empty(numel, dtype=dtype, device=device) if self.local > 1 else None
        self.scratch = backend.scratch(shard, self.nodes, dtype, device)
        self._key = key

    def add_worker(self, rank: int, buffer: Tensor, worker_error: Tensor) -> None:
        """Worker ``rank``'s buffer (``N`` elements; used as scratch); ``worker_error``:
        every worker's, ``[W, N / L]`` or flat. Ranks must come in order, from 0."""
        if rank != self._added:
            raise ValueError(f"workers must be added in rank order: expected {self._added}")
        self._prepare(buffer)
        node, index = divmod(rank, self.local)
        errors = worker_error.view(self.workers, -1)
        if self.local == 1:
            self._compress(0, node, buffer.view(-1), errors[rank], rank)
        else:
            mean = self.node_mean
            if index == 0:
                mean.copy_(buffer.view(-1))
            else:
                mean.add_(buffer.view(-1))
            if index == self.local - 1:
                mean.div_(self.local)
                for shard, shard_mean in enumerate(mean.view(self.local, -1)):
                    member = node * self.local + shard
                    self._compress(shard, node, shard_mean, errors[member], rank)
        self._added += 1

    def _compress(self, shard: int, node: int, x: Tensor, error: Tensor, rank: int) -> None:
        """Worker compression of ``x`` (also its scratch) with ``error`` as member ``node``
        of the inter-node exchange of ``shard``."""
        scale = self.backend.worker_compress(x, error, self.signs[shard, node], x, self.scratch)
        if not math.isfinite(float(scale)):
            raise SimulationDiverged(
                f"the local momentum of simulated worker {rank} is not finite (its compression "
                "scale is NaN or Inf); the simulation cannot skip the step, since earlier "
                "workers' error states are already updated"
            )
        self.scales[shard, node] = scale
        self.backend.worker_error_update(x, error, self.signs[shard, node], scale, x, self.scratch)

    def exchange(
        self, worker_error: Tensor, server_error: Tensor, traffic: TrafficCounter | None = None
    ) -> PackedResult:
        """Every server's compression of the chunks the workers added; the result in packed
        form. The bytes one worker would send are counted in ``traffic``."""
        if self._added != self.workers:
            raise RuntimeError(
                f"exchange() needs all {self.workers} workers added first; {self._added} were"
            )
        self._added = 0
        chunk_bytes = self.server_signs.shape[2]
        errors = server_error.view(self.workers, -1)
        for shard in range(self.local):
            for server in range(self.nodes):
                received = self.signs[shard, :, server * chunk_bytes : (server + 1) * chunk_bytes]
                received = received.contiguous()
                error = errors[server * self.local + shard]
                packed = self.server_signs[shard, server]
                scale = self.backend.server_compress(
                    received, self.scales[shard], error, packed, self.scratch
                )
                if not math.isfinite(float(scale)):
                    raise SimulationDiverged(
                        f"the server average of chunk {server} of shard {shard} is not finite"
                    )
                self.server_scales[shard, server] = scale
                self.backend.server_error_update(
                    received, self.scales[shard], error, packed, scale, self.scratch
                )
        if traffic is not None:
            for kind, nbytes in self.bytes_per_worker(worker_error.dtype).items():
                if nbytes:
                    traffic.record(kind, nbytes)
        signs = self.server_signs.view(self.workers, chunk_bytes)
        return PackedResult(signs, self.server_scales.view(-1), self.backend.name)

    def bytes_per_worker(self, dtype: torch.dtype) -> dict[str, int]:
        """Bytes one worker sends per exchange, by kind, as a distributed run counts them."""
        numel = 8 * self.signs.shape[2] * self.local
        if self.local == 1:
            return {"compressed_allreduce": compressed_allreduce_bytes(numel, self.nodes, dtype)}
        return hierarchical_bytes(numel, self.local, self.nodes, dtype)

    def nbytes(self) -> int:
        """Bytes of scratch held now: packed signs and scales, the node mean, the backend's."""
        if self._key is None:
            return 0
        own = [self.signs, self.scales, self.server_signs, self.server_scales, self.node_mean]
        scratch = vars(self.scratch).values() if self.scratch is not None else []
        return sum(t.numel() * t.element_size() for t in [*own, *scratch] if t is not None)


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

    Use: ``losses = simulation.step(worker_backward)``, where ``worker_backward(rank)`` runs
    worker ``rank``'s forward and backward pass on its micro-batch (leaving its gradients in
    ``.grad``, zeroed before each call) and returns whatever the caller wants back (e.g. its
    loss); ``step`` then updates the parameters once, as ``W`` real workers would.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        workers: int,
        node_size: int = 1,
        *,
        max_grad_norm: float = 0.0,
    ) -> None:
        self.exchange = SimulatedExchange(workers, node_size)
        if max_grad_norm < 0 or not math.isfinite(max_grad_norm):
            raise ValueError(f"max_grad_norm must be >= 0 (0: no clipping), got {max_grad_norm}")
        if isinstance(optimizer, OneBitOptimizer):
            if not isinstance(optimizer, OneBitLamb | OneBitAdam):
                raise ValueError(f"{type(optimizer).__name__} cannot be simulated (yet)")
            if optimizer.node_groups is not None or world_size(optimizer.process_group) > 1:
                raise ValueError(
                    "the simulated optimizer must run in one process: give it no node_groups "
                    "and no process group of more than one rank"
                )
            if getattr(optimizer, "compression", "fused") != "fused":
                raise ValueError(
                    f"the simulation exchanges the fused momentum buffer; "
                    f"compression={optimizer.compression!r} is not simulated"
                )
            if optimizer.momentum_exchange is not None:
                raise ValueError("optimizer is already simulated by another SimulatedDataParallel")
            self.exchange.kernels = optimizer.kernels
            optimizer.momentum_exchange = self.exchange
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

    @property
    def compressing(self) -> bool:
        """Whether the next step exchanges compressed momenta."""
        return self._onebit is not None and self._onebit.stage == COMPRESSION

    def step(self, worker_backward: Callable[[int], Result]) -> list[Result]:
        """One step of all workers; returns ``worker_backward(rank)`` of each rank."""
        if self.compressing:
            results = []
            for rank in range(self.workers):
                results.append(self._backward(rank, worker_backward))
                self._clip()
                momentum = self._onebit.local_momentum()
                worker_error, _ = self._onebit.error_feedback
                self.exchange.add_worker(rank, momentum, worker_error)
        else:
            results = self._average_gradients(worker_backward)
            self._clip()
        self.optimizer.step()
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

    def memory_bytes(self) -> dict[str, Any]:
        """Bytes the simulation holds now beyond one optimizer's usual state: every worker's
        error buffers, the exchange's scratch (packed signs, node mean), the gradient sum."""
        worker_error, server_error = (
            self._onebit.error_feedback if self._onebit is not None else (None, None)
        )

        def size(tensor: Tensor | None) -> int:
            return 0 if tensor is None else tensor.numel() * tensor.element_size()

        return {
            "worker_errors": size(worker_error),
            "server_errors": size(server_error),
            "exchange_scratch": self.exchange.nbytes(),
            "gradient_sum": size(self._gradient_sum),
        }
