"""The two exchanges of 1-bit Adam (or of 1-bit LAMB, ``--optimizer lamb``) side by side on the
main job's model: bytes and collectives per compression-stage step, and the time of that step
(world size 1: the local work only).

    .venv/bin/python scripts/compression_modes.py [--optimizer adam --hidden 128 --repeats 20]

Bytes are what :mod:`onebit.collectives` counts for n ranks (``compressed_allreduce_bytes``
and ``compressed_allreduce_per_tensor_bytes``); both exchanges make the same four collectives
per step (tests/unit/test_per_tensor.py counts them). Step times: ``optimizer.step()`` of
``OneBitAdam(compression=...)`` (or ``OneBitLamb``) in the compression stage, one thread, both
modes measured alternately in the same process, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import onebit
from onebit.collectives import compressed_allreduce_bytes, compressed_allreduce_per_tensor_bytes
from onebit.train.model import bert_config, build_mlm_model

MODES = ("fused", "per_tensor")
OPTIMIZERS = {"adam": onebit.OneBitAdam, "lamb": onebit.OneBitLamb}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps; 0: bytes only")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 64])
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    config = bert_config(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        dropout=0.0,
    )
    torch.manual_seed(0)
    template = build_mlm_model(config)
    numels = [p.numel() for p in template.parameters() if p.requires_grad]
    total = sum(numels)
    print(f"model: {len(numels)} tensors, {total} parameters (fp32)")
    print("| ranks | dense allreduce | fused | per_tensor | per_tensor / fused |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.world_sizes:
        dense = 2 * (n - 1) * total * 4 // n
        fused = compressed_allreduce_bytes(onebit.padded_size(total, n), n, torch.float32)
        per_tensor = compressed_allreduce_per_tensor_bytes(numels, n, torch.float32)
        print(f"| {n} | {dense} | {fused} | {per_tensor} | {per_tensor / fused:.4f} |")
    if args.repeats > 0:
        print_step_times(OPTIMIZERS[args.optimizer], config, template, numels, args.repeats)


def print_step_times(optimizer, config, template, numels: list[int], repeats: int) -> None:
    """Median time of a compression-stage ``optimizer.step()`` in each mode."""
    optimizers, params = {}, {}
    for mode in MODES:
        model = build_mlm_model(config)
        model.load_state_dict(template.state_dict())
        params[mode] = [p for p in model.parameters() if p.requires_grad]
        optimizers[mode] = optimizer(params[mode], freeze_step=1, compression=mode)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen) for n in numels]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(repeats + 2):  # the first two steps: warm-up and the switch
        for mode in MODES:
            for p, g in zip(params[mode], grads, strict=True):
                p.grad = g.view_as(p)
            start = time.perf_counter()
            optimizers[mode].step()
            if repeat >= 2:
                times[mode].append(time.perf_counter() - start)
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    print(f"compression-stage {optimizer.__name__}.step(), world size 1, one thread, median:")
    for mode in MODES:
        ratio = medians[mode] / medians["fused"]
        print(f"  {mode:10s} {1000 * medians[mode]:8.2f} ms  ({ratio:.2f}x fused)")


if __name__ == "__main__":
    main()
