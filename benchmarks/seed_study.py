"""Ten seeds of the shortened main job for each optimizer with its defaults: does any diverge?

    .venv/bin/python benchmarks/seed_study.py [--seeds 0 1 ... 9] [--arms lamb onebit-lamb ...]
        [-- ONEBIT_TRAIN_OPTIONS...]
    .venv/bin/python benchmarks/seed_study.py --report-only [--record FILE]

Runs ``onebit train`` (4 workers under DDP, the settings of docs/ONEBIT-ADAM.md: 150 steps,
the variance frozen after 30, global batch 256 of 32-token sequences, a 2-layer BERT with a
4096-token vocabulary; every optimizer hyper-parameter at the job's default) for each seed and
arm (an optimizer with the job's defaults; the ``-auto`` arms with ``--freeze-step auto``), one
run at a time, and skips a run whose ``summary.json`` already exists, so an
interrupted study resumes where it stopped. Then prints, per arm, each seed's final
validation loss beside its dense baseline's (LAMB for 1-bit LAMB, AdamW for 1-bit Adam and 0/1
Adam), the mean and standard deviation over the seeds, and the seeds that **diverged**: a
non-finite loss, or a training loss after the freeze above ``--blow-up`` times the training
loss of the step before the freeze; and the refresh steps the guard after the freeze took.
``--record`` writes each run's outcome as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

JOB = [
    "--workers", "4", "--steps", "150", "--freeze-step", "30", "--batch-size", "256",
    "--seq-len", "32", "--vocab-size", "4096", "--heads", "2", "--architecture", "bert",
    "--eval-every", "25", "--eval-seqs", "2048", "--checkpoint-every", "150",
]  # fmt: skip
#: 1-bit LAMB's exchange in the study's arms: the paper's, without ``momentum_bound``.
UNBOUNDED = ["--no-momentum-bound"]
#: The arms: name -> (optimizer, options beyond JOB, the dense baseline).
ARMS = {
    "lamb": ("lamb", [], None),
    "onebit-lamb": ("onebit-lamb", UNBOUNDED, "lamb"),
    "adam": ("adam", [], None),
    "onebit-adam": ("onebit-adam", [], "adam"),
    "zero-one-adam": ("zero-one-adam", [], "adam"),
    "onebit-lamb-auto": ("onebit-lamb", ["--freeze-step", "auto", *UNBOUNDED], "lamb"),
    "onebit-adam-auto": ("onebit-adam", ["--freeze-step", "auto"], "adam"),
    # DeepSpeed's exchange for 1-bit LAMB (its default until it diverged here)
    "onebit-lamb-fused": ("onebit-lamb", ["--compression", "fused", *UNBOUNDED], "lamb"),
    "onebit-lamb-fused-auto": (
        "onebit-lamb",
        ["--compression", "fused", "--freeze-step", "auto", *UNBOUNDED],
        "lamb",
    ),
}
DEFAULT_ARMS = ("lamb", "onebit-lamb", "adam", "onebit-adam", "zero-one-adam")
FREEZE_STEP = 30


def run_dir(root: Path, arm: str, seed: int) -> Path:
    return root / f"{arm}-seed{seed}"


def run(root: Path, arm: str, seed: int, extra: list[str]) -> None:
    """``onebit train`` for one arm and seed (``extra`` options after the study's), unless its
    run already finished."""
    out = run_dir(root, arm, seed)
    if (out / "summary.json").exists():
        return
    optimizer, options, _ = ARMS[arm]
    command = [sys.executable, "-m", "onebit", "train", "--optimizer", optimizer, *JOB, *options]
    command += extra
    command += ["--seed", str(seed), "--out", str(out)]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def outcome(out: Path, blow_up: float) -> dict[str, float | bool]:
    """The final validation loss of a finished run, its highest training loss after the
    freeze and whether it diverged."""
    summary = json.loads((out / "summary.json").read_text())
    train = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            train[record["step"]] = record["loss"]
    freeze = summary["freeze_step"] or FREEZE_STEP
    after = [loss for step, loss in train.items() if step > freeze]
    final = summary["final_validation_loss"]
    finite = all(math.isfinite(loss) for loss in train.values()) and math.isfinite(final)
    highest = max(after, default=float("nan"))  # nan: the run never froze
    limit = blow_up * train[min(freeze, max(train))]
    refresh = summary["bytes_sent"]["by_stage"].get("refresh", {}).get("steps", 0)
    return {
        "final": final,
        "freeze": freeze,
        "highest_after_freeze": highest,
        "diverged": not finite or highest > limit,
        "steps_above": sum(loss > limit for loss in after),
        "refresh_steps": refresh,
    }


def report(root: Path, seeds: list[int], blow_up: float) -> dict[str, dict[int, dict]]:
    """Print the table of the finished runs; returns each arm's outcome by seed."""
    results = {}
    for arm in ARMS:
        done = [s for s in seeds if (run_dir(root, arm, s) / "summary.json").exists()]
        results[arm] = {s: outcome(run_dir(root, arm, s), blow_up) for s in done}
    print(
        "\n| arm | seeds | mean final validation loss | std | vs baseline, mean of paired "
        "differences ± std | diverged (seed: steps above the limit) | highest training loss "
        "after the freeze | froze after |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---|")
    for arm, by_seed in results.items():
        if not by_seed:
            continue
        finals = [r["final"] for r in by_seed.values()]
        baseline = results.get(ARMS[arm][2] or "", {})
        paired = [
            100 * (by_seed[s]["final"] / baseline[s]["final"] - 1) for s in by_seed if s in baseline
        ]
        versus = (
            f"{statistics.mean(paired):+.2f}% ± {statistics.stdev(paired):.2f} ({len(paired)})"
            if len(paired) > 1
            else ""
        )
        diverged = {s: r["steps_above"] for s, r in by_seed.items() if r["diverged"]}
        spread = statistics.stdev(finals) if len(finals) > 1 else float("nan")
        highest = max(r["highest_after_freeze"] for r in by_seed.values())
        freezes = sorted({r["freeze"] for r in by_seed.values()})
        froze = f"{freezes[0]}-{freezes[-1]}" if len(freezes) > 1 else str(freezes[0])
        print(
            f"| {arm} | {len(finals)} | {statistics.mean(finals):.4f} | {spread:.4f} | "
            f"{versus} | {diverged or 'none'} | {highest:.2f} | {froze if ARMS[arm][2] else ''} |"
        )
    print("\nfinal validation loss by seed:")
    for arm, by_seed in results.items():
        row = " ".join(f"{s}:{r['final']:.4f}" for s, r in by_seed.items())
        print(f"  {arm}: {row}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    parser.add_argument("--out", type=Path, default=Path("runs/seed-study"))
    parser.add_argument("--blow-up", type=float, default=1.5)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--record", type=Path, default=None, help="write the outcomes as JSON")
    parser.add_argument(
        "job", nargs="*", help="after --: options of onebit train that replace the study's"
    )
    args = parser.parse_args(argv)
    if not args.report_only:
        for seed in args.seeds:
            for arm in args.arms:
                run(args.out, arm, seed, args.job)
    results = report(args.out, args.seeds, args.blow_up)
    if args.record is not None:
        arms = {arm: by_seed for arm, by_seed in results.items() if by_seed}
        seeds = sorted({s for by_seed in arms.values() for s in by_seed})
        job = f" -- {' '.join(args.job)}" if args.job else ""
        record = {
            "command": f".venv/bin/python benchmarks/seed_study.py --arms {' '.join(arms)} "
            f"--seeds {' '.join(map(str, seeds))}{job}",
            "blow_up": args.blow_up,
            "baselines": {arm: ARMS[arm][2] for arm in arms},
            "arms": arms,
        }
        args.record.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
