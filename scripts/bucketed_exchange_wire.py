"""The whole-buffer exchange against the bucketed (pipelined) one, on 2 emulated hosts.

Run as root from the checkout:

    .venv/bin/python scripts/bucketed_exchange_wire.py [log2 N] [rates...]

Per rank, the optimizers' exchange objects on N float32 (FlatExchange, and BucketedExchange
with 25 MiB buckets), one copy into the buffer included, fastest of the last 4 of 5 calls;
"line rate" is the time of the sign bytes each rank sends at the link's rate."""

import json
import os
import subprocess
import sys
import time


def rank_main(N):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    from onebit import kernels
    from onebit.exchange import BucketedExchange, FlatExchange, TrafficCounter

    r = dist.get_rank()
    x = torch.randn(N, generator=torch.Generator().manual_seed(r))
    buf = torch.empty(N)
    backend = kernels.select(buf)
    out = {}
    for name, exchange in (
        ("whole", FlatExchange(None)),
        ("bucketed", BucketedExchange(None, (25 << 20) // 4)),
    ):
        exchange.bind([N], torch.float32, torch.device("cpu"), backend, TrafficCounter())
        ts = []
        for _ in range(5):
            dist.barrier()
            t = time.perf_counter()
            buf.copy_(x)
            exchange.exchange(buf)
            ts.append(time.perf_counter() - t)
        out[name] = min(ts[1:])
        out[name + "_buckets"] = len(exchange.buckets()) if name == "bucketed" else 1
    if r == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main():
    if os.environ.get("WIRE_RANK"):
        return rank_main(int(sys.argv[1]))
    log2 = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    rates = sys.argv[2:] or ["none", "1gbit", "100mbit"]
    from onebit.bench.cluster import EmulatedCluster

    N, n = 1 << log2, 2
    for rate in rates:
        with EmulatedCluster(n, bandwidth=None if rate == "none" else rate) as cluster:
            procs = cluster.launch_ranks(
                [sys.executable, os.path.abspath(__file__), str(N)],
                env={"WIRE_RANK": "1"},
                stdout=subprocess.PIPE,
            )
            outs = [p.communicate(timeout=900)[0] for p in procs]
        res = json.loads(next(o for o in outs if o.strip()).strip().splitlines()[-1])
        line = (cluster.rate_bits_per_second or 0) / 8
        wire = 2 * (n - 1) / n * N / 8 / line if line else 0.0
        print(
            f"2^{log2}, {rate}: whole buffer {res['whole']:.3f} s, bucketed "
            f"({res['bucketed_buckets']} buckets) {res['bucketed']:.3f} s, ratio "
            f"{res['whole'] / res['bucketed']:.2f}x; sign bytes at line rate {wire:.3f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
