"""The guard after the freeze on a family of tasks: which runs miss their dense counterpart
without it and with it, where it fires on runs that did not need it, and what each refresh costs.

For every task, seed and freeze point it trains 1-bit Adam, 1-bit LAMB with its default
``momentum_bound=True`` (``onebit-lamb-momentum-bound``) and without it (``onebit-lamb``; also,
when named, with ``trust_bound=2``: ``onebit-lamb-bounded``) and 0/1 Adam (every
step dense up to the freeze, a synchronisation every step after it) with
``variance_guard="off"`` and with the default ``"refresh"``, beside their dense counterparts
(torch's Adam, onebit's LAMB) on the same samples, and writes one JSON line per run. A run
*misses* where its loss over the last 25 steps is above 1.15 times its dense counterpart's
(the target: within 15 %); the guard's *false alarm* is a refresh in a run whose
``"off"`` twin did not miss. A refresh's cost is its dense steps' allreduce bytes less the
1-bit bytes those steps would have sent, per worker.

    .venv/bin/python benchmarks/variance_guard.py --workers 2 --out runs.jsonl
    .venv/bin/python benchmarks/variance_guard.py --workers 16 --simulate --seeds 0

Tasks (:mod:`onebit.plateau`): ``attention`` (the pointer task: a plateau at chance until the
attention forms), ``lr-warmup`` (the same with the learning rate warming up over 300 steps,
past the late freeze), ``deep-narrow`` (a deep tanh network with small initial weights).
``--workers N`` runs N real gloo processes on this machine; with ``--simulate`` the N workers
are simulated in one process (bit for bit a real run's: ``onebit.simulate``; not 0/1 Adam,
whose local steps the simulation does not model).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import onebit
from onebit.collectives import compressed_allreduce_per_tensor_bytes, ring_allreduce_bytes
from onebit.plateau import DeepNarrowTask, PointerTask, train, warm_up_learning_rate
from onebit.simulate import SimulatedDataParallel
from onebit.testing import spawn_workers

#: A run ends within this factor of its dense counterpart's final loss, or it missed.
WITHIN = 1.15
#: Steps whose mean loss is a run's final loss.
FINAL_WINDOW = 25


@dataclass(frozen=True)
class Task:
    """A task of the family: its problem, its steps, its learning-rate warm-up and the two
    freeze points (before its plateau ends, after)."""

    problem: PointerTask | DeepNarrowTask
    steps: int
    lr_warmup_steps: int
    freezes: tuple[int, int]


TASKS = {
    "attention": Task(PointerTask(), 500, 0, (40, 300)),
    "lr-warmup": Task(PointerTask(), 500, 300, (100, 350)),
    "deep-narrow": Task(DeepNarrowTask(), 600, 0, (40, 300)),
}
#: Each 1-bit optimizer, its dense counterpart and their learning rate (the 1-bit paper's
#: ratio between LAMB's and Adam's).
ARMS = {
    "onebit-adam": ("adam", 1e-3),
    "onebit-lamb": ("lamb", 1e-2),
    "onebit-lamb-bounded": ("lamb", 1e-2),
    "onebit-lamb-momentum-bound": ("lamb", 1e-2),
    "zero-one-adam": ("adam", 1e-3),
}
#: The optimizers ``--simulate`` can run.
SIMULATABLE = ("onebit-adam", "onebit-lamb", "onebit-lamb-bounded", "onebit-lamb-momentum-bound")
#: ``onebit-lamb-bounded``'s ``trust_bound``: a compression step may grow to twice its size
#: at the freeze, against the weights.
TRUST_BOUND = 2.0
#: The 1-bit LAMB arms' arguments: the paper's unbounded exchange (``onebit-lamb``), with
#: ``trust_bound`` as well, and with ``momentum_bound`` (1-bit LAMB's default).
ONEBIT_LAMB_ARMS = {
    "onebit-lamb": {"momentum_bound": False},
    "onebit-lamb-bounded": {"trust_bound": TRUST_BOUND, "momentum_bound": False},
    "onebit-lamb-momentum-bound": {"momentum_bound": True},
}
#: The arms that run only when named.
OPTIONAL_ARMS = ("onebit-lamb-bounded",)


def default_optimizers(simulate: bool) -> list[str]:
    """What runs without ``--optimizers``: every arm but the :data:`OPTIONAL_ARMS` (that
    ``--simulate`` can run)."""
    return [n for n in ARMS if n not in OPTIONAL_ARMS and (not simulate or n in SIMULATABLE)]


def build_optimizer(
    name: str, lr: float, freeze: int, guard: str, params: Iterable[nn.Parameter]
) -> torch.optim.Optimizer:
    """``name``'s optimizer of ``params`` (a 1-bit one frozen after ``freeze``)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "lamb":
        return onebit.Lamb(params, lr=lr)
    if name == "zero-one-adam":
        return onebit.ZeroOneAdam(
            params, lr=lr, var_freeze_step=freeze, var_warmup_steps=freeze, variance_guard=guard
        )
    if name in ONEBIT_LAMB_ARMS:
        return onebit.OneBitLamb(
            params, lr=lr, freeze_step=freeze, variance_guard=guard, **ONEBIT_LAMB_ARMS[name]
        )
    return onebit.OneBitAdam(params, lr=lr, freeze_step=freeze, variance_guard=guard)


