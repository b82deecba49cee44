"""Linear probes of a pre-trained run's frozen encoder: the downstream check without the
seed-to-seed spread of fine-tuning.

The masked-language model of the run's newest checkpoint (or, for the no-pre-training
baseline, a random initialisation of its architecture) is frozen. At every token of a text,
unmasked, its features are the encoder's final hidden state and the log-probability the MLM
head gives the token that is there (pre-training replaced 10% of the tokens it scored with
random ones, so that head has learnt to doubt tokens out of place). They feed a binary
logistic regression, per token for ``replaced-letter`` and per text (the mean over its tokens)
for ``sentiment`` and ``spelling``, on the tasks and splits of :mod:`onebit.train.finetune`.
The fit,

    minimise  mean_i BCE(x̃_i·w + b, y_i) + (λ/2)·|w|²,   x̃ = (x - μ) / σ (training statistics),

runs L-BFGS from zero in float64: the same features give the same probe, so two models are
compared without fine-tuning's seed noise, on the same test examples, and the standard error
of their difference is that of the test sample alone. For the spelling tasks every test
window is scored in several versions, each with its own replaced letter; standard errors
treat a window's versions as one cluster (the mean over its versions, then the spread over
windows). Scoring follows the rule of :func:`onebit.train.finetune.correct_predictions`: a
text is right when its score's sign is its label; a ``replaced-letter`` window when its
highest-scoring token is the replaced one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from onebit.atomic import write_json_atomic
from onebit.train import data
from onebit.train.downstream_config import TOKEN_TASKS, ProbeConfig
from onebit.train.finetune import (
    EVAL_BATCH,
    REPLACED,
    Sentences,
    chance_accuracy,
    encode,
    load_run,
    task_rows,
)

logger = logging.getLogger(__name__)

#: Result file of the no-pre-training baseline, in the folder of the run whose architecture
#: it takes: ``probe-scratch-<task>[-seed<seed>].json``.
BASELINE_PREFIX = "probe-scratch"

Rows = list[tuple[str, int]]
#: Rows of features scored at once (their float64 copies stay small).
SCORE_ROWS = 1 << 18


@dataclass
class Features:
    """Final hidden states ``x`` (one row per labelled token, or per text), their binary labels
    ``y``, the index of the text each row belongs to (``example``), and the number of texts."""

    x: torch.Tensor
    y: torch.Tensor
    example: torch.Tensor
    examples: int
    per_token: bool


@dataclass
class Probe:
    """A fitted probe: ``score(x) = ((x - mean) / std)·w + b``."""

    mean: torch.Tensor
    std: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """The scores of the rows of ``x``, in float64, a block of rows at a time."""
        return torch.cat(
            [
                ((rows.double() - self.mean) / self.std) @ self.w + self.b
                for rows in x.split(SCORE_ROWS)
            ]
        )


@torch.no_grad()
def mlm_features(model: torch.nn.Module, sentences: Sentences) -> Features:
    """The frozen MLM ``model``'s features of ``sentences`` (the final hidden state and the
    log-probability of the token there, side by side): at every labelled token (per-token
    labels) or averaged over each text's tokens."""
    model.eval()
    xs, ys, examples = [], [], []
    for rows in torch.arange(len(sentences.ids)).split(EVAL_BATCH):
        ids, mask, labels = sentences.batch(rows)
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        observed = model.cls(hidden).log_softmax(-1).gather(-1, ids.unsqueeze(-1))
        features = torch.cat([hidden, observed], -1)
        if labels.dim() == 2:
            keep = labels != data.IGNORE_INDEX
            xs.append(features[keep])
            ys.append(labels[keep])
            examples.append(rows.unsqueeze(1).expand_as(labels)[keep])
        else:
            weights = mask.unsqueeze(-1).to(features.dtype)
            xs.append((features * weights).sum(1) / weights.sum(1))
            ys.append(labels)
            examples.append(rows)
    return Features(
        torch.cat(xs),
        torch.cat(ys),
        torch.cat(examples),
        len(sentences.ids),
        per_token=sentences.labels.dim() == 2,
    )


def fit_probe(features: Features, l2: float, max_iter: int) -> Probe:
    """Binary logistic regression of ``features.y`` (0 or 1) on the standardised features:
    L-BFGS (strong Wolfe line search) from zero in float64, at most ``max_iter`` iterations."""
    if not set(features.y.unique().tolist()) <= {0, 1}:
        raise ValueError("a probe fits binary labels (0 or 1)")
    x = features.x.double()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-12)
    x = (x - mean) / std
    y = features.y.double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    solver = torch.optim.LBFGS(
        [w, b],
        max_iter=max_iter,
        history_size=20,
        tolerance_grad=1e-10,
        tolerance_change=1e-14,
        line_search_fn="strong_wolfe",
    )

    def objective() -> torch.Tensor:
        solver.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w + b, y) + 0.5 * l2 * (w @ w)
        loss.backward()
        return loss

    solver.step(objective)
    return Probe(mean, std, w.detach(), b.detach())


