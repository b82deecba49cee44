"""Fine-tune a pre-trained run on a classification task (the paper's "same downstream accuracy"
check).

The tasks: ``sentiment``, the movie-review snippets of :func:`onebit.train.data.load_sentiment`
(positive vs negative, seeded 80/20 split); ``spelling``, text windows of the run's own
corpus with or without one replaced letter (:mod:`onebit.train.data.spelling`; test windows
from the documents held out of pre-training); and ``replaced-letter``, the same windows each
with one replaced letter, every token labelled replaced or not (ELECTRA's replaced-token
detection). The classifier is the run's architecture with a sequence head (a token head for
``replaced-letter``), its encoder loaded from the run's newest usable checkpoint, trained in
one process with AdamW under a linear warm-up/decay schedule on the cross-entropy of the
labels. A sequence task scores the fraction of test texts whose most likely class is their
label; ``replaced-letter`` the fraction of test windows whose token with the largest
``logit(replaced) - logit(original)`` is the replaced one.
"""

from __future__ import annotations

import logging
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from onebit.atomic import write_json_atomic
from onebit.train import checkpoint, data
from onebit.train.data.spelling import (
    build_spelling_task,
    labelled_windows,
    letter_positions,
    replaced_letter_windows,
    text_windows,
)
from onebit.train.downstream_config import SPELLING_TRAIN_WINDOWS, TOKEN_TASKS, FinetuneConfig
from onebit.train.run_dir import CHECKPOINT_DIR, TOKENIZER_FILE, read_config

logger = logging.getLogger(__name__)

EVAL_BATCH = 256
#: Fraction of the fine-tuning steps with a linearly rising learning rate.
WARMUP_FRACTION = 0.1
#: Token label of the replaced letter in the ``replaced-letter`` task (0: as written).
REPLACED = 1


@dataclass
class Sentences:
    """Token ids of sentences (``[CLS] ... [SEP]``, truncated) and their labels: one per
    sentence, or, for a per-token task, a row per sentence of one per token
    (``IGNORE_INDEX`` at special tokens and padding)."""

    ids: list[list[int]]
    labels: torch.Tensor
    pad_id: int

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, labels)`` of ``rows``, padded to their longest
        sentence."""
        chosen = [self.ids[i] for i in rows.tolist()]
        width = max(map(len, chosen))
        ids = torch.full((len(chosen), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(chosen), width), dtype=torch.int64)
        for row, tokens in enumerate(chosen):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        labels = self.labels[rows]
        return ids, mask, labels[:, :width] if labels.dim() == 2 else labels


def replaced_token_labels(encodings: list[Any], positions: list[int]) -> torch.Tensor:
    """Per encoding, ``REPLACED`` at the token whose character span holds ``positions[i]``, 0 at
    its other tokens and ``IGNORE_INDEX`` at special tokens and past its end.

    Raises ``ValueError`` if no token holds the position (a truncated text)."""
    labels = torch.full((len(encodings), max(len(e.ids) for e in encodings)), data.IGNORE_INDEX)
    for row, (encoding, position) in enumerate(zip(encodings, positions, strict=True)):
        found = False
        for i, ((start, end), special) in enumerate(
            zip(encoding.offsets, encoding.special_tokens_mask, strict=True)
        ):
            if not special:
                holds = start <= position < end
                labels[row, i] = REPLACED if holds else 1 - REPLACED
                found |= holds
        if not found:
            raise ValueError(
                f"no token of text {row} holds its replaced character {position} (truncated?)"
            )
    return labels


def encode(
    tokenizer: Any, rows: list[tuple[str, int]], max_len: int, *, per_token: bool = False
) -> Sentences:
    """Tokenize ``(sentence, label)`` rows (``per_token``: ``(text, replaced position)``, labelled
    by :func:`replaced_token_labels`), truncating to ``max_len`` tokens."""
    tokenizer.enable_truncation(max_length=max_len)
    encodings = tokenizer.encode_batch([sentence for sentence, _ in rows])
    values = [value for _, value in rows]
    labels = (
        replaced_token_labels(encodings, values)
        if per_token
        else torch.tensor(values, dtype=torch.int64)
    )
    return Sentences([e.ids for e in encodings], labels, tokenizer.token_to_id(data.PAD_TOKEN))


def correct_predictions(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per sentence, whether the prediction is right: its most likely class is its label, or
    (per-token labels) its token with the largest ``logit(replaced) - logit(original)`` is the
    replaced one."""
    if labels.dim() == 1:
        return logits.argmax(-1) == labels
    replaced = logits[..., REPLACED] - logits[..., 1 - REPLACED]
    replaced = replaced.masked_fill(labels == data.IGNORE_INDEX, -math.inf)
    return labels.gather(1, replaced.argmax(1, keepdim=True)).squeeze(1) == REPLACED


