"""The convergence study: the same pre-training job under several optimizers and worker counts.

A study is a JSON file (docs/convergence/study.json) holding the shared settings of the job
(``train``: :class:`~onebit.train.config.TrainConfig` fields) and its *arms*, each an optimizer
at a number of data-parallel workers, run either as real processes (``runner: "train"``, what
``onebit train`` does) or simulated in one process (``runner: "simulate"``, what
``onebit simulate`` does)::

    {"train": {"steps": 800, "batch_size": 1024, ...},
     "arms": [{"name": "lamb", "optimizer": "lamb", "workers": 4, "runner": "train"},
              {"name": "onebit-lamb-n64", "optimizer": "onebit-lamb", "workers": 64,
               "runner": "simulate"},
              {"name": "onebit-adam-n4", "optimizer": "onebit-adam", "workers": 4,
               "runner": "train", "train": {"lr": 0.002}}]}

Every arm sees the same samples in the same order with the same masks and initial weights (the
data order depends on the step alone, never on the number of workers), at the same global
batch. :func:`run_study` runs the arms one after another in ``OUT/<name>/``: a finished arm is
skipped, an interrupted one continues from its newest checkpoint, and an arm whose optimizer or
runner this installation does not have yet is reported as pending and left for later.
:func:`write_study_report` writes the curves, a table per number of workers and the commands.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onebit.cli import options_argv
from onebit.train.config import (
    CONFIG_FILE,
    METRICS_FILE,
    OPTIMIZERS,
    SUMMARY_FILE,
    FinetuneConfig,
    TrainConfig,
)
from onebit.train.report import human_bytes, read_metrics

logger = logging.getLogger(__name__)

RUNNERS = ("train", "simulate")
DEFAULT_SPEC = Path("docs/convergence/study.json")
DEFAULT_OUT = Path("runs/study")
REPORT_FILE = "report.md"
PLOT_FILE = "study.png"
RESULTS_FILE = "results.json"
#: The files of an arm's run folder that the report copies next to itself.
ARM_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE)
#: Settings every arm shares: what the samples, the model and the evaluation are.
SHARED_SETTINGS = (
    "steps", "batch_size", "seq_len", "layers", "hidden", "heads", "vocab_size", "dropout",
    "seed", "corpus", "eval_every", "eval_seqs",
)  # fmt: skip
#: The fine-tuning results of an arm's run folder.
FINETUNE_GLOB = "finetune*.json"
#: The arm whose final validation loss the others are compared with.
REFERENCE_ARM = "lamb"

#: The label of the downstream check's model without pre-training.
NO_PRETRAINING = "no pre-training"

FINISHED, PARTIAL, NOT_STARTED, UNAVAILABLE = "finished", "partial", "not started", "unavailable"


@dataclass(frozen=True)
class Arm:
    """One optimizer at one number of workers; ``train`` overrides the study's settings."""

    name: str
    optimizer: str
    workers: int
    runner: str
    train: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"arm name must be a non-empty folder name, got {self.name!r}")
        if self.runner not in RUNNERS:
            raise ValueError(
                f"arm {self.name}: runner must be one of {RUNNERS}, got {self.runner!r}"
            )
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(
                f"arm {self.name}: workers must be a positive integer, got {self.workers!r}"
            )
        if "optimizer" in self.train:
            raise ValueError(f"arm {self.name}: set the optimizer with 'optimizer', not in 'train'")
        shared = sorted(set(self.train) & set(SHARED_SETTINGS))
        if shared:
            raise ValueError(
                f"arm {self.name}: {shared} must be the same in every arm (same samples, same "
                "global batch, same model); set them in the study's 'train'"
            )


@dataclass(frozen=True)
class Downstream:
    """The fine-tuning check: ``finetune`` (:class:`FinetuneConfig` fields) repeated with each
    of ``seeds`` and each peak learning rate of ``lrs`` (default: ``finetune``'s) on every
    finished arm, and on a model without pre-training; each model is reported at the learning
    rate with its best mean test accuracy."""

    finetune: dict[str, Any]
    seeds: tuple[int, ...] = (0,)
    lrs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"downstream seeds must be distinct and not empty, got {self.seeds}")
        forbidden = sorted(set(self.finetune) & {"seed", "from_scratch"})
        if self.lrs and "lr" in self.finetune:
            forbidden.append("lr")
        if forbidden:
            raise ValueError(
                f"downstream 'finetune' must not set {forbidden} (the check sets them)"
            )
        lrs = tuple(self.lrs) or (FinetuneConfig(**self.finetune).lr,)
        if len(set(lrs)) != len(lrs):
            raise ValueError(f"downstream lrs must be distinct, got {list(lrs)}")
        object.__setattr__(self, "lrs", lrs)
        for lr in lrs:  # unknown or invalid settings fail here
            self.config(self.seeds[0], lr)

    def config(self, seed: int, lr: float, *, from_scratch: bool = False) -> FinetuneConfig:
        settings = {**self.finetune, "lr": lr}
        return FinetuneConfig(**settings, seed=seed, from_scratch=from_scratch)


