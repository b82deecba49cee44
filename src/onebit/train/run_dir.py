"""The run folder of a training job.

A run folder holds ``config.json`` (the job's :class:`~onebit.train.config.TrainConfig`, how
it was launched and the versions of the packages that decide its numbers), ``metrics.jsonl``,
``checkpoints/``, ``tokenizer.json`` and, when finished, ``summary.json`` and ``loss.png``.
Starting a job in a folder that already holds the same configuration continues it from its
latest checkpoint (that is how restarts under ``torchrun --max-restarts`` resume); a
different configuration there is an error.
"""

from __future__ import annotations

import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from onebit.atomic import write_json_atomic
from onebit.train.config import TrainConfig

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TOKENIZER_FILE = "tokenizer.json"
LOSS_PLOT_FILE = "loss.png"
CHECKPOINT_DIR = "checkpoints"


#: The packages whose versions decide a run's numbers (its data, initial weights and maths).
VERSIONED_PACKAGES = ("torch", "numpy", "numba", "transformers", "tokenizers", "mwparserfromhell")


def environment() -> dict[str, str]:
    """The versions of Python and of :data:`VERSIONED_PACKAGES` (those installed)."""
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def default_run_dir(optimizer: str, root: str | os.PathLike[str] = "runs") -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<optimizer>``."""
    return Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{optimizer}"


def _read_run_file(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder: {CONFIG_FILE} is missing")
    return json.loads(path.read_text(encoding="utf-8"))


#: What named 1-bit Adam's exchange before 1-bit LAMB had a choice too (runs whose 1-bit LAMB
#: always compressed fused).
_LEGACY_COMPRESSION = "onebit_adam_compression"


def read_config(run_dir: Path) -> TrainConfig:
    """The configuration saved in ``run_dir``; a clear error if there is none. A run saved
    before ``momentum_bound`` existed exchanged the momentum unbounded, and continues so; a
    DiLoCo run saved before ``worker_residual`` existed, or while ``"carried"`` was its
    default (then recorded by every run, DiLoCo's or not), continues with it."""
    train = dict(_read_run_file(run_dir)["train"])
    if _LEGACY_COMPRESSION in train:
        legacy = train.pop(_LEGACY_COMPRESSION)
        train["compression"] = "fused" if train.get("optimizer") == "onebit-lamb" else legacy
    train.setdefault("momentum_bound", False)
    if train.get("sync_every") is None:
        train["worker_residual"] = None
    else:
        train.setdefault("worker_residual", "carried")
    return TrainConfig.from_json(train)


def read_launch(run_dir: Path) -> dict[str, Any]:
    """How the run in ``run_dir`` was first launched (``{"world_size": n}``)."""
    return dict(_read_run_file(run_dir)["launch"])


def _check_same_kind_of_run(run_dir: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """A simulation (``onebit simulate``) continues only as a simulation of as many workers,
    a run of worker processes only as one (each keeps its workers' error buffers its way)."""
    simulated = saved.get("simulated", False)
    if simulated == now.get("simulated", False) and (
        not simulated or saved["world_size"] == now["world_size"]
    ):
        return
    kind = (
        f"a simulation of {saved['world_size']} workers (onebit simulate)"
        if simulated
        else "a run of worker processes (onebit train)"
    )
    command = "onebit simulate" if simulated else "onebit train"
    raise ValueError(f"{run_dir} holds {kind}; continue it with `{command} --resume {run_dir}`")


def prepare_run_dir(run_dir: Path, config: TrainConfig, launch: dict[str, Any]) -> bool:
    """Create ``run_dir`` with ``config.json``; return True if it continues an earlier run.

    Safe to call from every rank at once. Raises ``ValueError`` if the folder holds a run with
    another configuration, of another kind (``launch["simulated"]``), or other files.
    """
    path = run_dir / CONFIG_FILE
    if path.is_file():
        saved = read_config(run_dir)
        if saved != config:
            changed = {
                k: (v, getattr(config, k))
                for k, v in vars(saved).items()
                if getattr(config, k) != v
            }
            raise ValueError(
                f"{run_dir} holds a run with another configuration (saved vs now: {changed}); "
                "choose a new --out, or continue it with --resume RUN_DIR"
            )
        _check_same_kind_of_run(run_dir, read_launch(run_dir), launch)
        return True
    if run_dir.exists() and any(p for p in run_dir.iterdir() if not p.name.startswith(".")):
        raise ValueError(f"--out {run_dir} exists and is not a run folder; choose a new --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        path, {"train": config.to_json(), "launch": launch, "environment": environment()}
    )
    return False
