"""The main job's data and schedule: its corpus and tokenizer, the masked global batch of each
step, the seeds derived from the step, the learning-rate schedule and the model's config.

Determinism: the global batch of step ``t`` (``data.global_batches``), its BERT masking (a
generator seeded by ``(seed, t)`` over the whole global batch, then sliced per rank) and the
dropout seed (``(seed, t, rank)``) depend only on the step, so a resumed run replays exactly
the steps an uninterrupted run would take.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from onebit.train import data
from onebit.train.config import TrainConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def step_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (the run seed, the step, the rank)."""
    digest = hashlib.sha256(":".join(map(str, ("onebit-train", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def lr_factor(step_index: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to 1 over ``warmup_steps``, then linear decay towards 0 at ``total_steps``.

    ``step_index`` counts from 0; the value is the multiplier of the base LR for that step.
    """
    if step_index < warmup_steps:
        return (step_index + 1) / warmup_steps
    return max(0.0, (total_steps - step_index) / (total_steps - warmup_steps))


def load_documents(config: TrainConfig) -> list[str]:
    """The pre-training documents of ``config``: its own files, or the built-in corpus."""
    return data.read_text_files(config.corpus) if config.corpus else data.load_corpus()


def load_data(config: TrainConfig) -> tuple[data.MLMData, str]:
    """The MLM sequences and the tokenizer (as JSON) of ``config``, cached on first use."""
    documents = load_documents(config)
    tokenizer = data.train_tokenizer(documents, config.vocab_size)
    mlm = data.build_mlm_dataset(documents, tokenizer, config.seq_len, seed=config.seed)
    return mlm, tokenizer.to_str()


def masked_batch(
    config: TrainConfig, mlm: data.MLMData, step: int, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step`` (1, 2, ...): the training sequences ``indices``
    with BERT's masks, seeded by the run's seed and the step alone (the same at any number of
    workers), as ``(inputs, labels)``."""
    return data.mask_tokens(
        mlm.train[indices],
        torch.Generator().manual_seed(step_seed(config.seed, step)),
        vocab_size=mlm.vocab_size,
        special_ids=mlm.special_ids,
        mask_id=mlm.mask_id,
    )


def model_config(config: TrainConfig, vocab_size: int) -> PretrainedConfig:
    """The job's model configuration: ``config``'s architecture and sizes for a tokenizer of
    ``vocab_size`` tokens."""
    from onebit.train.model import bert_config

    return bert_config(
        vocab_size=vocab_size,
        seq_len=config.seq_len,
        layers=config.layers,
        hidden=config.hidden,
        heads=config.heads,
        dropout=config.dropout,
        architecture=config.architecture,
    )


def tensors_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 (16 hex digits) of the tensors' values, one after another in their order."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def run_inputs(mlm: data.MLMData, tokenizer_json: str, initial_weights: str) -> dict[str, Any]:
    """What a run trains on: digests of its tokenizer, its token sequences (training and
    validation) and its initial weights (``initial_weights``, their :func:`tensors_digest`).
    Runs with the same digests saw the same samples from the same start; runs compared side
    by side must (``config.json`` holds the versions of the packages that made them)."""
    return {
        "tokenizer": hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16],
        "sequences": tensors_digest([mlm.train, mlm.validation]),
        "initial_weights": initial_weights,
    }
