"""What a small collective between large ones costs on a shaped link (run as root).

Two emulated hosts (``onebit.bench.cluster``), one rank each, one torch thread. Each rank
times, fastest of the calls after the first:

* ``six all-to-alls``: the signs of one phase of a 2^LOG2-element exchange (``N / 8`` bytes,
  half of them to the peer) as six asynchronous all-to-alls, as the bucketed exchange sends
  six buckets;
* ``with a scale all-gather before each``: the same, each preceded by an all-gather of two
  floats, as the exchange sent each bucket's scales before its signs travelled with them;
* ``receives posted ahead``: the six pieces as point-to-point messages, every receive posted
  before the first send. Gloo sends a message's bytes once the receiver's notice that its
  receive is posted has arrived, and that notice queues behind the bytes already on the link
  in its direction; posted ahead, every notice goes before any bytes.

    .venv/bin/python scripts/exchange_messages.py --bandwidths 100mbit,1gbit
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PIECES = 6
RANK_FLAG = "--rank-main"


def _rank_main(log2: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    send = torch.zeros((1 << log2) // 8, dtype=torch.uint8)
    received = torch.empty_like(send)
    piece = send.numel() // (2 * PIECES) * 2  # an even split between the two ranks
    scales, local = torch.zeros(2, 2), torch.zeros(2)

    def pieces(with_scales: bool) -> None:
        works = []
        for i in range(PIECES):
            if with_scales:
                works.append(dist.all_gather_into_tensor(scales.view(-1), local, async_op=True))
            part = slice(i * piece, (i + 1) * piece)
            works.append(dist.all_to_all_single(received[part], send[part], async_op=True))
        for work in works:
            work.wait()

    def posted_ahead() -> None:
        peer = 1 - dist.get_rank()  # the half of a piece the all-to-all sends to (gets from) it
        half = piece // 2
        parts = [
            slice(i * piece + peer * half, i * piece + (peer + 1) * half) for i in range(PIECES)
        ]
        works = [dist.irecv(received[part], peer, tag=i) for i, part in enumerate(parts)]
        works += [dist.isend(send[part], peer, tag=i) for i, part in enumerate(parts)]
        for work in works:
            work.wait()

    runs = {
        "six all-to-alls": lambda: pieces(False),
        "with a scale all-gather": lambda: pieces(True),
        "receives posted ahead": posted_ahead,
    }
    seconds = {}
    for name, run in runs.items():
        times = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        seconds[name] = min(times[1:])
    if dist.get_rank() == 0:
        print(json.dumps(seconds), flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", default="100mbit,1gbit", help="comma-separated rates")
    parser.add_argument("--log2", type=int, default=25, help="log2 of the exchange's elements")
    parser.add_argument("--calls", type=int, default=5, help="calls per timing (first untimed)")
    args = parser.parse_args()
    from onebit.bench.cluster import EmulatedCluster
    from onebit.units import parse_bandwidth

    for bandwidth in args.bandwidths.split(","):
        rate = parse_bandwidth(bandwidth)
        with EmulatedCluster(2, bandwidth=bandwidth) as cluster:
            argv = [sys.executable, __file__, RANK_FLAG, str(args.log2), str(args.calls)]
            processes = cluster.launch_ranks(argv, stdout=subprocess.PIPE)
            outputs = [p.communicate(timeout=900)[0] for p in processes]
        seconds = json.loads(outputs[0].strip().splitlines()[-1])
        line_rate = (1 << args.log2) // 16 / (rate / 8)  # half the signs, to the peer
        print(
            f"{bandwidth}: half the signs at line rate {line_rate:.3f} s; "
            + "; ".join(f"{name} {value:.3f} s" for name, value in seconds.items()),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [RANK_FLAG]:
        _rank_main(*(int(a) for a in sys.argv[2:4]))
    else:
        sys.exit(main())
