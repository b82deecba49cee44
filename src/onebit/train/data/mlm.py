"""Masked-language-model data: packed ``[CLS] ... [SEP]`` sequences, BERT masking, and a global
batch order that does not depend on the number of data-parallel workers."""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from onebit.atomic import atomic_path
from onebit.train.data.corpus import corpus_digest
from onebit.train.data.fetch import CACHE_FORMAT_VERSION, resolve_cache_dir
from onebit.train.data.wordpiece import (
    CLS_TOKEN,
    MASK_TOKEN,
    PAD_TOKEN,
    SEP_TOKEN,
    SPECIAL_TOKENS,
    UNK_TOKEN,
)

logger = logging.getLogger(__name__)

#: Label value ignored by ``torch.nn.functional.cross_entropy``.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class MLMData:
    """Packed MLM sequences: int64 tensors ``[num_seqs, seq_len]``, ``[CLS] ... [SEP]`` each."""

    train: torch.Tensor
    validation: torch.Tensor
    vocab_size: int
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    unk_id: int

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1])

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids that are never masked or used as random replacements."""
        return (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)


def split_documents(
    documents: Sequence[str], validation_fraction: float = 0.05, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Split documents into (train, validation) by a seeded shuffle of whole documents.

    The validation part holds ``round(validation_fraction * n)`` documents, at least one;
    both parts keep the original document order.
    """
    n = len(documents)
    if n < 2:
        raise ValueError(f"Need at least 2 documents for a train/validation split, got {n}")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    n_val = min(n - 1, max(1, round(validation_fraction * n)))
    val_idx = set(random.Random(seed).sample(range(n), n_val))
    train = [d for i, d in enumerate(documents) if i not in val_idx]
    validation = [d for i, d in enumerate(documents) if i in val_idx]
    return train, validation


