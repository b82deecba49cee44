"""How much attention each head of a pre-trained run pays to the tokens at offsets -2..2.

    python scripts/attention_by_offset.py RUN_DIR [--sequences 64]

Loads the newest checkpoint of RUN_DIR, runs its first validation sequences (no masking) and
prints, per layer and head, the mean attention weight from position i to position i + k for
k = -2..2, beside 1/T, the weight of uniform attention over T positions. A head that has
learned to look at its neighbours puts several times 1/T on k = -1 or k = +1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from onebit.train import checkpoint
from onebit.train.job_data import load_data
from onebit.train.model import build_mlm_model, config_from_dict
from onebit.train.run_dir import CHECKPOINT_DIR, read_config

OFFSETS = (-2, -1, 0, 1, 2)


def attention_by_offset(attention: torch.Tensor, offset: int) -> torch.Tensor:
    """Mean over batch and positions of ``attention[b, h, i, i + offset]``, per head."""
    length = attention.shape[-1]
    rows = torch.arange(max(0, -offset), min(length, length - offset))
    return attention[:, :, rows, rows + offset].mean(dim=(0, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--sequences", type=int, default=64)
    args = parser.parse_args()
    step, state = checkpoint.latest_model_state(args.run_dir / CHECKPOINT_DIR)
    model = build_mlm_model(config_from_dict(state["bert_config"]))
    model.load_state_dict(state["model"])
    model.set_attn_implementation("eager")  # the fused kernels return no weights
    model.eval()
    mlm, _ = load_data(read_config(args.run_dir))
    inputs = mlm.validation[: args.sequences]
    with torch.no_grad():
        attentions = model.base_model(input_ids=inputs, output_attentions=True).attentions
    print(f"{args.run_dir} at step {step}; uniform attention: {1 / inputs.shape[1]:.3f}")
    print("layer head " + " ".join(f"{k:>+6d}" for k in OFFSETS))
    for layer, attention in enumerate(attentions):
        profile = torch.stack([attention_by_offset(attention, k) for k in OFFSETS], dim=1)
        for head, row in enumerate(profile.tolist()):
            print(f"{layer:>5d} {head:>4d} " + " ".join(f"{w:6.3f}" for w in row))


if __name__ == "__main__":
    main()
