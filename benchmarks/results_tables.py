"""Regenerate the results tables of the documentation from the result files kept in docs/.

Every table sits in a page between two markers::

    <!-- table: NAME -->
    ...generated: the table, then a line naming its source files, the commit and date they
    were measured on (or recorded in) and the command that measures them again...
    <!-- /table -->

and is built here from the JSON (and JSONL) files under docs/bench, docs/convergence,
docs/main-job and docs/zero-one-adam, never typed by hand. ``--check`` exits 1, naming the
pages, when a committed page differs from what the data give (tests/tools/test_results_tables.py
does the same).

    .venv/bin/python benchmarks/results_tables.py           # rewrite the pages in place
    .venv/bin/python benchmarks/results_tables.py --check   # only compare
    .venv/bin/python benchmarks/results_tables.py --list    # the tables and their pages
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: The pages whose tables this tool owns, relative to the repository root.
PAGES = (
    "README.md",
    "docs/BENCHMARKS.md",
    "docs/CONVERGENCE.md",
    "docs/ONEBIT-ADAM.md",
    "docs/ZERO-ONE-ADAM.md",
    "docs/ESTIMATE.md",
    "docs/VARIANCE-READINESS.md",
)

#: The dates of the library commits the result files name (``code.commit`` in a cluster
#: result, or the commit that recorded a file that names none), from ``git log``: the
#: result files do not record a date, and the check must not need the repository's history.
COMMIT_DATES = {
    "656a864": "2026-12-08",
    "f2c6e9e": "2026-12-07",
    "524fcaf": "2026-12-07",
    "9b5754e": "2026-12-07",
    "29107f6": "2026-12-07",
    "4d2d8ad": "2026-12-07",
    "e41c598": "2026-11-30",
    "ce967f0": "2026-11-30",
    "61e58fd": "2026-11-30",
    "3ea5fb3": "2026-11-30",
    "1354b52": "2026-11-30",
    "171c6ff": "2026-11-30",
    "425d9d9": "2026-11-30",
    "4118b9c": "2026-11-30",
    "488406f": "2026-11-30",
    "f960cf9": "2026-11-30",
    "3364b60": "2026-11-30",
    "86773e0": "2026-12-01",
    "d85dfdc": "2026-12-01",
    "0b0b186": "2026-12-01",
    "132aeb6": "2026-12-01",
    "5f2dabd": "2026-12-01",
    "8ac4669": "2026-12-02",
    "ae35092": "2026-12-02",
    "306b326": "2026-12-02",
    "c073904": "2026-12-02",
    "41afe88": "2026-12-03",
    "2af06df": "2026-12-03",
    "480caa2": "2026-12-03",
    "1c37e13": "2026-12-03",
    "1fe11f6": "2026-12-03",
    "ccf71d0": "2026-12-03",
    "320bd06": "2026-12-04",
    "f4d131b": "2026-12-04",
    "95bcdd9": "2026-12-04",
    "963ac7d": "2026-12-04",
    "af63a40": "2026-12-04",
    "e95d5d0": "2026-12-04",
    "5aee263": "2026-12-04",
    "294793a": "2026-12-04",
    "94bcbc4": "2026-12-04",
    "894403e": "2026-12-04",
    "dc88f59": "2026-12-04",
    "5ca0ad9": "2026-12-04",
    "ae839b0": "2026-12-04",
    "6e0a975": "2026-12-05",
    "916556b": "2026-12-05",
    "eb43f95": "2026-12-05",
    "43079ad": "2026-12-05",
    "24d5ed9": "2026-12-05",
    "5de40a3": "2026-12-05",
    "ebdf454": "2026-12-05",
    "343f88f": "2026-12-05",
    "751acb1": "2026-12-05",
    "cc08567": "2026-12-05",
    "8307ca6": "2026-12-05",
    "e6ab329": "2026-12-05",
    "252367a": "2026-12-05",
    "bb71905": "2026-12-05",
    "c2eea4d": "2026-12-05",
    "828a2f9": "2026-12-05",
    "96a0853": "2026-12-05",
    "d879708": "2026-12-05",
    "e47b06b": "2026-12-05",
    "6526e94": "2026-12-05",
    "9454f48": "2026-12-05",
    "ebe7139": "2026-12-06",
    "dc382fb": "2026-12-06",
    "27d3025": "2026-12-06",
    "0747295": "2026-12-06",
    "79d17a7": "2026-12-06",
    "af27bc3": "2026-12-06",
    "d653a46": "2026-12-06",
    "18896a7": "2026-12-06",
    "98fecdd": "2026-12-06",
    "7101be9": "2026-12-06",
    "028872d": "2026-12-06",
    "ffde085": "2026-12-06",
    "791e022": "2026-12-06",
    "015841c": "2026-12-06",
    "b83aeee": "2026-12-07",
    "2601711": "2026-12-07",
    "60686f5": "2026-12-07",
    "3476600": "2026-12-07",
    "ffb1821": "2026-12-07",
    "2b7b445": "2026-12-07",
}

#: Result files that do not name the commit they were measured on: the commit that recorded
#: them (``git log -1 -- FILE``), or, where the page that described them named the library
#: commit they were measured on, that commit.
RECORDED_IN = {
    "docs/main-job/diloco-reference": "656a864",
    **{
        f"docs/convergence/diloco-study/{seed}diloco-adam-n4-h20-1bit-m05-local-ref05": "656a864"
        for seed in ("", "seed-1/", "seed-2/", "seed-3/")
    },
    "docs/convergence/diloco-study/seed-1/diloco-adam-n4-h40-dense-m05": "9b5754e",
    "docs/convergence/diloco-study/seed-1/diloco-adam-n4-h40-1bit-m05-local": "9b5754e",
    "docs/convergence/diloco-study/seed-3": "29107f6",
    "docs/main-job/diloco-delivered": "29107f6",
    "docs/convergence/diloco-study/diloco-adam-n4-h20-1bit-m05-local-delivered": "29107f6",
    "docs/convergence/diloco-study/seed-1/diloco-adam-n4-h20-dense-m05": "f2c6e9e",
    "docs/convergence/diloco-study/seed-1/diloco-adam-n4-h20-1bit-m05-local": "f2c6e9e",
    "docs/convergence/diloco-study/seed-1/diloco-adam-n4-h20-1bit-m05-local-delivered": "29107f6",
    "docs/convergence/diloco-study/seed-2/diloco-adam-n4-h20-dense-m05": "4d2d8ad",
    "docs/convergence/diloco-study/seed-2/diloco-adam-n4-h20-1bit-m05-local": "524fcaf",
    "docs/convergence/diloco-study/seed-2/diloco-adam-n4-h20-1bit-m05-local-delivered": "29107f6",
    "docs/bench/micro-allreduce.json": "e41c598",
    "docs/bench/micro-optimizer.json": "b83aeee",
    "docs/bench/errors-ahead": "b83aeee",
    "docs/bench/errors-ahead/whole.json": "2601711",
    "docs/convergence/lamb": "4118b9c",
    "docs/convergence/onebit-lamb-n4": "488406f",
    "docs/convergence/onebit-adam-n4": "488406f",
    "docs/convergence/zero-one-adam-n4": "488406f",
    "docs/convergence/zero-one-adam-n4-s120": "86773e0",
    "docs/convergence/zero-one-adam-n4-k128-s120": "86773e0",
    "docs/convergence/zero-one-adam-n4-momentum": "d85dfdc",
    "docs/convergence/zero-one-adam-n4-momentum-s240": "d85dfdc",
    "docs/convergence/lamb-n16": "425d9d9",
    "docs/convergence/onebit-lamb-n16": "86773e0",
    "docs/convergence/onebit-lamb-n64": "86773e0",
    "docs/convergence/onebit-lamb-n256": "86773e0",
    "docs/convergence/lamb-n256": "86773e0",
    "docs/convergence/powersgd/lamb": "306b326",
    "docs/convergence/onebit-adam-n4-per-tensor": "8ac4669",
    "docs/convergence/zero-one-adam-n4-auto": "8ac4669",
    "docs/convergence/delayed/onebit-lamb-n4-delayed": "95bcdd9",
    "docs/convergence/delayed/prediction": "6e0a975",
    "docs/convergence/delayed/oracle": "24d5ed9",
    "docs/convergence/delayed/oracle/w64-undelayed": "af27bc3",
    "docs/convergence/delayed/oracle/w64-own": "af27bc3",
    "docs/convergence/delayed/oracle/w64-mean": "af27bc3",
    "docs/convergence/per-tensor/onebit-lamb-n4-per-tensor": "ae35092",
    "docs/main-job": "294793a",
    "docs/zero-one-adam": "1354b52",
    "docs/convergence/variance-guard": "af63a40",
    "docs/convergence/readiness": "94bcbc4",
    "docs/convergence/readiness/seed-study.json": "894403e",
    "docs/convergence/variance-guard/zero-one-adam": "94bcbc4",
    "docs/main-job/diloco": "d879708",
    "docs/main-job/diloco-outer": "d879708",
    "docs/main-job/diloco-local": "ffde085",
    "docs/main-job/longer": "24d5ed9",
    "docs/main-job/lamb": "c2eea4d",
    "docs/main-job/default": "e47b06b",
    "docs/main-job/momentum-bound/off": "c2eea4d",
    "docs/main-job/longer/lamb-1000x64": "252367a",
    "docs/main-job/longer/onebit-lamb-1000x64-freeze-200": "252367a",
    "docs/convergence/diloco-study": "ae839b0",
    "docs/convergence/diloco-study/link-choice.json": "2b7b445",
    "docs/convergence/diloco-study/lamb-n256": "79d17a7",
    "docs/convergence/diloco-study/lamb-powersgd-r4": "eb43f95",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-dense": "eb43f95",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-1bit": "eb43f95",
    "docs/convergence/diloco-study/link-choice-bert-base.json": "2b7b445",
    "docs/convergence/diloco-study/onebit-adam-n4-per-tensor": "5de40a3",
    "docs/convergence/diloco-study/zero-one-adam-n4-auto": "5de40a3",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-1bit-sgd": "ebdf454",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-1bit-m05": "ebdf454",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-dense-sgd": "ffb1821",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-1bit-sgd-local": "ffb1821",
    "docs/convergence/diloco-study/diloco-adam-n4-h40-dense-m05": "2b7b445",
    "docs/convergence/diloco-study/diloco-adam-n4-h40-1bit-m05-local": "2b7b445",
    "docs/convergence/diloco-study/diloco-adam-n4-h20-1bit-m05": "343f88f",
    "docs/convergence/diloco-study/diloco-adam-n4-h20-1bit-m05-local": "ffde085",
    "docs/convergence/diloco-study/diloco-adam-n4-h20-1bit-local": "ffde085",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-1bit-m05-local": "ffde085",
    "docs/convergence/diloco-study/diloco-adam-n4-h20-1bit-m05-local-b128": "791e022",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-1bit-m05-local-b128": "791e022",
    "docs/main-job/diloco-blocks": "791e022",
    "docs/convergence/diloco-study/diloco-adam-n4-h20-dense-m05": "e6ab329",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-dense-m05": "e6ab329",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-1bit-k3-d5": "e6ab329",
    "docs/convergence/diloco-study/diloco-adam-n4-h20-dense-torchft": "252367a",
    "docs/convergence/diloco-study/diloco-adam-n4-h60-dense-torchft": "252367a",
    "docs/convergence/variance-guard/trust-bound": "96a0853",
    "docs/main-job/trust-bound": "96a0853",
    "docs/convergence/variance-guard/momentum-bound": "e47b06b",
    "docs/convergence/variance-guard/momentum-bound/onebit-lamb-n4-fused-momentum-bound": "6526e94",
    "docs/convergence/variance-guard/momentum-bound/"
    "onebit-lamb-n4-buckets-momentum-bound": "9454f48",
    "docs/convergence/variance-guard/momentum-bound/"
    "onebit-lamb-n4-delayed-momentum-bound": "ebe7139",
    "docs/convergence/variance-guard/momentum-bound/"
    "onebit-lamb-n4-trust-bound-momentum-bound": "ebe7139",
    "docs/convergence/variance-guard/momentum-bound/onebit-lamb-n16-momentum-bound": "ebe7139",
    "docs/convergence/variance-guard/momentum-bound/onebit-lamb-n64-momentum-bound": "dc382fb",
    "docs/convergence/variance-guard/momentum-bound/"
    "onebit-lamb-n64-delayed-momentum-bound": "27d3025",
    "docs/convergence/variance-guard/momentum-bound/onebit-lamb-n256-momentum-bound": "0747295",
    "docs/convergence/delayed/oracle/onebit-lamb-n64-delayed-mean-momentum-bound": "18896a7",
    "docs/main-job/momentum-bound": "e47b06b",
    "docs/main-job/trust-bound/simulated-lamb-ratio": "828a2f9",
}

RUN = "python3 run.py onebit"
#: The main job's shape before its defaults became 1000 steps of 64 sequences, frozen after
#: 20 % of them: the options that rerun a run of then (1-bit runs froze after step 100).
EARLIER_MAIN_JOB = "--steps 250 --batch-size 256"
EARLIER_FREEZE = f"{EARLIER_MAIN_JOB} --freeze-step 100"
#: What runs of 1-bit LAMB recorded before ``momentum_bound`` was its default need today.
NO_MOMENTUM_BOUND = "--no-momentum-bound"
STUDY = f"{RUN} study run --spec docs/convergence/study.json"


@dataclass(frozen=True)
class Table:
    """A generated table: its Markdown rows and its stamp (sources, commits, dates, commands)."""

    name: str
    header: Sequence[str]
    align: Sequence[str]  # "l" or "r" per column
    rows: Sequence[Sequence[str]]
    sources: Sequence[str]
    commits: Sequence[str]
    dates: Sequence[str]
    commands: Sequence[str]
    measured: bool = True  # False: the commits are those that recorded the files

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.header) + " |"]
        lines.append("|" + "|".join("---:" if a == "r" else "---" for a in self.align) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        when = "measured at library commit" if self.measured else "recorded in commit"
        if len(self.commits) > 1:
            when += "s"
        commits = ", ".join(f"`{c}`" for c in self.commits)
        dates = " to ".join(sorted(set(self.dates))[:: max(1, len(set(self.dates)) - 1)])
        sources = ", ".join(f"`{s}`" for s in self.sources)
        commands = "; ".join(_command_span(c) for c in self.commands)
        lines += ["", f"Data: {sources}; {when} {commits}, {dates}. Reproduce: {commands}."]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# reading


def _read(path: str) -> Any:
    return json.loads((ROOT / path).read_text())


def _commit_of(path: str, data: Any | None = None) -> str:
    if isinstance(data, dict) and isinstance(data.get("code"), dict):
        return str(data["code"]["commit"])[:7]
    key = path
    while key not in RECORDED_IN:
        if "/" not in key:
            raise KeyError(f"no commit recorded for {path}: add it to RECORDED_IN")
        key = key.rsplit("/", 1)[0]
    return RECORDED_IN[key]


def _stamp(paths: Iterable[str], datas: Iterable[Any] | None = None) -> tuple[list[str], list[str]]:
    paths = list(paths)
    datas = list(datas) if datas is not None else [None] * len(paths)
    commits: list[str] = []
    for path, data in zip(paths, datas, strict=True):
        commit = _commit_of(path, data)
        if commit not in commits:
            commits.append(commit)
    return commits, [COMMIT_DATES[c] for c in commits]


def _validation_losses(run_dir: str) -> list[tuple[int, float]]:
    """Every validation loss of a run folder's metrics, or its final one where only the
    summary is kept."""
    if not (ROOT / run_dir / "metrics.jsonl").exists():
        summary = _read(f"{run_dir}/summary.json")
        return [(int(summary["steps"]), float(summary["final_validation_loss"]))]
    rows = []
    for line in (ROOT / run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "validation":
            rows.append((int(row["step"]), float(row["loss"])))
    return rows


# ---------------------------------------------------------------------------------------------
# formatting


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _pct(value: float) -> str:
    return f"{value * 100:+.2f} %"


def _mib(value: float) -> str:
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.1f} MiB"


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f} MB"


def _s(value: float) -> str:
    return f"{value:.3f} s"


LINKS = {"100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", None: "unshaped"}

METHODS = {
    "lamb": "LAMB (DDP, fp32 allreduce)",
    "lamb-compute": "LAMB without communication",
    "onebit-lamb": "1-bit LAMB",
    "onebit-lamb-ddp": "1-bit LAMB, DDP hook",
    "onebit-lamb-overlap": "1-bit LAMB, overlapped with backward",
    "onebit-lamb-ddp-overlap": "1-bit LAMB, DDP hook, overlapped",
    "onebit-lamb-overlap-per-tensor": "1-bit LAMB, overlapped, per tensor",
    "onebit-lamb-delayed": "1-bit LAMB, delayed exchange",
    "onebit-adam": "1-bit Adam (DDP hook, fused exchange)",
    "zero-one-adam": "0/1 Adam (DDP hook)",
    "diloco-dense": "DiLoCo over LAMB, H = 4, dense",
    "diloco-1bit": "DiLoCo over LAMB, H = 4, 1-bit",
    "diloco-dense-k2-d1": "Streaming DiLoCo over LAMB, H = 4, 2 fragments, delay 1, dense",
    "diloco-1bit-k2-d1": "Streaming DiLoCo over LAMB, H = 4, 2 fragments, delay 1, 1-bit",
    "fp16": "LAMB + DDP fp16 hook",
    "powersgd-1": "LAMB + PowerSGD rank 1",
    "powersgd-4": "LAMB + PowerSGD rank 4",
}


def _cluster_command(path: str, result: dict[str, Any]) -> str:
    s = result["settings"]
    parts = [f"{RUN} bench cluster --model {s['model']} --workers {s['workers']}"]
    if s.get("workers_per_node", 1) != 1:
        parts.append(f"--workers-per-node {s['workers_per_node']}")
    parts.append(f"--bandwidth {s['bandwidth'] or 'none'}")
    parts.append(
        f"--seq-len {s['seq_len']} --steps {s['steps']} --warm-steps {s['warm_steps']} "
        f"--skip-steps {s['skip_steps']} --rounds {s.get('rounds', 2)}"
    )
    parts.append(f"--methods {','.join(s['methods'])} --output {path}")
    return " ".join(parts)


def _command_span(command: str) -> str:
    """``command`` as code, a closing note in parentheses after it (so the code pastes)."""
    match = re.fullmatch(r"(.*?) (\([^()]*\))", command)
    return f"`{match[1]}` {match[2]}" if match else f"`{command}`"


def _cluster_commands(files: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """One command per file, the files that differ only in the link given as one line."""
    groups: dict[str, list[str]] = {}
    for path, result in files:
        command = _cluster_command(path, result)
        link = result["settings"]["bandwidth"] or "none"
        key = command.replace(f"--bandwidth {link}", "--bandwidth LINK").replace(path, "FILE")
        links = groups.setdefault(key, [])
        if link not in links:
            links.append(link)
    commands = []
    for key, links in groups.items():
        if len(links) == 1:
            key = key.replace("LINK", links[0])
        else:
            key += f" (LINK: {', '.join(links)})"
        commands.append(key.replace("--output FILE", "--output FILE.json"))
    return commands


def _cluster_table(
    name: str,
    header: Sequence[str],
    align: Sequence[str],
    rows: list[list[str]],
    files: Sequence[tuple[str, dict[str, Any]]],
) -> Table:
    commits, dates = _stamp([p for p, _ in files], [r for _, r in files])
    return Table(
        name, header, align, rows, [p for p, _ in files], commits, dates, _cluster_commands(files)
    )


# ---------------------------------------------------------------------------------------------
# speed: docs/bench

STEADY = [
    f"docs/bench/steady/cluster-small-4w-{link}.json"
    for link in ("100mbit", "1gbit", "10gbit", "unshaped")
]
DELAYED = [
    "docs/bench/delayed-prediction/cluster-base-2w-100mbit.json",
    "docs/bench/delayed-prediction/cluster-base-2w-1gbit.json",
    "docs/bench/delayed-prediction/cluster-base-2w-unshaped.json",
    "docs/bench/delayed-prediction/cluster-small-4w-100mbit.json",
    "docs/bench/delayed-prediction/cluster-small-4w-1gbit.json",
    "docs/bench/delayed-prediction/cluster-small-4w-unshaped.json",
]
ZERO_ONE_CLUSTER = [
    "docs/bench/zero-one-adam/cluster-small-4w-100mbit.json",
    "docs/bench/zero-one-adam/cluster-small-4w-1gbit.json",
]


def table_bytes_per_step() -> Table:
    path = "docs/bench/steady/cluster-small-4w-1gbit.json"
    result = _read(path)
    summary = result["summary"]
    lamb = summary["lamb"]["wire_comp"]
    rows = []
    for method, row in summary.items():
        if method == "lamb-compute":
            continue
        stages = row["stages"]
        library = stages.get("compression", stages.get("steady"))["library_bytes_per_step"]
        rows.append(
            [
                METHODS[method],
                _mb(row["wire_comp"]),
                _mb(library) if library else "-",
                _x(lamb / row["wire_comp"]),
                _x(row["whole_run_traffic_reduction"]["0.20"]),
            ]
        )
    return _cluster_table(
        "bytes-per-step",
        [
            "method (`small`, 28.8M parameters, 4 workers)",
            "on the wire per worker and step",
            "counted by the library",
            "fewer than LAMB",
            "whole run, 20 % warm-up",
        ],
        "lrrrr",
        rows,
        [(path, result)],
    )


def _steady_files() -> list[tuple[str, dict[str, Any]]]:
    return [(p, _read(p)) for p in STEADY]


def table_cluster_step_time() -> Table:
    files = _steady_files()
    methods = list(files[0][1]["summary"])
    rows = []
    for method in methods:
        cells = [METHODS[method]]
        for _, result in files:
            row = result["summary"].get(method)
            if row is None:
                cells.append("not run")
                continue
            lamb = result["summary"]["lamb"]["t_comp"]
            cells.append(f"{_s(row['t_comp'])} ({_x(lamb / row['t_comp'])})")
        rows.append(cells)
    links = [LINKS[r["settings"]["bandwidth"]] for _, r in files]
    return _cluster_table(
        "cluster-step-time",
        ["method (`small`, 4 workers): step (LAMB's step / it)", *links],
        "l" + "r" * len(links),
        rows,
        files,
    )


def table_cluster_whole_run() -> Table:
    files = _steady_files()
    rows = []
    for method in files[0][1]["summary"]:
        if method in ("lamb", "lamb-compute"):
            continue
        rows.append(
            [METHODS[method]]
            + [_x(result["summary"][method]["end_to_end_speedup"]) for _, result in files]
        )
    links = [LINKS[r["settings"]["bandwidth"]] for _, r in files]
    return _cluster_table(
        "cluster-whole-run",
        ["method (`small`, 4 workers): whole run, faster than LAMB", *links],
        "l" + "r" * len(links),
        rows,
        files,
    )


def table_delayed_exchange() -> Table:
    files = [(p, _read(p)) for p in DELAYED]
    rows = []
    for path, result in files:
        s, summary = result["settings"], result["summary"]
        lamb = summary["lamb"]["t_comp"]
        undelayed = summary["onebit-lamb"]["t_comp"]
        delayed = summary["onebit-lamb-delayed"]["t_comp"]
        overlap = summary.get("onebit-lamb-overlap")
        overlap_per_tensor = summary.get("onebit-lamb-overlap-per-tensor")
        rows.append(
            [
                f"`{s['model']}`, {s['workers']} workers, {LINKS[s['bandwidth']]}"
                + (" (again)" if path.endswith("-repeat.json") else ""),
                _s(summary["lamb-compute"]["t_comp"]),
                _s(lamb),
                _s(undelayed),
                _s(overlap["t_comp"]) if overlap else "not run",
                _s(overlap_per_tensor["t_comp"]) if overlap_per_tensor else "not run",
                _s(delayed),
                _x(undelayed / delayed),
                _x(lamb / delayed),
            ]
        )
    return _cluster_table(
        "delayed-exchange",
        [
            "run",
            "without communication",
            "LAMB",
            "1-bit LAMB",
            "1-bit LAMB, overlapped (fused)",
            "1-bit LAMB, overlapped (per tensor)",
            "1-bit LAMB, delayed",
            "undelayed / delayed",
            "LAMB / delayed",
        ],
        "lrrrrrrrr",
        rows,
        files,
    )


def table_allreduce_local() -> Table:
    path = "docs/bench/micro-allreduce.json"
    data = _read(path)
    rows = [
        [
            f"2^{row['numel'].bit_length() - 1}",
            f"{2 * 4 * row['numel'] / row['seconds']['copy'] / 1e9:.1f}",
            f"{row['copies']['torch']:.1f}",
            f"{row['copies']['numba']:.1f}",
        ]
        for row in data["local"]
    ]
    commits, dates = _stamp([path])
    return Table(
        "allreduce-local",
        ["elements", "copy (GB/s read + written)", "torch reference (copies)", "numba (copies)"],
        "rrrr",
        rows,
        [path],
        commits,
        dates,
        [
            f"{RUN} bench allreduce --min-log2 20 --max-log2 26 --world-sizes 2 4 --repeats 5 "
            f"--json {path}"
        ],
    )


def table_allreduce_loopback() -> Table:
    path = "docs/bench/micro-allreduce.json"
    data = _read(path)
    rows = []
    for row in data["loopback"]:
        seconds = row["seconds"]
        rows.append(
            [
                str(row["world_size"]),
                f"2^{row['numel'].bit_length() - 1}",
                f"{seconds['all_reduce']:.4f}",
                _x(seconds["all_reduce"] / seconds["torch"]),
                _x(seconds["all_reduce"] / seconds["numba"]),
            ]
        )
    commits, dates = _stamp([path])
    return Table(
        "allreduce-loopback",
        ["ranks", "elements", "dense all_reduce (s)", "torch reference", "numba"],
        "rrrrr",
        rows,
        [path],
        commits,
        dates,
        table_allreduce_local().commands,
    )


def table_optimizer_step() -> Table:
    path = "docs/bench/micro-optimizer.json"
    data = _read(path)
    rows = []
    for row in data:
        copy = row["copy_s"]
        lamb = row["lamb_step_s"] + row["dense_allreduce_s"]
        rows.append(
            [
                str(row["world_size"]),
                {"torch": "torch reference"}.get(row["backend"], row["backend"]),
                f"{row['lamb_step_s'] / copy:.1f}",
                f"{row['dense_allreduce_s'] / copy:.1f}" if row["dense_allreduce_s"] else "-",
                f"{row['onebit_warmup_step_s'] / copy:.1f}",
                f"{row['onebit_compression_step_s'] / copy:.1f}",
                f"{row['compressed_allreduce_s'] / copy:.1f}",
                _x(row["onebit_warmup_step_s"] / lamb),
                _x(row["onebit_compression_step_s"] / lamb),
            ]
        )
    commits, dates = _stamp([path])
    return Table(
        "optimizer-step",
        [
            "ranks",
            "kernels",
            "`Lamb.step()`",
            "its dense allreduce",
            "1-bit LAMB warm-up step",
            "1-bit LAMB compression step",
            "`compressed_allreduce` alone",
            "warm-up / LAMB",
            "compression / LAMB",
        ],
        "rlrrrrrrr",
        rows,
        [path],
        commits,
        dates,
        [f"{RUN} bench optimizer --world-sizes 1 2 --repeats 3 --json {path}"],
    )


def table_optimizer_memory() -> Table:
    path = "docs/bench/micro-optimizer.json"
    data = _read(path)
    rows = []
    for row in data:
        words = 4 * row["parameters"]
        rows.append(
            [
                str(row["world_size"]),
                {"torch": "torch reference"}.get(row["backend"], row["backend"]),
                f"{row['lamb_state_bytes'] / words:.2f}",
                f"{row['onebit_warmup_state_bytes'] / words:.2f}",
                f"{row['onebit_compression_state_bytes'] / words:.2f}",
                f"{row['onebit_scratch_bytes'] / words:.2f}",
            ]
        )
    commits, dates = _stamp([path])
    return Table(
        "optimizer-memory",
        [
            "ranks",
            "kernels",
            "LAMB state",
            "1-bit LAMB state, warm-up",
            "1-bit LAMB state, compression",
            "1-bit LAMB scratch",
        ],
        "rlrrrr",
        rows,
        [path],
        commits,
        dates,
        table_optimizer_step().commands,
    )


#: (result file, the exchange it timed, its ``--bucket-cap-mb``) of benchmarks/errors_ahead.py.
ERRORS_AHEAD = [
    ("docs/bench/errors-ahead/buckets-25mb.json", "per tensor, in buckets of 25 MiB", "25"),
    ("docs/bench/errors-ahead/whole.json", "per tensor, whole", "0"),
]


def table_errors_ahead() -> Table:
    rows = []
    for path, label, _ in ERRORS_AHEAD:
        for row in _read(path)["rows"]:
            rows.append(
                [
                    label,
                    {"none": "unshaped", "100mbit": "100 Mbit/s"}.get(row["bandwidth"]),
                    f"{row['ahead_median']:.3f} s",
                    f"{row['after_median']:.3f} s",
                    _x(row["after_over_ahead"]),
                ]
            )
    paths = [path for path, _, _ in ERRORS_AHEAD]
    commits, dates = _stamp(paths)
    return Table(
        "errors-ahead",
        [
            "exchange (BERT-base's tensors, 2 hosts)",
            "link",
            "error updates while the bytes travel",
            "error updates after the last check",
            "after / while",
        ],
        "llrrr",
        rows,
        paths,
        commits,
        dates,
        [
            f".venv/bin/python benchmarks/errors_ahead.py --calls 7 --bucket-cap-mb {cap} "
            f"--record {path}"
            for path, _, cap in ERRORS_AHEAD
        ],
    )


# ---------------------------------------------------------------------------------------------
# convergence: docs/convergence, docs/main-job

#: (run folder, arm label) of the study's first installation, against its LAMB arm.
STUDY_ARMS = [
    ("docs/convergence/lamb", "LAMB"),
    ("docs/convergence/onebit-lamb-n4", "1-bit LAMB (fused exchange)"),
    ("docs/convergence/onebit-adam-n4", "1-bit Adam (fused exchange)"),
    ("docs/convergence/zero-one-adam-n4", "0/1 Adam, κ 64, S 60"),
    ("docs/convergence/zero-one-adam-n4-s120", "0/1 Adam, κ 64, S 120"),
    ("docs/convergence/zero-one-adam-n4-k128-s120", "0/1 Adam, κ 128, S 120"),
    ("docs/convergence/zero-one-adam-n4-momentum", "0/1 Adam, momentum exchange, κ 64, S 120"),
    ("docs/convergence/zero-one-adam-n4-momentum-s240", "0/1 Adam, momentum exchange, κ 64, S 240"),
    ("docs/convergence/lamb-n16", "LAMB (simulated)"),
    ("docs/convergence/onebit-lamb-n16", "1-bit LAMB (simulated, fused exchange)"),
    ("docs/convergence/onebit-lamb-n64", "1-bit LAMB (simulated, fused exchange)"),
    ("docs/convergence/lamb-n256", "LAMB (simulated)"),
    ("docs/convergence/onebit-lamb-n256", "1-bit LAMB (simulated, fused exchange)"),
]

#: The arms with the library's defaults on the study's current inputs, against its LAMB arm.
DEFAULT_ARMS = [
    ("docs/convergence/diloco-study/lamb", "LAMB"),
    ("docs/convergence/variance-guard/momentum-bound/onebit-lamb-n4-momentum-bound", "1-bit LAMB"),
    ("docs/convergence/diloco-study/onebit-adam-n4-per-tensor", "1-bit Adam"),
    ("docs/convergence/diloco-study/zero-one-adam-n4-auto", "0/1 Adam"),
    ("docs/convergence/diloco-study/adam-n4", "AdamW"),
    ("docs/convergence/diloco-study/lamb-powersgd-r4", "LAMB + PowerSGD rank 4"),
]


def _summary(run_dir: str) -> dict[str, Any]:
    return _read(f"{run_dir}/summary.json")


def _arm_rows(arms: Sequence[tuple[str, str]]) -> list[list[str]]:
    lamb = _summary(arms[0][0])
    rows = []
    for run_dir, label in arms:
        s = _summary(run_dir)
        loss = s["final_validation_loss"]
        rows.append(
            [
                label,
                f"`{run_dir.rsplit('/', 1)[1]}`",
                str(s["workers"]),
                f"{loss:.4f}",
                "" if run_dir == arms[0][0] else _pct(loss / lamb["final_validation_loss"] - 1),
                _mib(s["bytes_sent"]["total"]),
                _x(s["reduction_vs_lamb"]),
            ]
        )
    return rows


ARM_HEADER = [
    "arm",
    "run",
    "workers",
    "final validation loss",
    "vs LAMB",
    "bytes per worker",
    "fewer than LAMB",
]


def _arms_table(
    name: str,
    arms: Sequence[tuple[str, str]],
    sources: Sequence[str] | None,
    command: str,
    *,
    measured: bool,
) -> Table:
    """The arms (run folder, label; LAMB first) that trained on the same inputs, with
    :data:`ARM_HEADER`'s columns; ``sources`` default to each arm's summary."""
    _first_losses_agree([d for d, _ in arms])
    paths = [f"{d}/summary.json" for d, _ in arms]
    commits, dates = _stamp(paths)
    return Table(
        name,
        ARM_HEADER,
        "lllrrrr",
        _arm_rows(arms),
        paths if sources is None else sources,
        commits,
        dates,
        [command],
        measured=measured,
    )


def table_convergence_study() -> Table:
    return _arms_table(
        "convergence-study",
        STUDY_ARMS,
        ["docs/convergence/<run>/summary.json"],
        f"{STUDY} --out runs/study2 --arms <run>",
        measured=False,
    )


def table_convergence_defaults() -> Table:
    return _arms_table(
        "convergence-defaults",
        DEFAULT_ARMS,
        None,
        f"{STUDY} --out runs/defaults --arms lamb onebit-lamb-n4-momentum-bound "
        "onebit-adam-n4-per-tensor zero-one-adam-n4-auto adam-n4 lamb-powersgd-r4",
        measured=False,
    )


#: The main job's runs, one installation and library commit for all (the tables of
#: CONVERGENCE.md and VARIANCE-READINESS.md read the same files): folder -> (label, command).
#: The commit whose ``trust_bound`` bounded the coefficient by LAMB's ratio itself.
TRUST_BOUND_OF_LAMB_RATIO = "828a2f9"
MAIN_JOB_RUNS = {
    "lamb": ("LAMB", "python3 run.py train --optimizer lamb"),
    "default": ("1-bit LAMB, frozen after step 200 (the default)", "python3 run.py train"),
    "momentum-bound/off": (
        "1-bit LAMB, frozen after step 200, without momentum_bound",
        f"python3 run.py train {NO_MOMENTUM_BOUND}",
    ),
    "steps-250/lamb": (
        "LAMB, 250 steps of 256",
        f"python3 run.py train --optimizer lamb {EARLIER_MAIN_JOB}",
    ),
    "steps-250/default": (
        "1-bit LAMB, 250 steps of 256, frozen after step 100",
        f"python3 run.py train {EARLIER_FREEZE} {NO_MOMENTUM_BOUND}",
    ),
    "steps-250/freeze-50": (
        "1-bit LAMB, 250 steps of 256, frozen after step 50",
        f"python3 run.py train {EARLIER_MAIN_JOB} --freeze-step 50 {NO_MOMENTUM_BOUND}",
    ),
    "longer/lamb": (
        "LAMB, 500 steps of 128 sequences (simulated)",
        f"{RUN} simulate --optimizer lamb --steps 500 --batch-size 128 --eval-every 250 "
        "--threads 1",
    ),
    "longer/onebit-lamb-freeze-100": (
        "1-bit LAMB, 500 steps of 128 sequences, frozen after step 100 (simulated)",
        f"{RUN} simulate --steps 500 --batch-size 128 --freeze-step 100 --eval-every 250 "
        f"--threads 1 {NO_MOMENTUM_BOUND}",
    ),
    "longer/lamb-1000x64": (
        "LAMB, 1000 steps of 64 sequences (simulated)",
        f"{RUN} simulate --optimizer lamb --eval-every 500 --threads 1",
    ),
    "longer/onebit-lamb-1000x64-freeze-200": (
        "1-bit LAMB, 1000 steps of 64 sequences, frozen after step 200, without "
        "momentum_bound (simulated)",
        f"{RUN} simulate --eval-every 500 --threads 1 {NO_MOMENTUM_BOUND}",
    ),
    "trust-bound/bound-2": (
        "1-bit LAMB, trust_bound 2",
        f"python3 run.py train --trust-bound 2 {NO_MOMENTUM_BOUND}",
    ),
    "trust-bound/simulated-bound-2": (
        "1-bit LAMB, trust_bound 2 (simulated)",
        f"{RUN} simulate --trust-bound 2 --eval-every 500 --threads 1 {NO_MOMENTUM_BOUND}",
    ),
    "trust-bound/simulated-lamb-ratio": (
        "1-bit LAMB, c at most LAMB's ratio clamp(‖p‖/‖u‖, c_min, c_max) (simulated)",
        f"{RUN} simulate --trust-bound 1 --eval-every 500 --threads 1 (at commit "
        f"{TRUST_BOUND_OF_LAMB_RATIO}, whose trust_bound was this bound)",
    ),
    "momentum-bound/simulated-bound": (
        "1-bit LAMB, 1000 steps of 64 sequences, frozen after step 200 (the default; simulated)",
        f"{RUN} simulate --eval-every 500 --threads 1",
    ),
}


def _main_job_table(
    name: str, groups: Sequence[Sequence[str]], header: Sequence[str], cells
) -> Table:
    """A table of the main job's runs (folders under docs/main-job) in ``groups`` of runs on
    the same inputs, LAMB's first in each: the label, then ``cells(summary, lamb_summary)``."""
    runs, paths, rows = [], [], []
    for group in groups:
        _first_losses_agree([f"docs/main-job/{run}" for run in group])
        summaries = [_read(f"docs/main-job/{run}/summary.json") for run in group]
        rows += [
            [MAIN_JOB_RUNS[run][0], *cells(s, summaries[0])]
            for run, s in zip(group, summaries, strict=True)
        ]
        runs += group
        paths += [f"docs/main-job/{run}/summary.json" for run in group]
    commits, dates = _stamp(paths)
    return Table(
        name,
        ["run", *header],
        "l" + "r" * len(header),
        rows,
        paths,
        commits,
        dates,
        [MAIN_JOB_RUNS[run][1] for run in runs],
    )