def _train_simulated(task: Task, build: Callable, workers: int, seed: int, batch: int):
    """``onebit.plateau.train`` with ``workers`` simulated workers in this process."""
    torch.manual_seed(seed)
    model = task.problem.model()
    optimizer = build(model.parameters())
    peaks = [group["lr"] for group in optimizer.param_groups]
    simulation = SimulatedDataParallel(optimizer, workers)
    share = batch // workers
    losses = []
    for step in range(1, task.steps + 1):
        if task.lr_warmup_steps:
            warm_up_learning_rate(optimizer, peaks, step, task.lr_warmup_steps)
        inputs, targets = task.problem.batch(step, batch, seed)

        def backward(rank: int, inputs=inputs, targets=targets) -> float:
            part = slice(rank * share, (rank + 1) * share)
            loss = nn.functional.cross_entropy(model(inputs[part]), targets[part])
            loss.backward()
            return float(loss)

        losses.append(sum(simulation.step(backward)) / workers)
    return losses, optimizer


def _train_on_rank(rank: int, world_size: int, task: Task, build: Callable, seed: int, batch: int):
    optimizers = []

    def keep(params):
        optimizers.append(build(params))
        return optimizers[0]

    losses = train(task.problem, keep, task.steps, batch, seed, None, task.lr_warmup_steps)
    return losses, getattr(optimizers[0], "refreshes", [])


def run_one(task_name: str, name: str, lr: float, freeze: int, guard: str, seed: int, args):
    task = TASKS[task_name]
    build = functools.partial(build_optimizer, name, lr, freeze, guard)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.simulate:
            losses, optimizer = _train_simulated(task, build, args.workers, seed, args.batch)
            refreshes = getattr(optimizer, "refreshes", [])
        else:
            results = spawn_workers(
                _train_on_rank,
                args.workers,
                args=(task, build, seed, args.batch),
                timeout_s=1200,
            )
            losses, refreshes = results[0]
    model = task.problem.model()
    numels = [p.numel() for p in model.parameters()]
    dense = ring_allreduce_bytes(4 * sum(numels), args.workers)
    onebit_step = compressed_allreduce_per_tensor_bytes(numels, args.workers, torch.float32)
    refresh_steps = sum(last - first + 1 for first, last in refreshes if last is not None)
    return {
        "task": task_name,
        "optimizer": name,
        "freeze_step": freeze if name in ARMS else None,
        "variance_guard": guard if name in ARMS else None,
        "seed": seed,
        "workers": args.workers,
        "simulated": args.simulate,
        "final_loss": sum(losses[-FINAL_WINDOW:]) / FINAL_WINDOW,
        "refreshes": [list(r) for r in refreshes],
        "refresh_steps": refresh_steps,
        "refresh_extra_bytes": refresh_steps * (dense - onebit_step),
        "seconds": time.perf_counter() - start,
    }


def summary_rows(rows: list[dict]) -> list[dict]:
    """One entry per task, optimizer and freeze point: its runs (seeds with both guard
    settings and the dense counterpart), the runs that miss without and with the guard, the
    runs it refreshed, its false alarms, the mean steps and extra bytes of a refresh, and the
    largest final loss against the dense counterpart's with the guard."""
    dense = {
        (r["task"], r["optimizer"], r["seed"]): r["final_loss"]
        for r in rows
        if not r["freeze_step"]
    }
    keys = sorted(
        {(r["task"], r["optimizer"], r["freeze_step"]) for r in rows if r["freeze_step"]},
        key=lambda key: (list(TASKS).index(key[0]), key[1], key[2]),
    )
    entries = []
    for task, name, freeze in keys:
        by_seed: dict[int, dict[str, dict]] = {}
        for r in rows:
            if (r["task"], r["optimizer"], r["freeze_step"]) == (task, name, freeze):
                by_seed.setdefault(r["seed"], {})[r["variance_guard"]] = r
        counterpart = ARMS[name][0]
        seeds = sorted(
            s
            for s, pair in by_seed.items()
            if {"off", "refresh"} <= set(pair) and (task, counterpart, s) in dense
        )

        def ratio(r: dict, task: str = task, counterpart: str = counterpart) -> float:
            return r["final_loss"] / dense[task, counterpart, r["seed"]]

        off = [by_seed[s]["off"] for s in seeds]
        on = [by_seed[s]["refresh"] for s in seeds]
        refreshed = [r for r in on if r["refreshes"]]
        count = sum(len(r["refreshes"]) for r in refreshed)
        entries.append(
            {
                "task": task,
                "optimizer": name,
                "freeze_step": freeze,
                "workers": rows[0]["workers"],
                "simulated": rows[0]["simulated"],
                "runs": len(seeds),
                "missed_off": sum(ratio(r) > WITHIN for r in off),
                "missed_refresh": sum(ratio(r) > WITHIN for r in on),
                "refreshed": len(refreshed),
                "false_alarms": sum(
                    bool(by_seed[s]["refresh"]["refreshes"]) and ratio(by_seed[s]["off"]) <= WITHIN
                    for s in seeds
                ),
                "refresh_steps": sum(r["refresh_steps"] for r in refreshed) / count if count else 0,
                "refresh_extra_mb": sum(r["refresh_extra_bytes"] for r in refreshed) / count / 1e6
                if count
                else 0.0,
                "worst_ratio": max((ratio(r) for r in on), default=float("nan")),
            }
        )
    return entries


