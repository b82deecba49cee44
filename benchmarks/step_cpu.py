"""Where each method's training step spends its CPU, on local gloo ranks without a shaped
network: the methods of ``onebit bench cluster`` (each with its model copy, optimizer and hooks,
as :mod:`onebit.bench._worker` builds them), ``--workers`` ranks of one torch thread each.

Per method: the timed block's wall time per step, and medians over its steps on rank 0 of
the step's wall time and, for its forward + backward and its ``optimizer.step()`` each, the
wall time, the process's user and system CPU seconds and its minor page faults; with
``--kernels``, the wall time per step of every call into the selected compression and update
kernels (:mod:`onebit.kernels`); with ``--exchange``, that of the exchange's steps (each
bucket's worker and server phases, with their kernels, the collectives they issue and their
waits) and of the overlap's hooks. By default all ranks meet before every timed step;
``--no-barrier`` runs the steps back to back, as in training. With more workers than cores,
the ranks share the cores as on the emulated cluster, so the CPU a method adds to a step shows
here without the network. The first method of a run also pays the
processes' warm-up (its first steps' page faults cost several times the system time of later
ones): name a method twice, first and again later, to see it (the second run is shown as
``NAME (2)``).

    .venv/bin/python benchmarks/step_cpu.py --workers 4 --model small \\
        --methods lamb-compute,lamb,onebit-lamb-ddp,onebit-lamb --steps 6 --kernels

Prints one Markdown table row per method (``--json FILE`` also writes rank 0's figures).
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PHASES = ("forward_backward", "optimizer_step")
MEASURES = ("wall", "user", "sys", "faults")


def _usage() -> tuple[float, float, float, int]:
    """(wall, user CPU, system CPU, minor faults) of this process now."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime, usage.ru_stime, usage.ru_minflt


def _timed_kernels(seconds: collections.Counter) -> None:
    """Add every public kernel call's wall time to ``seconds`` under its name."""
    import torch

    from onebit import kernels
    from onebit.timing import time_calls

    backend = kernels.select(torch.zeros(8))
    for part in (backend.compression, backend.updates):
        for name in dir(part) if part is not None else ():
            method = getattr(part, name)
            if name.startswith("_") or not callable(method) or name in ("supports", "scratch"):
                continue
            time_calls(seconds, part, name, name)


#: The exchange's steps (each with its kernels, collectives issued and waits) and the
#: overlap's hooks, timed by ``--exchange``.
EXCHANGE_CALLS = {
    "onebit.exchange.over_group.Round": ("send_workers", "send_servers", "finish", "drain"),
    "onebit.optim._overlap.BackwardOverlap": ("_on_gradient", "complete"),
}


def _timed_exchange(seconds: collections.Counter) -> None:
    """Add the wall time of every call in :data:`EXCHANGE_CALLS` to ``seconds``, as
    ``Class.method`` (``Round.drain`` also runs inside ``send_servers`` and ``finish``)."""
    import importlib

    from onebit.timing import time_calls

    for path, names in EXCHANGE_CALLS.items():
        module, cls = path.rsplit(".", 1)
        owner = getattr(importlib.import_module(module), cls)
        for name in names:
            time_calls(seconds, owner, name, f"{cls}.{name}")


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    import torch.distributed as dist

    from onebit.bench._worker import _Method
    from onebit.bench.bert import build_model, synthetic_batches

    kernel_seconds: collections.Counter = collections.Counter()
    if cfg["kernels"]:
        _timed_kernels(kernel_seconds)
    if cfg["exchange"]:
        _timed_exchange(kernel_seconds)
    template = build_model(cfg["model"], cfg["seed"])
    batches = synthetic_batches(cfg["model"], 1, cfg["seq_len"], 8, rank, cfg["seed"])
    results = {}
    for name in cfg["methods"]:
        method = _Method(name, template, cfg)
        untimed = (
            method.freeze_step + cfg["skip_steps"]
            if method.freeze_step is not None
            else method.untimed_before_steady
        )
        for i in range(untimed):
            method.step(batches[i % len(batches)])
        kernel_seconds.clear()
        steps = []
        dist.barrier()
        block_start = time.perf_counter()
        for i in range(cfg["steps"]):
            batch = batches[i % len(batches)]
            if cfg["barrier"]:
                dist.barrier()
            marks = [_usage()]
            loss = method.model(**batch).loss
            loss.backward()
            marks.append(_usage())
            method.optimizer.step()
            marks.append(_usage())
            method.optimizer.zero_grad(set_to_none=False)
            steps.append(
                {
                    phase: {
                        measure: after - before
                        for measure, before, after in zip(MEASURES, *marks[i : i + 2], strict=True)
                    }
                    for i, phase in enumerate(PHASES)
                }
            )
        dist.barrier()
        block = (time.perf_counter() - block_start) / cfg["steps"]
        stage = getattr(method.optimizer, "stage", None)
        runs = sum(key.split(" ")[0] == name for key in results)
        results[f"{name} ({runs + 1})" if runs else name] = {
            "stage": stage,
            "block": block,
            "steps": steps,
            "kernels": {k: v / cfg["steps"] for k, v in sorted(kernel_seconds.items())},
        }
        method.close()
    return results if rank == 0 else None