def _refresh_steps(summary: dict[str, Any]) -> int:
    return int(summary["bytes_sent"]["by_stage"].get("refresh", {}).get("steps", 0))


def table_main_job() -> Table:
    def cells(s: dict[str, Any], lamb: dict[str, Any]) -> list[str]:
        loss, first = s["final_validation_loss"], s is lamb
        return [
            f"{loss:.4f}",
            "" if first else _pct(loss / lamb["final_validation_loss"] - 1),
            f"{(1 - loss / s['unigram_entropy']) * 100:.1f} %",
            "" if first else str(_refresh_steps(s)),
            _mib(s["bytes_sent"]["total"]),
            _x(s["reduction_vs_lamb"]),
            f"{s['train_time_s']:.0f} s",
        ]

    header = [
        "final validation loss",
        "vs LAMB",
        "below the unigram level",
        "refresh steps",
        "bytes per worker",
        "fewer than LAMB",
        "training time",
    ]
    return _main_job_table("main-job", [["lamb", "default"]], header, cells)


#: DiLoCo on the main job: folder under docs/main-job/diloco -> (label, command).
DILOCO_RUNS = {
    "adam": (
        "AdamW, every step (DDP)",
        f"python3 run.py train --optimizer adam {EARLIER_MAIN_JOB}",
    ),
    **{
        f"h{h}-{x}": (
            f"DiLoCo, H = {h}, {'1-bit' if x == '1bit' else x} outer exchange",
            f"python3 run.py train --optimizer adam {EARLIER_MAIN_JOB} --sync-every {h} "
            f"--outer-exchange {x}"
            + (
                " --outer-lr 0.7 --outer-momentum 0.9 --worker-residual carried"
                if x == "1bit"
                else ""
            ),
        )
        for h in (10, 25)
        for x in ("dense", "1bit")
    },
}


