"""Running a study: each arm's state and command, the arms one after another (finished ones
skipped, interrupted ones continued), and the downstream check's fine-tuning runs."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

from onebit.cli import options_argv
from onebit.train.config import OPTIMIZERS
from onebit.train.report import read_metrics
from onebit.train.run_dir import METRICS_FILE, SUMMARY_FILE
from onebit.train.study.schema import (
    FINISHED,
    NO_PRETRAINING,
    NOT_STARTED,
    PARTIAL,
    REFERENCE_ARM,
    UNAVAILABLE,
    Arm,
    Study,
)
from onebit.train.torchft_diloco import torchft_missing

logger = logging.getLogger(__name__)


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
    if arm.train.get("outer_implementation") == "torchft":
        return torchft_missing()
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
