"""What computing the error updates while the bytes travel saves the per-tensor exchange:
side by side on emulated hosts, one rank each (one torch thread), the same exchange of the
same values, its calls alternating between

* ``ahead``: the exchange's own buffer (``send_buffer()``, as the optimizers use it): the
  error updates computed while each phase's bytes travel (ALGORITHM.md, "Error updates while
  the bytes travel");
* ``after``: a buffer of the caller's: every error update after the last check, where it
  lengthens the exchange.

    .venv/bin/python benchmarks/errors_ahead.py [--model base] [--bandwidths 100mbit,none]
        [--bucket-cap-mb 25] [--calls 7] [--record FILE]

As root (the emulated hosts are network namespaces). The tensors are BERT ``--model``'s
(:func:`onebit.bert_shapes.bert_shapes`); ``--bucket-cap-mb 0`` runs
the per-tensor exchange whole, else in buckets of whole tensors. Per link: the median and the
fastest call of each (the first call of each left out), and ``after / ahead`` of the medians.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

RANK_FLAG = "--rank-main"


def _rank_main(model: str, bucket_elements: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    from onebit import kernels
    from onebit.bert_shapes import bert_shapes
    from onebit.exchange import PerTensorBucketedExchange, PerTensorExchange, TrafficCounter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    numels = [math.prod(shape) for shape in bert_shapes(preset=model)]
    values = torch.randn(sum(numels), generator=torch.Generator().manual_seed(dist.get_rank()))
    exchange = (
        PerTensorExchange(None)
        if bucket_elements == 0
        else PerTensorBucketedExchange(None, bucket_elements)
    )
    exchange.bind(
        numels, torch.float32, torch.device("cpu"), kernels.select(values), TrafficCounter()
    )
    buffers = {"ahead": exchange.send_buffer(), "after": torch.empty_like(values)}
    seconds: dict[str, list[float]] = {name: [] for name in buffers}
    for _ in range(calls):
        for name, buffer in buffers.items():
            dist.barrier()
            start = time.perf_counter()
            buffer.copy_(values)
            exchange.exchange(buffer)
            seconds[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(json.dumps({name: times[1:] for name, times in seconds.items()}), flush=True)
    dist.destroy_process_group()


def _time_on(cluster: Any, model: str, bucket_elements: int, calls: int) -> dict[str, Any]:
    argv = [sys.executable, __file__, RANK_FLAG, model, str(bucket_elements), str(calls)]
    return cluster.rank0_record(argv, timeout=1800)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="base", help="BERT preset whose tensors travel")
    parser.add_argument("--bandwidths", default="100mbit,none", help="link rates, 'none' unshaped")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="0: no buckets")
    parser.add_argument("--calls", type=int, default=7, help="calls of each, the first untimed")
    parser.add_argument("--record", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.calls < 2:
        parser.error(f"--calls must be at least 2 (the first is not timed), got {args.calls}")
    if args.bucket_cap_mb < 0:
        parser.error(f"--bucket-cap-mb must be 0 (no buckets) or more, got {args.bucket_cap_mb}")
    from onebit.bench.cluster import EmulatedCluster

    bucket_elements = int(args.bucket_cap_mb * 2**20) // 4
    rows = []
    for link in args.bandwidths.split(","):
        bandwidth = None if link == "none" else link
        with EmulatedCluster(2, bandwidth=bandwidth) as cluster:
            times = _time_on(cluster, args.model, bucket_elements, args.calls)
        row = {"bandwidth": link, **{f"{k}_seconds": v for k, v in times.items()}}
        for name, values in times.items():
            row[f"{name}_median"] = statistics.median(values)
            row[f"{name}_fastest"] = min(values)
        row["after_over_ahead"] = row["after_median"] / row["ahead_median"]
        rows.append(row)
        print(
            f"{link}: ahead median {row['ahead_median']:.3f} s (fastest "
            f"{row['ahead_fastest']:.3f} s), after median {row['after_median']:.3f} s (fastest "
            f"{row['after_fastest']:.3f} s), after / ahead {row['after_over_ahead']:.2f}x",
            flush=True,
        )
    if args.record:
        with open(args.record, "w") as out:
            json.dump({"argv": sys.argv[1:], "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [RANK_FLAG]:
        _rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(main())
