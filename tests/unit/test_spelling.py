"""The spelling task: text windows of whole words, half of them with one letter replaced."""

from __future__ import annotations

import random
import string
from collections import Counter

import pytest

from onebit.train.data.spelling import (
    MISSPELT,
    build_spelling_task,
    labelled_windows,
    misspell,
    replaced_letter_windows,
    text_windows,
)


def test_text_windows_pack_whole_words() -> None:
    documents = ["aa bb cc dd e", "averyveryverylongword x yy", "zz"]
    assert text_windows(documents, 5) == ["aa bb", "cc dd", "x yy"]
    # "e" (1 of 5 characters) and "zz" (2 of 5) are too short to be kept as last runs.
    assert text_windows(["abc de fgh"], 6) == ["abc de", "fgh"]
    with pytest.raises(ValueError, match="max_chars"):
        text_windows(documents, 1)


def test_misspell_replaces_one_letter_by_another() -> None:
    rng = random.Random(0)
    text = "It's 1 Test, OK?"
    for _ in range(200):
        changed, position = misspell(text, rng)
        diff = [i for i, (a, b) in enumerate(zip(text, changed, strict=True)) if a != b]
        assert diff == [position]
        before, after = text[diff[0]], changed[diff[0]]
        assert before in string.ascii_letters and after in string.ascii_letters
        assert before.lower() != after.lower() and before.isupper() == after.isupper()
    with pytest.raises(ValueError, match="no ASCII letter"):
        misspell("12, 34!", rng)


def test_labelled_windows_misspell_about_half() -> None:
    windows = [f"word{i} other{i}" for i in range(2000)] + ["123 456"]
    rows = labelled_windows(windows, random.Random(1))
    assert len(rows) == 2000  # the window without a letter is left out
    misspelt = [text for text, label in rows if label == MISSPELT]
    assert 900 < len(misspelt) < 1100  # binomial(2000, 1/2): 4.5 standard deviations
    for (text, label), window in zip(rows, windows, strict=False):
        assert (text != window) == (label == MISSPELT)


def test_build_spelling_task_tests_on_the_held_out_documents() -> None:
    train_docs = [" ".join(f"tr{i}x{j}" for j in range(50)) for i in range(20)]
    test_docs = [" ".join(f"te{i}y{j}" for j in range(50)) for i in range(3)]
    train, test = build_spelling_task(train_docs, test_docs, max_chars=20, seed=3, max_train=40)
    assert len(train) == 40
    assert {text for text, label in train if label != MISSPELT} <= set(text_windows(train_docs, 20))
    windows = text_windows(test_docs, 20)
    assert len(test) == len(windows)  # every held-out window, in order
    for (text, label), window in zip(test, windows, strict=True):
        assert len(text) == len(window) and (text != window) == (label == MISSPELT)
    again = build_spelling_task(train_docs, test_docs, max_chars=20, seed=3, max_train=40)
    assert again == (train, test)
    with pytest.raises(ValueError, match="needs text"):
        build_spelling_task(train_docs, ["1 2 3 4 5 6 7 8 9 10 11"], max_chars=20)


def test_replaced_letter_windows_give_the_replaced_position() -> None:
    windows = ["Word, other!"] * 900 + ["123 456", "x"]
    rows = replaced_letter_windows(windows, random.Random(4))
    assert len(rows) == 901  # the window without a letter is left out
    for (text, position), window in zip(rows, windows[:900] + ["x"], strict=True):
        diff = [i for i, (a, b) in enumerate(zip(window, text, strict=True)) if a != b]
        assert diff == [position]
    # Each of the 9 letters is replaced in binomial(900, 1/9) windows: 100 ± 9.4.
    counts = Counter(position for _, position in rows[:900])
    assert sorted(counts) == [0, 1, 2, 3, 6, 7, 8, 9, 10]
    assert all(60 < count < 140 for count in counts.values()), counts


def test_build_spelling_task_with_replaced_positions_is_seeded() -> None:
    train_docs = [" ".join(f"tr{i}x{j}" for j in range(50)) for i in range(20)]
    test_docs = [" ".join(f"te{i}y{j}" for j in range(50)) for i in range(3)]

    def build(seed: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        return build_spelling_task(
            train_docs, test_docs, max_chars=20, seed=seed, max_train=40,
            rows=replaced_letter_windows,
        )  # fmt: skip

    train, test = build(3)
    assert len(train) == 40 and build(3) == (train, test)
    assert build(4) != (train, test)
    windows = text_windows(test_docs, 20)
    for (text, position), window in zip(test, windows, strict=True):  # every held-out window
        assert (
            text != window and text[:position] + window[position] + text[position + 1 :] == window
        )
    train_windows = set(text_windows(train_docs, 20))
    for text, position in train:
        assert any(
            text[:position] + letter + text[position + 1 :] in train_windows
            for letter in string.ascii_letters
        )
