"""``onebit finetune``'s parts without a run: the replaced-letter labels, the scoring against a
loop, chance accuracy, the classifier on a pretrained encoder, the command's errors (its runs:
end_to_end/test_finetune_runs.py)."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest
import torch
from helpers.jobs import FILLER, POSITIVE

from onebit.cli import main as onebit_main
from onebit.train import data
from onebit.train.data.spelling import replaced_letter_windows
from onebit.train.data.wordpiece import train_tokenizer
from onebit.train.finetune import REPLACED, chance_accuracy, correct_predictions, encode
from onebit.train.model import bert_config, build_classifier, build_mlm_model, config_from_dict


def test_replaced_token_labels_mark_the_replaced_letter(tmp_path: Path) -> None:
    alphabet = string.ascii_lowercase
    documents = [" ".join(FILLER + POSITIVE), alphabet, alphabet[::-1], "0123456789,"]
    tokenizer = train_tokenizer(documents, vocab_size=6, cache_dir=tmp_path)  # characters
    windows = ["the film was good", "Actors, 12 plots", "a"] * 30
    rows = replaced_letter_windows(windows, random.Random(0))
    sentences = encode(tokenizer, rows, max_len=64, per_token=True)
    for window, ids, labels in zip(windows, sentences.ids, sentences.labels, strict=True):
        # Independently: the one token that differs from the unaltered window's tokens.
        original = tokenizer.encode(window).ids
        changed = [i for i, (a, b) in enumerate(zip(original, ids, strict=True)) if a != b]
        assert len(changed) == 1
        assert (labels == REPLACED).nonzero().flatten().tolist() == changed
        assert (labels == 1 - REPLACED).sum() == len(ids) - 3  # all but [CLS], [SEP], it
        assert labels[0] == labels[len(ids) - 1] == data.IGNORE_INDEX
        assert (labels[len(ids) :] == data.IGNORE_INDEX).all()  # padding
    with pytest.raises(ValueError, match="no token of text 0 holds its replaced character 9"):
        encode(tokenizer, [("abc defghij", 9)], max_len=6, per_token=True)


def test_correct_predictions_against_a_loop() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 12, 2, generator=generator, dtype=torch.float64)
    labels = torch.full((200, 12), data.IGNORE_INDEX)
    for row in range(200):
        length = int(torch.randint(3, 13, (1,), generator=generator))
        labels[row, 1 : length - 1] = 1 - REPLACED
        labels[row, int(torch.randint(1, length - 1, (1,), generator=generator))] = REPLACED
    # The ignored tokens look the most replaced: they must not be chosen.
    logits[..., REPLACED] += 10 * (labels == data.IGNORE_INDEX)
    expected = []
    for row_logits, row_labels in zip(logits.tolist(), labels.tolist(), strict=True):
        scores = {i: b - a for i, (a, b) in enumerate(row_logits) if row_labels[i] >= 0}
        expected.append(row_labels[max(scores, key=scores.__getitem__)] == REPLACED)
    assert correct_predictions(logits, labels).tolist() == expected
    assert 0 < sum(expected) < 200
    classes = torch.randint(0, 2, (200,), generator=generator)
    sentence_logits = logits[:, 0]
    pairs = zip(sentence_logits.tolist(), classes.tolist(), strict=True)
    expected = [(b > a) == bool(c) for (a, b), c in pairs]
    assert correct_predictions(sentence_logits, classes).tolist() == expected


def test_chance_accuracy() -> None:
    assert chance_accuracy("spelling", [("a", 1), ("b", 0), ("c", 1)]) == pytest.approx(2 / 3)
    rows = [("ab, 1", 0), ("Abcd", 2)]
    assert chance_accuracy("replaced-letter", rows) == pytest.approx((1 / 2 + 1 / 4) / 2)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("architecture", ["bert", "roformer"])
def test_classifier_takes_the_pretrained_encoder(architecture: str, per_token: bool) -> None:
    sizes = dict(vocab_size=100, seq_len=16, hidden=32, heads=2, dropout=0.0)
    config = bert_config(**sizes, layers=1, architecture=architecture)
    assert config_from_dict(config.to_dict()).to_dict() == config.to_dict()
    torch.manual_seed(0)
    mlm = build_mlm_model(config)
    inputs = torch.randint(5, 100, (2, 16))
    labels = torch.where(torch.rand(2, 16) < 0.3, inputs, torch.full_like(inputs, -100))
    logits = mlm.cls(mlm.base_model(input_ids=inputs).last_hidden_state)  # every position
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert torch.allclose(mlm(inputs, labels), expected, rtol=1e-5)
    classifier = build_classifier(config, mlm.state_dict(), per_token=per_token)
    assert classifier.base_model_prefix == architecture
    logits = classifier(input_ids=inputs).logits
    assert logits.shape == ((2, 16, 2) if per_token else (2, 2))
    for name, tensor in mlm.base_model.state_dict().items():
        assert torch.equal(classifier.base_model.state_dict()[name], tensor), name
    other = bert_config(**sizes, layers=2, architecture=architecture)
    with pytest.raises(ValueError, match="does not match the model config"):
        build_classifier(other, mlm.state_dict())
    with pytest.raises(ValueError, match="no encoder weights"):
        build_classifier(config, {"cls.predictions.bias": torch.zeros(100)})


def test_finetune_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert onebit_main(["finetune", str(tmp_path)]) == 2
    assert "tokenizer.json is missing" in capsys.readouterr().err
    assert onebit_main(["finetune", str(tmp_path), "--epochs", "0"]) == 2
    assert "--epochs must be a positive integer" in capsys.readouterr().err
