"""Where the time of an overlapped 1-bit LAMB step goes, on 2 emulated hosts.

Run as root from the checkout:

    .venv/bin/python scripts/overlap_step_split.py [preset] [rate]   # e.g. base 100mbit

Each rank (one per host, one thread) trains the benchmark's BERT preset (``small``,
``base``, ...) for 7 steps with 1-bit LAMB (freeze_step=1, 25 MiB buckets), with and without
``overlap_backward``, and prints, fastest of the last 5 steps: forward+backward, step(), and
inside backward the time spent in onebit's hooks, split into forming the momentum and the
worker phase (compression, then the collectives handed to gloo)."""

import json
import os
import subprocess
import sys
import time
from collections import defaultdict


def rank_main(preset: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    import onebit
    from onebit.bench.bert import build_model, synthetic_batches
    from onebit.exchange import over_group
    from onebit.optim import _overlap
    from onebit.timing import time_calls

    spent = defaultdict(float)

    time_calls(spent, _overlap.BackwardOverlap, "_on_gradient", "hooks")
    time_calls(spent, over_group.Round, "send_workers", "worker phase")
    rank, out = dist.get_rank(), {}
    for mode in ("after", "overlap"):
        model = build_model(preset, 0)
        optimizer = onebit.OneBitLamb(
            model.parameters(), freeze_step=1, bucket_cap_mb=25, overlap_backward=mode == "overlap"
        )
        rows = []
        for i, batch in enumerate(synthetic_batches(preset, 1, 64, 7, rank, 0)):
            dist.barrier()
            spent.clear()
            start = time.perf_counter()
            model(**batch).loss.backward()
            middle = time.perf_counter()
            in_backward = dict(spent)
            optimizer.step()
            end = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            if i >= 2:
                rows.append({"fwd+bwd": middle - start, "step": end - middle, **in_backward})
        best = min(rows, key=lambda r: r["fwd+bwd"] + r["step"])
        out[mode] = {k: round(v, 3) for k, v in best.items()}
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    if os.environ.get("SPLIT_RANK"):
        return rank_main(sys.argv[1])
    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    rate = sys.argv[2] if len(sys.argv) > 2 else "100mbit"
    from onebit.bench.cluster import EmulatedCluster

    with EmulatedCluster(2, bandwidth=None if rate == "none" else rate) as cluster:
        procs = cluster.launch_ranks(
            [sys.executable, os.path.abspath(__file__), preset],
            env={"SPLIT_RANK": "1"},
            stdout=subprocess.PIPE,
        )
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    print(preset, rate, next(o for o in outs if o.strip()).strip().splitlines()[-1])


if __name__ == "__main__":
    main()
