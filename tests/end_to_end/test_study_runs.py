"""The convergence study's runner end to end on a tiny corpus with real worker processes:
arms run one after another, a finished arm is skipped, an interrupted arm continues from its
checkpoint, and arms this installation cannot run yet are reported as pending."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.jobs import write_corpus

from onebit.train import study as study_module
from onebit.train.launch import launch_job
from onebit.train.study import (
    FINISHED,
    NOT_STARTED,
    PARTIAL,
    UNAVAILABLE,
    Study,
    arm_state,
    run_downstream,
    run_study,
    trajectory_difference,
    write_study_report,
)


@pytest.fixture
def tiny_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Study:
    monkeypatch.setenv("ONEBIT_CACHE", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path / "corpus.txt")
    arm = dict(workers=2, runner="train")
    adam = {"name": "onebit-adam-n2", "optimizer": "onebit-adam", **arm, "train": {"lr": 0.01}}
    simulated = {
        "name": "future-sim",
        "optimizer": "onebit-lamb",
        "workers": 4,
        "runner": "simulate",
    }
    return Study.from_json(
        {
            "train": dict(
                steps=8, batch_size=8, seq_len=16, layers=1, hidden=32, heads=2, vocab_size=120,
                lr=0.05, freeze_step=4, eval_every=4, checkpoint_every=4, eval_seqs=0,
                corpus=[str(corpus)],
            ),
            "arms": [
                {"name": "lamb", "optimizer": "lamb", **arm},
                {"name": "onebit-lamb-n2", "optimizer": "onebit-lamb", **arm},
                adam,
                {"name": "future-n2", "optimizer": "no-such-optimizer", **arm},
                simulated,
            ],
            "downstream": {
                "finetune": {
                    "task": "replaced-letter", "epochs": 1, "max_train": 32, "max_test": 24,
                },
                "seeds": [0, 1],
                "lrs": [0.001, 0.003],
            },
        }
    )  # fmt: skip


@pytest.mark.slow
def test_study_runs_arms_resumes_and_skips(
    tiny_study: Study, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "study"
    # no `onebit simulate`
    monkeypatch.setattr(study_module.runner, "has_command", lambda name: False)
    lamb, onebit_lamb = tiny_study.arms[:2]
    # An interrupted arm: the last worker dies after step 6, the checkpoint of step 4 remains.
    status = launch_job(
        tiny_study.config(onebit_lamb), out / onebit_lamb.name, workers=2, max_restarts=0,
        kill_at_step=6,
    )  # fmt: skip
    assert status == 1 and arm_state(tiny_study, onebit_lamb, out) == PARTIAL
    assert arm_state(tiny_study, lamb, out) == NOT_STARTED

    states = run_study(tiny_study, out)
    assert states == {
        "lamb": FINISHED, "onebit-lamb-n2": FINISHED, "onebit-adam-n2": FINISHED,
        "future-n2": UNAVAILABLE, "future-sim": UNAVAILABLE,
    }  # fmt: skip
    for arm in tiny_study.arms[:3]:
        steps = [
            row["step"]
            for row in map(json.loads, (out / arm.name / "metrics.jsonl").read_text().splitlines())
            if row["kind"] == "train"
        ]
        assert steps == list(range(1, 9)), arm.name  # the resumed arm: no step twice
    # The 1-bit optimizers are LAMB / Adam exactly during the warm-up.
    diff = trajectory_difference(out / "lamb", out / "onebit-lamb-n2")
    assert diff["train_steps"] == 8 and diff["validation_steps"] == 2

    finished = (out / "lamb" / "summary.json").stat().st_mtime_ns

    def must_not_run(*args: object, **kwargs: object) -> int:
        raise AssertionError("a finished arm was run again")

    monkeypatch.setattr("onebit.train.launch.launch_job", must_not_run)
    assert run_study(tiny_study, out, arms=["lamb", "future-n2"]) == {
        "lamb": FINISHED, "future-n2": UNAVAILABLE,
    }  # fmt: skip
    assert (out / "lamb" / "summary.json").stat().st_mtime_ns == finished

    run_downstream(tiny_study, out)
    scratch = out / "lamb" / "finetune-scratch-replaced-letter-lr0.003-seed1.json"
    written = scratch.stat().st_mtime_ns
    run_downstream(tiny_study, out)  # nothing left to do
    assert scratch.stat().st_mtime_ns == written

    report_dir = tmp_path / "docs"
    text = write_study_report(tiny_study, out, report_dir).read_text()
    results = json.loads((report_dir / "results.json").read_text())
    entropy = results["unigram_entropy"]
    assert f"**{entropy:.4f} nats**" in text
    assert "## n = 2" in text and "## n = 4" in text
    assert "pending: `onebit simulate` is not available" in text
    assert "pending: optimizer 'no-such-optimizer'" in text
    lamb_loss = results["arms"][0]["validation_loss"]
    adam_loss = results["arms"][2]["validation_loss"]
    assert f"{100 * (adam_loss / lamb_loss - 1):+.2f}%" in text
    assert (report_dir / "study.png").stat().st_size > 0
    assert (report_dir / "onebit-adam-n2" / "metrics.jsonl").is_file()
    assert "onebit train --optimizer onebit-adam" in text and "--lr 0.01" in text
    downstream = results["downstream"]
    assert list(downstream) == ["no pre-training", "lamb", "onebit-lamb-n2", "onebit-adam-n2"]
    lamb, adam = downstream["lamb"], downstream["onebit-adam-n2"]
    assert len(lamb["accuracies"]) == 2 and lamb["test_examples"] == 24
    assert lamb["se_over_seeds"] == pytest.approx(
        abs(lamb["accuracies"][0] - lamb["accuracies"][1]) / 2
    )
    assert "## Downstream: replaced-letter" in text
    assert f"guessing scores {100 * lamb['chance_accuracy']:.2f}%" in text
    assert f"{100 * (adam['mean'] - lamb['mean']):+.2f} pt" in text
    assert (report_dir / "lamb" / "finetune-scratch-replaced-letter-lr0.003-seed1.json").is_file()
    by_lr = lamb["by_lr"]
    assert sorted(by_lr) == ["0.001", "0.003"] and len(by_lr["0.001"]["accuracies"]) == 2
    assert lamb["mean"] == max(r["mean"] for r in by_lr.values())
    assert by_lr[str(lamb["lr"])]["accuracies"] == lamb["accuracies"]
    assert "| lamb | " in text and "| lr 0.001 | lr 0.003 |" in text
