"""Tools on an emulated cluster: the throughput of a TCP stream between two hosts (through
:mod:`onebit.bench.tcp_tool`), a gloo ``all_reduce`` over all of them, and the self-check that
builds a cluster, runs both and reports them against the configured link rate:
``python -m onebit.bench.cluster_tools --hosts 4 --bandwidth 1gbit``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence

from onebit.bench import tcp_tool
from onebit.bench.cluster import EmulatedCluster
from onebit.bench.netns import COMMAND_TIMEOUT, ClusterUnavailable, stop_processes
from onebit.cli import checked_type
from onebit.units import delay_option, rate_option

__all__ = [
    "AllreduceReport",
    "TcpTransfer",
    "main",
    "measure_tcp_throughput",
    "run_allreduce",
    "tcp_transfer",
]

logger = logging.getLogger(__name__)

_MODULE = "onebit.bench.cluster_tools"
# The TCP tool runs as a script in isolated mode (standard library only: it starts in ~0.1 s).
_TCP_TOOL_ARGV = (sys.executable, "-I", os.path.abspath(tcp_tool.__file__))


@dataclasses.dataclass(frozen=True)
class TcpTransfer:
    """Outcome of one TCP stream between two hosts, as seen by the receiver."""

    nbytes: int
    """Bytes received."""
    seconds: float
    """Time from the first to the last received chunk."""
    bits_per_second: float
    """Receive rate over that time (the first chunk, which starts the clock, excluded)."""


def _read_port(receiver: subprocess.Popen[str]) -> int:
    """The port a ``tcp-recv`` helper bound, from the first line it writes."""
    assert receiver.stdout is not None
    ready, _, _ = select.select([receiver.stdout], [], [], COMMAND_TIMEOUT)
    line = receiver.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"the TCP receiver did not report its port (exit {receiver.poll()})")
    return int(json.loads(line)["port"])


def tcp_transfer(
    cluster: EmulatedCluster, src: int, dst: int, nbytes: int = 1 << 30, seconds: float = 3.0
) -> TcpTransfer:
    """Stream zeros over one TCP connection from ``cluster``'s host ``src`` to host ``dst`` (with
    ``src == dst``, between two processes of one host, over its loopback).

    The sender stops after ``nbytes`` or ``seconds``, whichever comes first; both ends time
    out on their own if the other side stalls.
    """
    cluster.check_host(src)
    cluster.check_host(dst)
    if nbytes < 1 or seconds <= 0:
        raise ValueError("nbytes and seconds must be positive")
    idle = seconds + 10.0
    address = cluster.host_address(dst)
    receiver = cluster.popen(
        dst,
        [*_TCP_TOOL_ARGV, "tcp-recv", "--bind", address, "--timeout", str(idle)],
        stdout=subprocess.PIPE,
    )
    try:
        port = str(_read_port(receiver))
    except BaseException:
        stop_processes([receiver])
        raise
    sender = cluster.popen(
        src,
        [
            *_TCP_TOOL_ARGV,
            "tcp-send",
            "--host",
            address,
            "--port",
            port,
            "--nbytes",
            str(nbytes),
            "--seconds",
            str(seconds),
            "--timeout",
            str(idle),
        ],
    )
    try:
        sender_rc = sender.wait(timeout=idle + COMMAND_TIMEOUT)
        out, _ = receiver.communicate(timeout=idle + COMMAND_TIMEOUT)
    finally:
        stop_processes([sender, receiver])
    if sender_rc != 0 or receiver.returncode != 0:
        raise RuntimeError(
            f"TCP transfer {src}->{dst} failed (sender exit {sender_rc}, "
            f"receiver exit {receiver.returncode})"
        )
    result = json.loads(out)
    return TcpTransfer(
        nbytes=result["bytes"],
        seconds=result["seconds"],
        bits_per_second=result["bits_per_second"],
    )


def measure_tcp_throughput(
    cluster: EmulatedCluster, src: int, dst: int, nbytes: int = 1 << 30, seconds: float = 3.0
) -> float:
    """Return the rate in bits/s of a TCP stream from host ``src`` to host ``dst``.

    See :func:`tcp_transfer` for the bounds.
    """
    return tcp_transfer(cluster, src, dst, nbytes=nbytes, seconds=seconds).bits_per_second


def _worker_command(args: argparse.Namespace) -> None:
    """One rank of the all_reduce check; reads the torchrun-style environment."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        tensor = torch.empty(args.numel, dtype=torch.float32)
        expected = world * (world + 1) / 2
        times = []
        for step in range(args.warmup + args.iters):
            tensor.fill_(rank + 1)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        correct = bool(torch.all(tensor == expected))
    finally:
        dist.destroy_process_group()
    tcp_tool.emit(
        {
            "rank": rank,
            "world_size": world,
            "numel": args.numel,
            "seconds": times,
            "correct": correct,
        }
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}",
        description="Build an emulated cluster, measure a TCP stream and a gloo all_reduce, "
        "report against the configured link rate, tear it down.",
    )
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument(
        "--bandwidth",
        type=checked_type(rate_option),
        default="1gbit",
        help="per-link rate such as 1gbit, or 'none' (default: 1gbit)",
    )
    parser.add_argument(
        "--latency",
        type=checked_type(delay_option),
        default=None,
        help="added one-way delay such as 0.1ms (needs netem; default: none)",
    )
    parser.add_argument(
        "--numel",
        type=int,
        default=25_000_000,
        help="float32 elements in the all_reduce (default: 25M)",
    )
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--tcp-seconds", type=float, default=3.0)
    sub = parser.add_subparsers(dest="command", metavar="{worker}")
    worker = sub.add_parser("worker", help="one all_reduce rank (started by the check)")
    worker.add_argument("--numel", type=int, required=True)
    worker.add_argument("--iters", type=int, default=3)
    worker.add_argument("--warmup", type=int, default=1)
    worker.add_argument("--threads", type=int, default=1)
    worker.add_argument("--timeout", type=float, default=300.0)
    worker.set_defaults(handler=_worker_command)
    return parser


