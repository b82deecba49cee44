"""Timing of the library's steps, the one measurement behind ``onebit bench optimizer`` and the
cost model's calibration (``onebit estimate --calibrate``).

Every function is timed *interleaved* (one after the other, round after round, the median of
each kept), so that all of them see the same load on a shared machine; ratios between them are
the result, not absolute times. :func:`time_calls` adds up the wall time of a method's calls
where it runs (the breakdowns of ``benchmarks/step_cpu.py``).
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "copy_fn",
    "cpu_backends",
    "interleaved",
    "optimizer_step_times",
    "rank_step_times",
    "time_calls",
]


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, sync: Callable[[], Any]
) -> dict[str, float]:
    """Median seconds of each function, run in turn ``repeats`` times (after one untimed
    round), so that all see the same machine load; ``sync`` runs before each timing."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            if round_index:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def time_calls(seconds: MutableMapping[str, float], owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` (a method or function attribute) by a wrapper that adds the wall
    time of each call to ``seconds[label]`` (a ``defaultdict(float)`` or a ``Counter``)."""
    method = getattr(owner, name)

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start

    setattr(owner, name, timed)


def copy_fn(numel: int, device: torch.device | str = "cpu") -> Callable[[], Any]:
    """A copy of ``numel`` float32 into a preallocated buffer: the unit of memory-bound cost."""
    source, target = torch.randn(numel, device=device), torch.empty(numel, device=device)
    target.copy_(source)  # touch the pages once
    return lambda: target.copy_(source)


def cpu_backends() -> list[str]:
    """The backends to compare on CPU: the torch reference first, the fastest last."""
    from onebit import kernels

    return [name for name in kernels.available() if name != "triton"]


def optimizer_step_times(
    shapes: Sequence[tuple[int, ...]],
    repeats: int,
    backend: str | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Seconds of ``Lamb.step()`` and of ``OneBitLamb``'s steps in each stage on parameters
    of ``shapes`` on every rank of the process group (world size 1 without one), each
    interleaved with a copy of all parameters, the dense allreduce of the gradients and
    ``compressed_allreduce`` alone; ``backend`` chooses OneBitLamb's kernels (the default
    ones when ``None``). Also the optimizers' memory (:meth:`memory_bytes`). At world size
    1 also the compression step of ``OneBitLamb(delayed_exchange=True)``, whose exchange
    then runs at once: beside the undelayed one, the delayed step's own passes over the
    weights (elsewhere its exchange runs in a thread, behind the other timings).

    Every rank passes the same gradients: Lamb, which does not communicate, then keeps its
    replicas identical, as it would under DDP."""
    import onebit
    from onebit.collectives import padded_size
    from onebit.optim.registry import optimizer_spec

    where = torch.device(device)
    world = dist.get_world_size() if dist.is_initialized() else 1

    def completed() -> None:
        if where.type == "cuda":
            torch.cuda.synchronize(where)

    def sync() -> None:
        completed()
        if world > 1:
            dist.barrier()

    def parameters() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, device=where) * 0.02) for s in shapes]

    lamb_params, onebit_params = parameters(), parameters()
    numel = sum(p.numel() for p in lamb_params)
    gen = torch.Generator(device=where).manual_seed(1)
    grads = [torch.randn(s, generator=gen, device=where) * 1e-3 for s in shapes]
    dense = torch.cat([g.reshape(-1) for g in grads])
    settings = {"lr": 1e-4, "weight_decay": 0.01, "freeze_step": repeats + 1}
    lamb = optimizer_spec("lamb").build(lamb_params, settings)
    optimizer = optimizer_spec("onebit-lamb").build(onebit_params, {**settings, "kernels": backend})

    def step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g  # the optimizers only read gradients
        opt.step()
        completed()

    copy = copy_fn(numel, where)
    fns = {
        "copy": lambda: (copy(), completed()),
        "lamb_step": lambda: step(lamb, lamb_params),
        "dense_allreduce": lambda: dist.all_reduce(dense) if world > 1 else None,
        "onebit_warmup_step": lambda: step(optimizer, onebit_params),
    }
    if world == 1:
        delayed_params = parameters()
        delayed = optimizer_spec("onebit-lamb").build(
            delayed_params, {**settings, "kernels": backend, "delayed_exchange": True}
        )
        fns["onebit_delayed_step"] = lambda: step(delayed, delayed_params)  # both stages
    warmup = interleaved(fns, repeats, sync)  # repeats + 1 warm-up steps: the last switches
    warmup_memory = optimizer.memory_bytes()
    del fns["onebit_warmup_step"], fns["dense_allreduce"]
    dense.resize_(0)
    size = padded_size(numel, world)
    exchange = (
        torch.randn(size, device=where),
        torch.zeros(size, device=where),
        torch.zeros(size // world, device=where),
    )
    workspace = onebit.CompressionWorkspace()
    fns["onebit_compression_step"] = lambda: step(optimizer, onebit_params)
    fns["compressed_allreduce"] = lambda: (
        onebit.compressed_allreduce(
            *exchange, out=exchange[0], workspace=workspace, kernels=backend
        ),
        completed(),
    )
    with warnings.catch_warnings():  # every rank passes the same gradients on purpose
        warnings.filterwarnings("ignore", message=".*bit-identical gradients", category=UserWarning)
        compression = interleaved(fns, repeats, sync)
    assert optimizer.stage == "compression"
    memory = optimizer.memory_bytes()
    return {
        "world_size": world,
        "backend": optimizer.backend.name,
        "device": str(where),
        "parameters": numel,
        "copy_s": statistics.median([warmup["copy"], compression["copy"]]),
        "lamb_step_s": statistics.median([warmup["lamb_step"], compression["lamb_step"]]),
        "dense_allreduce_s": warmup["dense_allreduce"] if world > 1 else 0.0,
        "onebit_warmup_step_s": warmup["onebit_warmup_step"],
        "onebit_compression_step_s": compression["onebit_compression_step"],
        "compressed_allreduce_s": compression["compressed_allreduce"],
        "onebit_delayed_compression_step_s": compression.get("onebit_delayed_step"),
        "lamb_state_bytes": lamb.memory_bytes()["state"],
        "onebit_warmup_state_bytes": warmup_memory["state"],
        "onebit_compression_state_bytes": memory["state"] + memory["error_feedback"],
        "onebit_scratch_bytes": memory["scratch"],
    }


def rank_step_times(rank: int, world: int, shapes, repeats: int, backend: str | None):
    """:func:`optimizer_step_times` as one rank of :func:`onebit.testing.spawn_workers`."""
    return optimizer_step_times(shapes, repeats, backend)
