"""The small BERT of the main job, built from a ``transformers`` config (no pretrained weights).

The masked-language-model head runs only at the masked positions (about 15% of the tokens),
which saves roughly a third of a training step on a small model, where the vocabulary
projection dominates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

from onebit.train.data import IGNORE_INDEX

#: Prefix of the encoder's parameters in both the MLM and the classification model.
ENCODER_PREFIX = "bert."


def bert_config(
    *,
    vocab_size: int,
    seq_len: int,
    layers: int,
    hidden: int,
    heads: int,
    dropout: float,
) -> BertConfig:
    """A BERT config with the usual 4x feed-forward width and positions for ``seq_len``."""
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by the number of heads {heads}")
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )


class BertForMaskedPositions(BertForMaskedLM):
    """``BertForMaskedLM`` (no pooler, tied embeddings) whose forward returns the MLM loss,
    computing the prediction head only where ``labels`` is not ``-100``."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Mean cross-entropy over the masked positions (0, with gradients, if there are none)."""
        hidden = self.bert(input_ids=input_ids).last_hidden_state
        selected = labels != IGNORE_INDEX
        logits = self.cls(hidden[selected])
        loss_sum = F.cross_entropy(logits, labels[selected], reduction="sum")
        return loss_sum / selected.sum().clamp(min=1)


def build_mlm_model(config: BertConfig) -> BertForMaskedPositions:
    """A freshly initialised MLM model (seed torch first for identical replicas)."""
    return BertForMaskedPositions(config)


def build_classifier(
    config: BertConfig, encoder_state: dict[str, torch.Tensor] | None, num_labels: int = 2
) -> BertForSequenceClassification:
    """A sequence classifier whose encoder takes ``encoder_state`` (an MLM model's state dict).

    Only the ``bert.*`` encoder weights are copied; the pooler and the classifier are new.
    ``encoder_state=None`` keeps the random initialisation (the no-pre-training baseline).
    """
    classifier = BertForSequenceClassification(
        BertConfig(**{**config.to_dict(), "num_labels": num_labels})
    )
    if encoder_state is None:
        return classifier
    encoder = {k: v for k, v in encoder_state.items() if k.startswith(ENCODER_PREFIX)}
    if not encoder:
        raise ValueError("the checkpoint holds no encoder weights (no 'bert.*' entries)")
    missing, unexpected = classifier.load_state_dict(encoder, strict=False)
    missing_encoder = [k for k in missing if not k.startswith(("bert.pooler.", "classifier."))]
    if missing_encoder or unexpected:
        raise ValueError(
            "the checkpoint's encoder does not match the model config: "
            f"missing {missing_encoder[:5]}, unexpected {unexpected[:5]}"
        )
    return classifier
