"""The small BERT of the main job, built from a ``transformers`` config (no pretrained weights).

Two architectures: ``bert`` (BERT with learned absolute position embeddings) and ``roformer``
(the same encoder with rotary position embeddings, RoFormer: the attention score of two
positions depends on their distance from the start, so attending to neighbours needs no
learned position table; small models on character-level text learn it within a few dozen
steps, where BERT's absolute positions left every head attending uniformly after 400 steps,
see docs/CONVERGENCE.md). The masked-language-model head runs only at the masked positions
(about 15% of the tokens), which saves roughly a third of a training step on a small model,
where the vocabulary projection dominates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    PretrainedConfig,
    RoFormerConfig,
    RoFormerForMaskedLM,
    RoFormerForSequenceClassification,
    RoFormerForTokenClassification,
)

from onebit.train.config import ARCHITECTURES
from onebit.train.data import IGNORE_INDEX

_CONFIGS: dict[str, type[PretrainedConfig]] = {"bert": BertConfig, "roformer": RoFormerConfig}


def bert_config(
    *,
    vocab_size: int,
    seq_len: int,
    layers: int,
    hidden: int,
    heads: int,
    dropout: float,
    architecture: str = "bert",
) -> PretrainedConfig:
    """A BERT (or RoFormer) config with the usual 4x feed-forward width and positions for
    ``seq_len``."""
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by the number of heads {heads}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    sizes = {"embedding_size": hidden} if architecture == "roformer" else {}
    return _CONFIGS[architecture](
        **sizes,
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )


def config_from_dict(data: dict) -> PretrainedConfig:
    """The config saved as ``data`` (``PretrainedConfig.to_dict()``), of its ``model_type``."""
    model_type = data.get("model_type", "bert")
    if model_type not in _CONFIGS:
        raise ValueError(f"unknown model type {model_type!r}; known: {list(_CONFIGS)}")
    return _CONFIGS[model_type].from_dict(data)


class _MaskedPositionsLoss:
    """A masked-LM model (no pooler, tied embeddings) whose forward returns the MLM loss,
    computing the prediction head only where ``labels`` is not ``-100``."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the masked positions (0, with gradients, if there are none)."""
        hidden = self.base_model(input_ids=input_ids).last_hidden_state
        selected = labels != IGNORE_INDEX
        logits = self.cls(hidden[selected])
        loss_sum = F.cross_entropy(logits, labels[selected], reduction="sum")
        return loss_sum / selected.sum().clamp(min=1)


class BertForMaskedPositions(_MaskedPositionsLoss, BertForMaskedLM):
    """``BertForMaskedLM`` with the loss at the masked positions only."""


class RoFormerForMaskedPositions(_MaskedPositionsLoss, RoFormerForMaskedLM):
    """``RoFormerForMaskedLM`` with the loss at the masked positions only."""


_MLM_MODELS = {"bert": BertForMaskedPositions, "roformer": RoFormerForMaskedPositions}
#: The classifiers by ``(model type, per token)``.
_CLASSIFIERS = {
    ("bert", False): BertForSequenceClassification,
    ("roformer", False): RoFormerForSequenceClassification,
    ("bert", True): BertForTokenClassification,
    ("roformer", True): RoFormerForTokenClassification,
}


def build_mlm_model(
    config: PretrainedConfig,
) -> BertForMaskedPositions | RoFormerForMaskedPositions:
    """A freshly initialised MLM model (seed torch first for identical replicas)."""
    return _MLM_MODELS[config.model_type](config)


def build_classifier(
    config: PretrainedConfig,
    encoder_state: dict[str, torch.Tensor] | None,
    num_labels: int = 2,
    *,
    per_token: bool = False,
) -> torch.nn.Module:
    """A sequence classifier (``per_token``: a token classifier, logits at every position)
    whose encoder takes ``encoder_state`` (an MLM model's state dict).

    Only the encoder weights (``bert.*`` or ``roformer.*``) are copied; the pooler and the
    classifier are new. ``encoder_state=None`` keeps the random initialisation (the
    no-pre-training baseline).
    """
    classifier = _CLASSIFIERS[config.model_type, per_token](
        type(config)(**{**config.to_dict(), "num_labels": num_labels})
    )
    if encoder_state is None:
        return classifier
    prefix = classifier.base_model_prefix + "."
    encoder = {k: v for k, v in encoder_state.items() if k.startswith(prefix)}
    if not encoder:
        raise ValueError(f"the checkpoint holds no encoder weights (no '{prefix}*' entries)")
    missing, unexpected = classifier.load_state_dict(encoder, strict=False)
    missing_encoder = [k for k in missing if not k.startswith((prefix + "pooler.", "classifier."))]
    if missing_encoder or unexpected:
        raise ValueError(
            "the checkpoint's encoder does not match the model config: "
            f"missing {missing_encoder[:5]}, unexpected {unexpected[:5]}"
        )
    return classifier
