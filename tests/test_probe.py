"""``onebit probe``: the logistic fit against its optimality condition, the scoring and the
clustered standard errors against loops, and the command on a tiny run."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from test_finetune import run_dir  # noqa: F401  (the fixture)

from onebit.cli import main as onebit_main
from onebit.train.downstream_config import ProbeConfig
from onebit.train.finetune import task_rows
from onebit.train.probe import (
    Features,
    Probe,
    cluster_mean_and_se,
    correct_examples,
    fit_probe,
    paired_difference,
)


def synthetic(rows: int = 400, dims: int = 5, seed: int = 0) -> Features:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dims, generator=gen) * torch.arange(1, dims + 1) + 3.0
    logit = x[:, 0] - 0.5 * x[:, 1] + 0.2 * torch.randn(rows, generator=gen)
    y = (logit > logit.median()).long()
    return Features(x, y, torch.arange(rows), rows, per_token=False)


@pytest.mark.parametrize("l2", [1e-3, 0.1])
def test_fit_probe_reaches_the_minimum_of_its_objective(l2: float) -> None:
    """At the minimiser of mean BCE + (λ/2)|w|² over standardised features, the gradient is 0;
    computed here in float64 from the formula, independently of the solver."""
    features = synthetic()
    probe = fit_probe(features, l2, max_iter=200)
    x = features.x.double()
    z = (x - x.mean(0)) / x.std(0)
    p = torch.sigmoid(z @ probe.w + probe.b)
    residual = p - features.y.double()
    grad_w = z.T @ residual / len(residual) + l2 * probe.w
    grad_b = residual.mean()
    assert float(grad_w.abs().max()) < 1e-7 and abs(float(grad_b)) < 1e-7
    assert torch.equal(fit_probe(features, l2, max_iter=200).w, probe.w)  # deterministic
    weaker = fit_probe(features, 10 * l2, max_iter=200)
    assert float(weaker.w.norm()) < float(probe.w.norm())  # the penalty shrinks the weights


def test_fit_probe_rejects_labels_other_than_0_and_1() -> None:
    features = synthetic()
    features.y[0] = 2
    with pytest.raises(ValueError, match="binary labels"):
        fit_probe(features, 1e-3, max_iter=5)


def test_correct_examples_against_a_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    texts, tokens_per_text = 30, [int(n) for n in torch.randint(1, 9, (30,), generator=gen)]
    example = torch.cat([torch.full((n,), i) for i, n in enumerate(tokens_per_text)])
    y = torch.zeros(len(example), dtype=torch.long)
    starts = [0, *torch.tensor(tokens_per_text).cumsum(0).tolist()[:-1]]
    replaced = [start + int(torch.randint(n, (1,), generator=gen)) for start, n in zip(
        starts, tokens_per_text, strict=True
    )]  # fmt: skip
    y[replaced] = 1
    x = torch.randn(len(example), 3, generator=gen, dtype=torch.float64)
    probe = Probe(torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64),
                  torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64),
                  torch.tensor(0.3, dtype=torch.float64))  # fmt: skip
    scores = x @ probe.w + probe.b
    expected = [
        int(torch.argmax(scores[start : start + n])) == replaced[i] - start
        for i, (start, n) in enumerate(zip(starts, tokens_per_text, strict=True))
    ]
    per_token = correct_examples(probe, Features(x, y, example, texts, per_token=True))
    assert per_token.tolist() == expected and 0 < sum(expected) < texts

    labels = torch.randint(2, (texts,), generator=gen)
    per_text = Features(x[:texts], labels, torch.arange(texts), texts, per_token=False)
    assert correct_examples(probe, per_text).tolist() == [
        (float(s) > 0) == bool(label) for s, label in zip(scores[:texts], labels, strict=True)
    ]


def test_cluster_mean_and_se_against_the_formula() -> None:
    values = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1], dtype=torch.float64)
    clusters = 4  # three variants, variant-major: value k*4 + j belongs to window j
    means = [statistics.fmean(values[j::clusters].tolist()) for j in range(clusters)]
    mean, se = cluster_mean_and_se(values, clusters)
    assert mean == pytest.approx(statistics.fmean(values.tolist()))
    assert se == pytest.approx(statistics.stdev(means) / math.sqrt(clusters))


def test_paired_difference_needs_the_same_test_examples() -> None:
    a = {"run_dir": "a", "test_fingerprint": "x", "correct": "1101", "test_windows": 2}
    b = {"run_dir": "b", "test_fingerprint": "x", "correct": "0111", "test_windows": 2}
    difference, se = paired_difference(a, b)  # windows: (1-0 + 0-1)/2 = 0, (1-1 + 1-1)/2 = 0
    assert difference == 0 and se == 0
    assert paired_difference(a, {**b, "correct": "0100"})[0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="different test examples"):
        paired_difference(a, {**b, "test_fingerprint": "y"})


def test_probe_command_on_a_tiny_run(
    run_dir: Path,  # noqa: F811
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


def test_probe_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert onebit_main(["probe", str(tmp_path)]) == 2
    assert "tokenizer.json is missing" in capsys.readouterr().err
    assert onebit_main(["probe", str(tmp_path), "--max-iter", "0"]) == 2
    assert "--max-iter must be a positive integer" in capsys.readouterr().err
    assert onebit_main(["probe", str(tmp_path), "--task", "sentiment", "--test-variants", "2"]) == 2
    assert "--test-variants applies to the spelling tasks" in capsys.readouterr().err
    assert ProbeConfig(task="sentiment").test_variants == 1
    assert ProbeConfig().test_variants == 8
