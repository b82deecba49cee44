"""The sentiment task of ``onebit finetune``: movie-review snippets, positive vs negative.

The snippets, with human ratings in ``[-4, 4]``, ship inside the ``vaderSentiment==3.3.2``
sdist (``hutto_ICWSM_2014.tar.gz``); they are fetched and parsed once and cached.
"""

from __future__ import annotations

import io
import os
import random
import tarfile
from pathlib import Path

from onebit.cache import CACHE_ENV_VAR
from onebit.train.data.fetch import (
    CACHE_FORMAT_VERSION,
    cached_records,
    decode_text,
    find_member,
    resolve_cache_dir,
)

SENTIMENT_INNER_ARCHIVE = "hutto_ICWSM_2014.tar.gz"
SENTIMENT_MEMBER = "movieReviewSnippets_GroundTruth.txt"

_SENTIMENT_OFFLINE_HINT = (
    "Connect to the internet once (the parsed data is cached afterwards) or set "
    f"${CACHE_ENV_VAR} to a directory holding a filled cache."
)


def parse_sentiment_snippets(text: str) -> list[tuple[str, int]]:
    """Parse ``id<TAB>mean rating<TAB>sentence`` rows into ``(sentence, label)`` pairs.

    ``label`` is 1 for a positive mean rating and 0 for a negative one; neutral rows (rating 0)
    are dropped. Doubled apostrophes used as quotes (``''like this''``) become ``"``.
    """
    rows: list[tuple[str, int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"Sentiment line {number}: expected 3 tab-separated fields: {line!r}")
        try:
            rating = float(fields[1])
        except ValueError as exc:
            raise ValueError(f"Sentiment line {number}: bad rating {fields[1]!r}") from exc
        if not -4.0 <= rating <= 4.0:
            raise ValueError(f"Sentiment line {number}: rating {rating} outside [-4, 4]")
        sentence = " ".join(fields[2].replace("''", '"').split())
        if rating != 0.0 and sentence:
            rows.append((sentence, int(rating > 0)))
    return rows


def extract_sentiment_rows(sdist: Path) -> list[tuple[str, int]]:
    """Read the movie-review snippets out of the vaderSentiment sdist."""
    with tarfile.open(sdist, "r:*") as outer:
        inner_name = find_member(outer.getnames(), SENTIMENT_INNER_ARCHIVE, sdist)
        inner_handle = outer.extractfile(inner_name)
        if inner_handle is None:
            raise RuntimeError(f"Cannot read {inner_name} from {sdist}")
        with tarfile.open(fileobj=io.BytesIO(inner_handle.read()), mode="r:*") as inner:
            name = find_member(inner.getnames(), SENTIMENT_MEMBER, sdist / inner_name)
            handle = inner.extractfile(name)
            if handle is None:
                raise RuntimeError(f"Cannot read {name} from {inner_name}")
            return parse_sentiment_snippets(decode_text(handle.read()))


def sentiment_cache_file(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the parsed rows are cached: ``<cache>/sentiment/movie_reviews-v<N>.jsonl``."""
    name = f"movie_reviews-v{CACHE_FORMAT_VERSION}.jsonl"
    return resolve_cache_dir(cache_dir) / "sentiment" / name


def load_sentiment(
    cache_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Return ``(train, test)`` lists of ``(sentence, label)`` from the movie-review snippets.

    The rows are cached at :func:`sentiment_cache_file`; the split is a seeded shuffle with
    ``round(test_fraction * n)`` test rows (at least one).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    records = cached_records(
        "sentiment",
        sentiment_cache_file(cache_dir),
        extract_sentiment_rows,
        _SENTIMENT_OFFLINE_HINT,
    )
    rows = [(str(sentence), int(label)) for sentence, label in records]
    if len(rows) < 2:
        raise ValueError(f"Need at least 2 sentiment rows for a split, got {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_test = min(len(rows) - 1, max(1, round(test_fraction * len(rows))))
    test = [rows[i] for i in order[:n_test]]
    train = [rows[i] for i in order[n_test:]]
    return train, test
