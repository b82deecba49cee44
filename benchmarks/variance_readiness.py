"""A fixed early freeze against ``freeze_step="auto"`` on the plateau task, on 2 gloo ranks.

    .venv/bin/python benchmarks/variance_readiness.py [--steps 500] [--early 70] [--record FILE]

Trains :class:`onebit.plateau.PointerTask` (its loss sits at chance, ln 8 = 2.08, until the
attention learns to point) with Adam (torch's, its gradients averaged densely) and with 1-bit
Adam, 1-bit LAMB and 0/1 Adam frozen at ``--early`` steps, at the end of the run (never
compressing) and with ``"auto"``; prints for each the mean loss of the last 25 steps against
Adam's, the step it froze at and whether the optimizer warned that the variance had not
settled (ALGORITHM.md, "Variance readiness"); ``--record`` writes them as JSON. The guard after
the freeze is off: this measures the warm-up's check alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

import onebit
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE
from onebit.plateau import PointerTask, train
from onebit.testing import spawn_workers

LAMB_LR = 1e-2


def arms(early: int, steps: int) -> dict[str, tuple[str, dict]]:
    """name -> (optimizer, its arguments)."""
    table = {"adam": ("torch-adam", {})}
    for name, optimizer, argument in (
        ("onebit-adam", "OneBitAdam", "freeze_step"),
        ("onebit-lamb", "OneBitLamb", "freeze_step"),
        ("zero-one-adam", "ZeroOneAdam", "var_freeze_step"),
    ):
        # the warm-up's check alone: the guard after the freeze (benchmarks/variance_guard.py)
        # is off
        guard = {"variance_guard": "off"}
        for label, value in (("early", early), ("never", steps), ("auto", "auto")):
            table[f"{name} {label}"] = (optimizer, {argument: value, **guard})
    table["zero-one-adam deepspeed-never"] = (
        "ZeroOneAdam",
        DEEPSPEED_SCHEDULE | {"var_freeze_step": steps},
    )
    return table


def make(optimizer: str, arguments: dict, params):
    if optimizer == "torch-adam":
        return torch.optim.Adam(params, lr=1e-3)
    lr = LAMB_LR if optimizer == "OneBitLamb" else 1e-3
    return getattr(onebit, optimizer)(params, lr=lr, **arguments)


def worker(rank: int, world: int, table: dict, steps: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, (optimizer, arguments) in table.items():
        built = []

        def build(params, optimizer=optimizer, arguments=arguments, built=built):
            built.append(make(optimizer, arguments, params))
            return built[0]

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train(PointerTask(), build, steps=steps)
        warned = any("has settled" in str(w.message) for w in caught)
        frozen = getattr(built[0], "freeze_step", None)
        first = getattr(built[0], "first_interval", None)
        if first is not None:
            first = min(first, frozen)  # frozen inside the first interval: it ended there
        out[name] = (sum(losses[-25:]) / 25, frozen, warned, first)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--early", type=int, default=70)
    parser.add_argument("--record", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    table = arms(args.early, args.steps)
    results = spawn_workers(worker, 2, args=(table, args.steps), timeout_s=3600)[0]
    adam = results["adam"][0]
    print(
        "| optimizer | freeze | froze after step | 0/1 Adam: first interval | warned | "
        "loss, last 25 steps | vs Adam |"
    )
    print("|---|---|---:|---:|---|---:|---:|")
    for name, (loss, frozen, warned, first) in results.items():
        optimizer, _, label = name.partition(" ")
        froze = "" if frozen is None else frozen
        print(
            f"| {optimizer} | {label or 'dense'} | {froze} | {first or ''} | "
            f"{'yes' if warned else 'no'} | {loss:.4f} | {loss / adam:.2f}x |"
        )
    if args.record is not None:
        command = ".venv/bin/python benchmarks/variance_readiness.py"
        if (args.steps, args.early) != (500, 70):
            command += f" --steps {args.steps} --early {args.early}"
        runs = {
            name: {"loss": loss, "froze_after": frozen, "warned": warned, "first_interval": first}
            for name, (loss, frozen, warned, first) in results.items()
        }
        record = {"command": command, "steps": args.steps, "early": args.early, "runs": runs}
        args.record.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
