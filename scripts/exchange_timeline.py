"""Where the bucketed exchange's time goes on a shaped link: one exchange of ``2^k`` float32
on 2 emulated hosts, with each rank's phase boundaries and its link's bytes over time.

Run as root from the checkout:

    .venv/bin/python scripts/exchange_timeline.py [BANDWIDTH] [--log2 25] [--bucket-cap-mb 25]

Each rank runs ``onebit bench exchange``'s bucketed call (a copy into the exchange's own
buffer, then :class:`~onebit.exchange.BucketedExchange`) ``--calls`` times; a thread reads its
interface's byte counters every millisecond. The last call is reported for both ranks (the
same call, so their clocks, one monotonic clock of the machine, line up): when each bucket's
worker phase was sent, when its signs were in (the wait in its server phase) and when its
result was in, and the bytes each rank sent and received per 20 ms. The summary reads how
long each direction of the link was busy (sending at over half the line rate) against the
exchange's time and its sign bytes at line rate."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

RANK_FLAG = "--rank-main"
BIN_SECONDS = 0.02


def _rank_main(log2: int, bucket_elements: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    from onebit import kernels
    from onebit.exchange import BucketedExchange, TrafficCounter, over_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    interface = next(name for name in os.listdir("/sys/class/net") if name != "lo")
    counters = [f"/sys/class/net/{interface}/statistics/{c}_bytes" for c in ("tx", "rx")]
    n = 1 << log2
    values = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    exchange = BucketedExchange(None, bucket_elements)
    exchange.bind([n], torch.float32, torch.device("cpu"), kernels.select(values), TrafficCounter())
    buffer = exchange.send_buffer()  # its own, as the benchmark and the optimizers use it
    rounds: dict[int, int] = {}  # id of a bucket's Round -> its place in the exchange order
    events: list[tuple[str, float]] = []

    def timed(method: str, label: str):
        original = getattr(over_group.Round, method)

        def run(self, *args):
            result = original(self, *args)
            index = rounds.setdefault(id(self), len(rounds))
            events.append((f"{label} {index}", time.perf_counter()))
            return result

        setattr(over_group.Round, method, run)

    timed("send_workers", "worker signs sent")
    timed("send_servers", "its signs in, server signs sent")
    timed("finish", "result in")

    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def read(path: str) -> int:
        with open(path) as counter:
            return int(counter.read())

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter(), *map(read, counters)))
            time.sleep(0.001)

    for _ in range(calls):
        rounds.clear()
        events.clear()
        samples.clear()
        stop.clear()
        dist.barrier()
        start = time.perf_counter()
        sampler = threading.Thread(target=sample)
        sampler.start()
        buffer.copy_(values)
        events.append(("copied", time.perf_counter()))
        exchange.exchange(buffer)
        events.append(("done", time.perf_counter()))
        stop.set()
        sampler.join()
    print(json.dumps({"start": start, "events": events, "samples": samples}), flush=True)
    dist.destroy_process_group()


def _bins(samples, origin: float) -> list[tuple[float, int, int]]:
    """(end of bin, bytes sent, bytes received) per :data:`BIN_SECONDS` from ``origin``."""
    out, last = [], samples[0]
    for sample in samples[1:]:
        if sample[0] - last[0] >= BIN_SECONDS:
            out.append((sample[0] - origin, sample[1] - last[1], sample[2] - last[2]))
            last = sample
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bandwidth", nargs="?", default="100mbit")
    parser.add_argument("--log2", type=int, default=25)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()

    from onebit.bench.cluster import EmulatedCluster
    from onebit.bench.exchange_wire import HOSTS, bucket_elements_of, sign_seconds

    bandwidth = None if args.bandwidth == "none" else args.bandwidth
    argv = [sys.executable, __file__, RANK_FLAG, str(args.log2)]
    argv += [str(bucket_elements_of(args.bucket_cap_mb)), str(args.calls)]
    with EmulatedCluster(HOSTS, bandwidth=bandwidth) as cluster:
        processes = cluster.launch_ranks(argv, stdout=subprocess.PIPE)
        outputs = [p.communicate(timeout=1800)[0] for p in processes]
        rate = cluster.rate_bits_per_second
    if any(p.returncode for p in processes):
        raise SystemExit("a rank failed")
    runs = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    origin = min(run["start"] for run in runs)
    for rank, run in enumerate(runs):
        total = run["events"][-1][1] - origin
        print(f"rank {rank}: exchange {total * 1e3:.0f} ms")
        for name, at in run["events"]:
            print(f"  {(at - origin) * 1e3:7.1f} ms  {name}")
        bins = _bins(run["samples"], origin)
        print("  MB sent / received per 20 ms, by the bin's end:")
        print(
            "   " + "  ".join(f"{t * 1e3:.0f}:{tx / 1e6:.2f}/{rx / 1e6:.2f}" for t, tx, rx in bins)
        )
        if rate:
            half_rate_bytes = rate / 8 * BIN_SECONDS / 2
            busy = sum(BIN_SECONDS for _, tx, _ in bins if tx > half_rate_bytes)
            wire = sign_seconds(args.log2, rate)
            print(
                f"  sending at over half the line rate for {busy * 1e3:.0f} ms; its sign bytes "
                f"at line rate {wire * 1e3:.0f} ms; exchange / line-rate time "
                f"{total / wire:.2f}x"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == [RANK_FLAG]:
        _rank_main(*(int(a) for a in sys.argv[2:5]))
    else:
        main()