def pack_sequences(
    token_ids: Sequence[Sequence[int]], seq_len: int, cls_id: int, sep_id: int
) -> torch.Tensor:
    """Concatenate token lists and cut them into ``[CLS] <seq_len - 2 tokens> [SEP]`` rows.

    The final incomplete chunk is dropped. Returns an int64 tensor ``[num_seqs, seq_len]``.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be at least 3 ([CLS] token [SEP]), got {seq_len}")
    body = seq_len - 2
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    num_seqs = flat.numel() // body
    if num_seqs == 0:
        raise ValueError(
            f"Only {flat.numel()} tokens, fewer than the {body} needed for one sequence of "
            f"length {seq_len}"
        )
    out = torch.empty(num_seqs, seq_len, dtype=torch.int64)
    out[:, 0] = cls_id
    out[:, 1:-1] = flat[: num_seqs * body].view(num_seqs, body)
    out[:, -1] = sep_id
    return out


def build_mlm_dataset(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int,
    seed: int = 0,
    validation_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
) -> MLMData:
    """Split, tokenize and pack ``documents`` into train/validation MLM sequences.

    The split is by document (see :func:`split_documents`). The token tensors are cached under
    ``<cache>/mlm/`` keyed by the corpus, the tokenizer and all arguments.
    """
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    missing = [tok for tok, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"Tokenizer lacks the special tokens {missing}")
    key = "|".join(
        [
            corpus_digest(documents),
            hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
            str(seq_len),
            str(seed),
            repr(validation_fraction),
            str(CACHE_FORMAT_VERSION),
        ]
    )
    path = (
        resolve_cache_dir(cache_dir) / "mlm" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    )
    if path.exists():
        logger.info("Loading cached MLM sequences from %s", path)
        tensors = torch.load(path, weights_only=True)
        train, validation = tensors["train"], tensors["validation"]
    else:
        train_docs, val_docs = split_documents(documents, validation_fraction, seed)
        parts = []
        for docs in (train_docs, val_docs):
            encodings = tokenizer.encode_batch(list(docs), add_special_tokens=False)
            parts.append(
                pack_sequences([e.ids for e in encodings], seq_len, ids[CLS_TOKEN], ids[SEP_TOKEN])
            )
        train, validation = parts
        with atomic_path(path) as tmp:
            torch.save({"train": train, "validation": validation}, tmp)
        logger.info("Cached MLM sequences in %s", path)
    logger.info(
        "MLM data: %d train and %d validation sequences of %d tokens",
        train.shape[0],
        validation.shape[0],
        seq_len,
    )
    return MLMData(
        train=train,
        validation=validation,
        vocab_size=tokenizer.get_vocab_size(),
        pad_id=ids[PAD_TOKEN],
        cls_id=ids[CLS_TOKEN],
        sep_id=ids[SEP_TOKEN],
        mask_id=ids[MASK_TOKEN],
        unk_id=ids[UNK_TOKEN],
    )


def unigram_cross_entropy(data: MLMData) -> float:
    """The MLM loss of predicting every token by its training frequency alone, in nats.

    ``H = -(1/|D|) Σ_{t in D} log p(t)`` over the non-special validation tokens ``D``, with
    ``p(t) = (c_t + 1) / (Σ_u c_u + K)``: the counts ``c`` of the ``K`` non-special ids in the
    training sequences, add-one smoothed so that a token unseen in training has a finite cost.
    A model whose validation MLM loss is not well below this has learned little beyond
    token frequencies.
    """
    special = torch.tensor(sorted(set(data.special_ids)), dtype=torch.int64)
    is_regular = ~torch.isin(torch.arange(data.vocab_size), special)
    train = data.train.flatten()
    counts = torch.bincount(train, minlength=data.vocab_size).double() + 1.0
    log_p = torch.where(is_regular, counts.log() - counts[is_regular].sum().log(), torch.nan)
    validation = data.validation.flatten()
    validation = validation[is_regular[validation]]
    if validation.numel() == 0:
        raise ValueError("the validation sequences hold no regular (non-special) tokens")
    return float(-log_p[validation].mean())


def mask_tokens(
    input_ids: torch.Tensor,
    generator: torch.Generator,
    mask_prob: float = 0.15,
    *,
    vocab_size: int,
    special_ids: Sequence[int],
    mask_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: returns ``(inputs, labels)`` for a masked-language-model step.

    Each non-special token is selected with probability ``mask_prob``; a selected token is
    replaced by ``[MASK]`` (80%), by a random non-special token (10%) or kept (10%). ``labels``
    holds the original id at selected positions and ``-100`` elsewhere. Special tokens are never
    selected. The result depends only on ``input_ids`` and the state of the CPU ``generator``.
    """
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
    ids = input_ids.cpu()
    specials = torch.tensor(sorted(set(special_ids)), dtype=ids.dtype)
    replaceable = torch.arange(vocab_size, dtype=ids.dtype)
    replaceable = replaceable[~torch.isin(replaceable, specials)]
    if replaceable.numel() == 0:
        raise ValueError(f"No non-special token ids in a vocabulary of {vocab_size}")
    shape = ids.shape
    selected = torch.rand(shape, generator=generator) < mask_prob
    selected &= ~torch.isin(ids, specials)
    choice = torch.rand(shape, generator=generator)
    random_ids = replaceable[torch.randint(replaceable.numel(), shape, generator=generator)]
    inputs = torch.where(selected & (choice < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(selected & (choice >= 0.8) & (choice < 0.9), random_ids, inputs)
    labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
    return inputs.to(input_ids.device), labels.to(input_ids.device)


def _epoch_permutation(num_train_seqs: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled sample order of one epoch, seeded by ``seed`` and ``epoch`` alone."""
    digest = hashlib.sha256(f"onebit-batches:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(num_train_seqs, generator=gen)


def _batch_stream(
    num_train_seqs: int, global_batch: int, steps: int, seed: int, start_step: int
) -> Iterator[torch.Tensor]:
    epoch, offset = divmod(start_step * global_batch, num_train_seqs)
    order = _epoch_permutation(num_train_seqs, seed, epoch)
    for _ in range(start_step, steps):
        pieces = []
        needed = global_batch
        while needed:
            if offset == num_train_seqs:
                epoch, offset = epoch + 1, 0
                order = _epoch_permutation(num_train_seqs, seed, epoch)
            take = min(needed, num_train_seqs - offset)
            pieces.append(order[offset : offset + take])
            offset += take
            needed -= take
        yield torch.cat(pieces)


def global_batches(
    num_train_seqs: int, global_batch: int, steps: int, seed: int, start_step: int = 0
) -> Iterator[torch.Tensor]:
    """Iterate over the sample indices (int64, ``[global_batch]``) of steps ``start_step..steps-1``.

    The indices are a stream of per-epoch permutations of ``range(num_train_seqs)`` (each epoch
    reshuffled with a seed derived from ``seed`` and the epoch), cut into consecutive batches;
    a batch may span an epoch boundary, and resuming at ``start_step`` gives the same batches as
    an uninterrupted run. The order depends only on these arguments, never on the number of
    workers: each rank takes its part with :func:`rank_slice`. Arguments are checked eagerly.
    """
    if num_train_seqs <= 0 or global_batch <= 0:
        raise ValueError(
            f"num_train_seqs ({num_train_seqs}) and global_batch ({global_batch}) must be positive"
        )
    if not 0 <= start_step <= steps:
        raise ValueError(f"start_step ({start_step}) must be in [0, steps={steps}]")
    return _batch_stream(num_train_seqs, global_batch, steps, seed, start_step)


def local_batch_size(global_batch: int, world_size: int) -> int:
    """Per-rank batch size; raises ValueError unless ``world_size`` divides ``global_batch``."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if global_batch % world_size:
        raise ValueError(
            f"global batch size {global_batch} is not divisible by world size {world_size}"
        )
    return global_batch // world_size


def rank_slice(batch_indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The contiguous part of a global batch that belongs to ``rank`` of ``world_size``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    local = local_batch_size(batch_indices.shape[0], world_size)
    return batch_indices[rank * local : (rank + 1) * local]
