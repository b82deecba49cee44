"""``onebit probe`` on a tiny run (the ``run_dir`` fixture): the command end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onebit.cli import main as onebit_main
from onebit.train.finetune import task_rows


@pytest.mark.slow  # a tiny training run to probe first
def test_probe_command_on_a_tiny_run(
    run_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["probe", str(run_dir), str(run_dir), "--max-train", "64", "--test-variants", "3"]
    assert onebit_main([*args, "--baseline", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    result = json.loads((run_dir / "probe-replaced-letter-seed1.json").read_text())
    baseline = json.loads((run_dir / "probe-scratch-replaced-letter-seed1.json").read_text())
    assert result["pretrained"] and not baseline["pretrained"]
    assert result["checkpoint_step"] == 4 and result["train_examples"] == 64
    assert result["test_variants"] == 3
    assert len(result["correct"]) == 3 * result["test_windows"]
    assert result["test_fingerprint"] == baseline["test_fingerprint"]
    assert result["correct"] != baseline["correct"]
    assert "+0.00 pt (0.00)" in out  # the run against itself: the probe is deterministic
    assert f"{100 * result['test_accuracy']:.2f}%" in out and "no pre-training" in out

    # a result with the same settings and checkpoint is reused; --recompute probes again
    path = run_dir / "probe-replaced-letter-seed1.json"
    path.write_text(json.dumps({**result, "test_accuracy": 0.123456}))
    assert onebit_main(args + ["--seed", "1"]) == 0
    assert "12.35%" in capsys.readouterr().out
    assert onebit_main(args + ["--seed", "1", "--max-iter", "150"]) == 0  # other settings
    assert "12.35%" not in capsys.readouterr().out
    path.write_text(json.dumps({**result, "test_accuracy": 0.123456}))
    assert onebit_main(args + ["--seed", "1", "--recompute"]) == 0
    assert "12.35%" not in capsys.readouterr().out
    assert json.loads(path.read_text())["correct"] == result["correct"]

    # a per-text task: the mean of each window's features
    spelling = ["probe", str(run_dir), "--task", "spelling", "--max-train", "64"]
    assert onebit_main([*spelling, "--test-variants", "2"]) == 0
    per_text = json.loads((run_dir / "probe-spelling.json").read_text())
    assert (
        per_text["test_variants"] == 2 and len(per_text["correct"]) == 2 * per_text["test_windows"]
    )
    assert 0.3 < per_text["test_accuracy"] < 1 and per_text["chance_accuracy"] == pytest.approx(
        0.5, abs=0.1
    )

    train_rows, variants = task_rows(
        run_dir, "replaced-letter", seed=1, max_train=64, max_tokens=16, test_variants=3
    )
    assert len(train_rows) == 64 and len(variants) == 3
    windows = [[text for text, _ in rows] for rows in variants]
    # the same windows, each with its own replaced letter: at most two characters differ
    for first, other in zip(windows[0], windows[1], strict=True):
        assert sum(a != b for a, b in zip(first, other, strict=True)) <= 2
    assert windows[0] != windows[1]