def correct_examples(probe: Probe, features: Features) -> torch.Tensor:
    """Per text, whether the probe gets it right: the sign of its score is its label, or (per
    token) its highest-scoring token is the replaced one."""
    scores = probe.scores(features.x)
    if not features.per_token:
        return (scores > 0) == (features.y == REPLACED)
    best = torch.full((features.examples,), -math.inf, dtype=scores.dtype)
    best.scatter_reduce_(0, features.example, scores, "amax")
    replaced = features.y == REPLACED
    correct = torch.zeros(features.examples, dtype=torch.bool)
    correct[features.example[replaced]] = scores[replaced] >= best[features.example[replaced]]
    return correct


def cluster_mean_and_se(values: torch.Tensor, clusters: int) -> tuple[float, float]:
    """Mean of ``values`` (variant-major: value ``k·clusters + j`` belongs to cluster j) and
    its standard error over clusters: ``stdev(cluster means) / sqrt(clusters)``."""
    per_cluster = values.double().reshape(-1, clusters).mean(0).tolist()
    return statistics.fmean(per_cluster), statistics.stdev(per_cluster) / math.sqrt(clusters)


def fingerprint(variants: list[Rows]) -> str:
    """A digest of the test examples, so that only results on the same ones are compared."""
    digest = hashlib.sha256()
    for rows in variants:
        for text, label in rows:
            digest.update(f"{label}\t{text}\n".encode())
    return digest.hexdigest()[:16]


def probe(
    run_dir: Path, config: ProbeConfig, *, pretrained: bool = True, reuse: bool = True
) -> dict[str, Any]:
    """Probe the newest checkpoint of ``run_dir`` (``pretrained=False``: a random
    initialisation of its architecture, seeded by ``config.seed``); write the result to
    ``RUN_DIR/<config.result_file>`` (``probe-scratch-…`` for the baseline) and return it.
    With ``reuse``, a result already there with the same settings and checkpoint is returned
    as it is (the probe is deterministic)."""
    from onebit.train.model import build_mlm_model, config_from_dict

    started = time.perf_counter()
    step, state, tokenizer = load_run(run_dir)
    name = config.result_file
    if not pretrained:
        name = name.replace("probe", BASELINE_PREFIX, 1)
    path = run_dir / name
    if reuse and path.is_file():
        result = json.loads(path.read_text())
        if result.get("config") == asdict(config) and result.get("checkpoint_step") == (
            step if pretrained else None
        ):
            logger.info("%s: reusing %s", run_dir, path)
            return {**result, "run_dir": str(run_dir), "path": str(path)}
    bert = config_from_dict(state["bert_config"])
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(config.seed)
    per_token = config.task in TOKEN_TASKS
    model = build_mlm_model(bert)
    if pretrained:
        model.load_state_dict(state["model"])
    max_len = bert.max_position_embeddings
    train_rows, variants = task_rows(
        run_dir, config.task, config.seed, config.max_train, max_len,
        test_variants=config.test_variants,
    )  # fmt: skip
    train = mlm_features(model, encode(tokenizer, train_rows, max_len, per_token=per_token))
    fitted = fit_probe(train, config.l2, config.max_iter)
    test_rows = [row for rows in variants for row in rows]
    test = mlm_features(model, encode(tokenizer, test_rows, max_len, per_token=per_token))
    correct = correct_examples(fitted, test)
    windows = len(variants[0])
    accuracy, se = cluster_mean_and_se(correct, windows)
    result = {
        "run_dir": str(run_dir),
        "task": config.task,
        "pretrained": pretrained,
        "checkpoint_step": step if pretrained else None,
        "test_accuracy": accuracy,
        "test_accuracy_se": se,
        "chance_accuracy": chance_accuracy(config.task, test_rows),
        "train_accuracy": float(correct_examples(fitted, train).double().mean()),
        "train_examples": len(train_rows),
        "test_windows": windows,
        "test_variants": len(variants),
        "test_fingerprint": fingerprint(variants),
        "correct": "".join("1" if c else "0" for c in correct.tolist()),
        "seconds": time.perf_counter() - started,
        "config": asdict(config),
    }
    write_json_atomic(path, result)
    result["path"] = str(path)
    logger.info("%s probe accuracy %.4f, written to %s", config.task, accuracy, path)
    return result


def paired_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """``(accuracy of a - accuracy of b, its standard error)`` over the same test examples:
    the mean of the per-window differences and their spread over windows."""
    if a["test_fingerprint"] != b["test_fingerprint"]:
        raise ValueError(
            f"the probes of {a['run_dir']} and {b['run_dir']} were scored on different test "
            "examples (another task, seed, variant count or corpus)"
        )
    difference = torch.tensor(
        [int(x) - int(y) for x, y in zip(a["correct"], b["correct"], strict=True)]
    )
    return cluster_mean_and_se(difference, a["test_windows"])
