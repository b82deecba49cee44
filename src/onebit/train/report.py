"""Summaries, plots and the comparison report of training runs, computed from ``metrics.jsonl``.

``metrics.jsonl`` has one ``{"kind": "train", ...}`` row per step (step, stage, global MLM loss,
lr, samples seen, bytes this worker sent in the step and so far, step time; with
``--node-size`` above 1 also ``bytes_intra_node`` and ``bytes_inter_node``, what the 1-bit
exchange, or DiLoCo's nodes, sent inside the node and between nodes) and a
``{"kind": "validation", ...}`` row (step, samples, loss) at every evaluation.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onebit.atomic import write_json_atomic
from onebit.collectives import ring_allreduce_bytes
from onebit.optim import AUTO, VARIANCE_UPDATE, WARMUP
from onebit.train.config import ZERO_ONE_ADAM, TrainConfig
from onebit.train.run_dir import LOSS_PLOT_FILE, METRICS_FILE, SUMMARY_FILE

#: The per-step byte counts by link, over nodes (see the module docstring).
LINKS = ("intra_node", "inter_node")
#: Fraction of the last train steps whose mean loss is reported as the final train loss.
FINAL_TRAIN_WINDOW = 0.05
COMPARE_PLOT_FILE = "compare.png"
COMPARE_REPORT_FILE = "report.md"
COMPARE_SUMMARY_FILE = "compare.json"


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def dense_allreduce_bytes(numel: int, world_size: int, steps: int) -> int:
    """Bytes one worker sends for ``steps`` ring allreduces of ``numel`` fp32 values."""
    return steps * ring_allreduce_bytes(4 * numel, world_size)


def dense_baseline(config: TrainConfig, numel: int, world_size: int) -> tuple[str, int]:
    """What the run is measured against, and the bytes one worker sends for it per step:
    LAMB's fp32 allreduce of the gradients over all workers, or with ``--fsdp`` HSDP's fp32
    allreduce of a worker's slices (``numel / node_size``) between the nodes."""
    if config.fsdp:
        nodes = world_size // config.node_size
        sliced = math.ceil(numel / config.node_size)
        return "HSDP, fp32 allreduce between nodes", dense_allreduce_bytes(sliced, nodes, 1)
    return "LAMB, fp32 allreduce", dense_allreduce_bytes(numel, world_size, 1)


@dataclass
class Metrics:
    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]


def read_metrics(run_dir: Path) -> Metrics:
    path = run_dir / METRICS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return Metrics(
        train=[r for r in rows if r["kind"] == "train"],
        validation=[r for r in rows if r["kind"] == "validation"],
    )


def frozen_after(config: TrainConfig, train: list[dict[str, Any]]) -> int:
    """The last step that updates the variance: ``--freeze-step`` (0/1 Adam:
    ``--var-freeze-step``), or with ``auto`` the last step the run's metrics record in the
    warm-up (0/1 Adam: as a variance update)."""
    zero_one = config.optimizer == ZERO_ONE_ADAM
    fixed = config.var_freeze_step if zero_one else config.freeze_step
    if fixed != AUTO:
        return fixed
    dense = VARIANCE_UPDATE if zero_one else WARMUP
    return max((row["step"] for row in train if row["stage"] == dense), default=0)


