"""A BERT-style uncased WordPiece tokenizer, trained locally on the corpus and cached."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import WordPieceTrainer

from onebit.atomic import atomic_path
from onebit.train.data.corpus import corpus_digest
from onebit.train.data.fetch import CACHE_FORMAT_VERSION, resolve_cache_dir

logger = logging.getLogger(__name__)

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
CLS_TOKEN = "[CLS]"
SEP_TOKEN = "[SEP]"
MASK_TOKEN = "[MASK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN)
#: Version of the cached tokenizers: 2 numbers the vocabulary in :func:`canonical_vocab` order.
TOKENIZER_FORMAT = 2


def tokenizer_cache_path(
    documents: Sequence[str],
    vocab_size: int,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Path of the cached tokenizer for this corpus and vocabulary size."""
    key = f"{corpus_digest(documents)}-{vocab_size}-v{CACHE_FORMAT_VERSION}-t{TOKENIZER_FORMAT}"
    short = hashlib.sha256(key.encode()).hexdigest()[:16]
    return resolve_cache_dir(cache_dir) / "tokenizers" / f"wordpiece-{vocab_size}-{short}.json"


def canonical_vocab(vocab: dict[str, int]) -> dict[str, int]:
    """The same tokens numbered in one order: the special tokens first (ids 0-4), then the
    others sorted by their text. ``tokenizers``' WordPiece trainer learns the same tokens in
    every process but numbers those of equal counts in an order that changes from process to
    process; renumbered, one corpus gives one tokenizer, and so one dataset, everywhere."""
    missing = [token for token in SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise ValueError(f"the vocabulary lacks the special tokens {missing}")
    others = sorted(token for token in vocab if token not in SPECIAL_TOKENS)
    return {token: index for index, token in enumerate([*SPECIAL_TOKENS, *others])}


def train_tokenizer(
    documents: Sequence[str],
    vocab_size: int = 8192,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Train (or load from the cache) a BERT-style uncased WordPiece tokenizer.

    The special tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` get ids 0-4, the others follow in
    :func:`canonical_vocab` order, so the result does not depend on the process. Encoding with
    ``add_special_tokens=True`` wraps a text as ``[CLS] text [SEP]`` (pairs as
    ``[CLS] a [SEP] b [SEP]``). The result is cached at :func:`tokenizer_cache_path`.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    if not documents:
        raise ValueError("Cannot train a tokenizer on an empty corpus")
    path = tokenizer_cache_path(documents, vocab_size, cache_dir)
    if path.exists():
        logger.info("Loading cached tokenizer %s", path)
        return Tokenizer.from_file(str(path))

    tokenizer = Tokenizer(models.WordPiece(unk_token=UNK_TOKEN))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    logger.info(
        "Training a WordPiece tokenizer (vocab %d) on %d documents", vocab_size, len(documents)
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    tokenizer.model = models.WordPiece(canonical_vocab(tokenizer.get_vocab()), unk_token=UNK_TOKEN)
    cls_id, sep_id = tokenizer.token_to_id(CLS_TOKEN), tokenizer.token_to_id(SEP_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS_TOKEN} $A {SEP_TOKEN}",
        pair=f"{CLS_TOKEN} $A {SEP_TOKEN} $B:1 {SEP_TOKEN}:1",
        special_tokens=[(CLS_TOKEN, cls_id), (SEP_TOKEN, sep_id)],
    )
    with atomic_path(path) as tmp:
        tokenizer.save(str(tmp))
    logger.info("Saved tokenizer (vocab %d) to %s", tokenizer.get_vocab_size(), path)
    return tokenizer
