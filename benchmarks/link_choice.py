"""Which method reaches a target loss first on a given link: the convergence study's arms,
each one's steps to the target, timed by the cost model of ``onebit estimate``.

    .venv/bin/python benchmarks/link_choice.py RUN_DIR [RUN_DIR ...] [--target LOSS]
        [--compute SECONDS] [--links 100mbit 1gbit 10gbit] [--record FILE]

For each run folder of ``onebit train`` (the study's arms: LAMB, AdamW, 1-bit LAMB and 1-bit
Adam, DiLoCo), the first validation step whose loss is at most ``--target`` (default: the
highest final validation loss of the runs, so that every run reaches it), and the time to
reach it on W workers, one per node, behind links of each rate: the sum over those steps of
the model's time of each step's kind (docs/ALGORITHM.md, "Cost model of a step"):

* a dense step (LAMB, AdamW under DDP, the 1-bit optimizers' warm-up and refreshes, 0/1
  Adam's variance updates): ``t_c + T_dense(4)``;
* a compression step of 1-bit LAMB or 1-bit Adam, 0/1 Adam's 1-bit gradient step and its
  synchronisation: ``t_c + t_local + T_flat``;
* 0/1 Adam's local step and DiLoCo's inner step ``t_c``; the last step of a round
  ``t_c + T_outer``; streaming (fragments, a delayed outer exchange), the τ + 1 steps of a
  turn its job labels ``outer`` (the one that starts the fragment's exchange, those it runs
  behind) ``t_c + T_stream / (τ + 1)`` each (the run's last step, which also exchanges every
  other fragment, is timed as a turn's).

``t_c`` (``--compute``) defaults to the median inner step of the DiLoCo runs given: a step
with no communication at all, as measured where the runs ran. ``--model`` times the steps of
another model (a name or a count such as ``110M``, as ``onebit estimate --model`` takes;
give its ``--compute`` too): the runs' steps to the target with that model's step times, an
extrapolation stated as such. A PowerSGD run, which the model does not time, has its steps
and bytes to the target and its place in the plot, but no times. Then, per link, the method that
reaches the target first and its lead over the next (runs whose times agree share the first
place; the validation losses come every ``eval_every`` steps, so steps to the target are
multiples of it). ``--record`` writes it all as JSON; ``--plot`` draws each run's final
validation loss against its bytes per worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from onebit.estimate.model import Cluster, Machine, estimate
from onebit.estimate.models import model_parameters
from onebit.units import parse_bandwidth

#: The plot's colours (matplotlib's cycle, ``C0`` to ``C9``) and markers, a pair per run.
COLOURS, MARKERS = 10, "os^D"
#: The step kinds of ``metrics.jsonl`` timed as a dense step, and as a 1-bit exchange's.
DENSE_STAGES = ("dense", "warmup", "refresh", "variance_update")
ONEBIT_STAGES = ("compression", "gradient_1bit", "sync")


def read_run(run_dir: Path) -> dict[str, Any]:
    """A run's config, its steps' kinds, its validation losses and its bytes per step."""
    config = json.loads((run_dir / "config.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if row["kind"] == "train"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "name": run_dir.name,
        "train": config["train"],
        "workers": int(config["launch"]["world_size"]),
        "parameters": int(summary["parameters"]),
        "stages": [row["stage"] for row in train],
        "step_times": _group(train, "stage", "step_time"),
        "bytes": [int(row["bytes"]) for row in train],
        "validation": [
            (int(r["step"]), float(r["loss"])) for r in rows if r["kind"] == "validation"
        ],
        "final": float(summary["final_validation_loss"]),
    }


def _group(rows: list[dict[str, Any]], key: str, value: str) -> dict[str, list[float]]:
    grouped: dict[str, list[float]] = {}
    for row in rows:
        grouped.setdefault(row[key], []).append(float(row[value]))
    return grouped


#: The methods the cost model does not time: PowerSGD.
UNTIMED = ("powersgd",)


def method_of(run: dict[str, Any]) -> str:
    """What the model times the run as (one of :data:`UNTIMED`: nothing)."""
    train = run["train"]
    if train.get("powersgd_rank"):
        return "powersgd"
    if train.get("sync_every"):
        fragments, delay = _streaming(train)
        method = f"diloco-{train['outer_exchange']}-h{train['sync_every']}"
        return method + (f"-k{fragments}-d{delay}" if (fragments, delay) != (1, 0) else "")
    onebit = ("onebit-lamb", "onebit-adam", "zero-one-adam")
    return "onebit" if train["optimizer"] in onebit else "lamb"


def _streaming(train: dict[str, Any]) -> tuple[int, int]:
    """A DiLoCo run's fragments and delay (older runs record neither)."""
    return train.get("fragments") or 1, train.get("fragment_delay") or 0


def check_stages(run: dict[str, Any]) -> None:
    """``ValueError`` naming the kinds of step of ``run`` that the model does not time."""
    timed = {*DENSE_STAGES, *ONEBIT_STAGES, "local"}
    if run["train"].get("sync_every"):
        timed |= {"inner", "outer"}
    unknown = sorted(set(run["stages"]) - timed)
    if unknown:
        raise ValueError(f"{run['name']}: the cost model does not time its steps of kind {unknown}")


def steps_to(run: dict[str, Any], target: float) -> int | None:
    """The first validation step at or below ``target``; ``None`` if there is none."""
    return next((step for step, loss in run["validation"] if loss <= target), None)


