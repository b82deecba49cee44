"""1-bit LAMB against LAMB and the alternatives on an emulated bandwidth-limited cluster.

``onebit bench cluster`` builds an :class:`~onebit.bench.cluster.EmulatedCluster` (one network
namespace per node, its link shaped with ``tc``), checks the shaping with a raw TCP stream,
starts ``workers_per_node`` workers per namespace (they talk over its unshaped loopback) joined
through ``torch.distributed``'s ``env://`` TCP rendezvous (as a multi-node ``torchrun`` job
starts) and runs, in one run, with the same model, data and per-worker batch, the methods of
:data:`onebit.bench.settings.METHODS`:

========================  =====================================================
``lamb``                  LAMB under DDP: dense fp32 gradient allreduce (baseline)
``lamb-compute``          the same with a no-op DDP hook: compute only, no traffic
``onebit-lamb-ddp``       1-bit LAMB, DDP communication-hook path
``onebit-lamb``           1-bit LAMB, plain path (no DDP)
``onebit-lamb-*overlap``  the same two, the exchange overlapped with backward
``onebit-lamb-overlap-per-tensor``
                          the plain path overlapped, per-tensor compression in
                          buckets of whole tensors
``onebit-lamb-delayed``   1-bit LAMB, plain path, each step's exchange run behind the
                          next step's forward and backward
``onebit-lamb-hier``      1-bit LAMB, hierarchical exchange over the nodes, DDP hook path
``onebit-adam``           1-bit Adam, DDP communication-hook path
``zero-one-adam``         0/1 Adam, DDP communication-hook path, each kind of step timed
``hsdp-lamb``             LAMB on FSDP2's HSDP: sharded in a node, dense between nodes
``hsdp-onebit-lamb``      1-bit LAMB on FSDP2 sharded in a node, 1-bit between nodes
``diloco-dense``          DiLoCo over LAMB, rounds of 4 steps, dense outer exchange; its
                          inner steps and the outer step timed apart
``diloco-1bit``           the same with the 1-bit outer exchange
``diloco-*-k2-d1``        Streaming DiLoCo, the same in 2 fragments, each exchanged at the
                          end of its turn of 2 steps, started a step before
``fp16``                  LAMB under DDP with PyTorch's ``fp16_compress_hook``
``powersgd-1``/``-4``     LAMB under DDP with PyTorch's PowerSGD hook, rank 1 / 4
========================  =====================================================

Each method starts from the same initial weights and sees the same batches. After untimed
steps, timed blocks of steps measure the step time of each stage (warm-up and compression for
the 1-bit methods, each kind of step for 0/1 Adam and DiLoCo, a steady state for the others),
and the bytes sent and received by every node's interface during the block, read from the kernel's
interface counters (:meth:`~onebit.bench.cluster.EmulatedCluster.interface_bytes`) at barriers
around the block; the 1-bit methods also report onebit's own accounting.
:mod:`onebit.bench.analysis` derives the speedups and targets from these measurements.

Needs Linux, root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; says so otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from onebit.bench.analysis import analyze
from onebit.bench.cluster import EmulatedCluster
from onebit.bench.cluster_tools import tcp_transfer
from onebit.bench.netns import ClusterUnavailable, unavailable_reason
from onebit.bench.settings import ComparisonSettings
from onebit.bert_shapes import PRESETS

logger = logging.getLogger(__name__)

__all__ = ["ComparisonError", "estimate_worker_memory", "run_comparison"]

_TAIL_CHARS = 4000
_FP32_COPIES_PER_WORKER = 11
"""fp32 copies of the parameters one worker holds at its peak (1-bit LAMB, plain path): the
initial model, the model, gradients, exp_avg, exp_avg_sq, exp_avg_sq_fresh, the flat warm-up
gradient buffer, the fused momentum buffer, worker_error and the compressed allreduce's two
full-size work buffers."""
_RUNTIME_BYTES = 800 * 2**20
"""Per-process overhead besides the parameters: interpreter, torch, transformers, activations."""
_MEMORY_MARGIN = 0.85
"""The largest share of the available memory the workers are estimated to use."""
_WORKER_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


class ComparisonError(RuntimeError):
    """The comparison could not run or its workers failed; the message says why."""


def estimate_worker_memory(parameters: int) -> int:
    """Rough peak resident bytes of one worker for a model of ``parameters`` fp32 parameters."""
    return parameters * 4 * _FP32_COPIES_PER_WORKER + _RUNTIME_BYTES


def _available_memory() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


def _check_memory(settings: ComparisonSettings) -> None:
    parameters = PRESETS[settings.model].parameter_count()
    available = _available_memory()
    need = settings.workers * estimate_worker_memory(parameters)
    if available is not None and need > _MEMORY_MARGIN * available:
        raise ComparisonError(
            f"{settings.workers} workers of the {settings.model!r} model "
            f"({parameters / 1e6:.1f}M parameters) need about {need / 2**30:.1f} GiB, "
            f"{available / 2**30:.1f} GiB available (at most {_MEMORY_MARGIN:.0%} of it is "
            "used): use a smaller --model, fewer --workers, or --no-memory-check"
        )


def run_comparison(settings: ComparisonSettings) -> dict[str, Any]:
    """Build the emulated cluster, run every method, tear it down; return the result dict.

    Raises:
        ComparisonError: a setting is out of range, the cluster cannot be built here, the
            memory would not suffice, or the workers failed before reporting anything.
    """
    try:
        settings = settings.resolved()
    except ValueError as exc:
        raise ComparisonError(str(exc)) from exc
    reason = unavailable_reason()
    if reason is not None:
        raise ComparisonError(f"the emulated cluster needs root and iproute2: {reason}")
    if settings.memory_check:
        _check_memory(settings)
    raw: dict[str, Any] = {
        "settings": {**dataclasses.asdict(settings), "cpu_cores": os.cpu_count() or 1},
        "code": _code_version(),
        "methods": {},
        "errors": [],
    }
    started = time.perf_counter()
    logdir = Path(tempfile.mkdtemp(prefix="onebit-bench-"))
    try:
        with EmulatedCluster(
            settings.nodes, bandwidth=settings.bandwidth, latency=settings.latency
        ) as cluster:
            raw["cluster"] = {
                "run_id": cluster.run_id,
                "configured_bits_per_second": cluster.rate_bits_per_second,
            }
            if settings.tcp_seconds > 0:
                raw["tcp_check"] = _tcp_check(cluster, settings.tcp_seconds)
            _Workers(cluster, settings, raw, logdir).run()
    except ClusterUnavailable as exc:
        raise ComparisonError(f"emulated cluster unavailable: {exc}") from exc
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    raw["wall_seconds"] = time.perf_counter() - started
    if not raw["methods"]:
        detail = "\n".join(raw["errors"])
        raise ComparisonError(f"no method completed:\n{detail}")
    return analyze(raw)


def _tcp_check(cluster: EmulatedCluster, seconds: float) -> dict[str, Any]:
    """One raw TCP stream from host 0 to host 1, against the configured rate."""
    transfer = tcp_transfer(cluster, 0, 1, seconds=seconds)
    rate = cluster.rate_bits_per_second
    logger.info(
        "TCP check host0 -> host1: %.1f Mbit/s%s",
        transfer.bits_per_second / 1e6,
        f" ({transfer.bits_per_second / rate:.3f} of configured)" if rate else "",
    )
    return {
        "src": 0,
        "dst": 1,
        "bytes": transfer.nbytes,
        "seconds": transfer.seconds,
        "bits_per_second": transfer.bits_per_second,
        "fraction_of_configured": (transfer.bits_per_second / rate) if rate else None,
    }


def _code_version() -> dict[str, Any]:
    """The git commit of the onebit source that ran, and its files with uncommitted changes."""
    import onebit

    root = Path(onebit.__file__).resolve().parents[2]
    version: dict[str, Any] = {"onebit": getattr(onebit, "__version__", None)}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "src/onebit"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        version.update(commit=commit, uncommitted=[line[3:] for line in dirty.splitlines() if line])
    return version


def _read_lines(stream: IO[str], sink: queue.Queue[str | None]) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-_TAIL_CHARS:]
    return ""


class _Workers:
    """The comparison's worker processes, ``workers_per_node`` per host, and the parent's side
    of their protocol (see :mod:`onebit.bench._worker`): rank 0 writes ``@@info``, ``@@method`` and
    ``@@done`` lines on stdout, and ``@@mark`` when it wants every host's interface counters,
    which the parent answers on its stdin. Everything goes into ``raw``."""

    def __init__(
        self,
        cluster: EmulatedCluster,
        settings: ComparisonSettings,
        raw: dict[str, Any],
        logdir: Path,
    ) -> None:
        self.cluster = cluster
        self.settings = settings
        self.raw = raw
        self.logs = [logdir / f"rank{rank}.log" for rank in range(settings.workers)]

    def _start(self) -> list[subprocess.Popen[str]]:
        argv = [
            sys.executable,
            "-m",
            "onebit.bench._worker",
            json.dumps(dataclasses.asdict(self.settings)),
        ]
        env = {**_WORKER_ENV, "OMP_NUM_THREADS": str(self.settings.threads)}
        with contextlib.ExitStack() as stack:
            logs = [stack.enter_context(path.open("w")) for path in self.logs]
            return self.cluster.launch_ranks(
                argv,
                env=env,
                rank_kwargs=lambda rank: {
                    "stdin": subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    "stdout": subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    "stderr": logs[rank],
                },
                ranks_per_host=self.settings.workers_per_node,
            )

    def _counters(self) -> list[tuple[int, int]]:
        return [self.cluster.interface_bytes(i) for i in range(self.settings.nodes)]

    def run(self) -> None:
        before = self._counters()
        processes = self._start()
        done = False
        try:
            done = self._serve(processes)
            if done:
                for process in processes:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=60)
            after = self._counters()
            self.raw["interface_totals"] = {
                "tx_bytes_by_host": [a[0] - b[0] for a, b in zip(after, before, strict=True)],
                "rx_bytes_by_host": [a[1] - b[1] for a, b in zip(after, before, strict=True)],
            }
        finally:
            for process in processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=10)
        errors = self.raw["errors"]
        failed = {r: p.returncode for r, p in enumerate(processes) if p.returncode not in (0, None)}
        if not done:
            for rank, path in enumerate(self.logs):
                tail = _tail(path)
                if tail.strip():
                    errors.append(f"rank {rank} log tail:\n{tail}")
        elif failed:
            # Every result has arrived; torch sometimes aborts a worker while it exits
            # ("terminate called without an active exception"), which changes none of them.
            logger.warning("after reporting every result, worker exit codes were %s", failed)
        missing = [
            m
            for m in self.settings.methods
            if len(self.raw["methods"].get(m, {}).get("runs", [])) < self.settings.rounds
        ]
        if missing:
            errors.append(f"no result for {missing}")

    def _serve(self, processes: list[subprocess.Popen[str]]) -> bool:
        """Answer rank 0 until it reports ``@@done`` (True), fails or times out (False)."""
        rank0 = processes[0]
        assert rank0.stdin is not None and rank0.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_read_lines, args=(rank0.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + self.settings.timeout
        errors = self.raw["errors"]
        while True:
            if time.monotonic() > deadline:
                errors.append(
                    f"timed out after {self.settings.timeout:.0f} s, before every method's "
                    "rounds had run (a longer run needs a larger --timeout)"
                )
                return False
            failed = [r for r, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failed:
                codes = [processes[r].returncode for r in failed]
                errors.append(f"worker rank(s) {failed} exited with {codes}")
                return False
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                errors.append("rank 0 closed its output before reporting 'done'")
                return False
            kind, _, payload = line.strip().partition(" ")
            if kind == "@@mark":
                rank0.stdin.write(json.dumps({"counters": self._counters()}) + "\n")
                rank0.stdin.flush()
            elif kind == "@@info":
                self.raw["info"] = json.loads(payload)
                logger.info("workers ready: %s", self.raw["info"])
            elif kind == "@@method":
                self._record(json.loads(payload))
            elif kind == "@@done":
                return True
            elif line.strip():
                logger.info("rank 0: %s", line.rstrip())

    def _record(self, record: dict[str, Any]) -> None:
        name, round_ = record["method"], record["round"]
        entry = self.raw["methods"].setdefault(
            name, {"label": record["label"], "ok": False, "runs": [], "errors": []}
        )
        entry["runs"].append(record)
        if record["ok"]:
            entry["ok"] = True
            logger.info("%s (round %d): done in %.1f s", name, round_, record["wall_seconds"])
        else:
            entry["errors"].append(f"round {round_}: {record['error']}")
            logger.warning("%s (round %d): SKIPPED, %s", name, round_, record["error"])
