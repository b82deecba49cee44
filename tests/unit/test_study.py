"""The convergence study: its settings and the shipped study, the unigram baseline, the
difference of two runs' trajectories (its runner and report, end to end on a tiny corpus with
real worker processes: end_to_end/test_study_runs.py).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.paths import ROOT

from onebit.cli import build_parser, given_options, options_argv
from onebit.train import study as study_module
from onebit.train.config import TrainConfig
from onebit.train.data import MLMData, unigram_cross_entropy
from onebit.train.study import Study, trajectory_difference

SPECIAL = dict(pad_id=0, unk_id=1, cls_id=2, sep_id=3, mask_id=4)


def test_unigram_cross_entropy_counts_training_tokens() -> None:
    train = torch.tensor([[2, 5, 5, 6, 3], [2, 5, 7, 1, 3]])
    validation = torch.tensor([[2, 5, 6, 8, 3], [2, 7, 7, 0, 3]])
    data = MLMData(train=train, validation=validation, vocab_size=9, **SPECIAL)
    special = set(SPECIAL.values())
    counts = Counter(t for t in train.flatten().tolist() if t not in special)
    regular = [t for t in range(9) if t not in special]
    total = sum(counts.values()) + len(regular)
    tokens = [t for t in validation.flatten().tolist() if t not in special]
    expected = -sum(math.log((counts[t] + 1) / total) for t in tokens) / len(tokens)
    assert unigram_cross_entropy(data) == pytest.approx(expected, rel=1e-12)


def test_unigram_cross_entropy_needs_regular_validation_tokens() -> None:
    train = torch.tensor([[2, 5, 3]])
    data = MLMData(train=train, validation=torch.tensor([[2, 0, 3]]), vocab_size=9, **SPECIAL)
    with pytest.raises(ValueError, match="no regular"):
        unigram_cross_entropy(data)


def test_options_argv_gives_the_config_back() -> None:
    config = TrainConfig(
        optimizer="onebit-adam", steps=30, lr=0.002, betas=(0.8, 0.99), ddp=False,
        corpus=["/a.txt", "/b"], grad_clip=0.0,
    ).resolved()  # fmt: skip
    argv = options_argv(config)
    assert "--no-ddp" in argv and "--seq-len" not in argv  # defaults are left out
    args = build_parser().parse_args(["train", *argv])
    assert TrainConfig(**given_options(TrainConfig, args)).resolved() == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"extra": 1}, "unknown keys"),
        ({"train": {"optimizer": "lamb"}}, "must not name an optimizer"),
        ({"train": {"stepz": 3}}, "stepz"),
        ({"arms": [{"name": "a", "optimizer": "lamb", "workers": 1, "runner": "x"}]}, "runner"),
        ({"arms": [{"name": "a", "optimizer": "lamb", "workers": 0, "runner": "train"}]}, "worker"),
        (
            {"arms": [{"name": "a", "optimizer": "lamb", "workers": 1, "runner": "train",
                       "train": {"batch_size": 8}}]},
            "same in every arm",
        ),
        (
            {"arms": [{"name": "a", "optimizer": "lamb", "workers": 1, "runner": "train"}] * 2},
            "unique",
        ),
        ({"downstream": {"finetune": {"seed": 1}}}, r"must not set \['seed'\]"),
        ({"downstream": {"finetune": {"lr": 0.1}, "lrs": [0.1]}}, r"must not set \['lr'\]"),
        ({"downstream": {"finetune": {}, "lrs": [0.1, 0.1]}}, "lrs must be distinct"),
        ({"downstream": {"finetune": {}, "lrs": [-1.0]}}, "--lr"),
    ],
)  # fmt: skip
def test_study_rejects_bad_specs(change: dict, message: str) -> None:
    spec = {
        "train": {"steps": 4},
        "arms": [{"name": "a", "optimizer": "lamb", "workers": 1, "runner": "train"}],
    }
    with pytest.raises((ValueError, TypeError), match=message):
        Study.from_json({**spec, **change})


def test_shipped_study_is_valid() -> None:
    study = Study.read(ROOT / "docs" / "convergence" / "study.json")
    assert study.arms[0].name == "lamb"
    configs = [
        study.config(arm) for arm in study.arms if study_module.unavailable_reason(arm) is None
    ]
    assert study.train["batch_size"] >= 1024 and study.downstream is not None
    assert len({(c.batch_size, c.steps, c.seq_len, c.seed) for c in configs}) == 1


def test_trajectory_difference_of_different_runs(tmp_path: Path) -> None:
    for name, losses in (("a", [4.0, 3.0]), ("b", [4.0, 2.0])):
        rows = [{"kind": "train", "step": i + 1, "loss": x} for i, x in enumerate(losses)]
        rows.append({"kind": "validation", "step": 2, "loss": losses[-1]})
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    diff = trajectory_difference(tmp_path / "a", tmp_path / "b")
    assert diff["train_max_relative_difference"] == pytest.approx(0.5)
    assert diff["validation_max_relative_difference"] == pytest.approx(0.5)