def summarize(run_dir: Path, config: TrainConfig, *, world_size: int, numel: int) -> dict[str, Any]:
    """The run's figures: losses, throughput, traffic per stage and against dense LAMB."""
    metrics = read_metrics(run_dir)
    train = metrics.train
    if not train:
        raise ValueError(f"{run_dir / METRICS_FILE} holds no training steps")
    window = train[-max(1, round(FINAL_TRAIN_WINDOW * len(train))) :]
    stages: dict[str, dict[str, int]] = {}
    for row in train:
        entry = stages.setdefault(row["stage"], {"steps": 0, "bytes": 0})
        entry["steps"] += 1
        entry["bytes"] += row["bytes"]
    baseline, dense_step = dense_baseline(config, numel, world_size)
    for entry in stages.values():
        entry["lamb_bytes"] = entry["steps"] * dense_step
    sent = sum(entry["bytes"] for entry in stages.values())
    bytes_sent: dict[str, Any] = {"total": sent, "by_stage": stages}
    if "bytes_inter_node" in train[-1]:
        bytes_sent["by_link"] = {
            link: sum(row.get(f"bytes_{link}", 0) for row in train) for link in LINKS
        }
    lamb = len(train) * dense_step
    train_time = sum(row["step_time"] for row in train)
    return {
        "run_dir": str(run_dir),
        "optimizer": config.optimizer,
        "workers": world_size,
        "node_size": config.node_size if config.counts_links else 1,
        "steps": len(train),
        "freeze_step": frozen_after(config, train) if config.uses_onebit else None,
        "global_batch": config.batch_size,
        "samples": train[-1]["samples"],
        "parameters": numel,
        "final_train_loss": statistics.fmean(row["loss"] for row in window),
        "final_train_loss_steps": len(window),
        "final_validation_loss": metrics.validation[-1]["loss"] if metrics.validation else None,
        "train_time_s": train_time,
        "samples_per_s": train[-1]["samples"] / train_time if train_time > 0 else None,
        "bytes_sent": bytes_sent,
        "lamb_bytes": lamb,
        "lamb_baseline": baseline,
        "reduction_vs_lamb": lamb / sent if sent else None,
    }


