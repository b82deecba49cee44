"""``onebit finetune`` run on a tiny run (the ``run_dir`` fixture, conftest.py) and a tiny
generated sentiment task (no network): its accuracy, the spelling tasks on the run's corpus."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from onebit.cli import main as onebit_main
from onebit.train.downstream_config import FinetuneConfig
from onebit.train.finetune import load_task


@pytest.mark.slow
def test_finetune_reports_accuracy(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["finetune", str(run_dir), "--epochs", "8", "--lr", "3e-3", "--max-test", "50"]
    assert onebit_main(args) == 0
    result = json.loads((run_dir / "finetune-lr0.003.json").read_text())  # not the default lr
    assert result["test_examples"] == 50 and result["train_examples"] == 240
    assert result["checkpoint_step"] == 4
    assert result["test_accuracy"] >= 0.8, result
    assert f"{100 * result['test_accuracy']:.2f}%" in capsys.readouterr().out

    assert onebit_main([*args, "--from-scratch", "--max-train", "20", "--epochs", "1"]) == 0
    scratch = json.loads((run_dir / "finetune-scratch-lr0.003.json").read_text())
    assert scratch["train_examples"] == 20 and scratch["config"]["from_scratch"]


@pytest.mark.slow
def test_finetune_spelling_task_on_the_runs_corpus(run_dir: Path) -> None:
    args = ["finetune", str(run_dir), "--task", "spelling", "--epochs", "1", "--seed", "2"]
    assert onebit_main([*args, "--max-train", "64", "--max-test", "40"]) == 0
    result = json.loads((run_dir / "finetune-spelling-seed2.json").read_text())
    assert result["task"] == "spelling" and result["config"]["seed"] == 2
    assert result["train_examples"] == 64 and result["test_examples"] == 40
    accuracy = result["test_accuracy"]
    assert result["test_accuracy_se"] == pytest.approx((accuracy * (1 - accuracy) / 40) ** 0.5)
    assert onebit_main([*args, "--max-train", "8", "--from-scratch"]) == 0
    scratch = json.loads((run_dir / "finetune-scratch-spelling-seed2.json").read_text())
    assert scratch["train_examples"] == 8 and scratch["test_examples"] > 40  # every window


@pytest.mark.slow
def test_finetune_replaced_letter_task(run_dir: Path) -> None:
    common = ["--task", "replaced-letter", "--epochs", "2", "--lr", "3e-3", "--max-test", "40"]
    assert onebit_main(["finetune", str(run_dir), *common, "--max-train", "64"]) == 0
    result = json.loads((run_dir / "finetune-replaced-letter-lr0.003.json").read_text())
    assert result["task"] == "replaced-letter"
    assert result["train_examples"] == 64 and result["test_examples"] == 40
    accuracy = result["test_accuracy"]
    assert result["test_accuracy_se"] == pytest.approx((accuracy * (1 - accuracy) / 40) ** 0.5)
    config = FinetuneConfig(task="replaced-letter", max_train=64, max_test=40)
    _, test_rows = load_task(run_dir, config, max_tokens=16)  # the run's --seq-len
    letters = [sum(char.isascii() and char.isalpha() for char in text) for text, _ in test_rows]
    assert result["chance_accuracy"] == pytest.approx(statistics.fmean(1 / n for n in letters))
    assert (
        onebit_main(["finetune", str(run_dir), *common, "--from-scratch", "--max-train", "8"]) == 0
    )
    scratch = json.loads((run_dir / "finetune-scratch-replaced-letter-lr0.003.json").read_text())
    assert scratch["config"]["from_scratch"] and scratch["train_examples"] == 8
