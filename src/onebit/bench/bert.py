"""The benchmark model: a BERT masked-language model built from a config, with synthetic batches.

The cluster comparison only needs a model whose gradient has the size and layout of a real
pre-training workload, so it uses ``transformers.BertForMaskedLM`` built from the training
job's :func:`onebit.train.model.bert_config` (random initialisation, seeded, identical on every
rank) and random token batches with 15 % of the positions labelled, as in MLM pre-training. No
tokenizer, corpus or download is involved.

Presets (:data:`onebit.bert_shapes.PRESETS`; feed-forward width 4 x hidden; parameter counts
with the MLM head, whose decoder is tied to the word embeddings):

========  ======  ======  ======  =======  ==========
preset    vocab   hidden  layers  heads    parameters
========  ======  ======  ======  =======  ==========
large     30522   1024    24      16       335.2M  (BERT-large)
base      30522   768     12      12       109.5M  (BERT-base)
small     30522   512     4       8        28.8M
mini      30522   256     4       4        11.2M
tiny      1024    64      2       2        0.2M    (tests)
========  ======  ======  ======  =======  ==========
"""

from __future__ import annotations

from typing import Any

from onebit.bert_shapes import PRESETS

__all__ = ["build_model", "synthetic_batches"]

#: BERT's dropout, which the benchmark model keeps.
DROPOUT = 0.1


def build_model(preset: str, seed: int) -> Any:
    """``BertForMaskedLM`` of a preset, initialised from ``seed`` (identical on every rank)."""
    import torch
    from transformers import BertForMaskedLM
    from transformers.utils import logging as hf_logging

    from onebit.train.model import bert_config

    if preset not in PRESETS:
        raise ValueError(f"model preset must be one of {sorted(PRESETS)}, got {preset!r}")
    shape = PRESETS[preset]
    hf_logging.set_verbosity_error()
    config = bert_config(
        vocab_size=shape.vocab_size,
        seq_len=shape.max_seq_len,
        layers=shape.layers,
        hidden=shape.hidden,
        heads=shape.heads,
        dropout=DROPOUT,
    )
    torch.manual_seed(seed)
    model = BertForMaskedLM(config)
    model.train()
    return model


def synthetic_batches(
    preset: str,
    batch_size: int,
    seq_len: int,
    count: int,
    rank: int,
    seed: int,
    mask_fraction: float = 0.15,
) -> list[dict[str, Any]]:
    """``count`` batches of random tokens for ``rank``: ``input_ids`` and MLM ``labels``.

    Each batch depends only on ``(seed, rank, index)``, so every method of a comparison sees
    the same data. Labels hold the token at ``mask_fraction`` of the positions (at least one
    per sequence) and -100 elsewhere.
    """
    import torch

    shape = PRESETS[preset]
    if seq_len > shape.max_seq_len:
        raise ValueError(
            f"seq_len {seq_len} exceeds the {preset} preset's max_seq_len {shape.max_seq_len}"
        )
    batches = []
    for index in range(count):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + index)
        ids = torch.randint(0, shape.vocab_size, (batch_size, seq_len), generator=generator)
        labelled = torch.rand(batch_size, seq_len, generator=generator) < mask_fraction
        labelled[:, 0] = True
        labels = torch.where(labelled, ids, torch.full_like(ids, -100))
        batches.append({"input_ids": ids, "labels": labels})
    return batches
