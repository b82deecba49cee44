"""``onebit probe``: the logistic fit against its optimality condition, the scoring and the
clustered standard errors against loops, the command's errors (on a tiny run:
end_to_end/test_probe_runs.py)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

from onebit.cli import main as onebit_main
from onebit.train.downstream_config import ProbeConfig
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


def test_probe_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert onebit_main(["probe", str(tmp_path)]) == 2
    assert "tokenizer.json is missing" in capsys.readouterr().err
    assert onebit_main(["probe", str(tmp_path), "--max-iter", "0"]) == 2
    assert "--max-iter must be a positive integer" in capsys.readouterr().err
    assert onebit_main(["probe", str(tmp_path), "--task", "sentiment", "--test-variants", "2"]) == 2
    assert "--test-variants applies to the spelling tasks" in capsys.readouterr().err
    assert ProbeConfig(task="sentiment").test_variants == 1
    assert ProbeConfig().test_variants == 8
