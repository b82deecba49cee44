"""The configuration of one training job, its validation, and the run folder it lives in.

A run folder holds ``config.json`` (this configuration), ``metrics.jsonl``, ``checkpoints/``,
``tokenizer.json`` and, when finished, ``summary.json`` and ``loss.png``. Starting a job in a
folder that already holds the same configuration continues it from its latest checkpoint
(that is how restarts under ``torchrun --max-restarts`` resume); a different configuration
there is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onebit.train.atomic import write_json_atomic

OPTIMIZERS = ("onebit-lamb", "lamb", "onebit-adam", "adam")
ONEBIT_OPTIMIZERS = ("onebit-lamb", "onebit-adam")
LAMB_OPTIMIZERS = ("onebit-lamb", "lamb")
BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TOKENIZER_FILE = "tokenizer.json"
LOSS_PLOT_FILE = "loss.png"
CHECKPOINT_DIR = "checkpoints"
FINETUNE_FILE = "finetune.json"

#: Peak learning rate when ``lr`` is not given: LAMB's was tuned on a short run of the
#: convergence setup (docs/CONVERGENCE.md); Adam's is the usual one for small BERTs (untuned).
DEFAULT_LAMB_LR = 0.016
DEFAULT_ADAM_LR = 0.001
#: Fraction of the steps spent in the warm-up stage when ``freeze_step`` is not given.
DEFAULT_FREEZE_FRACTION = 0.2
#: Fraction of the steps with a linearly rising learning rate when ``lr_warmup_steps`` is not given.
DEFAULT_LR_WARMUP_FRACTION = 0.1
#: Number of validation points and checkpoints of a run when their interval is not given.
DEFAULT_EVALS = 10
DEFAULT_CHECKPOINTS = 4


@dataclass
class TrainConfig:
    """Everything that determines a training run's trajectory (and so must match on resume).

    ``lr`` (per optimizer family), ``freeze_step``, ``lr_warmup_steps``, ``eval_every`` and
    ``checkpoint_every`` (from ``steps``) may be left ``None``; :meth:`resolved` fills them in.
    """

    optimizer: str = "onebit-lamb"
    steps: int = 400
    batch_size: int = 128
    lr: float | None = None
    freeze_step: int | None = None
    lr_warmup_steps: int | None = None
    seq_len: int = 64
    layers: int = 2
    hidden: int = 128
    heads: int = 2
    vocab_size: int = 4096
    dropout: float = 0.0
    seed: int = 0
    corpus: list[str] | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_coeff: float = 0.3
    min_coeff: float = 0.01
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1
    grad_clip: float = 1.0
    ddp: bool = True
    backend: str = "gloo"
    device: str = "cpu"
    eval_every: int | None = None
    eval_seqs: int = 512
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    timeout: float = 600.0

    def resolved(self) -> TrainConfig:
        """A validated copy with every ``None`` filled in."""
        config = dataclasses.replace(self, betas=tuple(self.betas))
        config.validate_basic()
        if config.lr is None:
            config.lr = DEFAULT_LAMB_LR if config.optimizer in LAMB_OPTIMIZERS else DEFAULT_ADAM_LR
        if config.freeze_step is None:
            config.freeze_step = max(1, round(DEFAULT_FREEZE_FRACTION * config.steps))
        if config.lr_warmup_steps is None:
            config.lr_warmup_steps = round(DEFAULT_LR_WARMUP_FRACTION * config.steps)
        if config.eval_every is None:
            config.eval_every = max(1, config.steps // DEFAULT_EVALS)
        if config.checkpoint_every is None:
            config.checkpoint_every = max(1, config.steps // DEFAULT_CHECKPOINTS)
        config.validate_intervals()
        return config

    def validate_basic(self) -> None:
        """Raise ``ValueError`` naming the first option that is out of range."""
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("backend", self.backend, BACKENDS)
        _choice("device", self.device, DEVICES)
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("--backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
        for name in ("steps", "batch_size", "layers", "hidden", "heads", "keep_checkpoints"):
            _positive_int(name, getattr(self, name))
        if self.eval_seqs < 0:
            raise ValueError(f"--eval-seqs must be >= 0 (0: all), got {self.eval_seqs}")
        if self.seq_len < 8:
            raise ValueError(f"--seq-len must be at least 8, got {self.seq_len}")
        if self.vocab_size < 64:
            raise ValueError(f"--vocab-size must be at least 64, got {self.vocab_size}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        for name in ("eps", "timeout", "factor_min", "max_coeff", "min_coeff"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip", "factor_threshold"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"--betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not 0.0 <= self.coeff_beta < 1.0:
            raise ValueError(f"--coeff-beta must be in [0, 1), got {self.coeff_beta}")
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"--min-coeff {self.min_coeff} exceeds --max-coeff {self.max_coeff}")
        if self.factor_min > self.factor_max:
            raise ValueError(
                f"--factor-min {self.factor_min} exceeds --factor-max {self.factor_max}"
            )

    def validate_intervals(self) -> None:
        """Check the step-count options against ``steps``."""
        if self.optimizer in ONEBIT_OPTIMIZERS and not 1 <= self.freeze_step <= self.steps:
            raise ValueError(
                f"--freeze-step must be in [1, --steps={self.steps}], got {self.freeze_step}"
            )
        if not 0 <= self.lr_warmup_steps < self.steps:
            raise ValueError(
                f"--lr-warmup-steps must be in [0, --steps={self.steps}), got "
                f"{self.lr_warmup_steps}"
            )
        _positive_int("eval_every", self.eval_every)
        _positive_int("checkpoint_every", self.checkpoint_every)

    @property
    def uses_onebit(self) -> bool:
        return self.optimizer in ONEBIT_OPTIMIZERS

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training options in the config: {unknown}")
        return cls(**data).resolved()


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"--{_flag(name)} must be one of {list(choices)}, got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{_flag(name)} must be a positive integer, got {value!r}")


def default_run_dir(optimizer: str, root: str | os.PathLike[str] = "runs") -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<optimizer>``."""
    return Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{optimizer}"


def _read_run_file(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder: {CONFIG_FILE} is missing")
    return json.loads(path.read_text(encoding="utf-8"))


def read_config(run_dir: Path) -> TrainConfig:
    """The configuration saved in ``run_dir``; a clear error if there is none."""
    return TrainConfig.from_json(_read_run_file(run_dir)["train"])


def read_launch(run_dir: Path) -> dict[str, Any]:
    """How the run in ``run_dir`` was first launched (``{"world_size": n}``)."""
    return dict(_read_run_file(run_dir)["launch"])


def prepare_run_dir(run_dir: Path, config: TrainConfig, launch: dict[str, Any]) -> bool:
    """Create ``run_dir`` with ``config.json``; return True if it continues an earlier run.

    Safe to call from every rank at once. Raises ``ValueError`` if the folder holds a run with
    another configuration, or other files.
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
        return True
    if run_dir.exists() and any(p for p in run_dir.iterdir() if not p.name.startswith(".")):
        raise ValueError(f"--out {run_dir} exists and is not a run folder; choose a new --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"train": config.to_json(), "launch": launch})
    return False