@dataclass(frozen=True)
class Study:
    """The shared settings and the arms of a study (see the module docstring)."""

    train: dict[str, Any]
    arms: tuple[Arm, ...]
    description: str = ""
    downstream: Downstream | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Study:
        unknown = sorted(set(data) - {"train", "arms", "description", "downstream"})
        if unknown:
            raise ValueError(f"unknown keys in the study: {unknown}")
        if "optimizer" in data.get("train", {}):
            raise ValueError(
                "the study's 'train' settings must not name an optimizer (each arm does)"
            )
        arms = tuple(Arm(**arm) for arm in data["arms"])
        names = [arm.name for arm in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        TrainConfig(**data.get("train", {}))  # unknown or misspelt settings fail here
        downstream = Downstream(**data["downstream"]) if "downstream" in data else None
        return cls(dict(data.get("train", {})), arms, data.get("description", ""), downstream)

    @classmethod
    def read(cls, path: Path) -> Study:
        if not path.is_file():
            raise FileNotFoundError(f"study file {path} does not exist")
        return cls.from_json(json.loads(path.read_text(encoding="utf-8")))

    def select(self, names: list[str] | None) -> tuple[Arm, ...]:
        """The arms named in ``names`` (all when None), in the study's order."""
        if names is None:
            return self.arms
        unknown = sorted(set(names) - {arm.name for arm in self.arms})
        if unknown:
            raise ValueError(
                f"the study has no arms {unknown}; it has {[a.name for a in self.arms]}"
            )
        return tuple(arm for arm in self.arms if arm.name in names)

    def settings(self, arm: Arm) -> TrainConfig:
        """The training configuration of ``arm`` as given (not validated, ``None`` kept)."""
        return TrainConfig(**{**self.train, **arm.train, "optimizer": arm.optimizer})

    def config(self, arm: Arm) -> TrainConfig:
        """The resolved training configuration of ``arm``."""
        return self.settings(arm).resolved()


def has_command(name: str) -> bool:
    """Whether this installation's ``onebit`` command has the sub-command ``name``."""
    from onebit.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return name in action.choices
    return False


def unavailable_reason(arm: Arm) -> str | None:
    """Why ``arm`` cannot run in this installation (None if it can)."""
    if arm.optimizer not in OPTIMIZERS:
        return (
            f"optimizer {arm.optimizer!r} is not available (onebit train knows {list(OPTIMIZERS)})"
        )
    if arm.runner != "train" and not has_command(arm.runner):
        return f"`onebit {arm.runner}` is not available"
    return None


def steps_done(run_dir: Path) -> int:
    """The last step recorded in ``run_dir``'s metrics (0 if none)."""
    if not (run_dir / METRICS_FILE).is_file():
        return 0
    train = read_metrics(run_dir).train
    return train[-1]["step"] if train else 0


def arm_state(study: Study, arm: Arm, out: Path) -> str:
    """``finished``, ``partial``, ``not started`` or ``unavailable``."""
    if unavailable_reason(arm) is not None:
        return UNAVAILABLE
    run_dir = out / arm.name
    summary = run_dir / SUMMARY_FILE
    if summary.is_file() and json.loads(summary.read_text())["steps"] == study.config(arm).steps:
        return FINISHED
    return PARTIAL if steps_done(run_dir) else NOT_STARTED


def arm_command(study: Study, arm: Arm, out: Path) -> list[str]:
    """The ``onebit train`` or ``onebit simulate`` command that runs (or continues) ``arm``."""
    return [
        "onebit",
        arm.runner,
        *options_argv(study.settings(arm)),
        "--workers",
        str(arm.workers),
        "--out",
        str(out / arm.name),
    ]


def run_arm(study: Study, arm: Arm, out: Path, *, max_restarts: int = 0) -> int:
    """Run or continue ``arm`` in ``out/<name>``; the exit status (0 on success)."""
    run_dir = out / arm.name
    if arm.runner == "train":
        from onebit.train.launch import launch_job

        return launch_job(
            study.config(arm), run_dir, workers=arm.workers, max_restarts=max_restarts
        )
    command = [sys.executable, "-m", "onebit", *arm_command(study, arm, out)[1:]]
    return subprocess.run(command, check=False).returncode


def run_study(
    study: Study, out: Path, *, arms: list[str] | None = None, max_restarts: int = 0
) -> dict[str, str]:
    """Run the selected arms one after another; return each arm's state afterwards.

    Finished arms are skipped, interrupted ones continue from their checkpoints, unavailable
    ones are logged as pending. Stops at the first arm that fails (its state is returned as
    ``partial`` or ``not started``), so a resumed study retries it first.
    """
    states: dict[str, str] = {}
    for arm in study.select(arms):
        state = arm_state(study, arm, out)
        if state == UNAVAILABLE:
            logger.warning("%s: pending, %s", arm.name, unavailable_reason(arm))
        elif state == FINISHED:
            logger.info("%s: finished, skipped", arm.name)
        else:
            logger.info("=== %s (%s, %d workers, %s) ===", arm.name, state, arm.workers, arm.runner)
            status = run_arm(study, arm, out, max_restarts=max_restarts)
            state = arm_state(study, arm, out)
            if status or state != FINISHED:
                logger.error(
                    "%s failed (exit %d); run the study again to continue it", arm.name, status
                )
                states[arm.name] = state
                return states
        states[arm.name] = state
    return states


def downstream_models(study: Study, out: Path) -> list[tuple[str, Path, bool]]:
    """``(label, run folder, from scratch)`` of every model the downstream check fine-tunes:
    the finished arms, and a model without pre-training (kept in the reference arm's folder,
    whose architecture and tokenizer it shares) once that arm has finished."""
    finished = [arm for arm in study.arms if arm_state(study, arm, out) == FINISHED]
    models = [(arm.name, out / arm.name, False) for arm in finished]
    if any(arm.name == REFERENCE_ARM for arm in finished):
        models.insert(0, (NO_PRETRAINING, out / REFERENCE_ARM, True))
    return models


def run_downstream(study: Study, out: Path) -> None:
    """Fine-tune every model of :func:`downstream_models` with every seed and learning rate
    of the study's downstream check, seed by seed; results already written are kept."""
    from onebit.train.finetune import finetune

    if study.downstream is None:
        raise ValueError("the study has no 'downstream' check")
    models = downstream_models(study, out)
    for seed in study.downstream.seeds:  # every model's first seed before any second one
        for lr in study.downstream.lrs:
            for label, run_dir, scratch in models:
                config = study.downstream.config(seed, lr, from_scratch=scratch)
                if (run_dir / config.result_file).is_file():
                    continue
                logger.info("=== fine-tuning %s, seed %d, lr %g ===", label, seed, lr)
                finetune(run_dir, config)


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
    from onebit.train.worker import load_data

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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``onebit study run|report|diff``."""
    study = subparsers.add_parser(
        "study",
        help="the convergence study: every optimizer and worker count, resumably, and its report",
        description=__doc__.split("\n\n")[0],
    )
    commands = study.add_subparsers(dest="study_command", required=True, metavar="STUDY")
    for name, handler, help_text in (
        ("run", _run, "run the arms one after another (finished ones are skipped, interrupted "
         "ones continue), then write the report"),
        ("report", _report, "write the report of the arms run so far"),
        ("finetune", _finetune, "the downstream check: fine-tune every finished arm's model and "
         "one without pre-training with each of the study's seeds (results already written are "
         "kept), then write the report"),
    ):  # fmt: skip
        parser = commands.add_parser(name, help=help_text, description=help_text)
        parser.add_argument(
            "--spec",
            type=Path,
            default=DEFAULT_SPEC,
            help=f"the study file (default: {DEFAULT_SPEC})",
        )
        parser.add_argument(
            "--out",
            type=Path,
            default=DEFAULT_OUT,
            help=f"the arms' run folders (default: {DEFAULT_OUT})",
        )
        parser.add_argument(
            "--report-dir",
            type=Path,
            help="where the report and copies of the arms' metrics go (default: --out)",
        )
        parser.set_defaults(handler=handler)
        if name == "run":
            parser.add_argument(
                "--arms", nargs="+", metavar="NAME", help="only these arms (default: all)"
            )
            parser.add_argument(
                "--max-restarts",
                type=int,
                default=0,
                help="restarts of a failed real-process arm (default: 0)",
            )
    diff = commands.add_parser(
        "diff",
        help="largest relative difference of two runs' train and validation losses",
        description="Compare two runs' per-step train losses and validation losses (e.g. LAMB "
        "at 1 and at 4 workers, whose update does not depend on the number of workers).",
    )
    diff.add_argument("run_a", type=Path)
    diff.add_argument("run_b", type=Path)
    diff.set_defaults(handler=_diff)


def _report_of(args: argparse.Namespace, study: Study) -> int:
    path = write_study_report(study, args.out, args.report_dir)
    print(path.read_text())
    return 0


def _run(args: argparse.Namespace) -> int:
    try:
        study = Study.read(args.spec)
        states = run_study(study, args.out, arms=args.arms, max_restarts=args.max_restarts)
    except (ValueError, FileNotFoundError) as exc:
        print(f"onebit study run: error: {exc}", file=sys.stderr)
        return 2
    _report_of(args, study)
    return 0 if all(state in (FINISHED, UNAVAILABLE) for state in states.values()) else 1


def _report(args: argparse.Namespace) -> int:
    try:
        return _report_of(args, Study.read(args.spec))
    except (ValueError, FileNotFoundError) as exc:
        print(f"onebit study report: error: {exc}", file=sys.stderr)
        return 2


def _finetune(args: argparse.Namespace) -> int:
    try:
        study = Study.read(args.spec)
        run_downstream(study, args.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"onebit study finetune: error: {exc}", file=sys.stderr)
        return 2
    return _report_of(args, study)


def _diff(args: argparse.Namespace) -> int:
    try:
        result = trajectory_difference(args.run_a, args.run_b)
    except (ValueError, FileNotFoundError) as exc:
        print(f"onebit study diff: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0
