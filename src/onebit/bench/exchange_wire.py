"""``onebit bench exchange``: the 1-bit exchange alone on emulated hosts (two by default), per
link rate.

Each rank (one per host, one torch thread) times, on the same ``2^k`` float32 elements, one
copy into a preallocated buffer (the 1-bit exchanges' own, ``send_buffer()``, as the
optimizers use it) followed by

* ``dense``: ``dist.all_reduce`` of the buffer (what DDP sends for LAMB);
* ``whole``: the whole-buffer 1-bit exchange (:class:`~onebit.exchange.FlatExchange`);
* ``bucketed``: the pipelined bucketed exchange (:class:`~onebit.exchange.BucketedExchange`,
  ``--bucket-cap-mb`` buckets), what ``bucket_cap_mb`` and ``overlap_backward`` run;

fastest of the calls after the first. Reported against the time of the sign bytes each rank
sends at the link's rate, ``2 (n - 1) / n * N / 8`` bytes among ``n`` hosts, and the exchange's
own unshaped time (when ``none`` is among the rates): the exchange's ideal is the larger of the
two.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

RANK_FLAG = "--rank-main"
#: Hosts of the exchange unless told otherwise (``--hosts``).
HOSTS = 2


def _rank_main(log2: int, bucket_elements: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    from onebit import kernels
    from onebit.exchange import BucketedExchange, FlatExchange, TrafficCounter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    n = 1 << log2
    values = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    backend = kernels.select(values)
    exchanges = {"whole": FlatExchange(None), "bucketed": BucketedExchange(None, bucket_elements)}
    for exchange in exchanges.values():
        exchange.bind([n], torch.float32, torch.device("cpu"), backend, TrafficCounter())
    # Each exchange's buffer is its own (n, then zero padding: whole bytes per rank), as the
    # optimizers use it: its error updates are computed while the bytes travel.
    buffers = {"dense": torch.empty(n)}
    buffers.update({name: e.send_buffer() for name, e in exchanges.items()})
    runs = {
        "dense": lambda: dist.all_reduce(buffers["dense"]),
        **{name: lambda e=e, b=buffers[name]: e.exchange(b) for name, e in exchanges.items()},
    }
    seconds: dict[str, Any] = {}
    for name, run in runs.items():
        times = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            buffers[name][:n].copy_(values)
            buffers[name][n:].zero_()  # the padding (scratch after the previous call)
            run()
            times.append(time.perf_counter() - start)
        seconds[name] = min(times[1:])
    seconds["buckets"] = len(exchanges["bucketed"].buckets())
    if dist.get_rank() == 0:
        print(json.dumps(seconds), flush=True)
    dist.destroy_process_group()


def time_exchanges(cluster: Any, log2: int, bucket_elements: int, calls: int) -> dict[str, Any]:
    """Rank 0's timings (and bucket count) of the three runs on ``cluster`` (an
    :class:`~onebit.bench.cluster.EmulatedCluster`, one rank per host)."""
    argv = [sys.executable, "-m", __name__, RANK_FLAG, str(log2), str(bucket_elements)]
    return cluster.rank0_record([*argv, str(calls)], timeout=1800)


def sign_seconds(log2: int, rate_bits_per_second: float, hosts: int = HOSTS) -> float:
    """Seconds of the sign bytes one rank sends in an exchange of ``2^log2`` elements among
    ``hosts`` hosts, ``2 (n - 1) / n * N / 8``, at the link's rate."""
    return 2 * (hosts - 1) / hosts * (1 << log2) / 8 / (rate_bits_per_second / 8)


def bucket_elements_of(bucket_cap_mb: float) -> int:
    """Float32 elements in a bucket of ``bucket_cap_mb`` MiB."""
    return max(1, int(bucket_cap_mb * 2**20) // 4)


def run_exchange_bench(
    log2: int,
    bandwidths: list[str | None],
    bucket_cap_mb: float,
    calls: int,
    hosts: int = HOSTS,
) -> list[dict[str, Any]]:
    """One row per link rate (``None``: unshaped) on ``hosts`` hosts: the three timings and
    the wire time."""
    from onebit.bench.cluster import EmulatedCluster

    rows = []
    for bandwidth in bandwidths:
        with EmulatedCluster(hosts, bandwidth=bandwidth) as cluster:
            row = time_exchanges(cluster, log2, bucket_elements_of(bucket_cap_mb), calls)
            rate = cluster.rate_bits_per_second
        row["bandwidth"] = bandwidth
        row["hosts"] = hosts
        row["wire"] = sign_seconds(log2, rate, hosts) if rate else None
        rows.append(row)
    unshaped = next((r for r in rows if r["bandwidth"] is None), None)
    for row in rows:
        floors = [t for t in (row["wire"], unshaped and unshaped["bucketed"]) if t]
        row["ideal"] = max(floors) if floors else None
    return rows


def format_rows(rows: list[dict[str, Any]], log2: int) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    head = (
        f"| link ({rows[0]['hosts']} hosts, 2^{log2} float32) | dense allreduce | "
        "1-bit, whole buffer | 1-bit, bucketed (pipelined) | sign bytes at line rate | "
        "bucketed / max(line rate, unshaped bucketed) | bucketed / dense |"
    )
    out = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['bucketed'] / r['ideal']:.2f}x" if r["ideal"] else "-"
        out.append(
            f"| {r['bandwidth'] or 'unshaped'} | {cell(r['dense'])} | {cell(r['whole'])} | "
            f"{cell(r['bucketed'])} ({r['buckets']} buckets) | {cell(r['wire'])} | {ratio} | "
            f"{r['bucketed'] / r['dense']:.2f}x |"
        )
    return "\n".join(out)


if __name__ == "__main__" and sys.argv[1:2] == [RANK_FLAG]:
    _rank_main(*(int(a) for a in sys.argv[2:5]))
