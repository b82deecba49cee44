"""Run a function on several local ranks, for tests and single-machine experiments.

:func:`spawn_workers` starts one process per rank, forked from multiprocessing's fork server
(which imports torch once, so that no rank imports it again; the ``spawn`` start method where
there is no fork server), joins them in a gloo (or NCCL) process group through a file store
in a fresh temporary directory (no fixed port), and returns each rank's return value. A worker
that raises, dies or overruns the timeout makes the call raise :class:`WorkerError` with every
failing rank's traceback, and no process is left behind. Training runs are launched with
torch's elastic launcher instead (see :mod:`onebit.train`). :func:`backend_device` says where a
backend's tests run.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from onebit.kernels import native_device

if TYPE_CHECKING:  # the fork server's context exists only where the platform has one
    from multiprocessing.context import ForkServerContext, SpawnContext

__all__ = ["WorkerError", "backend_device", "spawn_workers"]


def backend_device(backend: str) -> torch.device:
    """Where tests run a backend: triton on CUDA where there is a GPU (on CPU otherwise,
    through Triton's interpreter), every other backend on CPU."""
    cuda = native_device(backend) == "cuda" and torch.cuda.is_available()
    return torch.device("cuda" if cuda else "cpu")


class WorkerError(RuntimeError):
    """One or more spawned ranks failed, died or timed out."""


#: What the fork server imports once, before it forks the ranks: this module, and with it
#: torch, torch.distributed and onebit.
_SERVER_PRELOAD = [__name__]


def _start_context() -> ForkServerContext | SpawnContext:
    """The fork server's context, its preload set, where the platform has one; else spawn.

    A rank forked from the server starts with the server's environment (the first call's);
    :func:`_worker_main` then takes the caller's, so that only variables read when torch or
    onebit is imported keep the first call's values. sys.path and the working directory are
    the caller's, as with spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_SERVER_PRELOAD)
    return ctx


def _worker_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    collective_timeout_s: float,
    threads: int,
    args: Sequence[Any],
    results: mp.Queue,
    environment: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environment)
    try:
        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Pickled by value: torch's fd-sharing of tensors breaks once the worker exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        results.put((rank, False, traceback.format_exc()))


def spawn_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    threads_per_rank: int = 1,
    may_die: Collection[int] = (),
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes in one group.

    ``fn`` must be importable by name (a module-level function) and its return value
    picklable. Returns the values in rank order. Raises :class:`WorkerError` if any rank
    raises, exits without a result, or the whole call exceeds ``timeout_s``. Ranks in
    ``may_die`` may exit without a result (fault-injection tests): theirs is ``None`` and the
    other ranks are still waited for.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _start_context()
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="onebit-store-") as tmp:
        store_path = os.path.join(tmp, "store")
        processes = [
            ctx.Process(
                target=_worker_main,
                args=(
                    fn,
                    rank,
                    world_size,
                    store_path,
                    backend,
                    collective_timeout_s,
                    threads_per_rank,
                    tuple(args),
                    results,
                    dict(os.environ),
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outcomes) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 0.5))
                    outcomes[rank] = (ok, value)
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(processes)
                        if r not in outcomes and p.exitcode is not None
                    ]
                    if dead:
                        # Give a dying rank's report a moment to arrive, then stop waiting.
                        time.sleep(0.5)
                        while not results.empty():
                            rank, ok, value = results.get()
                            outcomes[rank] = (ok, value)
                        for r in dead:
                            outcomes.setdefault(
                                r,
                                (True, pickle.dumps(None))
                                if r in may_die
                                else (False, f"exited with code {processes[r].exitcode}"),
                            )
                        if any(not ok for ok, _ in outcomes.values()):
                            break
        finally:
            for process in processes:
                process.join(timeout=5 if len(outcomes) == world_size else 0.1)
                if process.is_alive():
                    process.kill()
                    process.join()
    failures = {r: v for r, (ok, v) in sorted(outcomes.items()) if not ok}
    missing = [r for r in range(world_size) if r not in outcomes]
    if failures or missing:
        lines = [f"rank {r} failed:\n{v}" for r, v in failures.items()]
        if missing:
            lines.append(f"rank(s) {missing} gave no result within {timeout_s:.0f} s")
        raise WorkerError("\n".join(lines))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