def table_diloco_main_job() -> Table:
    """DiLoCo over AdamW on the main job, dense and 1-bit, beside AdamW every step."""
    _first_losses_agree([f"docs/main-job/diloco/{run}" for run in DILOCO_RUNS])
    paths = [f"docs/main-job/diloco/{run}/summary.json" for run in DILOCO_RUNS]
    summaries = [_read(path) for path in paths]
    adam = summaries[0]
    rows = []
    for (label, _), s in zip(DILOCO_RUNS.values(), summaries, strict=True):
        stages = s["bytes_sent"]["by_stage"]
        rounds = stages.get("outer", {}).get("steps", 0)
        loss, first = s["final_validation_loss"], s is adam
        total = s["bytes_sent"]["total"]
        rows.append(
            [
                label,
                "" if first else str(rounds),
                f"{loss:.4f}",
                "" if first else _pct(loss / adam["final_validation_loss"] - 1),
                _mib(total),
                "" if first else _x(adam["bytes_sent"]["total"] / total),
                "" if first else _mb(total / rounds),
            ]
        )
    commits, dates = _stamp(paths)
    return Table(
        "diloco-main-job",
        [
            "run",
            "rounds",
            "final validation loss",
            "vs AdamW",
            "bytes per worker",
            "fewer than AdamW",
            "bytes per round",
        ],
        "lrrrrrr",
        rows,
        paths,
        commits,
        dates,
        [command for _, command in DILOCO_RUNS.values()],
    )


