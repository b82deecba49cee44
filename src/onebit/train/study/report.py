"""A study's report: each arm's result, the curves against the unigram level, a table per
number of workers, the downstream results, the commands; and the difference of two runs."""

from __future__ import annotations

import json
import logging
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

from onebit.train.config import TrainConfig
from onebit.train.report import human_bytes, read_metrics
from onebit.train.run_dir import SUMMARY_FILE
from onebit.train.study.runner import (
    arm_command,
    arm_state,
    downstream_models,
    steps_done,
    unavailable_reason,
)
from onebit.train.study.schema import (
    ARM_FILES,
    DEFAULT_SPEC,
    FINETUNE_GLOB,
    FINISHED,
    PLOT_FILE,
    REFERENCE_ARM,
    REPORT_FILE,
    RESULTS_FILE,
    UNAVAILABLE,
    Arm,
    Study,
)

logger = logging.getLogger(__name__)


def _seed_statistics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    accuracies = [r["test_accuracy"] for r in runs]
    return {
        "accuracies": accuracies,
        "mean": statistics.fmean(accuracies),
        "se_over_seeds": statistics.stdev(accuracies) / math.sqrt(len(runs))
        if len(runs) > 1
        else None,
        "se_binomial": statistics.fmean(r["test_accuracy_se"] for r in runs),
        "test_examples": runs[0]["test_examples"],
        "chance_accuracy": runs[0]["chance_accuracy"],
    }


def downstream_results(study: Study, out: Path) -> dict[str, dict[str, Any]]:
    """Per fine-tuned model, at the learning rate ``lr`` of the grid with the best mean test
    accuracy: the test accuracy of each seed run so far, their mean, the standard error of
    that mean over seeds (``stdev / sqrt(k)``, two seeds or more), the mean binomial standard
    error of one run (``sqrt(a·(1-a)/n_test)``) and the accuracy of guessing; ``by_lr``: the
    same at every learning rate run so far."""
    if study.downstream is None:
        return {}
    results = {}
    for label, run_dir, scratch in downstream_models(study, out):
        by_lr = {}
        for lr in study.downstream.lrs:
            runs = []
            for seed in study.downstream.seeds:
                path = run_dir / study.downstream.config(seed, lr, from_scratch=scratch).result_file
                if path.is_file():
                    runs.append(json.loads(path.read_text()))
            if runs:
                by_lr[lr] = _seed_statistics(runs)
        if by_lr:
            best = max(by_lr, key=lambda lr: by_lr[lr]["mean"])
            results[label] = {**by_lr[best], "lr": best, "by_lr": by_lr}
    return results


def data_facts(config: TrainConfig) -> dict[str, Any]:
    """The vocabulary, the numbers of sequences and the unigram cross-entropy of the
    validation tokens (nats) of ``config``'s data."""
    from onebit.train.data import unigram_cross_entropy
    from onebit.train.job_data import load_data

    mlm, _ = load_data(config)
    return {
        "unigram_entropy": unigram_cross_entropy(mlm),
        "vocabulary": mlm.vocab_size,
        "train_sequences": mlm.train.shape[0],
        "validation_sequences": mlm.validation.shape[0],
    }


def arm_result(study: Study, arm: Arm, out: Path) -> dict[str, Any]:
    """What the report says of ``arm``: its state, progress, losses, traffic and command."""
    run_dir = out / arm.name
    result: dict[str, Any] = {
        "name": arm.name,
        "optimizer": arm.optimizer,
        "workers": arm.workers,
        "runner": arm.runner,
        "state": arm_state(study, arm, out),
        "command": " ".join(arm_command(study, arm, out)),
    }
    if result["state"] == UNAVAILABLE:
        result["pending"] = unavailable_reason(arm)
        return result
    result["steps"] = study.config(arm).steps
    result["steps_done"] = steps_done(run_dir)
    if result["steps_done"]:
        validation = read_metrics(run_dir).validation
        if validation:
            result["validation_step"] = validation[-1]["step"]
            result["validation_loss"] = validation[-1]["loss"]
    if result["state"] == FINISHED:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        for key in ("parameters", "train_time_s", "samples_per_s", "reduction_vs_lamb"):
            result[key] = summary[key]
        result["bytes_sent"] = summary["bytes_sent"]["total"]
    return result


