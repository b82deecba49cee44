"""The compute step's phases, for ``onebit estimate --backward-share`` and the forward floor of an
overlapped exchange (docs/ALGORITHM.md, "Cost model of a step").

One process, one torch thread (one rank of the emulated cluster), no process group: the
benchmark's BERT preset trains with LAMB on synthetic batches of the cluster benchmark's shape,
and each step's forward (to the loss), backward and ``Lamb.step()`` are timed apart. Prints the
median of each over the steps after the first two, and ``b``, backward's share of the step.

    .venv/bin/python benchmarks/step_phases.py [--model small] [--steps 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

#: The first steps allocate the optimizer's state and warm the caches: not counted.
UNCOUNTED_STEPS = 2


def main(argv: list[str] | None = None) -> int:
    from onebit.bert_shapes import PRESETS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="small",
        choices=sorted(PRESETS),
        help="the benchmark's BERT preset (default: small)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=12,
        help=f"steps run; the first {UNCOUNTED_STEPS} are not counted (default: 12)",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens a sequence (default: 64)")
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args(argv)
    if args.steps <= UNCOUNTED_STEPS:
        parser.error(f"--steps must be more than {UNCOUNTED_STEPS}")

    import torch

    import onebit
    from onebit.bench.bert import build_model, synthetic_batches

    preset, steps = args.model, args.steps
    torch.set_num_threads(1)
    model = build_model(preset, 0)
    optimizer = onebit.Lamb(model.parameters())
    times: dict[str, list[float]] = {"forward": [], "backward": [], "update": []}
    for i, batch in enumerate(synthetic_batches(preset, 1, args.seq_len, steps, 0, 0)):
        start = time.perf_counter()
        loss = model(**batch).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        end = time.perf_counter()
        if i >= UNCOUNTED_STEPS:
            times["forward"].append(forward - start)
            times["backward"].append(backward - forward)
            times["update"].append(end - backward)
    medians = {name: statistics.median(values) for name, values in times.items()}
    total = sum(medians.values())
    print(
        f"{preset}, 1 thread, median of {len(times['forward'])} steps: "
        + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in medians.items())
        + f"; step {total:.3f} s, b = backward / step = {medians['backward'] / total:.2f}"
    )
    if args.json:
        result = {"model": preset, "seconds": medians, "step": total}
        result["backward_share"] = medians["backward"] / total
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