@torch.no_grad()
def accuracy(model: torch.nn.Module, sentences: Sentences) -> float:
    """Fraction of ``sentences`` predicted right (:func:`correct_predictions`)."""
    model.eval()
    correct = 0
    for rows in torch.arange(len(sentences.ids)).split(EVAL_BATCH):
        ids, mask, labels = sentences.batch(rows)
        logits = model(input_ids=ids, attention_mask=mask).logits
        correct += int(correct_predictions(logits, labels).sum())
    model.train()
    return correct / len(sentences.ids)


def chance_accuracy(task: str, test_rows: list[tuple[str, int]]) -> float:
    """The test accuracy of guessing: the most frequent class's share, or for
    ``replaced-letter`` a letter of the window chosen uniformly (the mean of 1/letters)."""
    if task in TOKEN_TASKS:
        return statistics.fmean(1 / len(letter_positions(text)) for text, _ in test_rows)
    labels = [label for _, label in test_rows]
    return max(map(labels.count, set(labels))) / len(labels)


def pretraining_split(run_dir: Path) -> tuple[list[str], list[str]]:
    """The run's pre-training documents and those held out of it (build_mlm_dataset's split):
    the spelling tasks train on windows of the first and test on windows of the second."""
    from onebit.train.job_data import load_documents

    pretraining = read_config(run_dir)
    return data.split_documents(load_documents(pretraining), seed=pretraining.seed)


def load_run(run_dir: Path) -> tuple[int, dict[str, Any], Any]:
    """``(step, model.pt contents, tokenizer)`` of the newest usable checkpoint of
    ``run_dir``; ``FileNotFoundError`` if it is not a finished run folder."""
    from tokenizers import Tokenizer

    tokenizer_path = run_dir / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a finished run folder: {TOKENIZER_FILE} is missing"
        )
    step, state = checkpoint.latest_model_state(run_dir / CHECKPOINT_DIR)
    return step, state, Tokenizer.from_file(str(tokenizer_path))


def task_rows(
    run_dir: Path,
    task: str,
    seed: int,
    max_train: int | None,
    max_tokens: int,
    *,
    test_variants: int = 1,
) -> tuple[list[tuple[str, int]], list[list[tuple[str, int]]]]:
    """``(train rows, test rows of each version)`` of ``(text, label)`` of ``task`` for the run
    in ``run_dir`` (whose corpus and document split the spelling tasks use), at most
    ``max_train`` training rows. Sentiment has one version of its test set. For the spelling
    tasks version 0 replaces letters with ``seed``'s random stream and version k ≥ 1 replaces
    letters of the same windows with its own, so that row j of every version is window j."""
    if task == "sentiment":
        if test_variants != 1:
            raise ValueError("sentiment's test set has one version of each text")
        train_rows, test_rows = data.load_sentiment(seed=seed)
        return train_rows[:max_train], [test_rows]
    make_rows = replaced_letter_windows if task in TOKEN_TASKS else labelled_windows
    train_docs, test_docs = pretraining_split(run_dir)
    max_chars = max_tokens - 2  # [CLS] and [SEP]; a character is at most one token
    train_rows, test_rows = build_spelling_task(
        train_docs,
        test_docs,
        max_chars=max_chars,
        seed=seed,
        max_train=max_train or SPELLING_TRAIN_WINDOWS,
        rows=make_rows,
    )
    if test_variants == 1:  # onebit finetune: no other versions, no second pass over the text
        return train_rows, [test_rows]
    windows = text_windows(test_docs, max_chars)
    others = [make_rows(windows, random.Random(f"{seed}/{k}")) for k in range(1, test_variants)]
    return train_rows, [test_rows, *others]