def markdown(entries: list[dict]) -> list[str]:
    lines = [
        "| task | optimizer | freeze | runs | above 1.15x dense, off | above 1.15x dense, refresh "
        "| runs refreshed | false alarms | refresh steps (mean) "
        "| extra MB per refresh (mean) | worst final / dense |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        lines.append(
            f"| {e['task']} | {e['optimizer']} | {e['freeze_step']} | {e['runs']} "
            f"| {e['missed_off']} | {e['missed_refresh']} | {e['refreshed']} "
            f"| {e['false_alarms']} | {e['refresh_steps']:.0f} | {e['refresh_extra_mb']:.3f} "
            f"| {e['worst_ratio']:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=None,
        choices=list(ARMS),
        help=f"default: all of them but {' and '.join(OPTIONAL_ARMS)} (with --simulate: those "
        "it can run)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=2, help="data-parallel workers")
    parser.add_argument("--simulate", action="store_true", help="simulate them in one process")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=None, help="override every task's steps")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per run")
    parser.add_argument(
        "--summary", type=Path, default=None, help="write the summary table's rows as JSON"
    )
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        default=None,
        help="run nothing: summarize these JSON-lines files of earlier runs",
    )
    args = parser.parse_args(argv)
    if args.batch % args.workers:
        parser.error(f"--batch {args.batch} must be a multiple of --workers {args.workers}")
    if args.optimizers is None:
        args.optimizers = default_optimizers(args.simulate)
    unsimulatable = sorted(set(args.optimizers) - set(SIMULATABLE))
    if args.simulate and unsimulatable:
        parser.error(f"--simulate runs {', '.join(SIMULATABLE)} only, not {unsimulatable}")
    if args.report:
        rows = [json.loads(line) for path in args.report for line in path.read_text().splitlines()]
    else:
        rows = measure(args)
    entries = summary_rows(rows)
    print("\n".join(markdown(entries)))
    if args.summary is not None:
        summary = {"command": measuring_command(rows), "rows": entries}
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def measuring_command(rows: list[dict]) -> str:
    """The command that measures ``rows`` again."""
    seeds = sorted({r["seed"] for r in rows})
    tasks = [name for name in TASKS if any(r["task"] == name for r in rows)]
    optimizers = [name for name in ARMS if any(r["optimizer"] == name for r in rows)]
    return " ".join(
        [
            ".venv/bin/python benchmarks/variance_guard.py",
            f"--workers {rows[0]['workers']}",
            *(["--simulate"] if rows[0]["simulated"] else []),
            "--tasks",
            *tasks,
            *(
                ["--optimizers", *optimizers]
                if optimizers != default_optimizers(rows[0]["simulated"])
                else []
            ),
            "--seeds",
            *map(str, seeds),
        ]
    )


def measure(args: argparse.Namespace) -> list[dict]:
    """Every run the arguments ask for, printed and appended to ``--out`` as it ends."""
    if args.steps is not None:
        for name, task in list(TASKS.items()):
            TASKS[name] = Task(task.problem, args.steps, task.lr_warmup_steps, task.freezes)
    torch.set_num_threads(1)
    rows: list[dict] = []
    for task_name in args.tasks:
        for seed in args.seeds:
            for name in args.optimizers:
                counterpart, lr = ARMS[name]
                plan = [(counterpart, None, "off")] + [
                    (name, freeze, guard)
                    for freeze in TASKS[task_name].freezes
                    for guard in ("off", "refresh")
                ]
                for optimizer, freeze, guard in plan:
                    if optimizer == counterpart and any(
                        (r["task"], r["optimizer"], r["seed"]) == (task_name, counterpart, seed)
                        for r in rows
                    ):
                        continue
                    row = run_one(task_name, optimizer, lr, freeze or 0, guard, seed, args)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out is not None:
                        with args.out.open("a") as out:
                            out.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(main())