@dataclasses.dataclass(frozen=True)
class AllreduceReport:
    """What one rank of :func:`run_allreduce` measured."""

    rank: int
    seconds: list[float]
    """Wall time of each timed ``all_reduce`` (after one untimed warm-up)."""
    correct: bool
    """Whether the reduced tensor held the expected sum everywhere."""


def run_allreduce(
    cluster: EmulatedCluster, numel: int, iters: int = 3, timeout: float = 300.0
) -> list[AllreduceReport]:
    """Run a gloo ``all_reduce`` of ``numel`` float32 on every host, one rank per host.

    Ranks are started with :meth:`EmulatedCluster.launch_ranks`, one thread each. Returns the
    reports in rank order.
    """
    argv = [
        sys.executable,
        "-m",
        _MODULE,
        "worker",
        "--numel",
        str(numel),
        "--iters",
        str(iters),
        "--timeout",
        str(timeout),
    ]
    processes = cluster.launch_ranks(argv, env={"OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    reports = []
    try:
        for rank, process in enumerate(processes):
            out, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RuntimeError(f"all_reduce rank {rank} failed (exit {process.returncode})")
            record = json.loads(out.strip().splitlines()[-1])
            reports.append(
                AllreduceReport(record["rank"], list(record["seconds"]), record["correct"])
            )
    finally:
        stop_processes(processes)
    return reports


def _check(args: argparse.Namespace) -> None:
    with EmulatedCluster(args.hosts, bandwidth=args.bandwidth, latency=args.latency) as cluster:
        rate = cluster.rate_bits_per_second
        logger.info(
            "hosts %d, bandwidth %s, latency %s",
            args.hosts,
            args.bandwidth or "unshaped",
            args.latency or "none added",
        )
        measured = None
        if args.hosts > 1:
            measured = measure_tcp_throughput(cluster, 0, 1, seconds=args.tcp_seconds)
            ratio = f", {measured / rate:.3f} of configured" if rate else ""
            logger.info("TCP host0 -> host1: %.1f Mbit/s%s", measured / 1e6, ratio)
        reports = run_allreduce(cluster, args.numel, iters=args.iters)
    nbytes = args.numel * 4
    rank0 = reports[0].seconds
    best = min(rank0)
    logger.info(
        "all_reduce of %d float32 (%.1f MB) over %d ranks: rank 0 best %.3f s, all %s",
        args.numel,
        nbytes / 1e6,
        args.hosts,
        best,
        " ".join(f"{t:.3f}" for t in rank0),
    )
    ring_bits = 2 * (args.hosts - 1) / args.hosts * nbytes * 8
    if rate and args.hosts > 1:
        logger.info(
            "ideal ring time 2(n-1)/n*bytes/rate = %.3f s; measured/ideal = %.3f",
            ring_bits / rate,
            best * rate / ring_bits,
        )
    if measured:
        logger.info(
            "ring time at the measured TCP rate (headers included) = %.3f s; measured/that = %.3f",
            ring_bits / measured,
            best * measured / ring_bits,
        )
    if not all(report.correct for report in reports):
        raise SystemExit("all_reduce result is WRONG on some rank")
    logger.info("all_reduce results correct on all ranks")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m onebit.bench.cluster``."""
    args = _parser().parse_args(argv)
    if args.command is not None:
        args.handler(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        _check(args)
    except ClusterUnavailable as exc:
        raise SystemExit(f"emulated cluster unavailable: {exc}") from exc


if __name__ == "__main__":
    main()
