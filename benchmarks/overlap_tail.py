"""What the exchange overlapped with backward leaves after backward, fused against per tensor:
on emulated hosts, one rank each (one torch thread), BERT ``--model`` trains with 1-bit LAMB
and ``overlap_backward=True``, once with each compression, the two taking compression steps in
turn on the same batches. Per step: forward and backward (the buckets whose gradients are
final start there), ``step()``, and within it the *tail*, the exchange's remainder after
backward (``BucketPipeline.complete``: the buckets still to start, the server phases left,
the last results) before the update runs.

    .venv/bin/python benchmarks/overlap_tail.py [--model small] [--bandwidths 100mbit]
        [--steps 6] [--record FILE]

As root (the emulated hosts are network namespaces). The stage's first step, which exchanges
after backward, and the warm-up's one dense step are not timed. Per link: the median of each
phase, and per tensor / fused of the tail and of the step.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from typing import Any

RANK_FLAG = "--rank-main"
COMPRESSIONS = ("fused", "per_tensor")
#: The warm-up's dense step and the stage's first step (exchanged after backward): untimed.
UNTIMED_STEPS = 2
SEQ_LEN = 64


def _rank_main(model: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import onebit
    from onebit.bench.bert import build_model, synthetic_batches
    from onebit.exchange.bucketed import BucketPipeline
    from onebit.timing import time_calls

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    runs = {}
    for compression in COMPRESSIONS:
        net = build_model(model, 0)
        optimizer = onebit.OneBitLamb(
            net.parameters(), freeze_step=1, overlap_backward=True, compression=compression
        )
        runs[compression] = (net, optimizer)
    in_complete: collections.Counter[str] = collections.Counter()
    time_calls(in_complete, BucketPipeline, "complete", "tail")
    phases: dict[str, dict[str, list[float]]] = {
        name: {"forward_backward": [], "step": [], "tail": [], "total": []} for name in COMPRESSIONS
    }
    batches = synthetic_batches(model, 1, SEQ_LEN, UNTIMED_STEPS + steps, rank, 0)
    for index, batch in enumerate(batches):
        for compression, (net, optimizer) in runs.items():
            dist.barrier()
            tail_before = in_complete["tail"]
            start = time.perf_counter()
            net(**batch).loss.backward()
            middle = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            if index >= UNTIMED_STEPS:
                timed = phases[compression]
                timed["forward_backward"].append(middle - start)
                timed["step"].append(end - middle)
                timed["tail"].append(in_complete["tail"] - tail_before)
                timed["total"].append(end - start)
    if rank == 0:
        print(json.dumps(phases), flush=True)
    dist.destroy_process_group()


def _time_on(cluster: Any, model: str, steps: int) -> dict[str, dict[str, list[float]]]:
    argv = [sys.executable, __file__, RANK_FLAG, model, str(steps)]
    return cluster.rank0_record(argv, timeout=3600)


def _summary(row: dict[str, Any], compression: str) -> str:
    def median(phase: str) -> str:
        return f"{row[f'{compression}_{phase}_median']:.3f} s"

    return (
        f"{compression}: forward and backward {median('forward_backward')}, step() "
        f"{median('step')} of which the exchange's tail {median('tail')}, in all "
        f"{median('total')}"
    )


def main(argv: list[str] | None = None) -> int:
    from onebit.bert_shapes import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS), help="BERT preset")
    parser.add_argument("--bandwidths", default="100mbit", help="link rates, 'none' unshaped")
    parser.add_argument("--steps", type=int, default=6, help="timed compression steps of each")
    parser.add_argument("--record", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    from onebit.bench.cluster import EmulatedCluster

    rows = []
    for link in args.bandwidths.split(","):
        bandwidth = None if link == "none" else link
        with EmulatedCluster(2, bandwidth=bandwidth) as cluster:
            phases = _time_on(cluster, args.model, args.steps)
        row: dict[str, Any] = {"bandwidth": link, "model": args.model, "seconds": phases}
        for compression, timed in phases.items():
            for phase, values in timed.items():
                row[f"{compression}_{phase}_median"] = statistics.median(values)
        for phase in ("tail", "total"):
            row[f"{phase}_per_tensor_over_fused"] = (
                row[f"per_tensor_{phase}_median"] / row[f"fused_{phase}_median"]
            )
        rows.append(row)
        summaries = "; ".join(_summary(row, compression) for compression in COMPRESSIONS)
        print(
            f"{link}, {args.model}, rank 0, median of {args.steps} steps: {summaries}; per "
            f"tensor / fused: tail {row['tail_per_tensor_over_fused']:.2f}x, step "
            f"{row['total_per_tensor_over_fused']:.2f}x",
            flush=True,
        )
    if args.record:
        with open(args.record, "w") as out:
            json.dump({"argv": sys.argv[1:], "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [RANK_FLAG]:
        _rank_main(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
