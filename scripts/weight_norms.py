"""The Frobenius norm of every weight of two runs' newest checkpoints, side by side.

    python scripts/weight_norms.py RUN_DIR OTHER_RUN_DIR [--rows NAME ...]

Prints one line per tensor (``||w||`` in each run and their ratio, other / first) and, for each
tensor named with ``--rows``, the norm of each of its rows (e.g. the token-type embeddings,
whose second row no pre-training input uses).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from onebit.train import checkpoint
from onebit.train.run_dir import CHECKPOINT_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs=2, metavar="RUN_DIR")
    parser.add_argument("--rows", nargs="*", default=[], help="tensors to show row by row")
    args = parser.parse_args()
    states = [checkpoint.latest_model_state(d / CHECKPOINT_DIR)[1]["model"] for d in args.run_dirs]
    first, other = states
    if first.keys() != other.keys():
        raise SystemExit("the two checkpoints hold different tensors")
    names = [str(d) for d in args.run_dirs]
    print(f"{'tensor':<64} {names[0]:>14} {names[1]:>14} {'ratio':>8}")
    for name, tensor in first.items():
        a, b = tensor.float().norm().item(), other[name].float().norm().item()
        print(f"{name:<64} {a:14.4f} {b:14.4f} {b / a if a else float('inf'):8.3f}")
    for name in args.rows:
        if name not in first:
            raise SystemExit(f"no tensor {name!r} in the checkpoints")
        for i, (a, b) in enumerate(zip(first[name].float(), other[name].float(), strict=True)):
            print(f"{name}[{i}] {a.norm().item():.4f} {b.norm().item():.4f}")


if __name__ == "__main__":
    main()
