"""Markdown reports of comparisons: one comparison in full, and a sweep as one table."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onebit.bench.settings import (
    BASELINE_METHODS,
    DILOCO_METHODS,
    DILOCO_SYNC_EVERY,
    HSDP_METHODS,
    METHODS,
    ZERO_ONE_ADAM_METHOD,
    ZERO_ONE_ADAM_SCHEDULE,
)

#: The methods compared against LAMB, in table (and plot) order.
COMPARED_METHODS = tuple(
    name for name in METHODS if name not in (*BASELINE_METHODS, *HSDP_METHODS, *DILOCO_METHODS)
)


def bandwidth_label(bandwidth: str | None) -> str:
    return bandwidth or "unshaped"


def _mb(value: float | None, unit: float = 1e6) -> str:
    """Bytes in MB (or in ``unit`` bytes), two decimals."""
    return "-" if value is None else f"{value / unit:.2f}"


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
    bandwidth = bandwidth_label(settings["bandwidth"])
    per_node = settings.get("workers_per_node", 1)
    shape = f"{settings['workers']} workers"
    if per_node > 1:
        shape = f"{settings['nodes']} nodes x {per_node} workers"
    host = "node" if per_node > 1 else "worker"
    out = [
        f"### {shape}, {bandwidth}, model {settings['model']} "
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
        "| method | warm-up samples/s | compression / steady samples/s | "
        f"wire MB/step/{host} (warm-up / compr.) | library MB/step (warm-up / compr.) | "
        "bytes vs LAMB (compr.) | "
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
        if name == ZERO_ONE_ADAM_METHOD or name in DILOCO_METHODS:
            out.append(f"| {name} | by kind of step: below |  |  |  |  |  |  |  |  |")
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
    if ZERO_ONE_ADAM_METHOD in summary:
        out += ["", *_zero_one_adam_tables(summary, settings, derived, host)]
    if any(name in summary for name in DILOCO_METHODS):
        out += ["", *_diloco_table(summary, host)]
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


def _diloco_table(summary: dict[str, Any], host: str) -> list[str]:
    """DiLoCo's kinds of step, its mean step over a turn and its speedup over LAMB's step."""
    out = [
        f"DiLoCo over LAMB, rounds of H = {DILOCO_SYNC_EVERY} steps (each worker's inner steps "
        "on its own gradients, the outer step at the round's last; streaming: a fragment's at "
        "the last of each turn, its exchange started a step before):",
        "",
        f"| method | turn | inner step | outer step | mean step | vs LAMB's step | wire "
        f"MB/step/{host} (outer step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in DILOCO_METHODS:
        item = summary.get(name)
        if item is None:
            continue
        stages = item["stages"]
        out.append(
            f"| {name} | {DILOCO_METHODS[name].turn} | {stages['inner']['step_seconds']:.3f} s | "
            f"{stages['outer']['step_seconds']:.3f} s | {item['mean_step_seconds']:.3f} s | "
            f"{_num(item.get('mean_step_speedup'), '{:.2f}x')} | "
            f"{_mb(stages['outer'].get('wire_tx_bytes_per_step'))} |"
        )
    return out


def _zero_one_adam_tables(
    summary: dict[str, Any], settings: dict[str, Any], derived: dict[str, Any], host: str
) -> list[str]:
    """0/1 Adam's steps by kind, and its whole run against LAMB's and 1-bit Adam's."""
    item = summary[ZERO_ONE_ADAM_METHOD]
    schedule = item["schedule"]
    arm = ", ".join(f"{key} {value}" for key, value in ZERO_ONE_ADAM_SCHEDULE.items())
    run = ", ".join(
        f"{key} {schedule[key]}"
        for key in ("var_freeze_step", "var_update_scaler", "local_step_scaler")
    )
    out = [
        f"{METHODS[ZERO_ONE_ADAM_METHOD].label}, measured with {arm} "
        f"(each kind's first {settings['skip_steps']} step(s) untimed), by kind of step; "
        f"steps of each kind in a run of {derived['run_steps']} steps as `onebit train "
        f"--optimizer zero-one-adam` schedules it ({run}, local_step_clipper "
        f"{schedule['local_step_clipper']}):",
        "",
        f"| kind of step | steps in the run | step time | speedup over LAMB's step | "
        f"wire MB/step/{host} | library MB/step | fwd+bwd / opt.step (rank 0) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for kind, count in schedule["steps_by_kind"].items():
        stage = item["stages"][kind]
        out.append(
            f"| {kind} | {count} | {stage['step_seconds']:.2f} s | "
            f"{_num(stage.get('speedup_over_lamb_step'), '{:.2f}x')} | "
            f"{_mb(stage.get('wire_tx_bytes_per_step'))} | "
            f"{_mb(stage['library_bytes_per_step'])} | "
            f"{_num(stage.get('rank0_forward_backward_seconds'), '{:.2f} s')} / "
            f"{_num(stage.get('rank0_optimizer_step_seconds'), '{:.2f} s')} |"
        )
    out += [
        "",
        f"| whole run of {derived['run_steps']} steps (computed) | time | wire GB/{host} | "
        "0/1 Adam faster by | 0/1 Adam sends fewer bytes by |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("lamb", "onebit-adam", ZERO_ONE_ADAM_METHOD):
        other = summary.get(name)
        if other is None:
            continue
        versus = item["vs"].get(name, {})
        out.append(
            f"| {name} | {_num(other['end_to_end_seconds'], '{:.0f} s')} | "
            f"{_mb(other.get('whole_run_wire_bytes'), unit=1e9)} | "
            f"{_num(versus.get('end_to_end_speedup'), '{:.2f}x')} | "
            f"{_num(versus.get('whole_run_bytes_reduction'), '{:.2f}x')} |"
        )
    return out


def format_sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per configuration, compression-stage speedups over LAMB (and the
    whole-run speedup at the configured warm-up fraction for 1-bit methods)."""
    lamb, compute = (METHODS[name].short for name in BASELINE_METHODS)
    head = (
        f"| workers | link | TCP check | {lamb} step | {compute} step | s | ideal compr. / "
        "whole run | " + " | ".join(METHODS[name].short for name in COMPARED_METHODS) + " |"
    )
    out = [head, "|" + "---|" * (7 + len(COMPARED_METHODS))]
    for row in rows:
        if "error" in row:
            out.append(
                f"| {row['workers']} | {bandwidth_label(row['bandwidth'])} | failed: "
                f"{row['error'].splitlines()[0]} |"
            )
            continue
        tcp = row.get("tcp_bits_per_second")
        cells = [
            str(row["workers"]),
            bandwidth_label(row["bandwidth"]),
            "-" if tcp is None else f"{tcp / 1e6:.0f} Mbit/s",
            _num(row.get("lamb_step_seconds"), "{:.2f} s"),
            _num(row.get("compute_step_seconds"), "{:.2f} s"),
            _num(row.get("comm_share")),
            f"{_num(row.get('ideal_compression_stage_speedup'), '{:.2f}x')} / "
            f"{_num(row.get('ideal_end_to_end_speedup'), '{:.2f}x')}",
        ]
        for name in COMPARED_METHODS:
            item = row["methods"].get(name)
            if item is None:
                requested = row.get("requested_methods")
                cells.append("not run" if requested and name not in requested else "failed")
            elif name == ZERO_ONE_ADAM_METHOD:
                cells.append(_num(item["end_to_end_speedup"], "{:.2f}x"))
            elif name.startswith("onebit"):
                cells.append(
                    f"{_num(item['compression_stage_speedup'], '{:.2f}x')} / "
                    f"{_num(item['end_to_end_speedup'], '{:.2f}x')}"
                )
            else:
                cells.append(_num(item["compression_stage_speedup"], "{:.2f}x"))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