#: DiLoCo's outer SGD on the main job: (lr, momentum) -> run folder of each H and exchange.
DILOCO_OUTER_RUNS = {
    (0.7, 0.9): "docs/main-job/diloco/h{h}-{x}",
    (0.7, 0.5): "docs/main-job/diloco-outer/h{h}-{x}-m05",
    (1.0, 0.0): "docs/main-job/diloco-outer/h{h}-{x}-m0-lr1",
}
#: The 1-bit exchange with ``--worker-residual local`` at the same outer SGDs.
DILOCO_LOCAL_RUNS = {
    (0.7, 0.9): "docs/main-job/diloco-local/h{h}-m09",
    (0.7, 0.5): "docs/main-job/diloco-local/h{h}-m05",
    (1.0, 0.0): "docs/main-job/diloco-local/h{h}-m0-lr1",
}


def _first_losses_agree(paths: Sequence[str]) -> None:
    """The runs compared in a table trained on the same samples from the same start: their
    first training losses (before any update) agree, and so do their ``inputs`` digests
    where recorded; ``ValueError`` naming the runs otherwise."""
    firsts, inputs = {}, {}
    for path in paths:
        with (ROOT / path / "metrics.jsonl").open() as metrics:
            firsts[path] = json.loads(metrics.readline())["loss"]
        recorded = _read(f"{path}/summary.json").get("inputs")
        if recorded is not None:
            inputs[path] = recorded
    reference = next(iter(firsts.values()))
    differ = [p for p, loss in firsts.items() if abs(loss - reference) > 1e-6 * abs(reference)]
    differ += [p for p, digests in inputs.items() if digests != next(iter(inputs.values()))]
    if differ:
        raise ValueError(f"runs {differ} did not train on the inputs of {next(iter(firsts))}")


def table_diloco_outer() -> Table:
    """DiLoCo's outer SGD, dense and 1-bit (the worker's residual carried, and local), at
    each H of the main job: the final validation losses side by side."""
    rows, paths, commands = [], [], []
    for h in (10, 25):
        for (lr, momentum), pattern in DILOCO_OUTER_RUNS.items():
            runs = {x: pattern.format(h=h, x=x) for x in ("dense", "1bit")}
            runs["local"] = DILOCO_LOCAL_RUNS[lr, momentum].format(h=h)
            loss = {
                x: _read(f"{run}/summary.json")["final_validation_loss"] for x, run in runs.items()
            }
            nesterov = f"Nesterov {momentum:g}" if momentum else "no momentum"
            rows.append(
                [
                    str(h),
                    f"{lr:g}, {nesterov}",
                    f"{loss['dense']:.4f}",
                    f"{loss['1bit']:.4f}",
                    _pct(loss["1bit"] / loss["dense"] - 1),
                    f"{loss['local']:.4f}",
                    _pct(loss["local"] / loss["dense"] - 1),
                ]
            )
            paths += runs.values()
            commands += [
                f"python3 run.py train --optimizer adam {EARLIER_MAIN_JOB} --sync-every {h} "
                f"--outer-exchange {'dense' if x == 'dense' else '1bit'} "
                f"--outer-lr {lr:g} --outer-momentum {momentum:g}"
                + {"dense": "", "1bit": " --worker-residual carried"}.get(
                    x, " --worker-residual local"
                )
                for x in runs
            ]
    _first_losses_agree(paths)
    commits, dates = _stamp(f"{path}/summary.json" for path in paths)
    return Table(
        "diloco-outer",
        [
            "H",
            "outer SGD: lr, momentum",
            "dense",
            "1-bit",
            "1-bit vs dense",
            "1-bit, residual local",
            "local vs dense",
        ],
        "llrrrrr",
        rows,
        [f"{path}/summary.json" for path in paths],
        commits,
        dates,
        commands,
    )


DILOCO_STUDY = "docs/convergence/diloco-study"
#: The 1-bit exchange in blocks, beside one scale per tensor and the dense exchange (outer
#: Nesterov SGD, lr 0.7, momentum 0.5; the residual local): (where, H, dense, per tensor,
#: in blocks).
DILOCO_BLOCKS = [
    (
        "main job",
        25,
        "docs/main-job/diloco-outer/h25-dense-m05",
        "docs/main-job/diloco-local/h25-m05",
        "docs/main-job/diloco-blocks/h25-m05-b128",
    ),
    *(
        (
            "study",
            h,
            f"docs/convergence/diloco-study/diloco-adam-n4-h{h}-dense-m05",
            f"docs/convergence/diloco-study/diloco-adam-n4-h{h}-1bit-m05-local",
            f"docs/convergence/diloco-study/diloco-adam-n4-h{h}-1bit-m05-local-b128",
        )
        for h in (20, 60)
    ),
]


def _outer_bytes(folder: str) -> int:
    """A DiLoCo run's bytes per worker of its outer exchanges."""
    return int(_read(f"{folder}/summary.json")["bytes_sent"]["by_stage"]["outer"]["bytes"])


def table_diloco_blocks() -> Table:
    """The 1-bit outer exchange in blocks of 128 elements to each server scale against one
    scale per tensor and against the dense exchange: final validation losses and bytes."""
    rows, paths = [], []
    for where, h, *runs in DILOCO_BLOCKS:
        _first_losses_agree(runs)
        dense, per_tensor, blocks = (
            _read(f"{run}/summary.json")["final_validation_loss"] for run in runs
        )
        dense_bytes, *one_bit_bytes = map(_outer_bytes, runs)  # the same rounds each
        fewer = [dense_bytes / sent for sent in one_bit_bytes]
        rows.append(
            [
                where,
                str(h),
                f"{dense:.4f}",
                f"{per_tensor:.4f} ({_pct(per_tensor / dense - 1)})",
                f"{blocks:.4f} ({_pct(blocks / dense - 1)})",
                f"{_x(fewer[0])}, {_x(fewer[1])}",
            ]
        )
        paths += runs
    commits, dates = _stamp(f"{path}/summary.json" for path in paths)
    study = "python3 run.py onebit study run --spec docs/convergence/study.json --arms"
    commands = [
        f"python3 run.py train --optimizer adam {EARLIER_MAIN_JOB} --sync-every 25 "
        f"--outer-exchange {exchange} --outer-lr 0.7 --outer-momentum 0.5{options}"
        for exchange, options in (
            ("dense", ""),
            ("1bit", " --worker-residual local"),
            ("1bit", " --worker-residual local --outer-block-size 128"),
        )
    ] + [f"{study} " + " ".join(Path(p).name for _, _, *runs in DILOCO_BLOCKS[1:] for p in runs)]
    return Table(
        "diloco-blocks",
        [
            "run",
            "H",
            "dense",
            "1-bit, one scale per tensor",
            "1-bit, blocks of 128",
            "bytes per round, fewer than dense (tensor, blocks)",
        ],
        "lrrrrr",
        rows,
        [f"{path}/summary.json" for path in paths],
        commits,
        dates,
        commands,
    )


