"""The local work of 0/1 Adam's steps after the variance freeze, for each CPU backend, in
copies of the parameter buffer (the time of ``copy_`` between two buffers of that size).

    .venv/bin/python scripts/zero_one_adam_step_cost.py [--scale 0.5] [--repeats 8]

On BERT-base's parameter shapes shrunk by ``--scale``, in a world of one rank with one
thread: one ``ZeroOneAdam`` per backend (``onebit.kernels``) takes the same steps in turn,
with the variance frozen after step 1 and the local interval at its longest (16) from step
5 on; every step is timed alone and grouped by its kind (``local``: the momentum and weight
update; ``sync``: that update plus the accumulated update's 1-bit exchange). Medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import onebit
from onebit.bert_shapes import bert_shapes
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE
from onebit.timing import copy_fn, cpu_backends

KINDS = ("local", "sync")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=8, help="timed steps of each kind")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    shapes = bert_shapes(args.scale)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=gen) * 1e-3 for shape in shapes]
    runs = {}
    for backend in cpu_backends():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
        optimizer = onebit.ZeroOneAdam(
            params, lr=1e-4, weight_decay=0.01, local_step_scaler=1, kernels=backend,
            **(DEEPSPEED_SCHEDULE | {"var_freeze_step": 1}),
        )  # fmt: skip
        runs[backend] = (params, optimizer, {kind: [] for kind in KINDS})
    numel = sum(p.numel() for p in runs[cpu_backends()[0]][0])
    copy = copy_fn(numel)
    copies = []
    while min(len(times) for _, _, kinds in runs.values() for times in kinds.values()) < (
        args.repeats
    ):
        start = time.perf_counter()
        copy()
        copies.append(time.perf_counter() - start)
        for params, optimizer, kinds in runs.values():
            kind = optimizer.stage
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            start = time.perf_counter()
            optimizer.step()
            if kind in kinds and optimizer.step_count > 4:  # past the first, shorter intervals
                kinds[kind].append(time.perf_counter() - start)
    unit = statistics.median(copies)
    print(f"{numel / 1e6:.1f}M parameters, 1 thread; median step time in copies")
    print(f"{'backend':>8} {'local':>7} {'sync':>7}")
    for backend, (_, _, kinds) in runs.items():
        local, sync = (statistics.median(kinds[k][: args.repeats]) / unit for k in KINDS)
        print(f"{backend:>8} {local:>7.1f} {sync:>7.1f}")


if __name__ == "__main__":
    main()
