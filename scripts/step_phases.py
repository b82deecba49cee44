"""The compute step's phases, for ``onebit estimate --backward-share`` and the forward floor of an
overlapped exchange (docs/ALGORITHM.md, "Cost model of a step").

One process, one torch thread (one rank of the emulated cluster), no process group: the
benchmark's BERT preset trains with LAMB on synthetic batches of the cluster benchmark's shape,
and each step's forward (to the loss), backward and ``Lamb.step()`` are timed apart. Prints the
median of each over the steps after the first two, and ``b``, backward's share of the step.

    .venv/bin/python scripts/step_phases.py [preset] [steps]   # e.g. base 12
"""

from __future__ import annotations

import statistics
import sys
import time


def main() -> None:
    import torch

    import onebit
    from onebit.bench.bert import build_model, synthetic_batches

    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    torch.set_num_threads(1)
    model = build_model(preset, 0)
    optimizer = onebit.Lamb(model.parameters())
    times: dict[str, list[float]] = {"forward": [], "backward": [], "update": []}
    for i, batch in enumerate(synthetic_batches(preset, 1, 64, steps, 0, 0)):
        start = time.perf_counter()
        loss = model(**batch).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        end = time.perf_counter()
        if i >= 2:
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


if __name__ == "__main__":
    main()