#: The errors delivered at the end: (run, H, outer SGD (lr, momentum), seed) -> the dense
#: exchange's folder, the 1-bit one's (each worker moved by its residual) and the 1-bit one's
#: with ``--deliver-errors``.
DILOCO_DELIVERED = {
    **{
        ("main job", h, (lr, momentum), 0): (
            DILOCO_OUTER_RUNS[lr, momentum].format(h=h, x="dense"),
            DILOCO_LOCAL_RUNS[lr, momentum].format(h=h),
            DILOCO_LOCAL_RUNS[lr, momentum].format(h=h).replace("diloco-local", "diloco-delivered"),
        )
        for h in (10, 25)
        for lr, momentum in DILOCO_LOCAL_RUNS
    },
    **{
        ("study", 20, (0.7, 0.5), seed): tuple(
            f"{DILOCO_STUDY}{f'/seed-{seed}' if seed else ''}/diloco-adam-n4-h20-{arm}"
            for arm in ("dense-m05", "1bit-m05-local", "1bit-m05-local-delivered")
        )
        for seed in (1,)
    },
}
STUDY_SEED_RUN = (
    "python3 run.py onebit train --optimizer adam --steps 600 --batch-size 1024 --lr 0.002 "
    "--freeze-step 120 --sync-every {h} --outer-lr 0.7 --outer-momentum 0.5 --eval-every 50 "
    "--eval-seqs 2048 --checkpoint-every 50 --workers 4 --seed {seed} --outer-exchange "
)


def table_diloco_delivered() -> Table:
    """The 1-bit outer exchange (each worker moved by its residual) with and without its
    errors delivered at the end, against the dense exchange: final validation losses, and
    bytes over the whole run."""
    rows, paths, commands = [], [], []
    for (where, h, (lr, momentum), seed), runs in DILOCO_DELIVERED.items():
        _first_losses_agree(runs)
        dense, local, delivered = (
            _read(f"{run}/summary.json")["final_validation_loss"] for run in runs
        )
        dense_bytes, *one_bit_bytes = map(_outer_bytes, runs)
        nesterov = f"Nesterov {momentum:g}" if momentum else "no momentum"
        rows.append(
            [
                where,
                str(h),
                f"{lr:g}, {nesterov}",
                str(seed),
                f"{dense:.4f}",
                f"{local:.4f} ({_pct(local / dense - 1)})",
                f"{delivered:.4f} ({_pct(delivered / dense - 1)})",
                ", ".join(_x(dense_bytes / sent) for sent in one_bit_bytes),
            ]
        )
        paths += runs
        if where == "main job":
            commands.append(
                f"python3 run.py train --optimizer adam {EARLIER_MAIN_JOB} --sync-every {h} "
                f"--outer-exchange 1bit --outer-lr {lr:g} --outer-momentum {momentum:g} "
                "--worker-residual local --deliver-errors"
            )
        else:
            commands += [
                STUDY_SEED_RUN.format(h=h, seed=seed) + "dense",
                STUDY_SEED_RUN.format(h=h, seed=seed) + "1bit --worker-residual local",
                STUDY_SEED_RUN.format(h=h, seed=seed)
                + "1bit --worker-residual local --deliver-errors",
            ]
    commits, dates = _stamp(f"{path}/summary.json" for path in paths)
    return Table(
        "diloco-delivered",
        [
            "run",
            "H",
            "outer SGD: lr, momentum",
            "seed",
            "dense",
            "1-bit, residual local",
            "1-bit, errors delivered",
            "bytes of the run, fewer than dense (1-bit, delivered)",
        ],
        "lrlrrrrr",
        rows,
        [f"{path}/summary.json" for path in paths],
        commits,
        dates,
        commands,
    )


#: The seeds of the study's DiLoCo at H = 20 and 40, outer Nesterov SGD (0.7, 0.5), the dense
#: exchange and the 1-bit one (each worker moved by its residual): H -> seeds.
DILOCO_SEEDS = {20: (0, 1, 2, 3), 40: (0, 1)}


def _seed_run(h: int, seed: int, arm: str) -> str:
    """The study's DiLoCo run folder of ``arm`` at ``h`` and ``seed`` (0: the study's own)."""
    return f"{DILOCO_STUDY}{f'/seed-{seed}' if seed else ''}/diloco-adam-n4-h{h}-{arm}"


def table_diloco_seeds() -> Table:
    """The 1-bit outer exchange against the dense one at the same H under several seeds:
    final validation losses, and bytes per round."""
    rows, paths, commands = [], [], []
    for h, seeds in DILOCO_SEEDS.items():
        gaps = []
        for seed in seeds:
            runs = [_seed_run(h, seed, arm) for arm in ("dense-m05", "1bit-m05-local")]
            _first_losses_agree(runs)
            dense, one_bit = (_read(f"{run}/summary.json")["final_validation_loss"] for run in runs)
            dense_bytes, one_bit_bytes = map(_outer_bytes, runs)
            gaps.append(one_bit / dense - 1)
            rows.append(
                [
                    str(h),
                    str(seed),
                    f"{dense:.4f}",
                    f"{one_bit:.4f}",
                    _pct(gaps[-1]),
                    _x(dense_bytes / one_bit_bytes),
                ]
            )
            paths += runs
        rows.append([str(h), "mean", "", "", _pct(sum(gaps) / len(gaps)), ""])
        commands += [
            STUDY_SEED_RUN.format(h=h, seed="SEED") + exchange
            for exchange in ("dense", "1bit --worker-residual local")
        ]
    commits, dates = _stamp(f"{path}/summary.json" for path in paths)
    return Table(
        "diloco-seeds",
        ["H", "seed", "dense", "1-bit, residual local", "1-bit vs dense", "fewer bytes"],
        "llrrrr",
        rows,
        [f"{path}/summary.json" for path in paths],
        commits,
        dates,
        commands,
    )


#: The last round's average as a reference (outer Nesterov SGD, lr 0.7, momentum 0.5; each
#: worker moved by its residual): (run, H, seed, the share) -> the dense exchange's folder, the
#: 1-bit one's without a reference and with it.
DILOCO_REFERENCE = {
    **{
        ("main job", 10, 0, share): (
            DILOCO_OUTER_RUNS[0.7, 0.5].format(h=10, x="dense"),
            DILOCO_LOCAL_RUNS[0.7, 0.5].format(h=10),
            f"docs/main-job/diloco-reference/h10-m05-c{share:g}",
        )
        for share in (0.25, 0.5, 0.75, 1.0)
    },
    ("main job", 25, 0, 0.5): (
        DILOCO_OUTER_RUNS[0.7, 0.5].format(h=25, x="dense"),
        DILOCO_LOCAL_RUNS[0.7, 0.5].format(h=25),
        "docs/main-job/diloco-reference/h25-m05-c0.5",
    ),
    **{
        ("study", 20, seed, 0.5): tuple(
            _seed_run(20, seed, arm)
            for arm in ("dense-m05", "1bit-m05-local", "1bit-m05-local-ref05")
        )
        for seed in DILOCO_SEEDS[20]
    },
}


def table_diloco_reference() -> Table:
    """The 1-bit outer exchange (each worker moved by its residual) with and without a share
    of the last round's average taken out of its messages, against the dense exchange: final
    validation losses, and bytes per round."""
    rows, paths, commands, study_gaps = [], [], [], []
    for (where, h, seed, share), runs in DILOCO_REFERENCE.items():
        _first_losses_agree(runs)
        dense, local, referenced = (
            _read(f"{run}/summary.json")["final_validation_loss"] for run in runs
        )
        dense_bytes, _, referenced_bytes = map(_outer_bytes, runs)
        if where == "study":
            study_gaps.append((local / dense - 1, referenced / dense - 1))
        rows.append(
            [
                where,
                str(h),
                str(seed),
                f"{share:g}",
                f"{dense:.4f}",
                f"{local:.4f} ({_pct(local / dense - 1)})",
                f"{referenced:.4f} ({_pct(referenced / dense - 1)})",
                _x(dense_bytes / referenced_bytes),
            ]
        )
        paths += runs
        if where == "main job":
            commands.append(
                f"python3 run.py train --optimizer adam {EARLIER_MAIN_JOB} --sync-every {h} "
                "--outer-exchange 1bit --outer-lr 0.7 --outer-momentum 0.5 "
                f"--worker-residual local --outer-reference-share {share:g}"
            )
    mean_local, mean_referenced = (sum(gaps) / len(gaps) for gaps in zip(*study_gaps, strict=True))
    rows.append(["study", "20", "mean", "0.5", "", _pct(mean_local), _pct(mean_referenced), ""])
    commands.append(
        STUDY_SEED_RUN.format(h=20, seed="SEED") + "1bit --worker-residual local "
        "--outer-reference-share 0.5"
    )
    paths = list(dict.fromkeys(paths))  # each run once: the dense and the 1-bit one recur
    commits, dates = _stamp(f"{path}/summary.json" for path in paths)
    return Table(
        "diloco-reference",
        [
            "run",
            "H",
            "seed",
            "share",
            "dense",
            "1-bit, residual local",
            "1-bit, with the reference",
            "fewer bytes",
        ],
        "lrrrrrrr",
        rows,
        [f"{path}/summary.json" for path in paths],
        commits,
        dates,
        commands,
    )


DELAYED_PREDICTION = "docs/convergence/delayed/prediction"
DELAYED_ORACLE = "docs/convergence/delayed/oracle"
MOMENTUM_BOUND = "docs/convergence/variance-guard/momentum-bound"
#: The study's DiLoCo arms, in the order of its table.
DILOCO_STUDY_DILOCO = [
    "diloco-adam-n4-h20-dense",
    "diloco-adam-n4-h20-dense-torchft",
    "diloco-adam-n4-h20-dense-m05",
    "diloco-adam-n4-h20-1bit",
    "diloco-adam-n4-h20-1bit-m05",
    "diloco-adam-n4-h20-1bit-m05-local",
    "diloco-adam-n4-h20-1bit-m05-local-b128",
    "diloco-adam-n4-h20-1bit-local",
    "diloco-adam-n4-h40-dense-m05",
    "diloco-adam-n4-h40-1bit-m05-local",
    "diloco-adam-n4-h60-dense",
    "diloco-adam-n4-h60-dense-torchft",
    "diloco-adam-n4-h60-dense-m05",
    "diloco-adam-n4-h60-1bit",
    "diloco-adam-n4-h60-1bit-m05",
    "diloco-adam-n4-h60-1bit-m05-local",
    "diloco-adam-n4-h60-1bit-m05-local-b128",
    "diloco-adam-n4-h60-dense-sgd",
    "diloco-adam-n4-h60-1bit-sgd",
    "diloco-adam-n4-h60-1bit-sgd-local",
    "diloco-adam-n4-h60-1bit-k3-d5",
]
#: The inner optimizers of the job's DiLoCo, as the tables name them.
DILOCO_INNER = {"adam": "AdamW", "lamb": "LAMB"}


def _diloco_label(folder: str) -> str:
    """A DiLoCo run's label, from the settings its ``config.json`` records."""
    train = _read(f"{folder}/config.json")["train"]
    momentum = train["outer_momentum"]
    outer = f"Nesterov {momentum:g}" if momentum else f"SGD lr {train['outer_lr']:g}"
    exchange = {"dense": "dense", "1bit": "1-bit"}[train["outer_exchange"]]
    label = (
        f"DiLoCo over {DILOCO_INNER[train['optimizer']]}, H = {train['sync_every']}, "
        f"{exchange}, {outer}"
    )
    if train["outer_exchange"] == "1bit":  # runs before the option carried it, null: the default
        label += f", residual {train.get('worker_residual', 'carried') or 'local'}"
    if train.get("outer_block_size"):
        label += f", blocks of {train['outer_block_size']}"
    if (train.get("fragments") or 1) > 1:
        label = (
            f"Streaming {label}, {train['fragments']} fragments, delay {train['fragment_delay']}"
        )
    if train.get("outer_implementation") == "torchft":
        label = f"torchft's {label}"
    return label


