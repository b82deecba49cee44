#!/usr/bin/env python3
"""The optimizers' shape, counted: each optimizer's classes (onebit's, in method resolution
order) with the methods and properties each defines, and for one compression step of the
default ``OneBitLamb`` on 2 gloo ranks the frames from ``step()`` to the first collective, the
files on that path, and the onebit functions and files the step runs through.

    .venv/bin/python benchmarks/optimizer_anatomy.py [--json FILE]

Run it with ``PYTHONPATH=<another checkout>/src`` to count another version of the library.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import onebit
from onebit.testing import spawn_workers

#: The collectives whose first call in the step is "the first byte".
COLLECTIVES = (
    "all_to_all_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    "isend",
    "irecv",
    "send",
    "recv",
    "broadcast",
)


def class_counts() -> dict[str, dict[str, int]]:
    """Per optimizer: each of its onebit classes and the callables it defines itself."""
    counts = {}
    for optimizer in (onebit.Lamb, onebit.OneBitLamb, onebit.OneBitAdam, onebit.ZeroOneAdam):
        counts[optimizer.__name__] = {
            cls.__name__: sum(
                inspect.isfunction(v) or isinstance(v, property | staticmethod | classmethod)
                for v in vars(cls).values()
            )
            for cls in optimizer.__mro__
            if cls.__module__.startswith("onebit")
        }
    return counts


def _step_anatomy(rank: int, world: int) -> dict:
    """On each rank: 3 steps of OneBitLamb(freeze_step=1); the third (a compression step
    after the first) traced."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    optimizer = onebit.OneBitLamb(model.parameters(), lr=1e-3, freeze_step=1)
    root = os.path.dirname(onebit.__file__)
    first: dict = {}
    called: set[tuple[str, str]] = set()
    tracing = [False]

    def wrap(name, collective):
        def traced(*args, **kwargs):
            if tracing[0] and "path" not in first:
                path = []
                for frame in inspect.stack()[1:]:
                    path.append((os.path.relpath(frame.filename, root), frame.function))
                    if frame.function == "step" and frame.filename.startswith(root):
                        break
                first.update(path=path[::-1], collective=name)
            return collective(*args, **kwargs)

        return traced

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            called.add((os.path.relpath(frame.f_code.co_filename, root), frame.f_code.co_name))

    generator = torch.Generator().manual_seed(rank)
    for step in range(3):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        tracing[0] = step == 2
        sys.setprofile(profile if tracing[0] else None)
        optimizer.step()
        sys.setprofile(None)
    return {
        "first_collective": first["collective"],
        "path": first["path"],
        "functions": len(called),
        "files": len({file for file, _ in called}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="also write the counts here")
    args = parser.parse_args(argv)
    classes = class_counts()
    step = spawn_workers(_step_anatomy, 2)[0]
    print(f"onebit from {os.path.dirname(onebit.__file__)}")
    for optimizer, chain in classes.items():
        levels = ", ".join(f"{name} {count}" for name, count in chain.items())
        print(f"{optimizer}: {len(chain)} onebit classes ({levels} methods)")
    path = step["path"]
    print(
        f"one compression step of OneBitLamb (2 ranks): {len(path)} frames in "
        f"{len({file for file, _ in path})} files from step() to the first collective "
        f"({step['first_collective']}); {step['functions']} onebit functions in "
        f"{step['files']} files run"
    )
    for file, function in path:
        print(f"  {file}: {function}")
    if args.json:
        args.json.write_text(json.dumps({"classes": classes, "step": step}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
