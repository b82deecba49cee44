"""Fine-tune a pre-trained run on a classification task (the paper's "same downstream accuracy"
check).

The tasks: ``sentiment``, the movie-review snippets of :func:`onebit.train.data.load_sentiment`
(positive vs negative, seeded 80/20 split), and ``spelling``, text windows of the run's own
corpus with or without one replaced letter (:mod:`onebit.train.data.spelling`; test windows
from the documents held out of pre-training). The classifier is
``BertForSequenceClassification`` built from the run's BERT config, its encoder loaded from the
run's newest usable checkpoint, and it is trained in one process with AdamW under a linear
warm-up/decay schedule.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from onebit.train import checkpoint, data
from onebit.train.atomic import write_json_atomic
from onebit.train.config import (
    CHECKPOINT_DIR,
    SPELLING_TRAIN_WINDOWS,
    TOKENIZER_FILE,
    FinetuneConfig,
    read_config,
)
from onebit.train.data.spelling import build_spelling_task

logger = logging.getLogger(__name__)

EVAL_BATCH = 256
#: Fraction of the fine-tuning steps with a linearly rising learning rate.
WARMUP_FRACTION = 0.1


@dataclass
class Sentences:
    """Token ids of sentences (``[CLS] ... [SEP]``, truncated) and their labels."""

    ids: list[list[int]]
    labels: torch.Tensor
    pad_id: int

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` of ``rows``, padded to their longest sentence."""
        chosen = [self.ids[i] for i in rows.tolist()]
        width = max(map(len, chosen))
        ids = torch.full((len(chosen), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(chosen), width), dtype=torch.int64)
        for row, tokens in enumerate(chosen):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        return ids, mask


def encode(tokenizer: Any, rows: list[tuple[str, int]], max_len: int) -> Sentences:
    """Tokenize ``(sentence, label)`` rows, truncating to ``max_len`` tokens."""
    tokenizer.enable_truncation(max_length=max_len)
    encodings = tokenizer.encode_batch([sentence for sentence, _ in rows])
    labels = torch.tensor([label for _, label in rows], dtype=torch.int64)
    return Sentences([e.ids for e in encodings], labels, tokenizer.token_to_id(data.PAD_TOKEN))


@torch.no_grad()
def accuracy(model: torch.nn.Module, sentences: Sentences) -> float:
    """Fraction of ``sentences`` whose predicted class is their label."""
    model.eval()
    correct = 0
    for rows in torch.arange(len(sentences.ids)).split(EVAL_BATCH):
        ids, mask = sentences.batch(rows)
        logits = model(input_ids=ids, attention_mask=mask).logits
        correct += int((logits.argmax(-1) == sentences.labels[rows]).sum())
    model.train()
    return correct / len(sentences.ids)


def load_task(
    run_dir: Path, config: FinetuneConfig, max_tokens: int
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(train, test)`` rows of ``(text, label)`` of ``config.task`` for the run in
    ``run_dir`` (whose corpus and document split the spelling task uses), ``max_train`` and
    ``max_test`` applied."""
    if config.task == "sentiment":
        train_rows, test_rows = data.load_sentiment(seed=config.seed)
        train_rows = train_rows[: config.max_train]
    else:
        from onebit.train.worker import load_documents

        pretraining = read_config(run_dir)
        documents = load_documents(pretraining)
        # The split of build_mlm_dataset: test windows come from the held-out documents.
        train_docs, test_docs = data.split_documents(documents, seed=pretraining.seed)
        train_rows, test_rows = build_spelling_task(
            train_docs,
            test_docs,
            max_chars=max_tokens - 2,  # [CLS] and [SEP]; a character is at most one token
            seed=config.seed,
            max_train=config.max_train or SPELLING_TRAIN_WINDOWS,
        )
    return train_rows, test_rows[: config.max_test]


def finetune(run_dir: Path, config: FinetuneConfig) -> dict[str, Any]:
    """Fine-tune the newest checkpoint of ``run_dir``; write and return the result.

    The result (``test_accuracy``, its binomial standard error
    ``sqrt(a·(1-a)/n_test)``, and the settings) goes to ``RUN_DIR/<config.result_file>``.
    """
    from tokenizers import Tokenizer

    from onebit.train.model import build_classifier, config_from_dict
    from onebit.train.worker import lr_factor

    tokenizer_path = run_dir / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a finished run folder: {TOKENIZER_FILE} is missing"
        )
    step, state = checkpoint.latest_model_state(run_dir / CHECKPOINT_DIR)
    bert = config_from_dict(
        {
            **state["bert_config"],
            "hidden_dropout_prob": config.dropout,
            "attention_probs_dropout_prob": config.dropout,
        }
    )
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(config.seed)
    model = build_classifier(bert, None if config.from_scratch else state["model"])

    train_rows, test_rows = load_task(run_dir, config, bert.max_position_embeddings)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    train_set = encode(tokenizer, train_rows, bert.max_position_embeddings)
    test_set = encode(tokenizer, test_rows, bert.max_position_embeddings)

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
            ids, mask = train_set.batch(rows)
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = F.cross_entropy(logits, train_set.labels[rows])
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
