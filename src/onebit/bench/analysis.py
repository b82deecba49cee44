"""What a comparison's raw measurements mean: per-stage summaries, speedups and targets.

Derived figures:

* ``s``, the share of LAMB's step spent on communication: ``1 - t(lamb-compute) / t(lamb)``.
* The end-to-end time of a run of ``S`` steps with warm-up fraction ``w``, *computed* from the
  measured per-stage step times, ``T = w S t_warm + (1 - w) S t_comp`` (methods without stages
  use their steady step time for both), and the speedup ``T(lamb) / T``.
* Whole-run traffic reduction ``B(lamb) / (w B_warm + (1 - w) B_comp)`` from the measured bytes.
* The ideals for 32x compression: ``1 / (w + (1 - w) / 32)`` for traffic and
  ``1 / ((1 - s) + s / 32)`` for the compression-stage speedup.
* 0/1 Adam: the mean step time and bytes of each kind of step (variance update, 1-bit
  gradient, local, synchronisation), and its whole run as the sum over the kinds of the steps
  of that kind times their step time (or bytes), with the number of steps of each kind from
  the schedule ``onebit train --optimizer zero-one-adam`` uses for a run of ``S`` steps with
  ``--freeze-step`` ``w S``; against LAMB's and 1-bit Adam's whole runs.
* On nodes of ``L > 1`` workers: the hierarchical exchange against the flat one, and 1-bit
  LAMB under FSDP2 against FSDP's own HSDP (:mod:`onebit.bench.node_analysis`).

Wire bytes are per emulated host, that is per node: what crosses its one shaped link.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from onebit.bench.node_analysis import compare_nodes, node_targets, target
from onebit.bench.settings import (
    DELAYED_METHOD,
    DILOCO_METHODS,
    DILOCO_SYNC_EVERY,
    ONEBIT_LAMB_METHODS,
    ONEBIT_METHODS,
    OVERLAP_METHODS,
    UNDELAYED_METHOD,
    ZERO_ONE_ADAM_METHOD,
    DilocoArm,
)
from onebit.optim.zero_one_adam import STEP_KINDS, step_kind
from onebit.train.config import ZERO_ONE_ADAM, TrainConfig
from onebit.units import parse_bandwidth

__all__ = ["analyze", "ideal_speedup", "ideal_traffic_reduction", "zero_one_adam_run_schedule"]

COMPRESSION_RATIO = 32.0
TARGET_WARMUP_FRACTIONS = (0.15, 0.20)


def ideal_traffic_reduction(w: float, ratio: float = COMPRESSION_RATIO) -> float:
    """Whole-run traffic reduction against fp32 with a fraction ``w`` of uncompressed steps."""
    return 1.0 / (w + (1.0 - w) / ratio)


def ideal_speedup(s: float, ratio: float = COMPRESSION_RATIO, w: float = 0.0) -> float:
    """Speedup over the baseline when a share ``s`` of its step is communication, the
    compressed steps send ``1/ratio`` of the bytes, and a fraction ``w`` of steps is not
    compressed (``w = 0``: the compression stage alone)."""
    compressed = (1.0 - s) + s / ratio
    return 1.0 / (w + (1.0 - w) * compressed)


def zero_one_adam_run_schedule(run_steps: int, freeze_fraction: float) -> dict[str, Any]:
    """0/1 Adam's schedule in a run of ``run_steps`` steps as ``onebit train --optimizer
    zero-one-adam --steps S --freeze-step wS --var-warmup-steps 16 --pre-freeze-exchange
    gradient`` sets it (DeepSpeed's schedule, whose kinds of step are known in advance;
    ``var_freeze_step`` = the freeze step, the other settings the job's defaults), and how many
    of its steps are of each kind."""
    config = TrainConfig(
        optimizer=ZERO_ONE_ADAM,
        steps=run_steps,
        freeze_step=max(1, round(freeze_fraction * run_steps)),
    ).resolved()
    names = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
    settings = {name: getattr(config, name) for name in names}
    kinds = collections.Counter(step_kind(t, **settings) for t in range(1, run_steps + 1))
    return {**settings, "steps_by_kind": {kind: kinds[kind] for kind in STEP_KINDS}}


def _zero_one_adam_summary(
    stages: dict[str, dict[str, Any]], run_steps: int, freeze_fraction: float
) -> dict[str, Any]:
    """0/1 Adam's whole run from the step time and bytes of each kind of step, weighted by
    the number of steps of that kind in :func:`zero_one_adam_run_schedule`."""
    missing = [kind for kind in STEP_KINDS if kind not in stages]
    if missing:
        raise ValueError(f"{ZERO_ONE_ADAM_METHOD}: no timed steps of kind(s) {missing}")
    schedule = zero_one_adam_run_schedule(run_steps, freeze_fraction)
    counts = schedule["steps_by_kind"]

    def whole_run(key: str) -> float | None:
        if any(stages[kind].get(key) is None for kind in STEP_KINDS):
            return None
        return sum(counts[kind] * stages[kind][key] for kind in STEP_KINDS)

    return {
        "schedule": schedule,
        "end_to_end_seconds": whole_run("step_seconds"),
        "whole_run_wire_bytes": whole_run("wire_tx_bytes_per_step"),
        "whole_run_library_bytes": whole_run("library_bytes_per_step"),
    }


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
        peak_rss = max(run.get("peak_rss_bytes") or 0 for run in runs)
        if name == ZERO_ONE_ADAM_METHOD:
            summary[name] = {
                "label": entry["label"],
                "stages": stages,
                **_zero_one_adam_summary(stages, steps_run, w),
                "peak_rss_bytes": peak_rss,
            }
            continue
        if name in DILOCO_METHODS:
            summary[name] = {
                "label": entry["label"],
                "stages": stages,
                **_diloco_summary(stages, DILOCO_METHODS[name]),
                "peak_rss_bytes": peak_rss,
            }
            continue
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
            "peak_rss_bytes": peak_rss,
        }
        if "wire_tx_bytes_per_step" in warm and "wire_tx_bytes_per_step" in comp:
            summary[name]["whole_run_wire_bytes"] = steps_run * (
                w * warm["wire_tx_bytes_per_step"] + (1 - w) * comp["wire_tx_bytes_per_step"]
            )
    derived: dict[str, Any] = {
        "freeze_fraction": w,
        "run_steps": steps_run,
        "end_to_end_note": (
            "end-to-end time is computed, not measured end to end: T = w*S*t_warm + "
            "(1-w)*S*t_comp from the measured per-stage step times (methods without stages: "
            "their steady step time for both; 0/1 Adam: the sum over its kinds of step of the "
            "steps of that kind in the schedule times their measured step time)"
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
        if lamb and name in DILOCO_METHODS:
            item["mean_step_speedup"] = lamb["t_comp"] / item["mean_step_seconds"]
        elif lamb and name != ZERO_ONE_ADAM_METHOD:
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
    compare_nodes(summary)
    _compare_zero_one_adam(summary)
    raw["summary"] = summary
    raw["derived"] = derived
    raw["targets"] = {**_targets(raw), **node_targets(raw)}
    return raw


def _diloco_summary(stages: dict[str, Any], arm: DilocoArm) -> dict[str, Any]:
    """DiLoCo's turn (a round of :data:`DILOCO_SYNC_EVERY` steps, or Streaming DiLoCo's share
    of it): the arm, its mean step, ``turn - 1`` inner steps and the outer one, and the bytes
    a worker sends per step on average (a streaming exchange, started at the end of an inner
    step, sends some of its bytes during that step's timed block)."""
    inner, outer = stages["inner"], stages["outer"]
    turn = arm.turn
    summary: dict[str, Any] = {
        "sync_every": DILOCO_SYNC_EVERY,
        **arm._asdict(),
        "turn": turn,
        "mean_step_seconds": ((turn - 1) * inner["step_seconds"] + outer["step_seconds"]) / turn,
    }
    if "wire_tx_bytes_per_step" in outer:  # streaming: the exchange crosses into its steps
        turn_bytes = (turn - 1) * inner["wire_tx_bytes_per_step"] + outer["wire_tx_bytes_per_step"]
        summary["wire_bytes_per_step"] = turn_bytes / turn
    return summary


def _compare_zero_one_adam(summary: dict[str, Any]) -> None:
    """Add to 0/1 Adam's summary each kind of step's speedup over LAMB's step (with its
    allreduce), and ``vs``: its whole run against LAMB's and 1-bit Adam's of the same run,
    in time (``end_to_end_speedup``) and in wire bytes (``whole_run_bytes_reduction``)."""
    item = summary.get(ZERO_ONE_ADAM_METHOD)
    if item is None:
        return
    lamb = summary.get("lamb")
    if lamb:
        for stage in item["stages"].values():
            stage["speedup_over_lamb_step"] = lamb["t_comp"] / stage["step_seconds"]
    item["vs"] = {}
    for reference in ("lamb", "onebit-adam"):
        other = summary.get(reference)
        if other is None or item["end_to_end_seconds"] is None:
            continue
        versus = {"end_to_end_speedup": other["end_to_end_seconds"] / item["end_to_end_seconds"]}
        if other.get("whole_run_wire_bytes") and item["whole_run_wire_bytes"]:
            versus["whole_run_bytes_reduction"] = (
                other["whole_run_wire_bytes"] / item["whole_run_wire_bytes"]
            )
        item["vs"][reference] = versus
    if "lamb" in item["vs"]:
        item["end_to_end_speedup"] = item["vs"]["lamb"]["end_to_end_speedup"]


def _overlap_targets(summary: dict[str, Any]) -> dict[str, Any]:
    """The overlapped exchange's targets: its compression-stage step within 1.2x of the
    compute-only step, and never slower than LAMB (each path present)."""
    overlapped = [m for m in OVERLAP_METHODS if m in summary]
    compute, lamb = summary.get("lamb-compute"), summary.get("lamb")
    targets: dict[str, Any] = {}
    if not overlapped or not compute or not lamb:
        return targets
    ratios = {m: summary[m]["t_comp"] / compute["t_comp"] for m in overlapped}
    targets["overlap_within_1.2x_compute"] = target(
        max(ratios.values()) <= 1.2,
        ", ".join(
            f"{m} compression-stage step / compute-only step = {r:.2f}" for m, r in ratios.items()
        ),
    )
    vs_lamb = {m: summary[m]["t_comp"] / lamb["t_comp"] for m in overlapped}
    targets["overlap_not_slower_than_lamb"] = target(
        max(vs_lamb.values()) <= 1.0,
        ", ".join(f"{m} compression-stage step / LAMB step = {r:.2f}" for m, r in vs_lamb.items()),
    )
    return targets


def _delay_targets(summary: dict[str, Any], bandwidth: str | None) -> dict[str, Any]:
    """The delayed exchange's targets (ALGORITHM.md, "Delayed exchange"): on a shaped link its
    compression-stage step within 1.15x of the longer of the compute-only step and the wire
    time of its own bytes at line rate (each host's bytes on its interface per step); and
    never slower than the same method without the delay."""
    delayed, compute = summary.get(DELAYED_METHOD), summary.get("lamb-compute")
    targets: dict[str, Any] = {}
    if delayed is None:
        return targets
    if compute and bandwidth is not None and delayed.get("wire_comp"):
        wire = delayed["wire_comp"] * 8 / parse_bandwidth(bandwidth)
        floor = max(compute["t_comp"], wire)
        ratio = delayed["t_comp"] / floor
        targets["delayed_within_1.15x_of_max_compute_wire"] = target(
            ratio <= 1.15,
            f"{DELAYED_METHOD} compression-stage step {delayed['t_comp']:.3f} s / max(compute-only "
            f"step {compute['t_comp']:.3f} s, wire time {wire:.3f} s) = {ratio:.2f}",
        )
    undelayed = summary.get(UNDELAYED_METHOD)
    if undelayed:
        ratio = delayed["t_comp"] / undelayed["t_comp"]
        targets["delayed_not_slower_than_undelayed"] = target(
            ratio <= 1.0,
            f"{DELAYED_METHOD} / {UNDELAYED_METHOD} compression-stage step = {ratio:.2f}",
        )
    return targets


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
        targets["compression_bytes_30x"] = target(
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
            targets[f"whole_run_traffic_w{round(fraction * 100)}"] = target(
                min(got.values()) >= 0.95 * ideal,
                f"ideal {ideal:.2f}x; measured "
                + ", ".join(f"{m} {r:.2f}x ({r / ideal:.3f} of ideal)" for m, r in got.items()),
            )
    s = derived.get("comm_share")
    lamb_paths = [m for m in ONEBIT_LAMB_METHODS if m in summary]
    if s is None:
        targets["speedup_where_comm_70"] = target(None, "comm share not measured")
    elif s < 0.7:
        targets["speedup_where_comm_70"] = target(
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
        targets["speedup_where_comm_70"] = target(
            met,
            f"s = {s:.2f}, ideal compression-stage {ideal_speedup(s):.2f}x, ideal whole-run "
            f"(w = {settings['freeze_fraction']:.2f}) "
            f"{ideal_speedup(s, w=settings['freeze_fraction']):.2f}x; " + "; ".join(parts),
        )
    targets.update(_overlap_targets(summary))
    targets.update(_delay_targets(summary, settings["bandwidth"]))
    if settings["bandwidth"] is None:
        parts, met = [], True
        for m in lamb_paths:
            ratio = summary[m]["t_comp"] / lamb["t_comp"]
            met = met and ratio <= 1.1
            parts.append(f"{m} compression-stage step / LAMB step = {ratio:.2f}")
        targets["unshaped_step_within_1.1x"] = target(met if lamb_paths else None, "; ".join(parts))
    return targets