def diloco_study_arms() -> list[tuple[str, str]]:
    """The study's arms run again on one tokenizer, with DiLoCo's: (folder, label). LAMB
    first."""
    return [
        (f"{DILOCO_STUDY}/lamb", "LAMB"),
        (f"{DILOCO_STUDY}/onebit-lamb-n4-per-tensor", "1-bit LAMB"),
        (f"{DILOCO_STUDY}/adam-n4", "AdamW, every step (DDP)"),
        (f"{DILOCO_STUDY}/onebit-adam-n4-per-tensor", "1-bit Adam"),
        (f"{DILOCO_STUDY}/zero-one-adam-n4-auto", "0/1 Adam"),
        (f"{DILOCO_STUDY}/lamb-powersgd-r4", "LAMB, PowerSGD rank 4 (DDP)"),
        *(
            (f"{DILOCO_STUDY}/{name}", _diloco_label(f"{DILOCO_STUDY}/{name}"))
            for name in DILOCO_STUDY_DILOCO
        ),
    ]


def table_diloco_study() -> Table:
    """The study's arms with DiLoCo's, on the same samples: final loss and bytes."""
    arms = diloco_study_arms()
    names = " ".join(d.rsplit("/", 1)[1] for d, _ in arms)
    return _arms_table(
        "diloco-study",
        arms,
        None,
        f"{STUDY} --out runs/diloco-study --arms {names}",
        measured=True,
    )


def _link_choice(name: str, path: str) -> Table:
    """Per link, the time each run of the DiLoCo study takes to reach the target loss (its
    steps timed by the cost model) and which is first, from ``link_choice.py --record``."""
    choice = _read(path)
    links = list(choice["fastest"])
    labels = {d.rsplit("/", 1)[1]: label for d, label in diloco_study_arms()}
    rows = []
    for name, entry in choice["runs"].items():
        reached = entry["steps"] is not None
        timed = reached and entry.get("timed", True)
        rows.append(
            [
                labels.get(name, name),
                str(entry["steps"]) if reached else "not reached",
                _mib(entry["bytes"]) if reached else "",
                *(
                    f"{entry['seconds'][link]:.0f} s" if timed else "not timed" if reached else ""
                    for link in links
                ),
            ]
        )
    rows.append(
        [
            "**first**",
            "",
            "",
            *(
                " = ".join(labels.get(run, run) for run in b["runs"])
                + (f", {b['lead']:.2f}x ahead" if "lead" in b else "")
                for b in choice["fastest"].values()
            ),
        ]
    )
    commits, dates = _stamp([path])
    runs = " ".join(f"{DILOCO_STUDY}/{name}" for name in choice["runs"])
    options = f" --model {choice['parameters']}" if choice["parameters"] else ""
    options += f" --compute {choice['compute_seconds']:g}"
    return Table(
        name,
        ["run", "steps to the target", "bytes to the target", *links],
        "lrr" + "r" * len(links),
        rows,
        [path],
        commits,
        dates,
        [
            f".venv/bin/python benchmarks/link_choice.py {runs} --target {choice['target']:.4f}"
            + options
        ],
    )


def table_link_choice() -> Table:
    return _link_choice("link-choice", f"{DILOCO_STUDY}/link-choice.json")


def table_link_choice_bert_base() -> Table:
    return _link_choice("link-choice-bert-base", f"{DILOCO_STUDY}/link-choice-bert-base.json")


#: The delayed exchange beside the same run without it: per run, the undelayed run's folder
#: and label, then each delayed variant's (all of a run on the same inputs).
DELAYED_RUNS = [
    (
        "main job",
        [
            (f"{DELAYED_PREDICTION}/main-job/undelayed", "1-bit LAMB"),
            (f"{DELAYED_PREDICTION}/main-job/delayed", "delayed, at the prediction"),
        ],
    ),
    (
        "study, 4 workers, without momentum_bound",
        [
            (f"{DILOCO_STUDY}/onebit-lamb-n4-per-tensor", "1-bit LAMB"),
            (f"{DELAYED_PREDICTION}/onebit-lamb-n4-delayed", "delayed, at the prediction"),
        ],
    ),
    (
        "study, 4 workers",
        [
            (f"{MOMENTUM_BOUND}/onebit-lamb-n4-momentum-bound", "1-bit LAMB"),
            (
                f"{MOMENTUM_BOUND}/onebit-lamb-n4-delayed-momentum-bound",
                "delayed, at the prediction",
            ),
        ],
    ),
    (
        "study, 64 simulated workers, fused exchange",
        [
            (f"{MOMENTUM_BOUND}/onebit-lamb-n64-momentum-bound", "1-bit LAMB"),
            (
                f"{MOMENTUM_BOUND}/onebit-lamb-n64-delayed-momentum-bound",
                "delayed, at the prediction",
            ),
            (
                f"{DELAYED_ORACLE}/onebit-lamb-n64-delayed-mean-momentum-bound",
                "delayed, at the mean prediction (oracle)",
            ),
        ],
    ),
    (
        "main job (another tokenizer)",
        [
            ("docs/main-job/steps-250/default", "1-bit LAMB"),
            ("docs/main-job/steps-250/delayed", "delayed, one update behind"),
        ],
    ),
]


#: The simulated main job at W workers, each worker's micro-batch 1/W of the global batch:
#: without the delay, delayed at each worker's own prediction, and at the oracle's (the
#: workers' mean).
DELAYED_ORACLE_WORKERS = (4, 16, 64)
DELAYED_ORACLE_ARMS = [
    ("undelayed", "not delayed", ""),
    ("own", "delayed, each worker at its own prediction", " --delayed-exchange"),
    (
        "mean",
        "delayed, every worker at the mean prediction (oracle)",
        " --delayed-exchange --delayed-prediction mean",
    ),
]


def table_delayed_oracle() -> Table:
    """Final validation losses of the simulated main job with and without the delay, and
    with the oracle prediction, per number of workers (each group on the same inputs)."""
    rows, paths = [], []
    for workers in DELAYED_ORACLE_WORKERS:
        runs = [f"{DELAYED_ORACLE}/w{workers}-{arm}" for arm, _, _ in DELAYED_ORACLE_ARMS]
        _first_losses_agree(runs)
        summaries = [_summary(run) for run in runs]
        plain = summaries[0]["final_validation_loss"]
        per_worker = _read(f"{runs[0]}/config.json")["train"]["batch_size"] // workers
        for (_, label, _), summary in zip(DELAYED_ORACLE_ARMS, summaries, strict=True):
            loss = summary["final_validation_loss"]
            versus = "" if summary is summaries[0] else _pct(loss / plain - 1)
            rows.append([str(workers), str(per_worker), label, f"{loss:.4f}", versus])
        paths += [f"{run}/summary.json" for run in runs]
    commits, dates = _stamp(paths)
    return Table(
        "delayed-oracle",
        ["workers", "sequences per worker", "gradients", "final validation loss", "vs not delayed"],
        "rrlrr",
        rows,
        paths,
        commits,
        dates,
        [
            f"{RUN} simulate {EARLIER_FREEZE} --workers W --threads 1{flags} {NO_MOMENTUM_BOUND}"
            for _, _, flags in DELAYED_ORACLE_ARMS
        ],
    )


def table_delayed_convergence() -> Table:
    """Validation losses by step with and without the delay, run by run (each run's variants
    on the same inputs), and each delayed variant's final loss against the undelayed run's."""
    folders = [d for _, variants in DELAYED_RUNS for d, _ in variants]
    curves = {d: dict(_validation_losses(d)) for d in folders}
    steps = sorted(set().union(*[set(c) for c in curves.values()]))
    header = ["run", "gradients", *[str(s) for s in steps], "vs undelayed"]
    rows = []
    for run, variants in DELAYED_RUNS:
        _first_losses_agree([d for d, _ in variants])
        plain = variants[0][0]
        final = {d: curves[d][max(curves[d])] for d, _ in variants}
        for run_dir, label in variants:
            curve = curves[run_dir]
            versus = "" if run_dir == plain else _pct(final[run_dir] / final[plain] - 1)
            rows.append(
                [run, label, *[f"{curve[s]:.3f}" if s in curve else "" for s in steps], versus]
            )
    paths = [f"{d}/metrics.jsonl" for d in folders]
    commits, dates = _stamp(paths)
    return Table(
        "delayed-convergence",
        header,
        "ll" + "r" * (len(steps) + 1),
        rows,
        paths,
        commits,
        dates,
        [
            f"python3 run.py train {EARLIER_FREEZE} [--delayed-exchange] {NO_MOMENTUM_BOUND}",
            f"{STUDY} --out runs/study-delay-n4 --arms onebit-lamb-n4-delayed",
            f"{STUDY} --out runs/study --arms onebit-lamb-n4-momentum-bound "
            "onebit-lamb-n4-delayed-momentum-bound onebit-lamb-n64-momentum-bound "
            "onebit-lamb-n64-delayed-momentum-bound onebit-lamb-n64-delayed-mean-momentum-bound",
        ],
        measured=False,
    )


def table_onebit_adam_convergence() -> Table:
    arms = [
        ("docs/convergence/lamb", "docs/convergence/onebit-adam-n4", "fused"),
        (
            "docs/convergence/powersgd/lamb",
            "docs/convergence/onebit-adam-n4-per-tensor",
            "per tensor",
        ),
    ]
    rows = []
    paths = []
    for lamb_dir, run_dir, mode in arms:
        _first_losses_agree([lamb_dir, run_dir])
        lamb, s = _summary(lamb_dir), _summary(run_dir)
        paths += [f"{lamb_dir}/summary.json", f"{run_dir}/summary.json"]
        rows.append(
            [
                mode,
                f"`{run_dir.rsplit('/', 1)[1]}`",
                f"{s['final_validation_loss']:.4f}",
                f"{lamb['final_validation_loss']:.4f}",
                _pct(s["final_validation_loss"] / lamb["final_validation_loss"] - 1),
                _x(s["reduction_vs_lamb"]),
            ]
        )
    commits, dates = _stamp(paths)
    return Table(
        "onebit-adam-convergence",
        [
            "exchange",
            "run",
            "final validation loss",
            "LAMB's, same inputs",
            "vs LAMB",
            "fewer bytes than LAMB",
        ],
        "llrrrr",
        rows,
        paths,
        commits,
        dates,
        [f"{STUDY} --out runs/study2 --arms lamb onebit-adam-n4 onebit-adam-n4-per-tensor"],
        measured=False,
    )


# ---------------------------------------------------------------------------------------------
# 0/1 Adam


def table_zero_one_adam_study() -> Table:
    pairs = [
        ("docs/convergence/onebit-adam-n4", [d for d, _ in STUDY_ARMS if "zero-one" in d]),
        ("docs/convergence/onebit-adam-n4-per-tensor", ["docs/convergence/zero-one-adam-n4-auto"]),
    ]
    labels = dict(STUDY_ARMS)
    labels["docs/convergence/zero-one-adam-n4-auto"] = "0/1 Adam, its defaults"
    rows = []
    paths = []
    for base_dir, runs in pairs:
        base = _summary(base_dir)
        paths.append(f"{base_dir}/summary.json")
        for run_dir in runs:
            _first_losses_agree([base_dir, run_dir])
            s = _summary(run_dir)
            paths.append(f"{run_dir}/summary.json")
            rows.append(
                [
                    labels[run_dir],
                    f"`{run_dir.rsplit('/', 1)[1]}`",
                    f"{s['final_validation_loss']:.4f}",
                    f"`{base_dir.rsplit('/', 1)[1]}`: {base['final_validation_loss']:.4f}",
                    _pct(s["final_validation_loss"] / base["final_validation_loss"] - 1),
                    _x(base["bytes_sent"]["total"] / s["bytes_sent"]["total"]),
                ]
            )
    commits, dates = _stamp(paths)
    return Table(
        "zero-one-adam-study",
        [
            "arm",
            "run",
            "final validation loss",
            "1-bit Adam, same inputs",
            "vs 1-bit Adam",
            "fewer bytes than 1-bit Adam",
        ],
        "llrrrr",
        rows,
        ["docs/convergence/<run>/summary.json"],
        commits,
        dates,
        [f"{STUDY} --out runs/study2 --arms <run>"],
        measured=False,
    )


