"""The tiny job the end-to-end tests run (a tiny BERT on a generated corpus: ``TINY``, the
options of ``onebit train``, ``STEPS`` steps of which ``FREEZE`` in the warm-up) and its
inputs: a corpus of made-up words, a cached sentiment task told by one word."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from onebit.train import checkpoint
from onebit.train.data import sentiment

STEPS = 12
FREEZE = 4
TINY = [
    "--workers", "2", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "16",
    "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab-size", "120",
    "--lr", "0.05", "--freeze-step", str(FREEZE), "--eval-every", "4",
    "--checkpoint-every", "4", "--eval-seqs", "0",
]  # fmt: skip


def write_corpus(path: Path, num_docs: int = 30, words_per_doc: int = 120, seed: int = 0) -> Path:
    """Documents of made-up words with a skewed frequency, separated by blank lines."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "tu", "ren", "sha", "vo", "qi", "zar", "pel"]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(80)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocab))]
    docs = [" ".join(rng.choices(vocab, weights=weights, k=words_per_doc)) for _ in range(num_docs)]
    path.write_text("\n\n".join(docs))
    return path


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    step, state = checkpoint.latest_model_state(run_dir / "checkpoints")
    assert step == STEPS
    return state["model"]


POSITIVE = ["good", "great", "lovely", "fine", "superb"]
NEGATIVE = ["bad", "awful", "dull", "poor", "boring"]
FILLER = ["the", "film", "was", "a", "story", "with", "actors", "and", "plot"]


def write_sentiment_cache(cache: Path, rows: int = 300) -> None:
    """A cached sentiment set whose label is told by one word in filler text."""
    rng = random.Random(0)
    records = []
    for _ in range(rows):
        label = rng.randint(0, 1)
        words = rng.choices(FILLER, k=6) + [rng.choice(POSITIVE if label else NEGATIVE)]
        rng.shuffle(words)
        records.append([" ".join(words), label])
    path = sentiment.sentiment_cache_file(cache)
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