def _median(steps: list[dict], phase: str, measure: str) -> float:
    return statistics.median(step[phase][measure] for step in steps)


def main(argv: list[str] | None = None) -> int:
    from onebit.bert_shapes import PRESETS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="local gloo ranks, one thread each (default: 2)"
    )
    parser.add_argument(
        "--model",
        default="mini",
        choices=sorted(PRESETS),
        help="the benchmark's BERT preset (default: mini)",
    )
    parser.add_argument(
        "--methods",
        default="lamb,onebit-lamb",
        help="comma-separated methods of onebit bench cluster, in the order run "
        "(default: lamb,onebit-lamb)",
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per method (default: 4)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens a sequence (default: 64)")
    parser.add_argument("--kernels", action="store_true", help="time the kernel calls too")
    parser.add_argument(
        "--exchange", action="store_true", help="time the exchange's steps and hooks too"
    )
    parser.add_argument(
        "--barrier",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="all ranks meet before every timed step (default); without, steps run back to "
        "back as in training",
    )
    parser.add_argument("--json", type=Path, help="also write rank 0's figures here")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.steps < 1:
        parser.error("--workers and --steps must be at least 1")

    from onebit.bench.settings import METHODS
    from onebit.testing import spawn_workers

    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
    cfg = {
        "model": args.model,
        "methods": methods,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "kernels": args.kernels,
        "exchange": args.exchange,
        "barrier": args.barrier,
        "seed": 0,
        "lr": 1e-3,
        "skip_steps": 1,
        "warm_steps": 1,
        "workers_per_node": 1,
    }
    results = spawn_workers(
        _rank, args.workers, args=(cfg,), timeout_s=3600, collective_timeout_s=600
    )[0]
    print(
        f"{args.model}, {args.workers} local gloo ranks, 1 thread each; rank 0, median of "
        f"{args.steps} steps (seconds; faults in thousands)\n"
    )
    print(
        "| method | stage | block / steps | step wall | fwd+bwd wall / user / sys / faults | "
        "optimizer.step() wall / user / sys / faults | CPU (user + sys) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, result in results.items():
        steps = result["steps"]
        cells = []
        for phase in PHASES:
            wall, user, sys_, faults = (_median(steps, phase, m) for m in MEASURES)
            cells.append(f"{wall:.3f} / {user:.3f} / {sys_:.3f} / {faults / 1e3:.1f}")
        wall = statistics.median(sum(s[p]["wall"] for p in PHASES) for s in steps)
        cpu = statistics.median(sum(s[p]["user"] + s[p]["sys"] for p in PHASES) for s in steps)
        print(
            f"| {name} | {result['stage'] or '-'} | {result['block']:.3f} | {wall:.3f} | "
            f"{cells[0]} | {cells[1]} | "
            f"{cpu:.3f} |"
        )
    for name, result in results.items():
        if result["kernels"]:
            calls = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in result["kernels"].items())
            print(f"\n{name}: wall time per step of the calls timed (ms): {calls}")
    if args.json:
        summary = {"model": args.model, "workers": args.workers, "methods": results}
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
