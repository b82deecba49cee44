"""The shapes of the BERT models that the benchmarks and the cost model speak of: presets by
name, their parameter counts, and their tensor shapes (for timing optimizer steps on
realistic tensors without building a model)."""

from __future__ import annotations

import dataclasses
import math

__all__ = ["PRESETS", "ModelPreset", "bert_shapes"]


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """The shape of a BERT (the feed-forward layers are 4 x ``hidden`` wide)."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    max_seq_len: int = 512

    def embedding_count(self) -> int:
        """Parameters of the embeddings: words (tied to the decoder), positions, two token
        types and their LayerNorm."""
        return (self.vocab_size + self.max_seq_len + 2) * self.hidden + 2 * self.hidden

    def parameter_count(self) -> int:
        """Trainable parameters of ``BertForMaskedLM`` with this shape (decoder tied)."""
        h, i, v = self.hidden, 4 * self.hidden, self.vocab_size
        layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
        head = h * h + h + 2 * h + v
        return self.embedding_count() + self.layers * layer + head

    def tail_share(self) -> float:
        """The share of the parameters whose gradients backward completes last: the
        embeddings, which forward uses first (the tied word embeddings get the decoder's
        gradient first, the lookup's last)."""
        return self.embedding_count() / self.parameter_count()


PRESETS: dict[str, ModelPreset] = {
    "base": ModelPreset(30522, 768, 12, 12),
    "large": ModelPreset(30522, 1024, 24, 16),
    "small": ModelPreset(30522, 512, 4, 8),
    "mini": ModelPreset(30522, 256, 4, 4),
    "tiny": ModelPreset(1024, 64, 2, 2, max_seq_len=128),
}


def bert_shapes(scale: float = 1.0, preset: str = "base") -> list[tuple[int, ...]]:
    """The encoder's parameter shapes of BERT ``preset`` in their real tensor shapes (base:
    197 tensors, 108.9M parameters; large: 389, 334.1M), without the pre-training head.

    ``scale`` multiplies the widths (hidden and feed-forward); below 1 for quick runs."""
    shape = PRESETS[preset]
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    hidden, ff, vocab = int(shape.hidden * scale), int(4 * shape.hidden * scale), shape.vocab_size
    if not hidden >= 1:
        raise ValueError(
            f"scale {scale!r} leaves {preset}'s hidden width {shape.hidden} below 1; give a "
            f"scale of at least {1 / shape.hidden:.3g}"
        )
    shapes: list[tuple[int, ...]] = [
        (vocab, hidden),
        (shape.max_seq_len, hidden),
        (2, hidden),
        (hidden,),
        (hidden,),
    ]
    for _ in range(shape.layers):
        shapes += [(hidden, hidden), (hidden,)] * 4  # query, key, value, attention output
        shapes += [(hidden,), (hidden,)]  # attention LayerNorm
        shapes += [(ff, hidden), (ff,), (hidden, ff), (hidden,)]  # feed-forward
        shapes += [(hidden,), (hidden,)]  # output LayerNorm
    return shapes
