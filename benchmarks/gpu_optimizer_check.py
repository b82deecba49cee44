"""The optimizers on CUDA against the same run on CPU (part of scripts/gpu_check.sh).

    .venv/bin/python benchmarks/gpu_optimizer_check.py [--optimizers lamb onebit-lamb ...]

1. World size 1: Lamb, OneBitLamb, OneBitAdam and ZeroOneAdam on float64 CUDA parameters
   (triton for the exchange and the update) against float64 CPU
   parameters (numba where installed): same gradients, clipped by the optimizers' max_grad_norm,
   one row that never gets a gradient (the variance-0 mask), 12 steps across the switch to
   compression (0/1 Adam: dense and 1-bit gradient steps, the freeze, local intervals of 1
   and 2 steps). float64 leaves only summation-order differences (~1e-15), so 1e-9 catches
   any error in the maths.
2. Two NCCL ranks (one GPU each) against two gloo ranks on CPU, OneBitLamb: ranks
   bit-identical on each backend, and the two trajectories within 1e-9 (float64). Skipped, and
   said so, when fewer than two GPUs are visible or with ``--no-ranks``.

Prints one PASS/FAIL line per comparison. Exit status: 0 when every part that ran passed, 1 on
a failure, 77 when no CUDA device is visible (nothing could run).
"""

from __future__ import annotations

import argparse
import sys

import torch

import onebit
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE
from onebit.testing import spawn_workers

OPTIMIZERS = ("lamb", "onebit-lamb", "onebit-adam", "zero-one-adam")
SHAPES = [(64, 48), (48,), (33, 7), (5,)]
STEPS, FREEZE = 12, 5
NEVER_READ_ROW = 7  # of the first tensor: its gradient is always 0
MAX_NORM = 40.0  # below the gradients' norm (about 58), so clipping acts at every step


def trajectory(kind: str, device: str, rank: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(device))
        for s in SHAPES
    ]
    clip = {"max_grad_norm": MAX_NORM}
    build = {
        "lamb": lambda: onebit.Lamb(params, lr=0.01, weight_decay=0.01, max_coeff=0.3, **clip),
        "onebit-lamb": lambda: onebit.OneBitLamb(
            params, lr=0.01, freeze_step=FREEZE, weight_decay=0.01, max_coeff=0.3, **clip
        ),
        "onebit-adam": lambda: onebit.OneBitAdam(params, lr=0.01, freeze_step=FREEZE, **clip),
        "zero-one-adam": lambda: onebit.ZeroOneAdam(
            params,
            **clip,
            lr=0.01,
            weight_decay=0.01,
            var_update_scaler=2,
            local_step_scaler=3,
            local_step_clipper=2,
            **(DEEPSPEED_SCHEDULE | {"var_freeze_step": FREEZE}),
        ),
    }
    optimizer = build[kind]()
    grads = torch.Generator().manual_seed(100 + rank)
    history = []
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads, dtype=torch.float64).to(device)
        params[0].grad[NEVER_READ_ROW] = 0
        optimizer.step()
        history.append(torch.cat([p.detach().reshape(-1).cpu() for p in params]))
    return history


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def _rank(rank: int, world: int, device: str) -> list[torch.Tensor]:
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    return trajectory("onebit-lamb", device, rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=OPTIMIZERS,
        default=list(OPTIMIZERS),
        help="the optimizers of part 1 (default: all four)",
    )
    parser.add_argument(
        "--no-ranks", action="store_true", help="skip part 2 (the NCCL and gloo ranks)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 77
    failed = False
    for kind in args.optimizers:
        difference = max_difference(trajectory(kind, "cuda"), trajectory(kind, "cpu"))
        ok = difference < 1e-9
        failed |= not ok
        print(
            f"{kind:13} world size 1, CUDA vs CPU: max relative difference {difference:.2e} "
            f"({'PASS' if ok else 'FAIL'})"
        )
    if args.no_ranks:
        return 1 if failed else 0
    if torch.cuda.device_count() < 2:
        print("2 NCCL ranks: SKIP (needs 2 GPUs; NCCL does not run two ranks on one GPU)")
        return 1 if failed else 0
    nccl = spawn_workers(_rank, 2, args=("cuda",), backend="nccl", timeout_s=300)
    gloo = spawn_workers(_rank, 2, args=("cpu",), backend="gloo", timeout_s=300)
    identical = all(
        torch.equal(a, b) for runs in (nccl, gloo) for a, b in zip(runs[0], runs[1], strict=True)
    )
    difference = max_difference(nccl[0], gloo[0])
    ok = identical and difference < 1e-9
    failed |= not ok
    print(
        f"onebit-lamb   2 NCCL ranks vs 2 gloo ranks: ranks identical {identical}, max "
        f"relative difference {difference:.2e} ({'PASS' if ok else 'FAIL'})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