def load_task(
    run_dir: Path, config: FinetuneConfig, max_tokens: int
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(train, test)`` rows of ``(text, label)`` of ``config.task`` for the run in
    ``run_dir`` (:func:`task_rows`), ``max_train`` and ``max_test`` applied."""
    train_rows, (test_rows,) = task_rows(
        run_dir, config.task, config.seed, config.max_train, max_tokens
    )
    return train_rows, test_rows[: config.max_test]


def finetune(run_dir: Path, config: FinetuneConfig) -> dict[str, Any]:
    """Fine-tune the newest checkpoint of ``run_dir``; write and return the result.

    The result (``test_accuracy``, its binomial standard error
    ``sqrt(a·(1-a)/n_test)``, the ``chance_accuracy`` of guessing, and the settings) goes to
    ``RUN_DIR/<config.result_file>``.
    """
    from onebit.train.job_data import lr_factor
    from onebit.train.model import build_classifier, config_from_dict

    step, state, tokenizer = load_run(run_dir)
    bert = config_from_dict(
        {
            **state["bert_config"],
            "hidden_dropout_prob": config.dropout,
            "attention_probs_dropout_prob": config.dropout,
        }
    )
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(config.seed)
    per_token = config.task in TOKEN_TASKS
    encoder_state = None if config.from_scratch else state["model"]
    model = build_classifier(bert, encoder_state, per_token=per_token)

    train_rows, test_rows = load_task(run_dir, config, bert.max_position_embeddings)
    train_set, test_set = (
        encode(tokenizer, rows, bert.max_position_embeddings, per_token=per_token)
        for rows in (train_rows, test_rows)
    )

    batches_per_epoch = -(-len(train_rows) // config.batch_size)
    total = config.epochs * batches_per_epoch
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    warmup = round(WARMUP_FRACTION * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i, warmup, total))
    generator = torch.Generator().manual_seed(config.seed)
    started = time.perf_counter()
    logger.info(
        "Fine-tuning %s on %d sentences for %d epochs",
        "a randomly initialised model" if config.from_scratch else f"{run_dir} (step {step})",
        len(train_rows),
        config.epochs,
    )
    for epoch in range(config.epochs):
        order = torch.randperm(len(train_rows), generator=generator)
        for rows in order.split(config.batch_size):
            ids, mask, labels = train_set.batch(rows)
            logits = model(input_ids=ids, attention_mask=mask).logits
            # Per sentence or per token; IGNORE_INDEX (-100, cross_entropy's default) is left out.
            loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten())
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        logger.info("epoch %d: last batch loss %.4f", epoch + 1, loss.item())
    test_accuracy = accuracy(model, test_set)
    result = {
        "run_dir": str(run_dir),
        "task": config.task,
        "checkpoint_step": step,
        "test_accuracy": test_accuracy,
        "test_accuracy_se": math.sqrt(test_accuracy * (1 - test_accuracy) / len(test_rows)),
        "chance_accuracy": chance_accuracy(config.task, test_rows),
        "train_accuracy": accuracy(model, train_set),
        "train_examples": len(train_rows),
        "test_examples": len(test_rows),
        "seconds": time.perf_counter() - started,
        "config": asdict(config),
    }
    path = run_dir / config.result_file
    write_json_atomic(path, result)
    result["path"] = str(path)
    logger.info("%s test accuracy %.4f, written to %s", config.task, test_accuracy, path)
    return result
