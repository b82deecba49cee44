"""The models ``onebit estimate`` knows by name, and parameter counts given as text."""

from __future__ import annotations

import math

from onebit.bert_shapes import PRESETS, ModelPreset

__all__ = ["NAMED_MODELS", "model_parameters", "model_tail_share"]

#: Named models: BERT-Base and BERT-Large, and the benchmark's ``small`` and ``mini``.
NAMED_MODELS: dict[str, ModelPreset] = {
    "bert-base": PRESETS["base"],
    "bert-large": PRESETS["large"],
    "small": PRESETS["small"],
    "mini": PRESETS["mini"],
}
_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}


def model_parameters(text: str) -> int:
    """Parameters of a named model (``bert-base``, ``bert-large``, ``small``, ``mini``: BERT
    masked-language models, counted by :class:`onebit.bert_shapes.ModelPreset`) or a count such
    as ``340M``, ``1.3B`` or ``110000000``."""
    name = text.strip().lower()
    if name in NAMED_MODELS:
        return NAMED_MODELS[name].parameter_count()
    scale = _SUFFIXES.get(name[-1:], 1.0)
    number = name[:-1] if name[-1:] in _SUFFIXES else name
    try:
        count = float(number) * scale
    except ValueError:
        count = math.nan
    if not (math.isfinite(count) and count >= 1):
        raise ValueError(
            f"model must be one of {sorted(NAMED_MODELS)} or a parameter count such as 340M or "
            f"1.3e9; got {text!r}"
        )
    return round(count)


def model_tail_share(text: str) -> float:
    """The share of a named model's parameters whose gradients backward completes last (its
    embeddings, :meth:`onebit.bert_shapes.ModelPreset.tail_share`); 0 for a parameter count."""
    preset = NAMED_MODELS.get(text.strip().lower())
    return 0.0 if preset is None else preset.tail_share()