def _plot(results: list[dict[str, Any]], out: Path, entropy: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for result in results:
        if result.get("steps_done"):
            val = read_metrics(out / result["name"]).validation
            label = result["name"] + ("" if result["state"] == FINISHED else " (running)")
            ax.plot([r["samples"] for r in val], [r["loss"] for r in val], "o-", ms=2, label=label)
    ax.axhline(entropy, color="black", ls="--", lw=1, label=f"unigram entropy {entropy:.3f}")
    ax.axhline(0.75 * entropy, color="gray", ls=":", lw=1, label="75% of it")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("validation MLM loss (nats)")
    ax.set_title("validation loss vs samples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _table_row(result: dict[str, Any], reference: dict[int, float], entropy: float) -> str:
    """A row of an arm's table; ``reference``: LAMB's validation loss by step, which the
    arm's latest validation loss is compared with at the same step."""
    state = result["state"]
    if state == UNAVAILABLE:
        return f"| {result['name']} | {result['workers']} | pending: {result['pending']} | | | | |"
    progress = f"{result['steps_done']}/{result['steps']}"
    loss = result.get("validation_loss")
    if loss is None:
        return f"| {result['name']} | {result['workers']} | {state}, {progress} | | | | |"
    shown = f"{loss:.4f}" if state == FINISHED else f"{loss:.4f} (step {result['validation_step']})"
    versus = ""
    if result["name"] != REFERENCE_ARM and result["validation_step"] in reference:
        versus = f"{100 * (loss / reference[result['validation_step']] - 1):+.2f}%"
    traffic = ""
    if state == FINISHED:
        traffic = human_bytes(result["bytes_sent"])
        if result["name"] != REFERENCE_ARM:
            traffic += f" ({result['reduction_vs_lamb']:.2f}x less than LAMB)"
    return (
        f"| {result['name']} | {result['workers']} | {state}, {progress} | {shown} | {versus} "
        f"| {100 * (1 - loss / entropy):.1f}% | {traffic} |"
    )


def _downstream_table(study: Study, results: dict[str, dict[str, Any]]) -> list[str]:
    assert study.downstream is not None
    lrs = study.downstream.lrs
    task = study.downstream.config(study.downstream.seeds[0], lrs[0]).task
    reference = results.get(REFERENCE_ARM)
    first = next(iter(results.values()))
    lines = [
        f"## Downstream: {task}",
        "",
        f"Fine-tuned with seeds {list(study.downstream.seeds)} at peak learning rates "
        f"{', '.join(f'{lr:g}' for lr in lrs)}, each model shown at the one with its best mean; "
        f"{first['test_examples']} test examples; guessing scores "
        f"{100 * first['chance_accuracy']:.2f}%.",
        "",
        "| model | lr | seeds | test accuracy (mean) | standard error over seeds | binomial "
        "standard error of one run | vs LAMB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        over_seeds = "" if r["se_over_seeds"] is None else f"{100 * r['se_over_seeds']:.2f}"
        versus = ""
        if reference is not None and label != REFERENCE_ARM:
            versus = f"{100 * (r['mean'] - reference['mean']):+.2f} pt"
        lines.append(
            f"| {label} | {r['lr']:g} | {len(r['accuracies'])} | {100 * r['mean']:.2f}% "
            f"| {over_seeds} | {100 * r['se_binomial']:.2f} | {versus} |"
        )
    if len(lrs) > 1:
        lines += [
            "",
            "Mean test accuracy at each learning rate:",
            "",
            "| model | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
            "|---|" + "---:|" * len(lrs),
        ]
        for label, r in results.items():
            cells = [
                f"{100 * r['by_lr'][lr]['mean']:.2f}%" if lr in r["by_lr"] else "" for lr in lrs
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def write_study_report(study: Study, out: Path, report_dir: Path | None = None) -> Path:
    """Write ``report.md``, ``study.png`` and ``results.json`` into ``report_dir`` (default:
    ``out``), with a copy of each arm's config, metrics and summary there; return the report."""
    report_dir = out if report_dir is None else report_dir
    report_dir.mkdir(parents=True, exist_ok=True)
    results = [arm_result(study, arm, out) for arm in study.arms]
    base = study.config(next(arm for arm in study.arms if unavailable_reason(arm) is None))
    facts = data_facts(base)
    entropy = facts["unigram_entropy"]
    _plot(results, out, entropy, report_dir / PLOT_FILE)
    if report_dir.resolve() != out.resolve():
        for result in results:
            run_dir = out / result["name"]
            for source in [run_dir / name for name in ARM_FILES] + sorted(
                run_dir.glob(FINETUNE_GLOB)
            ):
                if source.is_file():
                    (report_dir / result["name"]).mkdir(exist_ok=True)
                    shutil.copyfile(source, report_dir / result["name"] / source.name)
    by_name = {result["name"]: result for result in results}
    reference = by_name.get(REFERENCE_ARM, {})
    reference_curve = {}
    if reference.get("steps_done"):
        validation = read_metrics(out / REFERENCE_ARM).validation
        reference_curve = {row["step"]: row["loss"] for row in validation}
    header = [
        "| arm | workers | state | final validation loss | vs LAMB (same step) "
        "| below unigram entropy "
        "| bytes sent per worker |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    lines = [
        "# Convergence study",
        "",
        f"{base.steps} steps at a global batch of {base.batch_size} sequences of {base.seq_len} "
        f"tokens ({facts['train_sequences']:,} training and {facts['validation_sequences']:,} "
        f"validation sequences, vocabulary of {facts['vocabulary']} tokens); {base.layers} "
        f"layers, hidden {base.hidden}, {base.heads} heads. Unigram cross-entropy of the "
        "validation tokens under the training counts: "
        f"**{entropy:.4f} nats** (25% below it: {0.75 * entropy:.4f}).",
        "",
    ]
    workers = sorted({r["workers"] for r in results if r["name"] != REFERENCE_ARM})
    for n in workers:
        rows = [r for r in results if r["workers"] == n and r["name"] != REFERENCE_ARM]
        if reference:
            rows.insert(0, reference)
        lines += [f"## n = {n}", "", *header]
        lines += [_table_row(r, reference_curve, entropy) for r in rows]
        lines.append("")
    lines += [f"![validation loss vs samples]({PLOT_FILE})", ""]
    downstream = downstream_results(study, out)
    if downstream:
        lines += _downstream_table(study, downstream)
    lines += [
        "## Commands",
        "",
        "```",
        f"onebit study run --spec {DEFAULT_SPEC} --out {out}   # every arm, one after another",
        *(r["command"] for r in results),
        f"onebit study finetune --spec {DEFAULT_SPEC} --out {out}   # the downstream check",
        "```",
        "",
    ]
    path = report_dir / REPORT_FILE
    path.write_text("\n".join(lines))
    with (report_dir / RESULTS_FILE).open("w") as f:
        json.dump({**facts, "arms": results, "downstream": downstream}, f, indent=1)
    return path


def trajectory_difference(run_a: Path, run_b: Path) -> dict[str, Any]:
    """The largest relative differences between two runs' per-step train losses and
    validation losses over the steps both recorded (for runs that should coincide, such as
    LAMB at two numbers of workers)."""
    a, b = read_metrics(run_a), read_metrics(run_b)
    result: dict[str, Any] = {}
    for kind in ("train", "validation"):
        losses_b = {row["step"]: row["loss"] for row in getattr(b, kind)}
        pairs = [
            (row["loss"], losses_b[row["step"]])
            for row in getattr(a, kind)
            if row["step"] in losses_b
        ]
        if not pairs:
            raise ValueError(f"{run_a} and {run_b} have no {kind} step in common")
        result[f"{kind}_steps"] = len(pairs)
        result[f"{kind}_max_relative_difference"] = max(abs(x - y) / abs(y) for x, y in pairs)
    return result