def table_zero_one_adam_cluster() -> Table:
    files = [(p, _read(p)) for p in ZERO_ONE_CLUSTER]
    kinds = ["variance_update", "gradient_1bit", "local", "sync"]
    rows = []
    for _, result in files:
        summary = result["summary"]
        zo = summary["zero-one-adam"]
        link = LINKS[result["settings"]["bandwidth"]]
        cells = [link, _s(summary["lamb"]["t_comp"]), _s(summary["onebit-adam"]["t_comp"])]
        cells += [_s(zo["stages"][k]["step_seconds"]) for k in kinds]
        cells += [
            _x(zo["vs"]["lamb"]["end_to_end_speedup"]),
            _x(zo["vs"]["onebit-adam"]["end_to_end_speedup"]),
            _x(zo["vs"]["lamb"]["whole_run_bytes_reduction"]),
            _x(zo["vs"]["onebit-adam"]["whole_run_bytes_reduction"]),
        ]
        rows.append(cells)
    return _cluster_table(
        "zero-one-adam-cluster",
        [
            "link (`small`, 4 workers)",
            "LAMB step",
            "1-bit Adam compression step",
            *[f"0/1 Adam `{k}` step" for k in kinds],
            "whole run faster than LAMB",
            "than 1-bit Adam",
            "fewer bytes than LAMB",
            "than 1-bit Adam",
        ],
        "l" + "r" * 10,
        rows,
        files,
    )


def table_zero_one_adam_main_job() -> Table:
    runs = [
        ("docs/zero-one-adam/onebit-adam.summary.json", "1-bit Adam (fused exchange)"),
        ("docs/zero-one-adam/zero-one-adam.summary.json", "0/1 Adam, DeepSpeed's schedule"),
    ]
    rows = []
    for path, label in runs:
        s = _read(path)
        for kind, stage in s["bytes_sent"]["by_stage"].items():
            rows.append(
                [
                    label,
                    f"`{kind}`",
                    str(stage["steps"]),
                    _mib(stage["bytes"]),
                    _mib(stage["lamb_bytes"]),
                    _x(stage["lamb_bytes"] / stage["bytes"]) if stage["bytes"] else "nothing sent",
                    "",
                ]
            )
        rows.append(
            [
                label,
                "whole run",
                str(s["steps"]),
                _mib(s["bytes_sent"]["total"]),
                _mib(s["lamb_bytes"]),
                _x(s["reduction_vs_lamb"]),
                f"{s['final_validation_loss']:.4f}",
            ]
        )
    commits, dates = _stamp([p for p, _ in runs])
    flags = (
        "--steps 400 --batch-size 128 --vocab-size 4096 --heads 2 --architecture bert "
        "--freeze-step 80"
    )
    return Table(
        "zero-one-adam-main-job",
        [
            "optimizer",
            "kind of step",
            "steps",
            "bytes per worker",
            "LAMB's, same steps",
            "fewer than LAMB",
            "final validation loss",
        ],
        "llrrrrr",
        rows,
        [p for p, _ in runs],
        commits,
        dates,
        [
            f"{RUN} train {flags} --optimizer zero-one-adam --var-warmup-steps 16 "
            "--pre-freeze-exchange gradient",
            f"{RUN} train {flags} --optimizer onebit-adam --compression fused",
        ],
        measured=False,
    )


# ---------------------------------------------------------------------------------------------
# the cost model: docs/bench/pipelined


def _predictions(folder: str) -> list[Any]:
    from onebit.estimate.model import Machine
    from onebit.estimate.validate import emulated_machine, load_results, validate

    return validate(load_results([ROOT / folder]), emulated_machine(Machine()))


def _estimate_validation(name: str, folder: str) -> Table:
    """Every step time of the result files in ``folder`` beside the model's prediction."""
    predictions = _predictions(folder)
    rows = []
    for p in predictions:
        rows.append(
            [
                f"`{p.run}`",
                METHODS.get(p.method, p.method),
                p.stage,
                _s(p.measured),
                _s(p.predicted),
                f"{p.predicted / p.measured:.2f}",
            ]
        )
    return Table(
        name,
        ["run", "method", "stage", "measured", "predicted", "predicted / measured"],
        "lllrrr",
        rows,
        *_validation_stamp(folder),
    )