def plot_loss(
    run_dir: Path,
    config: TrainConfig,
    *,
    world_size: int,
    numel: int,
    unigram_entropy: float | None = None,
) -> Path:
    """``loss.png``: train loss per step, validation loss, the unigram level and the switch to
    compression; beside it, the bytes one worker has sent against what the dense baseline
    (:func:`dense_baseline`) would have sent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline, dense_step = dense_baseline(config, numel, world_size)
    metrics = read_metrics(run_dir)
    steps = [r["step"] for r in metrics.train]
    fig, (ax, traffic) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(3, 2))
    ax.plot(steps, [r["loss"] for r in metrics.train], lw=0.8, alpha=0.7, label="train")
    if metrics.validation:
        ax.plot(
            [r["step"] for r in metrics.validation],
            [r["loss"] for r in metrics.validation],
            "o-",
            ms=3,
            label="validation",
        )
    if unigram_entropy is not None:
        ax.axhline(unigram_entropy, color="black", ls=":", lw=1, label="unigram level")
    traffic.plot(
        steps,
        [step * dense_step / 2**20 for step in steps],
        color="gray",
        label=baseline,
    )
    traffic.plot(steps, [r["bytes_total"] / 2**20 for r in metrics.train], label=config.optimizer)
    if config.uses_onebit:
        for axes in (ax, traffic):
            axes.axvline(
                frozen_after(config, metrics.train) + 0.5,
                color="gray",
                ls="--",
                lw=1,
                label="switch to 1-bit",
            )
    ax.set_ylabel("MLM loss")
    ax.set_title(f"{config.optimizer}: {config.layers} layers, hidden {config.hidden}")
    traffic.set_ylabel("MiB sent per worker")
    traffic.set_title(f"traffic, {world_size} workers")
    for axes in (ax, traffic):
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend()
    fig.tight_layout()
    path = run_dir / LOSS_PLOT_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_run_report(
    run_dir: Path,
    config: TrainConfig,
    *,
    world_size: int,
    numel: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``summary.json`` (with the entries of ``extra``) and ``loss.png``; return the
    summary."""
    summary = {**summarize(run_dir, config, world_size=world_size, numel=numel), **(extra or {})}
    plot_loss(
        run_dir,
        config,
        world_size=world_size,
        numel=numel,
        unigram_entropy=summary.get("unigram_entropy"),
    )
    write_json_atomic(run_dir / SUMMARY_FILE, summary)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The few lines printed at the end of ``onebit train``."""
    stages = summary["bytes_sent"]["by_stage"]
    val = summary["final_validation_loss"]
    baseline = summary.get("lamb_baseline", "LAMB, fp32 allreduce")
    lines = [
        f"{summary['optimizer']}: {summary['steps']} steps on {summary['workers']} workers, "
        f"{summary['samples']:,} samples, {summary['samples_per_s']:.0f} samples/s",
        f"  final MLM loss: train {summary['final_train_loss']:.4f} (mean of the last "
        f"{summary['final_train_loss_steps']} steps), validation "
        + ("n/a" if val is None else f"{val:.4f}")
        + _below_unigram(val, summary.get("unigram_entropy")),
        "  bytes sent per worker:",
    ]
    for stage, entry in stages.items():
        lines.append(
            f"    {stage:<12} {entry['steps']:>6} steps  {human_bytes(entry['bytes']):>10}"
            f"   ({baseline}: {human_bytes(entry['lamb_bytes'])})"
        )
    reduction = summary["reduction_vs_lamb"]
    lines.append(
        f"    {'total':<12} {summary['steps']:>6} steps  "
        f"{human_bytes(summary['bytes_sent']['total']):>10}   ({baseline.split(',')[0]}: "
        f"{human_bytes(summary['lamb_bytes'])}"
        + ("" if reduction is None else f", {reduction:.1f}x less sent")
        + ")"
    )
    links = summary["bytes_sent"].get("by_link")
    if links:
        lines.append(
            f"    of which, on nodes of {summary['node_size']} workers: "
            f"intra-node {human_bytes(links['intra_node'])}, "
            f"inter-node {human_bytes(links['inter_node'])}"
        )
    lines.append(
        f"  outputs in {summary['run_dir']}/ (metrics.jsonl, loss.png, summary.json, "
        "config.json, checkpoints/)"
    )
    return "\n".join(lines)


def _below_unigram(loss: float | None, entropy: float | None) -> str:
    """`` (unigram level 3.54: 44.4% below)``, or nothing without both figures."""
    if loss is None or entropy is None:
        return ""
    return f" (unigram level {entropy:.4f}: {100 * (1 - loss / entropy):.1f}% below)"


def write_compare_report(
    out_dir: Path, runs: dict[str, Path], finetune: dict[str, dict[str, Any]] | None = None
) -> Path:
    """``report.md``, ``compare.png`` and ``compare.json`` for runs of several optimizers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = {name: json.loads((path / SUMMARY_FILE).read_text()) for name, path in runs.items()}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, path in runs.items():
        val = read_metrics(path).validation
        ax.plot([r["samples"] for r in val], [r["loss"] for r in val], "o-", ms=3, label=name)
        freeze = summaries[name]["freeze_step"]
        if freeze:
            ax.axvline(freeze * summaries[name]["global_batch"], color="gray", ls=":", lw=1)
    ax.set_xlabel("samples seen")
    ax.set_ylabel("validation MLM loss")
    ax.set_title("validation loss vs samples (dotted: switch to 1-bit)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / COMPARE_PLOT_FILE, dpi=100)
    plt.close(fig)

    reference = summaries.get("lamb")
    header = "| optimizer | final validation loss | final train loss | bytes sent per worker "
    header += "| reduction vs LAMB (fp32) | samples/s |"
    rows = [header, "|---|---:|---:|---:|---:|---:|"]
    if finetune:
        rows[0] += " sentiment accuracy |"
        rows[1] += "---:|"
    for name, s in summaries.items():
        val = s["final_validation_loss"]
        rel = ""
        if reference is not None and name != "lamb" and val and reference["final_validation_loss"]:
            rel = f" ({100 * (val / reference['final_validation_loss'] - 1):+.2f}%)"
        row = (
            f"| {name} | {val:.4f}{rel} | {s['final_train_loss']:.4f} "
            f"| {human_bytes(s['bytes_sent']['total'])} | {s['reduction_vs_lamb']:.2f}x "
            f"| {s['samples_per_s']:.0f} |"
        )
        if finetune:
            acc = finetune.get(name, {}).get("test_accuracy")
            row += " n/a |" if acc is None else f" {100 * acc:.2f}% |"
        rows.append(row)
    first = next(iter(summaries.values()))
    text = "\n".join(
        [
            "# Optimizer comparison",
            "",
            f"{first['steps']} steps, global batch {first['global_batch']}, {first['workers']} "
            f"workers, {first['parameters']:,} parameters; same seed, data order and initial "
            "weights for every optimizer.",
            "",
            *rows,
            "",
            f"![validation loss vs samples]({COMPARE_PLOT_FILE})",
            "",
        ]
    )
    (out_dir / COMPARE_REPORT_FILE).write_text(text)
    write_json_atomic(
        out_dir / COMPARE_SUMMARY_FILE, {"runs": summaries, "finetune": finetune or {}}
    )
    return out_dir / COMPARE_REPORT_FILE
