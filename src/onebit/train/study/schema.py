"""A study's file: the shared settings of the job, its arms and its downstream check, read and
checked; the names of an arm's states and of the files its run folder and the report hold."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onebit.train.config import TrainConfig
from onebit.train.downstream_config import FinetuneConfig
from onebit.train.run_dir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE

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
