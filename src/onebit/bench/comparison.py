"""1-bit LAMB against LAMB and the alternatives on an emulated bandwidth-limited cluster.

``onebit bench cluster`` builds an :class:`~onebit.bench.cluster.EmulatedCluster` (one network
namespace per worker, links shaped with ``tc``), checks the shaping with a raw TCP stream,
starts one worker per namespace joined through ``torch.distributed``'s ``env://`` TCP
rendezvous (as a multi-node ``torchrun`` job starts) and runs, in one run, with the same model,
data and per-worker batch:

========================  =====================================================
``lamb``                  LAMB under DDP: dense fp32 gradient allreduce (baseline)
``lamb-compute``          the same with a no-op DDP hook: compute only, no traffic
``onebit-lamb-ddp``       1-bit LAMB, DDP communication-hook path
``onebit-lamb``           1-bit LAMB, plain path (no DDP)
``onebit-adam``           1-bit Adam, DDP communication-hook path
``fp16``                  LAMB under DDP with PyTorch's ``fp16_compress_hook``
``powersgd-1``/``-4``     LAMB under DDP with PyTorch's PowerSGD hook, rank 1 / 4
========================  =====================================================

Each method starts from the same initial weights and sees the same batches. After untimed
steps, timed blocks of steps measure the step time of each stage (warm-up and compression for
the 1-bit methods, a steady state for the others), and the bytes sent and received by every
worker's interface during the block, read from the kernel's interface counters
(:meth:`~onebit.bench.cluster.EmulatedCluster.interface_bytes`) at barriers around the block;
the 1-bit methods also report onebit's own accounting (:data:`onebit.TRAFFIC`).

Derived figures:

* ``s``, the share of LAMB's step spent on communication: ``1 - t(lamb-compute) / t(lamb)``.
* The end-to-end time of a run of ``S`` steps with warm-up fraction ``w``, *computed* from the
  measured per-stage step times, ``T = w S t_warm + (1 - w) S t_comp`` (methods without stages
  use their steady step time for both), and the speedup ``T(lamb) / T``.
* Whole-run traffic reduction ``B(lamb) / (w B_warm + (1 - w) B_comp)`` from the measured bytes.
* The ideals for 32x compression: ``1 / (w + (1 - w) / 32)`` for traffic and
  ``1 / ((1 - s) + s / 32)`` for the compression-stage speedup.

``onebit bench sweep`` runs the comparison over bandwidths and worker counts and plots the
speedups against bandwidth beside the ideal for the measured ``s``.

Needs Linux, root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; says so otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("onebit.bench.comparison")

__all__ = [
    "ALL_METHODS",
    "analyze",
    "estimate_worker_memory",
    "format_report",
    "ideal_speedup",
    "ideal_traffic_reduction",
    "register",
    "run_comparison",
    "run_sweep",
]

ALL_METHODS = (
    "lamb",
    "lamb-compute",
    "onebit-lamb-ddp",
    "onebit-lamb",
    "onebit-adam",
    "fp16",
    "powersgd-1",
    "powersgd-4",
)
ONEBIT_METHODS = ("onebit-lamb-ddp", "onebit-lamb", "onebit-adam")
ONEBIT_LAMB_METHODS = ("onebit-lamb-ddp", "onebit-lamb")
COMPRESSION_RATIO = 32.0
TARGET_WARMUP_FRACTIONS = (0.15, 0.20)
_TAIL_CHARS = 4000


# ----- the ideal figures -------------------------------------------------------------------


def ideal_traffic_reduction(w: float, ratio: float = COMPRESSION_RATIO) -> float:
    """Whole-run traffic reduction against fp32 with a fraction ``w`` of uncompressed steps."""
    return 1.0 / (w + (1.0 - w) / ratio)


def ideal_speedup(s: float, ratio: float = COMPRESSION_RATIO, w: float = 0.0) -> float:
    """Speedup over the baseline when a share ``s`` of its step is communication, the
    compressed steps send ``1/ratio`` of the bytes, and a fraction ``w`` of steps is not
    compressed (``w = 0``: the compression stage alone)."""
    compressed = (1.0 - s) + s / ratio
    return 1.0 / (w + (1.0 - w) * compressed)


# ----- memory ------------------------------------------------------------------------------

_FP32_COPIES_PER_WORKER = 11
"""fp32 copies of the parameters one worker holds at its peak (1-bit LAMB, plain path): the
initial model, the model, gradients, exp_avg, exp_avg_sq, exp_avg_sq_fresh, the flat warm-up
gradient buffer, the fused momentum buffer, worker_error and the compressed allreduce's two
full-size work buffers."""
_RUNTIME_BYTES = 800 * 2**20
_MEMORY_MARGIN = 0.85
"""Per-process overhead besides the parameters: interpreter, torch, transformers, activations."""


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


# ----- running one comparison --------------------------------------------------------------


class ComparisonError(RuntimeError):
    """The comparison could not run or its workers failed; the message says why."""


def _worker_config(args: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "model",
        "batch_size",
        "seq_len",
        "steps",
        "warm_steps",
        "skip_steps",
        "methods",
        "threads",
        "timeout",
        "seed",
        "lr",
        "rounds",
    )
    return {key: args[key] for key in keys}


def _read_lines(stream: Any, sink: queue.Queue[str | None]) -> None:
    for line in stream:
        sink.put(line)
    sink.put(None)


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace")
        return text[-_TAIL_CHARS:]
    return ""


def run_comparison(
    workers: int = 4,
    bandwidth: str | None = "1gbit",
    latency: str | None = None,
    model: str = "base",
    batch_size: int = 1,
    seq_len: int = 128,
    steps: int = 3,
    warm_steps: int = 2,
    skip_steps: int = 1,
    methods: Sequence[str] = ALL_METHODS,
    freeze_fraction: float = 0.2,
    run_steps: int = 10000,
    tcp_seconds: float = 2.0,
    threads: int | None = None,
    timeout: float = 1800.0,
    seed: int = 0,
    lr: float = 1e-3,
    rounds: int = 2,
    memory_check: bool = True,
) -> dict[str, Any]:
    """Build the emulated cluster, run every method, tear it down; return the result dict.

    Raises:
        ComparisonError: the cluster cannot be built here, the memory would not suffice, or
            the workers failed before reporting anything.
    """
    from onebit.bench.bert import PRESETS
    from onebit.bench.cluster import ClusterUnavailable, EmulatedCluster, unavailable_reason

    if workers < 2:
        raise ComparisonError(f"--workers must be at least 2, got {workers}")
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ComparisonError(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)}")
    if model not in PRESETS:
        raise ComparisonError(f"unknown model preset {model!r}; choose from {sorted(PRESETS)}")
    for name, value, low in (
        ("steps", steps, 1),
        ("warm_steps", warm_steps, 1),
        ("skip_steps", skip_steps, 1),
        ("batch_size", batch_size, 1),
    ):
        if value < low:
            raise ComparisonError(f"{name} must be at least {low}, got {value}")
    if not 0.0 <= freeze_fraction <= 1.0:
        raise ComparisonError(f"freeze_fraction must be in [0, 1], got {freeze_fraction}")
    reason = unavailable_reason()
    if reason is not None:
        raise ComparisonError(f"the emulated cluster needs root and iproute2: {reason}")
    parameters = PRESETS[model].parameter_count()
    available = _available_memory()
    need = workers * estimate_worker_memory(parameters)
    if memory_check and available is not None and need > _MEMORY_MARGIN * available:
        raise ComparisonError(
            f"{workers} workers of the {model!r} model ({parameters / 1e6:.1f}M parameters) need "
            f"about {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available (at most "
            f"{_MEMORY_MARGIN:.0%} of it is used): use a smaller "
            "--model, fewer --workers, or --no-memory-check"
        )
    cores = os.cpu_count() or 1
    threads = threads or max(1, cores // workers)
    settings = {
        "workers": workers,
        "bandwidth": bandwidth,
        "latency": latency,
        "model": model,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "warm_steps": warm_steps,
        "skip_steps": skip_steps,
        "methods": list(methods),
        "freeze_fraction": freeze_fraction,
        "run_steps": run_steps,
        "threads": threads,
        "timeout": timeout,
        "seed": seed,
        "lr": lr,
        "rounds": rounds,
        "cpu_cores": cores,
    }
    raw: dict[str, Any] = {
        "settings": settings,
        "code": _code_version(),
        "methods": {},
        "errors": [],
    }
    started = time.perf_counter()
    logdir = Path(tempfile.mkdtemp(prefix="onebit-bench-"))
    try:
        with EmulatedCluster(workers, bandwidth=bandwidth, latency=latency) as cluster:
            raw["cluster"] = {
                "run_id": cluster.run_id,
                "configured_bits_per_second": cluster.rate_bits_per_second,
            }
            if tcp_seconds > 0:
                transfer = cluster.tcp_transfer(0, 1, seconds=tcp_seconds)
                rate = cluster.rate_bits_per_second
                raw["tcp_check"] = {
                    "src": 0,
                    "dst": 1,
                    "bytes": transfer.nbytes,
                    "seconds": transfer.seconds,
                    "bits_per_second": transfer.bits_per_second,
                    "fraction_of_configured": (transfer.bits_per_second / rate) if rate else None,
                }
                logger.info(
                    "TCP check host0 -> host1: %.1f Mbit/s%s",
                    transfer.bits_per_second / 1e6,
                    f" ({transfer.bits_per_second / rate:.3f} of configured)" if rate else "",
                )
            _run_workers(cluster, settings, raw, logdir)
    except ClusterUnavailable as exc:
        raise ComparisonError(f"emulated cluster unavailable: {exc}") from exc
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    raw["wall_seconds"] = time.perf_counter() - started
    if not raw["methods"]:
        detail = "\n".join(raw["errors"])
        raise ComparisonError(f"no method completed:\n{detail}")
    return analyze(raw)


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


def _run_workers(cluster: Any, settings: dict[str, Any], raw: dict[str, Any], logdir: Path) -> None:
    workers = settings["workers"]
    config = json.dumps(_worker_config(settings))
    argv = [sys.executable, "-m", "onebit.bench._worker", config]
    env = {
        "OMP_NUM_THREADS": str(settings["threads"]),
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    totals_before = [cluster.interface_bytes(i) for i in range(workers)]
    port = cluster.free_port(0)
    master = cluster.host_address(0)
    processes = []
    logs = []
    for rank in range(workers):
        log_path = logdir / f"rank{rank}.log"
        logs.append(log_path)
        with open(log_path, "w") as log:
            processes.append(
                cluster.popen(
                    rank,
                    argv,
                    env={**env, **cluster.torchrun_like_env(rank, workers, master, port)},
                    stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stderr=log,
                )
            )
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(processes[0].stdout, lines), daemon=True)
    reader.start()
    deadline = time.monotonic() + settings["timeout"]
    done = False
    try:
        while not done:
            if time.monotonic() > deadline:
                raw["errors"].append(f"timed out after {settings['timeout']:.0f} s")
                break
            failed = [r for r, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failed:
                raw["errors"].append(
                    f"worker rank(s) {failed} exited with "
                    f"{[processes[r].returncode for r in failed]}"
                )
                break
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                raw["errors"].append("rank 0 closed its output before reporting 'done'")
                break
            kind, _, payload = line.strip().partition(" ")
            if kind == "@@mark":
                counters = [list(cluster.interface_bytes(i)) for i in range(workers)]
                assert processes[0].stdin is not None
                processes[0].stdin.write(json.dumps({"counters": counters}) + "\n")
                processes[0].stdin.flush()
            elif kind == "@@info":
                raw["info"] = json.loads(payload)
                logger.info("workers ready: %s", raw["info"])
            elif kind == "@@method":
                record = json.loads(payload)
                name = record["method"]
                entry = raw["methods"].setdefault(
                    name, {"label": record["label"], "ok": False, "runs": [], "errors": []}
                )
                entry["runs"].append(record)
                if record["ok"]:
                    entry["ok"] = True
                    logger.info(
                        "%s (round %d): done in %.1f s",
                        name,
                        record["round"],
                        record["wall_seconds"],
                    )
                else:
                    entry["errors"].append(f"round {record['round']}: {record['error']}")
                    logger.warning(
                        "%s (round %d): SKIPPED, %s", name, record["round"], record["error"]
                    )
            elif kind == "@@done":
                done = True
            elif line.strip():
                logger.info("rank 0: %s", line.rstrip())
        if done:
            for process in processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=60)
        totals_after = [cluster.interface_bytes(i) for i in range(workers)]
        raw["interface_totals"] = {
            "tx_bytes_by_host": [
                a[0] - b[0] for a, b in zip(totals_after, totals_before, strict=False)
            ],
            "rx_bytes_by_host": [
                a[1] - b[1] for a, b in zip(totals_after, totals_before, strict=False)
            ],
        }
    finally:
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
    if not done or any(p.returncode not in (0, None) for p in processes):
        for rank, path in enumerate(logs):
            tail = _tail(path)
            if tail.strip():
                raw["errors"].append(f"rank {rank} log tail:\n{tail}")
    missing = [
        m
        for m in settings["methods"]
        if len(raw["methods"].get(m, {}).get("runs", [])) < settings["rounds"]
    ]
    if missing:
        raw["errors"].append(f"no result for {missing}")


# ----- analysis ----------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _stage_summary(blocks: Sequence[dict[str, Any]], world: int, batch_size: int) -> dict[str, Any]:
    """One stage of one method over its rounds: the fastest round's step time (the machine is
    shared, so contention only ever adds time), byte counts averaged over the rounds."""
    means = [b["seconds"] / b["steps"] for b in blocks]
    step_seconds = min(means)
    summary: dict[str, Any] = {
        "steps_per_round": blocks[0]["steps"],
        "rounds": len(blocks),
        "step_seconds": step_seconds,
        "step_seconds_by_round": means,
        "samples_per_second": world * batch_size / step_seconds,
        "rank0_step_seconds": [b["rank0_step_seconds"] for b in blocks],
        "library_bytes_per_step": _mean(
            [_mean(b["library_bytes_by_rank"]) / b["steps"] for b in blocks]
        ),
        "last_loss": blocks[-1]["last_loss"],
    }
    fastest = blocks[means.index(step_seconds)]
    for key in ("forward_backward", "optimizer_step"):
        values = fastest.get(f"rank0_{key}_seconds")
        if values:  # rank 0's split of the fastest round's steps
            summary[f"rank0_{key}_seconds"] = _mean(values)
    wired = [b for b in blocks if "interface_tx_bytes_by_host" in b]
    if wired:
        summary["wire_tx_bytes_per_step"] = _mean(
            [_mean(b["interface_tx_bytes_by_host"]) / b["steps"] for b in wired]
        )
        summary["wire_rx_bytes_per_step"] = _mean(
            [_mean(b["interface_rx_bytes_by_host"]) / b["steps"] for b in wired]
        )
        summary["wire_tx_bytes_per_step_by_host"] = [
            _mean(per_host)
            for per_host in zip(
                *[[x / b["steps"] for x in b["interface_tx_bytes_by_host"]] for b in wired],
                strict=False,
            )
        ]
    return summary


def analyze(raw: dict[str, Any]) -> dict[str, Any]:
    """Add per-stage summaries, the communication share, speedups and targets to ``raw``."""
    settings = raw["settings"]
    world, batch = settings["workers"], settings["batch_size"]
    w, steps_run = settings["freeze_fraction"], settings["run_steps"]
    parameters = raw.get("info", {}).get("parameters")
    summary: dict[str, Any] = {}
    for name, entry in raw["methods"].items():
        runs = [run for run in entry["runs"] if run.get("ok")]
        if not runs:
            continue
        by_stage: dict[str, list[dict[str, Any]]] = {}
        for run in runs:
            for block in run["blocks"]:
                by_stage.setdefault(block["stage"], []).append(block)
        stages = {stage: _stage_summary(blocks, world, batch) for stage, blocks in by_stage.items()}
        if "steady" in stages:
            warm = comp = stages["steady"]
        else:
            warm, comp = stages["warmup"], stages["compression"]
        summary[name] = {
            "label": entry["label"],
            "stages": stages,
            "t_warm": warm["step_seconds"],
            "t_comp": comp["step_seconds"],
            "end_to_end_seconds": steps_run
            * (w * warm["step_seconds"] + (1 - w) * comp["step_seconds"]),
            "wire_warm": warm.get("wire_tx_bytes_per_step"),
            "wire_comp": comp.get("wire_tx_bytes_per_step"),
            "peak_rss_bytes": max(run.get("peak_rss_bytes") or 0 for run in runs),
        }
    derived: dict[str, Any] = {
        "freeze_fraction": w,
        "run_steps": steps_run,
        "end_to_end_note": (
            "end-to-end time is computed, not measured end to end: T = w*S*t_warm + "
            "(1-w)*S*t_comp from the measured per-stage step times (methods without stages: "
            "their steady step time for both)"
        ),
    }
    if parameters and world > 1:
        derived["ring_allreduce_fp32_bytes_per_step_model"] = (
            2 * (world - 1) / world * 4 * parameters
        )
        derived["onebit_bytes_per_step_model"] = 2 * (world - 1) / world * parameters / 8
    lamb = summary.get("lamb")
    compute = summary.get("lamb-compute")
    if lamb and compute:
        s = max(0.0, 1.0 - compute["t_comp"] / lamb["t_comp"])
        derived["comm_share"] = s
        derived["ideal_compression_stage_speedup"] = ideal_speedup(s)
        derived["ideal_end_to_end_speedup"] = ideal_speedup(s, w=w)
    for name, item in summary.items():
        if lamb:
            item["compression_stage_speedup"] = lamb["t_comp"] / item["t_comp"]
            item["warmup_stage_speedup"] = lamb["t_comp"] / item["t_warm"]
            item["end_to_end_speedup"] = lamb["end_to_end_seconds"] / item["end_to_end_seconds"]
            b_lamb = lamb["wire_comp"]
            if b_lamb and item["wire_comp"] and name != "lamb-compute":  # sends ~nothing
                item["compression_stage_bytes_reduction"] = b_lamb / item["wire_comp"]
                item["whole_run_traffic_reduction"] = {
                    f"{fraction:.2f}": b_lamb
                    / (fraction * item["wire_warm"] + (1 - fraction) * item["wire_comp"])
                    for fraction in sorted({*TARGET_WARMUP_FRACTIONS, w})
                }
    raw["summary"] = summary
    raw["derived"] = derived
    raw["targets"] = _targets(raw)
    return raw


def _target(met: bool | None, detail: str) -> dict[str, Any]:
    return {"met": met, "detail": detail}


def _targets(raw: dict[str, Any]) -> dict[str, Any]:
    summary, derived, settings = raw["summary"], raw["derived"], raw["settings"]
    targets: dict[str, Any] = {}
    lamb = summary.get("lamb")
    onebit = [m for m in ONEBIT_METHODS if m in summary]
    if not lamb or not onebit:
        return {"note": "LAMB or every 1-bit method is missing: no target can be evaluated"}
    ratios = {m: summary[m].get("compression_stage_bytes_reduction") for m in onebit}
    if all(r is not None for r in ratios.values()):
        worst = min(ratios.values())
        targets["compression_bytes_30x"] = _target(
            worst >= 30.0,
            "wire bytes per worker per step, LAMB / compression stage: "
            + ", ".join(f"{m} {r:.1f}x" for m, r in ratios.items()),
        )
    for fraction in TARGET_WARMUP_FRACTIONS:
        ideal = ideal_traffic_reduction(fraction)
        got = {
            m: summary[m]["whole_run_traffic_reduction"][f"{fraction:.2f}"]
            for m in onebit
            if "whole_run_traffic_reduction" in summary[m]
        }
        if got:
            targets[f"whole_run_traffic_w{round(fraction * 100)}"] = _target(
                min(got.values()) >= 0.95 * ideal,
                f"ideal {ideal:.2f}x; measured "
                + ", ".join(f"{m} {r:.2f}x ({r / ideal:.3f} of ideal)" for m, r in got.items()),
            )
    s = derived.get("comm_share")
    lamb_paths = [m for m in ONEBIT_LAMB_METHODS if m in summary]
    if s is None:
        targets["speedup_where_comm_70"] = _target(None, "comm share not measured")
    elif s < 0.7:
        targets["speedup_where_comm_70"] = _target(
            None, f"not applicable: LAMB's communication share here is {s:.2f} < 0.70"
        )
    elif lamb_paths:
        fp16 = summary.get("fp16")
        parts, met = [], True
        for m in lamb_paths:
            speedup = summary[m]["compression_stage_speedup"]
            above_fp16 = fp16 is None or summary[m]["t_comp"] < fp16["t_comp"]
            met = met and speedup >= 2.8 and above_fp16
            parts.append(
                f"{m}: compression-stage throughput {speedup:.2f}x LAMB"
                + (f", fp16 hook {lamb['t_comp'] / fp16['t_comp']:.2f}x" if fp16 else "")
                + f"; whole-run {summary[m]['end_to_end_speedup']:.2f}x"
            )
        targets["speedup_where_comm_70"] = _target(
            met,
            f"s = {s:.2f}, ideal compression-stage {ideal_speedup(s):.2f}x, ideal whole-run "
            f"(w = {settings['freeze_fraction']:.2f}) "
            f"{ideal_speedup(s, w=settings['freeze_fraction']):.2f}x; " + "; ".join(parts),
        )
    if settings["bandwidth"] is None:
        parts, met = [], True
        for m in lamb_paths:
            ratio = summary[m]["t_comp"] / lamb["t_comp"]
            met = met and ratio <= 1.1
            parts.append(f"{m} compression-stage step / LAMB step = {ratio:.2f}")
        targets["unshaped_step_within_1.1x"] = _target(
            met if lamb_paths else None, "; ".join(parts)
        )
    return targets


# ----- reporting ---------------------------------------------------------------------------


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else fmt.format(value)
    )


def format_report(result: dict[str, Any]) -> str:
    """A Markdown report of one comparison: settings, TCP check, the table and the targets."""
    settings, summary, derived = result["settings"], result["summary"], result["derived"]
    info = result.get("info", {})
    bandwidth = settings["bandwidth"] or "unshaped"
    out = [
        f"### {settings['workers']} workers, {bandwidth}, model {settings['model']} "
        f"({_num(info.get('parameters', 0) / 1e6, '{:.1f}')}M parameters), per-worker batch "
        f"{settings['batch_size']} x {settings['seq_len']} tokens",
        "",
    ]
    tcp = result.get("tcp_check")
    if tcp:
        frac = tcp["fraction_of_configured"]
        out.append(
            f"TCP check host0 -> host1: {tcp['bits_per_second'] / 1e6:.1f} Mbit/s"
            + (f" ({frac:.3f} of the configured rate)" if frac else " (unshaped)")
        )
    s = derived.get("comm_share")
    if s is not None:
        out.append(
            f"LAMB communication share s = 1 - t_compute/t_step = {s:.2f} "
            f"(ideal compression-stage speedup {derived['ideal_compression_stage_speedup']:.2f}x, "
            f"ideal whole-run speedup at w = {derived['freeze_fraction']:.2f}: "
            f"{derived['ideal_end_to_end_speedup']:.2f}x)"
        )
    out += [
        "",
        "| method | warm-up samples/s | compression / steady samples/s | wire MB/step/worker "
        "(warm-up / compr.) | library MB/step (warm-up / compr.) | bytes vs LAMB (compr.) | "
        f"T for {derived['run_steps']} steps, w={derived['freeze_fraction']:.2f} (computed) | "
        "compr.-stage speedup | whole-run speedup | compr./steady step: fwd+bwd / opt.step "
        "(rank 0) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in settings["methods"]:
        if name not in summary:
            errors = result["methods"].get(name, {}).get("errors") or ["no result"]
            error = "; ".join(errors)
            out.append(f"| {name} | skipped: {error} |  |  |  |  |  |  |  |  |")
            continue
        item = summary[name]
        stages = item["stages"]
        staged = "steady" not in stages
        warm = stages["warmup"] if staged else None
        comp = stages["compression"] if staged else stages["steady"]
        lib = (
            f"{_mb(warm['library_bytes_per_step'])} / {_mb(comp['library_bytes_per_step'])}"
            if staged
            else "-"
        )
        wire = (
            f"{_mb(warm.get('wire_tx_bytes_per_step'))} / {_mb(comp.get('wire_tx_bytes_per_step'))}"
            if staged
            else _mb(comp.get("wire_tx_bytes_per_step"))
        )
        reduction = item.get("compression_stage_bytes_reduction")
        out.append(
            f"| {name} | {_num(warm['samples_per_second']) if staged else '-'} | "
            f"{_num(comp['samples_per_second'])} | {wire} | {lib} | "
            f"{_num(reduction, '{:.1f}x')} | {item['end_to_end_seconds']:.0f} s | "
            f"{_num(item.get('compression_stage_speedup'), '{:.2f}x')} | "
            f"{_num(item.get('end_to_end_speedup'), '{:.2f}x')} | "
            f"{_num(comp.get('rank0_forward_backward_seconds'), '{:.2f} s')} / "
            f"{_num(comp.get('rank0_optimizer_step_seconds'), '{:.2f} s')} |"
        )
    out += ["", "| target | met | detail |", "|---|---|---|"]
    for name, target in result["targets"].items():
        if isinstance(target, dict):
            met = {True: "yes", False: "NO", None: "n/a"}[target["met"]]
            out.append(f"| {name} | {met} | {target['detail']} |")
        else:
            out.append(f"| {name} | | {target} |")
    if result.get("errors"):
        out += [
            "",
            "Errors:",
            *[f"    {line}" for e in result["errors"] for line in e.splitlines()],
        ]
    return "\n".join(out)


def _write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")


# ----- sweep -------------------------------------------------------------------------------


def _bandwidth_label(bandwidth: str | None) -> str:
    return bandwidth or "unshaped"


def run_sweep(
    bandwidths: Sequence[str | None],
    bandwidth_workers: int,
    worker_counts: Sequence[int],
    worker_bandwidth: str | None,
    out_dir: Path,
    **kwargs: Any,
) -> dict[str, Any]:
    """The comparison at every bandwidth (``bandwidth_workers`` workers) and at every worker
    count (``worker_bandwidth``); writes one JSON per configuration, a summary JSON and a PNG.
    A configuration that fails is recorded with its error and the sweep goes on."""
    configs: list[tuple[int, str | None]] = [(bandwidth_workers, b) for b in bandwidths]
    configs += [
        (n, worker_bandwidth) for n in worker_counts if (n, worker_bandwidth) not in configs
    ]
    model = kwargs.get("model", "base")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for workers, bandwidth in configs:
        label = f"{model}-{workers}w-{_bandwidth_label(bandwidth)}"
        logger.info("sweep: %s", label)
        try:
            result = run_comparison(workers=workers, bandwidth=bandwidth, **kwargs)
        except ComparisonError as exc:
            logger.error("sweep: %s failed: %s", label, exc)
            results.append({"workers": workers, "bandwidth": bandwidth, "error": str(exc)})
            continue
        _write_json(result, out_dir / f"cluster-{label}.json")
        print(format_report(result), flush=True)
        results.append(_sweep_row(result))
    sweep = {
        "model": model,
        "bandwidth_workers": bandwidth_workers,
        "worker_bandwidth": worker_bandwidth,
        "rows": results,
    }
    if bandwidths and not worker_counts:
        tag = f"bandwidth-{bandwidth_workers}w"
    elif worker_counts and not bandwidths:
        tag = f"workers-{_bandwidth_label(worker_bandwidth)}"
    else:
        tag = "bandwidth-workers"
    _write_json(sweep, out_dir / f"sweep-{model}-{tag}.json")
    plot_sweep(sweep, out_dir / f"speedup-{model}-{tag}.png")
    return sweep


def _sweep_row(result: dict[str, Any]) -> dict[str, Any]:
    settings, summary, derived = result["settings"], result["summary"], result["derived"]
    tcp = result.get("tcp_check") or {}
    return {
        "workers": settings["workers"],
        "bandwidth": settings["bandwidth"],
        "tcp_bits_per_second": tcp.get("bits_per_second"),
        "comm_share": derived.get("comm_share"),
        "ideal_compression_stage_speedup": derived.get("ideal_compression_stage_speedup"),
        "ideal_end_to_end_speedup": derived.get("ideal_end_to_end_speedup"),
        "lamb_step_seconds": summary.get("lamb", {}).get("t_comp"),
        "compute_step_seconds": summary.get("lamb-compute", {}).get("t_comp"),
        "model": settings["model"],
        "parameters": result.get("info", {}).get("parameters"),
        "methods": {
            name: {
                "t_warm": item["t_warm"],
                "t_comp": item["t_comp"],
                "compression_stage_speedup": item.get("compression_stage_speedup"),
                "end_to_end_speedup": item.get("end_to_end_speedup"),
                "compression_stage_bytes_reduction": item.get("compression_stage_bytes_reduction"),
            }
            for name, item in summary.items()
        },
        "targets": {k: v.get("met") for k, v in result["targets"].items() if isinstance(v, dict)},
        "requested_methods": list(settings["methods"]),
    }


_PLOT_METHODS = (
    "onebit-lamb-ddp",
    "onebit-lamb",
    "onebit-adam",
    "fp16",
    "powersgd-1",
    "powersgd-4",
)


def plot_sweep(sweep: dict[str, Any], path: Path) -> None:
    """Speedup over LAMB against link bandwidth (and against workers), with the ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in sweep["rows"] if "error" not in r and r["comm_share"] is not None]
    by_bandwidth = sorted(
        (r for r in rows if r["workers"] == sweep["bandwidth_workers"]),
        key=lambda r: _x_of(r),
    )
    by_workers = sorted(
        (r for r in rows if r["bandwidth"] == sweep["worker_bandwidth"]), key=lambda r: r["workers"]
    )
    panels = [
        (data, xkey)
        for data, xkey in ((by_bandwidth, "bandwidth"), (by_workers, "workers"))
        if len(data) > 1 or (data and len(rows) == 1)
    ]
    if not panels:
        logger.warning("nothing to plot: no configuration of the sweep completed")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.8 * len(panels) + 2.6, 5), squeeze=False)
    for ax, (data, xkey) in zip(axes[0], panels, strict=False):
        xs = [_x_of(r) if xkey == "bandwidth" else r["workers"] for r in data]
        for name in _PLOT_METHODS:
            pts = [
                (x, r["methods"][name]["compression_stage_speedup"])
                for x, r in zip(xs, data, strict=False)
                if name in r["methods"]
            ]
            if pts:
                style = "-o" if name.startswith("onebit") else "--s"
                ax.plot(*zip(*pts, strict=False), style, label=f"{name} (compr. stage)")
        for name in ("onebit-lamb-ddp",):
            pts = [
                (x, r["methods"][name]["end_to_end_speedup"])
                for x, r in zip(xs, data, strict=False)
                if name in r["methods"]
            ]
            if pts:
                ax.plot(
                    *zip(*pts, strict=False), ":^", color="black", label=f"{name} whole run (w=0.2)"
                )
        ax.plot(
            xs,
            [r["ideal_compression_stage_speedup"] for r in data],
            "-",
            color="grey",
            linewidth=3,
            alpha=0.5,
            label="ideal 1/((1-s)+s/32), measured s",
        )
        ax.plot(
            xs,
            [r["ideal_end_to_end_speedup"] for r in data],
            ":",
            color="grey",
            linewidth=3,
            alpha=0.5,
            label="ideal whole run, measured s, w=0.2",
        )
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_ylabel("speedup over LAMB + DDP (step time ratio)")
        for x, r in zip(xs, data, strict=False):
            ax.annotate(
                f"s={r['comm_share']:.2f}",
                (x, r["ideal_compression_stage_speedup"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
        if xkey == "bandwidth":
            ax.set_xscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([_x_label(r) for r in data], fontsize=8)
            ax.minorticks_off()
            ax.set_xlabel(
                f"per-link bandwidth, configured (measured TCP rate of one stream); "
                f"{sweep['bandwidth_workers']} workers"
            )
        else:
            ax.set_xticks(xs)
            ax.set_xlabel(f"workers ({_bandwidth_label(sweep['worker_bandwidth'])} links)")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(
        f"Emulated cluster, model {sweep['model']}: speedup over LAMB "
        "(all workers share 2 CPU cores)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


_UNSHAPED_X = 4e10
"""Where an unshaped link sits on a bandwidth axis: right of every shaped rate swept here."""


def _x_of(row: dict[str, Any]) -> float:
    from onebit.bench.cluster import parse_bandwidth

    if row["bandwidth"] is not None:
        return parse_bandwidth(row["bandwidth"])
    return _UNSHAPED_X


def _x_label(row: dict[str, Any]) -> str:
    tcp = row.get("tcp_bits_per_second")
    measured = f"\n(TCP {tcp / 1e9:.2f} Gbit/s)" if tcp else ""
    return _bandwidth_label(row["bandwidth"]) + measured


# ----- command line ------------------------------------------------------------------------


def _bandwidth_arg(text: str) -> str | None:
    from onebit.bench.cluster import parse_bandwidth

    if text.lower() in ("none", "unshaped"):
        return None
    try:
        parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _methods_arg(text: str) -> list[str]:
    if text == "all":
        return list(ALL_METHODS)
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {ALL_METHODS}")
    return methods


def _add_common(parser: argparse.ArgumentParser, model_default: str) -> None:
    parser.add_argument(
        "--latency", default=None, help="added one-way delay such as 0.1ms (needs the netem qdisc)"
    )
    parser.add_argument(
        "--model",
        default=model_default,
        choices=["base", "small", "mini", "tiny"],
        help=f"BERT preset (see onebit.bench.bert; default {model_default})",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="per-worker batch (default 1)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="timed steps of the compression / steady stage (default 3)",
    )
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=2,
        help="timed warm-up-stage steps of the 1-bit methods (default 2)",
    )
    parser.add_argument(
        "--skip-steps",
        type=int,
        default=1,
        help="untimed steps before each timed block (default 1)",
    )
    parser.add_argument(
        "--methods",
        type=_methods_arg,
        default=list(ALL_METHODS),
        help="comma-separated subset of " + ",".join(ALL_METHODS),
    )
    parser.add_argument(
        "--freeze-fraction",
        type=float,
        default=0.2,
        help="warm-up fraction w of the computed end-to-end run (default 0.2)",
    )
    parser.add_argument(
        "--run-steps",
        type=int,
        default=10000,
        help="steps S of the computed end-to-end run (default 10000)",
    )
    parser.add_argument(
        "--tcp-seconds",
        type=float,
        default=2.0,
        help="length of the raw TCP shaping check, 0 to skip (default 2)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: cores // workers, at least 1)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds before a configuration is abandoned (default 1800)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run every method this many times, alternating the order; a "
        "stage's step time is its fastest round's (default 2)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-memory-check",
        dest="memory_check",
        action="store_false",
        help="start even if the estimated memory exceeds MemAvailable",
    )


def _common_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "latency": args.latency,
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warm_steps": args.warm_steps,
        "skip_steps": args.skip_steps,
        "methods": args.methods,
        "freeze_fraction": args.freeze_fraction,
        "run_steps": args.run_steps,
        "tcp_seconds": args.tcp_seconds,
        "threads": args.threads,
        "timeout": args.timeout,
        "seed": args.seed,
        "rounds": args.rounds,
        "memory_check": args.memory_check,
    }


def _cluster_command(args: argparse.Namespace) -> int:
    try:
        result = run_comparison(
            workers=args.workers, bandwidth=args.bandwidth, **_common_kwargs(args)
        )
    except ComparisonError as exc:
        print(f"onebit bench cluster: {exc}", file=sys.stderr)
        return 2
    if args.output:
        _write_json(result, Path(args.output))
        logger.info("wrote %s", args.output)
    print(format_report(result))
    return 0 if not result["errors"] else 1


def _sweep_command(args: argparse.Namespace) -> int:
    from onebit.bench.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(
            f"onebit bench sweep: the emulated cluster needs root and iproute2: {reason}",
            file=sys.stderr,
        )
        return 2
    sweep = run_sweep(
        bandwidths=args.bandwidths,
        bandwidth_workers=args.workers,
        worker_counts=args.worker_counts,
        worker_bandwidth=args.worker_bandwidth,
        out_dir=Path(args.out_dir),
        **_common_kwargs(args),
    )
    failed = [r for r in sweep["rows"] if "error" in r]
    for row in failed:
        print(
            f"failed: {row['workers']} workers, {_bandwidth_label(row['bandwidth'])}: "
            f"{row['error']}",
            file=sys.stderr,
        )
    return 1 if failed else 0


def register(subparsers: Any) -> None:
    """Add ``cluster`` and ``sweep`` to the ``onebit bench`` sub-commands."""
    cluster = subparsers.add_parser(
        "cluster",
        help="1-bit LAMB vs LAMB, fp16 and PowerSGD hooks on an emulated cluster (root)",
        description=__doc__.split("\n\n")[0],
    )
    cluster.add_argument("--workers", type=int, default=4, help="workers, one per namespace (4)")
    cluster.add_argument(
        "--bandwidth",
        type=_bandwidth_arg,
        default="1gbit",
        help="per-link rate such as 100mbit, 1gbit; 'none' = unshaped (1gbit)",
    )
    cluster.add_argument("--output", default=None, help="write the result JSON here")
    _add_common(cluster, "base")
    cluster.set_defaults(handler=_cluster_command)

    sweep = subparsers.add_parser(
        "sweep",
        help="the cluster comparison over bandwidths and worker counts, JSON + PNG (root)",
    )
    sweep.add_argument(
        "--bandwidths",
        type=lambda t: [_bandwidth_arg(b) for b in t.split(",") if b.strip()],
        default=["100mbit", "1gbit", "10gbit", None],
        help="comma-separated link rates, 'none' = unshaped (default 100mbit,1gbit,10gbit,none)",
    )
    sweep.add_argument(
        "--workers", type=int, default=4, help="workers for the bandwidth sweep (default 4)"
    )
    sweep.add_argument(
        "--worker-counts",
        type=lambda t: [int(n) for n in t.split(",") if n],
        default=[2, 4, 8],
        help="worker counts to sweep (default 2,4,8)",
    )
    sweep.add_argument(
        "--worker-bandwidth",
        type=_bandwidth_arg,
        default="1gbit",
        help="link rate of the worker sweep (default 1gbit)",
    )
    sweep.add_argument("--out-dir", default="docs/bench", help="where JSON and PNG go")
    _add_common(sweep, "small")
    sweep.set_defaults(handler=_sweep_command)


_SWEEP_COLUMNS = (
    ("onebit-lamb-ddp", "1-bit LAMB (DDP hook)"),
    ("onebit-lamb", "1-bit LAMB (plain)"),
    ("onebit-adam", "1-bit Adam"),
    ("fp16", "fp16 hook"),
    ("powersgd-1", "PowerSGD r1"),
    ("powersgd-4", "PowerSGD r4"),
)


def format_sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per configuration, compression-stage speedups over LAMB (and the
    whole-run speedup at the configured warm-up fraction for 1-bit methods)."""
    head = (
        "| workers | link | TCP check | LAMB step | compute-only step | s | ideal compr. / "
        "whole run | " + " | ".join(label for _, label in _SWEEP_COLUMNS) + " |"
    )
    out = [head, "|" + "---|" * (7 + len(_SWEEP_COLUMNS))]
    for row in rows:
        if "error" in row:
            out.append(
                f"| {row['workers']} | {_bandwidth_label(row['bandwidth'])} | failed: "
                f"{row['error'].splitlines()[0]} |"
            )
            continue
        tcp = row.get("tcp_bits_per_second")
        cells = [
            str(row["workers"]),
            _bandwidth_label(row["bandwidth"]),
            "-" if tcp is None else f"{tcp / 1e6:.0f} Mbit/s",
            _num(row.get("lamb_step_seconds"), "{:.2f} s"),
            _num(row.get("compute_step_seconds"), "{:.2f} s"),
            _num(row.get("comm_share")),
            f"{_num(row.get('ideal_compression_stage_speedup'), '{:.2f}x')} / "
            f"{_num(row.get('ideal_end_to_end_speedup'), '{:.2f}x')}",
        ]
        for name, _ in _SWEEP_COLUMNS:
            item = row["methods"].get(name)
            if item is None:
                requested = row.get("requested_methods")
                cells.append("not run" if requested and name not in requested else "failed")
            elif name.startswith("onebit"):
                cells.append(
                    f"{_num(item['compression_stage_speedup'], '{:.2f}x')} / "
                    f"{_num(item['end_to_end_speedup'], '{:.2f}x')}"
                )
            else:
                cells.append(_num(item["compression_stage_speedup"], "{:.2f}x"))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _report_command(args: argparse.Namespace) -> int:
    results = [json.loads(Path(path).read_text()) for path in args.files]
    rows = []
    for path, result in zip(args.files, results, strict=True):
        if "rows" in result:
            rows.extend(result["rows"])
            continue
        if args.full:
            print(f"<!-- {path} -->")
            print(format_report(result))
            print()
        rows.append(_sweep_row(result))
    rows.sort(key=lambda r: (str(r.get("model")), r["workers"], _x_of(r)))
    print(format_sweep_table(rows))
    if args.plot:
        workers = {r["workers"] for r in rows}
        bandwidths = {r["bandwidth"] for r in rows}
        models = {r.get("model") for r in rows} - {None}
        sweep = {
            "model": ", ".join(sorted(models)) or "?",
            "bandwidth_workers": next(iter(workers)) if len(workers) == 1 else None,
            "worker_bandwidth": next(iter(bandwidths)) if len(bandwidths) == 1 else None,
            "rows": rows,
        }
        plot_sweep(sweep, Path(args.plot))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m onebit.bench.comparison {cluster,sweep,report} ...``"""
    parser = argparse.ArgumentParser(prog="python -m onebit.bench.comparison")
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)
    register(commands)
    report = commands.add_parser(
        "report", help="Markdown tables (and optionally the plot) from result JSON files"
    )
    report.add_argument("files", nargs="+", help="cluster-*.json or sweep-*.json files")
    report.add_argument("--full", action="store_true", help="also each comparison's full report")
    report.add_argument("--plot", default=None, help="write the speedup plot (PNG) here")
    report.set_defaults(handler=_report_command)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s %(message)s"
    )
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
