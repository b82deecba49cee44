"""The spelling task of ``onebit finetune --task spelling``: has one letter of this text been
replaced?

Built from the pre-training corpus itself, so that what pre-training learns (which letters
follow which, which words exist) is what the task asks: windows of whole words cut from the
documents, and in half of them, chosen at random, one letter replaced by another letter. Test
windows come from the documents held out of pre-training (the validation documents of
:func:`~onebit.train.data.split_documents`), training windows from the others. A model that
knows only letter frequencies cannot tell a window from its misspelt copy; one that knows
spelling can.

The same windows serve a per-token version of the task (ELECTRA's replaced-token detection):
every window has one letter replaced, and the task is to say which;
:func:`build_spelling_task` with ``rows=replaced_letter_windows`` gives each window with the
position of its replaced letter.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence

#: Label of a window with a replaced letter (0: the text as written).
MISSPELT = 1


def text_windows(documents: Sequence[str], max_chars: int) -> list[str]:
    """Consecutive runs of whole words, each as long as fits in ``max_chars`` characters
    (words joined by one space); a word longer than ``max_chars`` is skipped, and a
    document's last run is kept only if it fills at least half of ``max_chars``."""
    if max_chars < 2:
        raise ValueError(f"max_chars must be at least 2, got {max_chars}")
    windows: list[str] = []
    for document in documents:
        current: list[str] = []
        length = -1
        for word in document.split():
            if len(word) > max_chars:
                continue
            if length + 1 + len(word) > max_chars:
                windows.append(" ".join(current))
                current, length = [], -1
            current.append(word)
            length += 1 + len(word)
        if current and 2 * length >= max_chars:
            windows.append(" ".join(current))
    return windows


def letter_positions(text: str) -> list[int]:
    """Positions of the ASCII letters of ``text``."""
    return [i for i, char in enumerate(text) if char in string.ascii_letters]


def misspell(text: str, rng: random.Random) -> tuple[str, int]:
    """``(text with one ASCII letter replaced, its position)``: the letter chosen uniformly,
    its replacement uniformly among the 25 other letters (same case).

    Raises ``ValueError`` if ``text`` has no ASCII letter.
    """
    positions = letter_positions(text)
    if not positions:
        raise ValueError(f"no ASCII letter to replace in {text!r}")
    i = rng.choice(positions)
    original = text[i].lower()
    replacement = rng.choice([c for c in string.ascii_lowercase if c != original])
    if text[i].isupper():
        replacement = replacement.upper()
    return text[:i] + replacement + text[i + 1 :], i


def labelled_windows(windows: Sequence[str], rng: random.Random) -> list[tuple[str, int]]:
    """Each window with an ASCII letter, as ``(window, 0)`` or, with probability 1/2,
    ``(misspelt window, 1)``."""
    rows = []
    for window in filter(letter_positions, windows):
        if rng.random() < 0.5:
            rows.append((misspell(window, rng)[0], MISSPELT))
        else:
            rows.append((window, 1 - MISSPELT))
    return rows


def replaced_letter_windows(windows: Sequence[str], rng: random.Random) -> list[tuple[str, int]]:
    """Each window with an ASCII letter, misspelt: ``(misspelt window, position of the replaced
    letter)``."""
    return [misspell(window, rng) for window in filter(letter_positions, windows)]


def build_spelling_task(
    train_documents: Sequence[str],
    test_documents: Sequence[str],
    *,
    max_chars: int,
    seed: int = 0,
    max_train: int | None = None,
    rows: Callable[[Sequence[str], random.Random], list[tuple[str, int]]] = labelled_windows,
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(train, test)``: ``rows`` (:func:`labelled_windows`: ``(text, label)``, or
    :func:`replaced_letter_windows`: ``(text, replaced position)``) of the windows of the
    training documents (a seeded sample of ``max_train`` of them, or all) and of every test
    document."""
    rng = random.Random(seed)
    train_windows = text_windows(train_documents, max_chars)
    if max_train is not None and max_train < len(train_windows):
        train_windows = rng.sample(train_windows, max_train)
    train = rows(train_windows, rng)
    test = rows(text_windows(test_documents, max_chars), rng)
    if not train or not test:
        raise ValueError(
            f"the spelling task needs text: {len(train)} training and {len(test)} test windows "
            f"of at most {max_chars} characters"
        )
    return train, test
