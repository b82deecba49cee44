"""Fixtures of the end-to-end tests that several modules use."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.jobs import FILLER, NEGATIVE, POSITIVE, write_corpus, write_sentiment_cache

from onebit.cli import main as onebit_main
from onebit.train import data


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A finished one-worker run, trained in this process as a torchrun worker would be."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(data.CACHE_ENV_VAR, str(cache))
    write_sentiment_cache(cache)
    corpus = write_corpus(tmp_path / "corpus.txt")
    with corpus.open("a") as f:  # the task's words, often enough to become whole tokens
        f.write("\n\n" + " ".join((POSITIVE + NEGATIVE + FILLER) * 20))
    for name, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT="0",  # one rank: the store binds any free port
    ).items():  # fmt: skip
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    status = onebit_main(
        [
            "train", "--no-launch", "--out", str(out), "--corpus", str(corpus),
            "--steps", "4", "--freeze-step", "2", "--batch-size", "8", "--seq-len", "16",
            "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab-size", "300",
        ]
    )  # fmt: skip
    assert status == 0
    return out
