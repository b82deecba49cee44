"""Time and memory per step of ``onebit simulate`` at several worker counts
(docs/guide/simulation.md).

Runs ``onebit simulate`` once per ``--workers`` value, each in a fresh process (so its peak
resident memory is its own), one after another, with the ``onebit simulate`` options given
after ``--``, and writes one JSON: per run the median step time of each stage (each stage's
first step left out: it compiles kernels and allocates the stage's buffers), the peak RSS of
the process, the simulation's own buffers (``summary.json``), and the parameters. Prints a row
per worker count, each stage's step time also as a ratio to the first worker count's.

    .venv/bin/python benchmarks/simulation_cost.py --workers 1 16 64 256 --out sim.json -- \\
        --steps 8 --freeze-step 4 --batch-size 1024 ...
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def measure(workers: int, options: list[str], run_dir: Path) -> dict:
    """One ``onebit simulate`` run with ``workers``; its figures."""
    command = [sys.executable, "-m", "onebit", "simulate", *options]
    command += ["--workers", str(workers), "--out", str(run_dir)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    summary = json.loads((run_dir / "summary.json").read_text())
    by_stage: dict[str, list[float]] = {}
    for row in rows:
        if row["kind"] == "train":
            by_stage.setdefault(row["stage"], []).append(row["step_time"])
    return {
        "workers": workers,
        "parameters": summary["parameters"],
        "step_time_s": {
            stage: statistics.median(times[1:] or times) for stage, times in by_stage.items()
        },
        "steps_timed": {stage: max(1, len(times) - 1) for stage, times in by_stage.items()},
        "peak_rss_bytes": summary["simulation"]["peak_rss_bytes"],
        "simulation_bytes": summary["simulation"]["memory_bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 4],
        help="simulated worker counts, one run each (default: 1 4)",
    )
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "options",
        nargs=argparse.REMAINDER,
        help="after --: options of onebit simulate (its defaults otherwise; --workers and "
        "--out are set here)",
    )
    args = parser.parse_args(argv)
    if min(args.workers) < 1:
        parser.error("--workers must be at least 1")
    options = args.options[1:] if args.options[:1] == ["--"] else args.options
    results = []
    with tempfile.TemporaryDirectory(prefix="onebit-simulation-cost-") as tmp:
        for workers in args.workers:
            run_dir = Path(tmp) / f"n{workers}"
            results.append(measure(workers, options, run_dir))
            shutil.rmtree(run_dir)
    print_table(results)
    if args.out:
        command = ["python", "benchmarks/simulation_cost.py", *(argv or sys.argv[1:])]
        args.out.write_text(json.dumps({"command": " ".join(command), "runs": results}, indent=1))
    return 0


def print_table(results: list[dict]) -> None:
    """A row per run: step time per stage (and its ratio to the first run's), memory."""
    first = results[0]
    stages = list(first["step_time_s"])
    header = " | ".join(f"{stage} s (x first)" for stage in stages)
    print(f"| workers | {header} | peak RSS MiB | simulation MiB |")
    print("|---:|" + "---:|" * (len(stages) + 2))
    for run in results:
        cells = []
        for stage in stages:
            seconds = run["step_time_s"].get(stage)
            cells.append(
                "-" if seconds is None
                else f"{seconds:.3f} ({seconds / first['step_time_s'][stage]:.2f})"
            )  # fmt: skip
        print(
            f"| {run['workers']} | {' | '.join(cells)} | {run['peak_rss_bytes'] / 2**20:.0f} | "
            f"{sum(run['simulation_bytes'].values()) / 2**20:.1f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