def _validation_stamp(folder: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """The sources, commits, dates and command of a validation of ``folder``'s results."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).glob("cluster-*.json"))
    commits, dates = _stamp(files, [_read(f) for f in files])
    return [f"{folder}/cluster-*.json"], commits, dates, [f"{RUN} estimate --validate {folder}"]


def table_estimate_validation() -> Table:
    return _estimate_validation("estimate-validation", "docs/bench/pipelined")


def table_estimate_zero_one_adam() -> Table:
    return _estimate_validation("estimate-zero-one-adam", "docs/bench/zero-one-adam")


def table_estimate_diloco() -> Table:
    return _estimate_validation("estimate-diloco", "docs/bench/diloco")


def table_estimate_summary() -> Table:
    folder = "docs/bench/pipelined"
    predictions = _predictions(folder)
    ratios = [p.predicted / p.measured for p in predictions]
    within = sum(abs(r - 1) <= 0.2 for r in ratios)
    rows = [
        [
            str(len(ratios)),
            str(within),
            f"{min(ratios):.2f}",
            f"{max(ratios):.2f}",
        ]
    ]
    return Table(
        "estimate-summary",
        ["step times", "within 20 %", "lowest predicted / measured", "highest"],
        "rrrr",
        rows,
        *_validation_stamp(folder),
    )


# ---------------------------------------------------------------------------------------------
# the README's one table


def table_readme_results() -> Table:
    steady = {r["settings"]["bandwidth"]: (p, r) for p, r in _steady_files()}
    zero_one = {
        r["settings"]["bandwidth"]: (p, r) for p, r in ((p, _read(p)) for p in ZERO_ONE_CLUSTER)
    }
    defaults = {d: _summary(d) for d, _ in DEFAULT_ARMS}
    lamb_loss = defaults[DEFAULT_ARMS[0][0]]["final_validation_loss"]
    links = ["100mbit", "1gbit", None]

    def speed(source: dict[Any, tuple[str, dict[str, Any]]], method: str) -> list[str]:
        cells = []
        for link in links:
            if link not in source:
                cells.append("not measured")
                continue
            row = source[link][1]["summary"][method]
            value = row["vs"]["lamb"] if "vs" in row else row
            cells.append(_x(value["end_to_end_speedup"]))
        return cells

    rows = []
    for (run_dir, label), source, method in zip(
        DEFAULT_ARMS[1:4],
        [steady, zero_one, zero_one],
        ["onebit-lamb", "onebit-adam", "zero-one-adam"],
        strict=True,
    ):
        s = defaults[run_dir]
        rows.append(
            [
                label,
                _x(s["reduction_vs_lamb"]),
                *speed(source, method),
                _pct(s["final_validation_loss"] / lamb_loss - 1),
            ]
        )
    files = [steady[k] for k in links] + list(zero_one.values())
    paths = [f"{d}/summary.json" for d, _ in DEFAULT_ARMS[:4]]
    c1, d1 = _stamp([p for p, _ in files], [r for _, r in files])
    c2, d2 = _stamp(paths)
    return Table(
        "readme-results",
        [
            "optimizer",
            "bytes per worker, fewer than LAMB",
            "whole run faster than LAMB, 100 Mbit/s",
            "1 Gbit/s",
            "unshaped",
            "final validation loss vs LAMB",
        ],
        "lrrrrr",
        rows,
        [p for p, _ in files] + paths,
        c1 + [c for c in c2 if c not in c1],
        d1 + d2,
        [
            f"{RUN} bench cluster --model small --workers 4 --bandwidth LINK (docs/BENCHMARKS.md)",
            f"{STUDY} (docs/CONVERGENCE.md)",
        ],
    )


def table_variance_guard() -> Table:
    """The guard after the freeze on the family of tasks, from the summaries
    benchmarks/variance_guard.py writes (one per worker count)."""
    folder = DOCS / "convergence" / "variance-guard"
    paths = sorted(
        (str(path.relative_to(ROOT)) for path in folder.glob("**/summary-*.json")),
        key=lambda path: (int(Path(path).stem.split("-")[1]), path),  # by workers, then folder
    )
    summaries = [_read(path) for path in paths]
    rows = []
    for summary in summaries:
        for row in summary["rows"]:
            workers = f"{row['workers']}" + (" simulated" if row["simulated"] else "")
            rows.append(
                [
                    row["task"],
                    row["optimizer"],
                    str(row["freeze_step"]),
                    workers,
                    str(row["runs"]),
                    str(row["missed_off"]),
                    str(row["missed_refresh"]),
                    str(row["refreshed"]),
                    str(row["false_alarms"]),
                    f"{row['refresh_steps']:.0f}",
                    f"{row['refresh_extra_mb']:.3f}",
                    f"{row['worst_ratio']:.2f}",
                ]
            )
    commits, dates = _stamp(paths)
    return Table(
        "variance-guard",
        [
            "task",
            "optimizer",
            "freeze after",
            "workers",
            "runs",
            "above 1.15x dense, guard off",
            "above 1.15x dense, guard on",
            "runs refreshed",
            "false alarms",
            "refresh steps (mean)",
            "extra MB per refresh (mean)",
            "worst final loss / dense, guard on",
        ],
        "lllrrrrrrrrr",
        rows,
        paths,
        commits,
        dates,
        [summary["command"] for summary in summaries],
    )


def _guard_cells(s: dict[str, Any], lamb: dict[str, Any]) -> list[str]:
    loss, first = s["final_validation_loss"], s is lamb
    return [
        f"{loss:.4f}",
        "" if first else _pct(loss / lamb["final_validation_loss"] - 1),
        "" if first else str(_refresh_steps(s)),
        _mib(s["bytes_sent"]["total"]),
        _x(s["reduction_vs_lamb"]),
    ]


GUARD_HEADER = [
    "final validation loss",
    "vs LAMB",
    "refresh steps",
    "bytes per worker",
    "fewer than LAMB",
]


def table_main_job_guard() -> Table:
    """The main job frozen at its default and earlier, with the guard, beside LAMB."""
    runs = ["steps-250/lamb", "steps-250/default", "steps-250/freeze-50"]
    return _main_job_table("main-job-guard", [runs], GUARD_HEADER, _guard_cells)


def table_main_job_longer() -> Table:
    """The main job's first shape's compute spread over twice and four times the steps of a
    half and a quarter of the batch, simulated, 1-bit LAMB frozen after 20 % of them."""
    groups = [
        ["longer/lamb", "longer/onebit-lamb-freeze-100"],
        ["longer/lamb-1000x64", "longer/onebit-lamb-1000x64-freeze-200"],
    ]
    return _main_job_table("main-job-longer", groups, GUARD_HEADER, _guard_cells)


def table_main_job_trust_bound() -> Table:
    """The main job with 1-bit LAMB's trust bound, on 4 processes and simulated, beside LAMB
    and the unbounded run; simulated also with the bound by LAMB's ratio itself."""
    groups = [
        ["lamb", "momentum-bound/off", "trust-bound/bound-2"],
        [
            "longer/lamb-1000x64",
            "longer/onebit-lamb-1000x64-freeze-200",
            "trust-bound/simulated-bound-2",
            "trust-bound/simulated-lamb-ratio",
        ],
    ]
    return _main_job_table("main-job-trust-bound", groups, GUARD_HEADER, _guard_cells)


def table_main_job_momentum_bound() -> Table:
    """The main job with 1-bit LAMB's momentum bound, on 4 processes and simulated, beside
    LAMB and the run without it."""
    groups = [
        ["lamb", "momentum-bound/off", "default"],
        [
            "longer/lamb-1000x64",
            "longer/onebit-lamb-1000x64-freeze-200",
            "momentum-bound/simulated-bound",
        ],
    ]
    return _main_job_table("main-job-momentum-bound", groups, GUARD_HEADER, _guard_cells)


#: The convergence study's per-tensor 1-bit LAMB arm without ``momentum_bound``.
UNBOUNDED_ARM = (f"{DILOCO_STUDY}/onebit-lamb-n4-per-tensor", "1-bit LAMB, without momentum_bound")


def _study_beside_lamb(name: str, runs: Sequence[tuple[str, str]]) -> Table:
    """The convergence study's LAMB arm beside ``runs`` (arms of 1-bit LAMB on its inputs:
    run folder, label)."""
    arms = [(f"{DILOCO_STUDY}/lamb", "LAMB"), *runs]
    return _arms_table(name, arms, None, f"{STUDY} --out runs/study --arms <run>", measured=True)


TRUST_BOUND_ARM = "docs/convergence/variance-guard/trust-bound/onebit-lamb-n4-trust-bound"


def table_study_momentum_bound() -> Table:
    """The convergence study's 1-bit LAMB arms with the momentum bound, beside those without
    it that ran on the same inputs (LAMB's update does not depend on the number of workers)."""
    bounded = f"{MOMENTUM_BOUND}/onebit-lamb-n4"
    return _study_beside_lamb(
        "study-momentum-bound",
        [
            UNBOUNDED_ARM,
            (f"{bounded}-momentum-bound", "1-bit LAMB (the default)"),
            (f"{bounded}-fused-momentum-bound", "1-bit LAMB, fused exchange"),
            (f"{bounded}-buckets-momentum-bound", "1-bit LAMB, fused exchange in buckets"),
            (
                "docs/convergence/delayed/prediction/onebit-lamb-n4-delayed",
                "1-bit LAMB, delayed exchange, without momentum_bound",
            ),
            (f"{bounded}-delayed-momentum-bound", "1-bit LAMB, delayed exchange"),
            (TRUST_BOUND_ARM, "1-bit LAMB, trust_bound 2, without momentum_bound"),
            (f"{bounded}-trust-bound-momentum-bound", "1-bit LAMB, trust_bound 2"),
            (
                f"{MOMENTUM_BOUND}/onebit-lamb-n16-momentum-bound",
                "1-bit LAMB (simulated), fused exchange",
            ),
            (
                f"{MOMENTUM_BOUND}/onebit-lamb-n64-momentum-bound",
                "1-bit LAMB (simulated), fused exchange",
            ),
            (f"{DILOCO_STUDY}/lamb-n256", "LAMB (simulated)"),
            (
                f"{MOMENTUM_BOUND}/onebit-lamb-n256-momentum-bound",
                "1-bit LAMB (simulated), fused exchange",
            ),
            (
                f"{MOMENTUM_BOUND}/onebit-lamb-n64-delayed-momentum-bound",
                "1-bit LAMB (simulated), fused exchange, delayed exchange",
            ),
        ],
    )


def table_study_trust_bound() -> Table:
    """The convergence study's 1-bit LAMB arm with and without the trust bound."""
    return _study_beside_lamb(
        "study-trust-bound",
        [UNBOUNDED_ARM, (TRUST_BOUND_ARM, "1-bit LAMB, trust_bound 2, without momentum_bound")],
    )


# ---------------------------------------------------------------------------------------------
# the variance's readiness: docs/convergence/readiness

READINESS = "docs/convergence/readiness"
#: The readiness trajectories: file -> the run they follow.
TRAJECTORIES = {
    "trajectory-main.json": "main job, 1-bit LAMB's warm-up (1 process)",
    "trajectory-plateau.json": "plateau task, 1-bit Adam's warm-up (1 process)",
}


def table_readiness_trajectory() -> Table:
    """The largest R at each check of the warm-up until ``"auto"`` froze, the peak in bold."""
    paths = [f"{READINESS}/{name}" for name in TRAJECTORIES]
    records = [_read(path) for path in paths]
    steps = sorted({c["step"] for r in records for c in r["checks"]})
    rows = []
    for record, label in zip(records, TRAJECTORIES.values(), strict=True):
        ratios = {c["step"]: c["largest_ratio"] for c in record["checks"]}
        peak = max(ratios, key=ratios.__getitem__)
        cells = [
            "" if s not in ratios else f"**{ratios[s]:.2f}**" if s == peak else f"{ratios[s]:.2f}"
            for s in steps
        ]
        rows.append([label, *cells, str(record["froze_after"])])
    commits, dates = _stamp(paths)
    return Table(
        "readiness-trajectory",
        ["run", *(f"step {s}" if s == steps[0] else str(s) for s in steps), "froze after"],
        "l" + "r" * (len(steps) + 1),
        rows,
        paths,
        commits,
        dates,
        [r["command"] for r in records],
    )


#: The plateau run's arms: name -> (optimizer, freeze).
PLATEAU_ARMS = {
    "adam": ("Adam (torch's, dense)", ""),
    "onebit-adam early": ("1-bit Adam", "step {early}"),
    "onebit-adam never": ("1-bit Adam", "never (step {steps})"),
    "onebit-adam auto": ("1-bit Adam", '`"auto"`'),
    "onebit-lamb early": ("1-bit LAMB", "step {early}"),
    "onebit-lamb never": ("1-bit LAMB", "never (step {steps})"),
    "onebit-lamb auto": ("1-bit LAMB", '`"auto"`'),
    "zero-one-adam early": ("0/1 Adam, its other defaults", "`var_freeze_step={early}`"),
    "zero-one-adam never": ("0/1 Adam, its other defaults", "never ({steps})"),
    "zero-one-adam auto": ("0/1 Adam, its defaults", '`var_freeze_step="auto"`'),
    "zero-one-adam deepspeed-never": (
        "0/1 Adam, DeepSpeed's schedule (`**DEEPSPEED_SCHEDULE`)",
        "never ({steps})",
    ),
}


def first_interval(arm: str, updates: int | None) -> str:
    """0/1 Adam's first interval: its updates, or DeepSpeed's kappa where it set none."""
    if not arm.startswith("zero-one-adam"):
        return ""
    return "16 (κ)" if updates is None else str(updates)


def table_plateau_readiness() -> Table:
    path = f"{READINESS}/plateau.json"
    record = _read(path)
    runs = record["runs"]
    adam = runs["adam"]["loss"]
    rows = []
    for name, (optimizer, freeze) in PLATEAU_ARMS.items():
        run = runs[name]
        rows.append(
            [
                optimizer,
                freeze.format(early=record["early"], steps=record["steps"]),
                "" if run["froze_after"] is None else str(run["froze_after"]),
                first_interval(name, run["first_interval"]),
                "yes" if run["warned"] else "no",
                f"{run['loss']:.4f}",
                _x(run["loss"] / adam),
            ]
        )
    commits, dates = _stamp([path])
    return Table(
        "plateau-readiness",
        [
            "optimizer",
            "freeze",
            "froze after step",
            "0/1 Adam: first interval",
            "warned",
            "loss, last 25 steps",
            "vs Adam",
        ],
        "lllrlrr",
        rows,
        [path],
        commits,
        dates,
        [record["command"]],
    )


#: The seed study's arms, as the table names them.
SEED_ARMS = {
    "lamb": "LAMB",
    "onebit-lamb": "1-bit LAMB (each tensor compressed alone, the default)",
    "onebit-lamb-fused": "1-bit LAMB, `--compression fused` (DeepSpeed's exchange)",
    "adam": "AdamW",
    "onebit-adam": "1-bit Adam (per tensor)",
    "zero-one-adam": "0/1 Adam (its defaults)",
}


def table_seed_study() -> Table:
    """Each arm over the seeds: the final validation loss, against the dense baseline paired
    by seed, the seeds whose training loss left the limit after the freeze, the refreshes."""
    path = f"{READINESS}/seed-study.json"
    record = _read(path)
    arms = record["arms"]
    rows = []
    for arm, label in SEED_ARMS.items():
        by_seed = arms[arm]
        finals = [r["final"] for r in by_seed.values()]
        baseline = record["baselines"][arm]
        versus = ""
        if baseline is not None:
            paired = [
                100 * (r["final"] / arms[baseline][s]["final"] - 1) for s, r in by_seed.items()
            ]
            versus = f"{statistics.mean(paired):+.2f} % ± {statistics.stdev(paired):.2f}"
        flagged = {s: r["steps_above"] for s, r in by_seed.items() if r["diverged"]}
        refreshed = [
            f"{s} ({r['refresh_steps']})" for s, r in by_seed.items() if r["refresh_steps"]
        ]
        rows.append(
            [
                label,
                str(len(finals)),
                f"{statistics.mean(finals):.4f}",
                f"{statistics.stdev(finals):.4f}",
                versus,
                ", ".join(f"{s} ({n})" for s, n in flagged.items()) or "none",
                f"{max(r['highest_after_freeze'] for r in by_seed.values()):.2f}",
                "" if baseline is None else ", ".join(refreshed) or "none",
            ]
        )
    commits, dates = _stamp([path])
    return Table(
        "seed-study",
        [
            "arm",
            "seeds",
            "mean final validation loss",
            "std",
            "against its dense baseline (paired, mean ± std)",
            "flagged seeds (steps above the limit)",
            "highest training loss after the freeze",
            "seeds the guard refreshed (refresh steps)",
        ],
        "lrrrrlrl",
        rows,
        [path],
        commits,
        dates,
        [record["command"]],
    )


# ---------------------------------------------------------------------------------------------
# pages

TABLES: dict[str, Callable[[], Table]] = {
    "readme-results": table_readme_results,
    "bytes-per-step": table_bytes_per_step,
    "cluster-step-time": table_cluster_step_time,
    "cluster-whole-run": table_cluster_whole_run,
    "delayed-exchange": table_delayed_exchange,
    "allreduce-local": table_allreduce_local,
    "allreduce-loopback": table_allreduce_loopback,
    "optimizer-step": table_optimizer_step,
    "optimizer-memory": table_optimizer_memory,
    "errors-ahead": table_errors_ahead,
    "convergence-study": table_convergence_study,
    "convergence-defaults": table_convergence_defaults,
    "main-job": table_main_job,
    "delayed-convergence": table_delayed_convergence,
    "delayed-oracle": table_delayed_oracle,
    "onebit-adam-convergence": table_onebit_adam_convergence,
    "zero-one-adam-study": table_zero_one_adam_study,
    "zero-one-adam-cluster": table_zero_one_adam_cluster,
    "zero-one-adam-main-job": table_zero_one_adam_main_job,
    "estimate-validation": table_estimate_validation,
    "estimate-zero-one-adam": table_estimate_zero_one_adam,
    "estimate-diloco": table_estimate_diloco,
    "estimate-summary": table_estimate_summary,
    "variance-guard": table_variance_guard,
    "main-job-guard": table_main_job_guard,
    "main-job-longer": table_main_job_longer,
    "main-job-trust-bound": table_main_job_trust_bound,
    "study-trust-bound": table_study_trust_bound,
    "main-job-momentum-bound": table_main_job_momentum_bound,
    "study-momentum-bound": table_study_momentum_bound,
    "readiness-trajectory": table_readiness_trajectory,
    "plateau-readiness": table_plateau_readiness,
    "seed-study": table_seed_study,
    "diloco-main-job": table_diloco_main_job,
    "diloco-outer": table_diloco_outer,
    "diloco-blocks": table_diloco_blocks,
    "diloco-delivered": table_diloco_delivered,
    "diloco-seeds": table_diloco_seeds,
    "diloco-reference": table_diloco_reference,
    "diloco-study": table_diloco_study,
    "link-choice": table_link_choice,
    "link-choice-bert-base": table_link_choice_bert_base,
}

MARKER = re.compile(
    r"(<!-- table: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.DOTALL
)


def render(text: str, tables: dict[str, Table] | None = None) -> str:
    """The page ``text`` with every marked table regenerated; an unknown name raises."""
    cache: dict[str, Table] = dict(tables or {})

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        if name not in cache:
            cache[name] = TABLES[name]()
        return f"{match.group(1)}{cache[name].markdown()}\n{match.group(4)}"

    return MARKER.sub(replace, text)


def tables_in(text: str) -> list[str]:
    return [m.group("name") for m in MARKER.finditer(text)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Regenerate the results tables of README.md and docs/ from the result "
        "files under docs/ (between <!-- table: NAME --> and <!-- /table --> markers).",
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    parser.add_argument("--list", action="store_true", help="list the tables and their pages")
    args = parser.parse_args(argv)
    if args.list:
        for page in PAGES:
            print(page, " ".join(tables_in((ROOT / page).read_text())))
        return 0
    cache = {name: build() for name, build in TABLES.items()}
    stale = []
    for page in PAGES:
        path = ROOT / page
        text = path.read_text()
        new = render(text, cache)
        if new != text:
            stale.append(page)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    for page in stale:
        print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