def stage_seconds(run: dict[str, Any], cluster: Cluster, machine: Machine) -> dict[str, float]:
    """The model's seconds of each kind of step of ``run``."""
    method, train = method_of(run), run["train"]
    fragments, delay = _streaming(train)
    if method.startswith("diloco"):
        cluster = dataclasses.replace(
            cluster,
            sync_every=(int(train["sync_every"]),),
            fragments=fragments,
            fragment_delay=delay,
            outer_block_size=train.get("outer_block_size"),
        )
    rows = {row.method: row for row in estimate(cluster, machine)}
    seconds = {stage: rows["lamb"].compression_step for stage in DENSE_STAGES}
    seconds |= {stage: rows["onebit"].compression_step for stage in ONEBIT_STAGES}
    seconds["local"] = compute = cluster.compute_seconds
    if method.startswith("diloco"):  # a turn's τ + 1 "outer" steps share what it adds
        added = rows[method].compression_step - compute
        seconds |= {"inner": compute, "outer": compute + added / (delay + 1)}
    return seconds


def choose(
    runs: list[dict[str, Any]],
    target: float,
    compute: float,
    links: list[str],
    machine: Machine,
    parameters: int | None = None,
) -> dict[str, Any]:
    """Each run's steps, bytes and seconds to ``target`` on each link (steps of a model of
    ``parameters``, default each run's own), and each link's fastest run."""
    results: dict[str, Any] = {
        "target": target,
        "compute_seconds": compute,
        "parameters": parameters,
        "runs": {},
    }
    for run in runs:
        steps = steps_to(run, target)
        timed = method_of(run) not in UNTIMED
        entry: dict[str, Any] = {
            "steps": steps,
            "final": run["final"],
            "total_bytes": sum(run["bytes"]),
            "timed": timed,
            "seconds": {},
        }
        if steps is not None:
            entry["bytes"] = sum(run["bytes"][:steps])
        for link in links if timed else []:
            cluster = Cluster(
                parameters=parameters or run["parameters"],
                compute_seconds=compute,
                bandwidth=parse_bandwidth(link) / 8,
                nodes=run["workers"],
            )
            if steps is not None:
                seconds = stage_seconds(run, cluster, machine)
                entry["seconds"][link] = sum(seconds[stage] for stage in run["stages"][:steps])
        results["runs"][run["name"]] = entry
    results["fastest"] = {}
    for link in links:
        timed = sorted(
            (entry["seconds"][link], name)
            for name, entry in results["runs"].items()
            if link in entry["seconds"]
        )
        if timed:
            first = timed[0][0]
            tied = [name for seconds, name in timed if seconds <= first * (1 + 1e-9)]
            best: dict[str, Any] = {"runs": tied, "seconds": first}
            rest = timed[len(tied) :]
            if rest:
                best |= {"next": rest[0][1], "lead": rest[0][0] / first}
            results["fastest"][link] = best
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders of onebit train")
    parser.add_argument("--target", type=float, help="validation loss to reach")
    parser.add_argument("--compute", type=float, help="seconds of a step without communication")
    parser.add_argument("--links", nargs="+", default=["100mbit", "1gbit", "10gbit"])
    parser.add_argument("--model", help="time the steps of this model (name or count)")
    parser.add_argument("--record", type=Path, help="write the results as JSON")
    parser.add_argument("--plot", type=Path, help="final loss against bytes per worker (PNG)")
    args = parser.parse_args(argv)
    try:
        runs = [read_run(path) for path in args.runs]
        for run in runs:
            check_stages(run)
        for link in args.links:
            parse_bandwidth(link)
        parameters = None if args.model is None else model_parameters(args.model)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))
    if parameters is not None and args.compute is None:
        parser.error("--model needs --compute, that model's step without communication")
    target = args.target if args.target is not None else max(run["final"] for run in runs)
    compute = args.compute
    if compute is None:
        inner = [t for run in runs for t in run["step_times"].get("inner", [])]
        if not inner:
            parser.error("--compute is needed: no DiLoCo run gives a step without communication")
        compute = statistics.median(inner)
    if not compute > 0:
        parser.error(f"--compute must be > 0 seconds, got {compute}")
    results = choose(runs, target, compute, args.links, Machine(), parameters)
    silent = [name for name, entry in results["runs"].items() if entry["total_bytes"] <= 0]
    if args.plot and silent:
        parser.error(f"--plot draws bytes on a log scale; {silent} sent none (one worker?)")
    print(f"target validation loss {target:.4f}, t_c {compute:.3f} s")
    for name, entry in results["runs"].items():
        times = ", ".join(f"{link} {s:.0f} s" for link, s in entry["seconds"].items())
        if not entry["timed"]:
            times = "not timed by the cost model"
        print(f"  {name}: {entry['steps']} steps; {times or 'never reached'}")
    for link, best in results["fastest"].items():
        lead = f", {best['lead']:.2f}x ahead of {best['next']}" if "next" in best else ""
        print(f"{link}: {' and '.join(best['runs'])} first{lead}")
    if args.record:
        args.record.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot_loss_against_bytes(results, args.plot)
    return 0


def plot_loss_against_bytes(results: dict[str, Any], path: Path) -> None:
    """Each run's final validation loss against the bytes a worker sent, bytes on a log
    scale, the target as a line; each run a colour and marker of its own, named in the
    legend beside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 5.5))
    for index, (name, entry) in enumerate(results["runs"].items()):
        marker = MARKERS[index // COLOURS % len(MARKERS)]
        axes.scatter(
            entry["total_bytes"],
            entry["final"],
            color=f"C{index % COLOURS}",
            marker=marker,
            label=name,
        )
    axes.axhline(results["target"], color="grey", linestyle=":", label="target")
    axes.set_xscale("log")
    axes.set_xlabel("bytes sent per worker, whole run")
    axes.set_ylabel("final validation loss")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
