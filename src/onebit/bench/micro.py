"""Micro-benchmarks: ``onebit bench allreduce`` and ``onebit bench optimizer``.

Every figure is measured side by side in one run, for each compression backend
(:mod:`onebit.kernels`: the pure-torch reference and the fused kernels), with one thread
per process; the unit of local work is a *copy*, the time of ``copy_`` between two buffers
of the same size (the physical limit of a pass over memory).

``allreduce``: for buffers of 2^k float32 elements, the local work of one
:func:`onebit.compressed_allreduce` in a world of one rank (in copies), and its time against
``dist.all_reduce`` of the same buffer on loopback gloo, with the bytes each sends.

``optimizer``: on a model of BERT-base's parameter shapes, one ``step()`` of
:class:`onebit.OneBitLamb` in each stage against what LAMB itself does, ``Lamb.step()`` plus
its dense allreduce of the gradients (none at world size 1), all in copies of a buffer the
size of all parameters, and the optimizer's memory per parameter.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onebit.bert_shapes import bert_shapes
from onebit.cli import checked_type
from onebit.timing import copy_fn, cpu_backends, interleaved, rank_step_times

FLOAT_BYTES = 4


def register(commands: argparse._SubParsersAction) -> None:
    allreduce = commands.add_parser(
        "allreduce",
        help="compressed_allreduce against dist.all_reduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    allreduce.add_argument("--min-log2", type=int, default=20, help="smallest size 2^k (20)")
    allreduce.add_argument("--max-log2", type=int, default=26, help="largest size 2^k (26)")
    allreduce.add_argument(
        "--world-sizes", type=int, nargs="+", default=[2, 4], help="ranks (default: 2 4)"
    )
    allreduce.add_argument("--repeats", type=int, default=5, help="timed calls per figure (5)")
    allreduce.add_argument("--json", type=Path, help="also write the results here")
    allreduce.set_defaults(handler=run_allreduce_bench)

    optimizer = commands.add_parser(
        "optimizer",
        help="OneBitLamb.step() against Lamb.step() and its allreduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    optimizer.add_argument(
        "--world-sizes", type=int, nargs="+", default=[1, 2], help="ranks (default: 1 2)"
    )
    optimizer.add_argument("--repeats", type=int, default=3, help="timed steps per figure (3)")
    optimizer.add_argument(
        "--scale",
        type=checked_type(_width_scale),
        default=1.0,
        help="multiply the model's widths by this factor; below 1 shrinks it (1.0)",
    )
    optimizer.add_argument("--json", type=Path, help="also write the results here")
    optimizer.set_defaults(handler=run_optimizer_bench)


def _width_scale(text: str) -> float:
    """``--scale``: a factor that leaves BERT-base at least one unit wide."""
    value = float(text)
    bert_shapes(value)  # raises ValueError naming the problem
    return value


def _rank_zero_result(worker: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run ``worker`` on ``world`` local gloo ranks (long timeouts: large buffers on a
    shared machine) and return rank 0's result."""
    from onebit.testing import spawn_workers

    return spawn_workers(worker, world, args=args, timeout_s=3600, collective_timeout_s=600)[0]


# ---------------------------------------------------------------------------- allreduce


def local_compression_work(numel: int, repeats: int) -> dict[str, float]:
    """Seconds of a copy and of one whole compressed_allreduce in a world of one rank with
    each backend (the worker's and the server's compression and the decoding)."""
    import torch

    import onebit

    source = torch.randn(numel)
    fns = {"copy": copy_fn(numel)}
    for backend in cpu_backends():
        state = (torch.zeros(numel), torch.zeros(numel), torch.empty(numel))
        workspace = onebit.CompressionWorkspace()
        fns[backend] = lambda b=backend, s=state, w=workspace: onebit.compressed_allreduce(
            source, s[0], s[1], out=s[2], workspace=w, kernels=b
        )
    return interleaved(fns, repeats, sync=lambda: None)


def _allreduce_worker(rank: int, world: int, sizes: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    import onebit
    from onebit.collectives import compressed_allreduce_bytes

    rows = []
    for numel in sizes:
        buffer = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        dense = buffer.clone()
        fns: dict[str, Callable[[], Any]] = {"all_reduce": lambda d=dense: dist.all_reduce(d)}
        for backend in cpu_backends():
            state = (torch.zeros(numel), torch.zeros(numel // world), torch.empty(numel))
            workspace = onebit.CompressionWorkspace()
            fns[backend] = lambda b=backend, s=state, w=workspace, x=buffer: (
                onebit.compressed_allreduce(x, s[0], s[1], out=s[2], workspace=w, kernels=b)
            )
        medians = interleaved(fns, repeats, sync=dist.barrier)
        rows.append(
            {
                "numel": numel,
                "world_size": world,
                "seconds": medians,
                "compressed_bytes_per_rank": compressed_allreduce_bytes(
                    numel, world, torch.float32
                ),
                "allreduce_bytes_per_rank": 2 * (world - 1) * numel * FLOAT_BYTES // world,
            }
        )
    return rows


def run_allreduce_bench(args: argparse.Namespace) -> int:
    import torch

    if not 3 <= args.min_log2 <= args.max_log2 <= 30:
        raise SystemExit("need 3 <= --min-log2 <= --max-log2 <= 30")
    torch.set_num_threads(1)
    backends = cpu_backends()
    sizes = [1 << k for k in range(args.min_log2, args.max_log2 + 1)]
    print(f"torch {torch.__version__}, 1 thread per process, median of {args.repeats}\n")
    print("Local work of one compressed_allreduce (world size 1), float32, in copies:")
    print(f"{'N':>10} {'copy GB/s':>10} " + " ".join(f"{b:>10}" for b in backends))
    local_rows = []
    for numel in sizes:
        seconds = local_compression_work(numel, args.repeats)
        copies = {b: seconds[b] / seconds["copy"] for b in backends}
        local_rows.append({"numel": numel, "seconds": seconds, "copies": copies})
        gbps = 2 * FLOAT_BYTES * numel / seconds["copy"] / 1e9  # read and write
        print(f"{numel:>10} {gbps:>10.1f} " + " ".join(f"{copies[b]:>10.1f}" for b in backends))
    loopback_rows = []
    for world in args.world_sizes:
        loopback_rows.extend(_rank_zero_result(_allreduce_worker, world, sizes, args.repeats))
    print("\nLoopback gloo, per call and rank: dense all_reduce time / compressed time")
    print(f"{'n':>2} {'N':>10} {'all_reduce s':>13} " + " ".join(f"{b:>10}" for b in backends))
    for row in loopback_rows:
        seconds = row["seconds"]
        ratios = " ".join(f"{seconds['all_reduce'] / seconds[b]:>10.2f}" for b in backends)
        print(f"{row['world_size']:>2} {row['numel']:>10} {seconds['all_reduce']:>13.4f} {ratios}")
    print(
        "bytes per rank: dense / compressed = "
        + ", ".join(
            f"{r['allreduce_bytes_per_rank'] / r['compressed_bytes_per_rank']:.1f}"
            for r in loopback_rows[:1]
        )
        + " (every size)"
    )
    if args.json:
        args.json.write_text(json.dumps({"local": local_rows, "loopback": loopback_rows}, indent=1))
    return 0


# ---------------------------------------------------------------------------- optimizer


def _print_optimizer_rows(rows: list[dict[str, Any]]) -> None:
    n, numel = rows[0]["world_size"], rows[0]["parameters"]
    print(f"world size {n}, {numel / 1e6:.1f}M parameters; times in copies of all parameters")
    print(
        f"{'backend':>8} {'Lamb.step':>10} {'+allreduce':>11} {'warm-up':>8} {'compress':>9} "
        f"{'exchange':>9} {'+delayed':>9} {'warm-up/LAMB':>13} {'compress/LAMB':>14}"
    )
    for row in rows:
        copy = row["copy_s"]
        lamb = row["lamb_step_s"] + row["dense_allreduce_s"]
        delayed = row.get("onebit_delayed_compression_step_s")  # world size 1 only
        delayed_extra = (
            "-" if delayed is None else f"{(delayed - row['onebit_compression_step_s']) / copy:.1f}"
        )
        print(
            f"{row['backend']:>8} {row['lamb_step_s'] / copy:>10.1f} "
            f"{row['dense_allreduce_s'] / copy:>11.1f} "
            f"{row['onebit_warmup_step_s'] / copy:>8.1f} "
            f"{row['onebit_compression_step_s'] / copy:>9.1f} "
            f"{row['compressed_allreduce_s'] / copy:>9.1f} "
            f"{delayed_extra:>9} "
            f"{row['onebit_warmup_step_s'] / lamb:>13.2f} "
            f"{row['onebit_compression_step_s'] / lamb:>14.2f}"
        )
    words = FLOAT_BYTES * numel
    row = rows[-1]
    print(
        f"state per parameter, fp32 words: Lamb {row['lamb_state_bytes'] / words:.2f}, "
        f"OneBitLamb warm-up {row['onebit_warmup_state_bytes'] / words:.2f}, compression "
        f"{row['onebit_compression_state_bytes'] / words:.2f} (m, v, v_fresh and the errors: "
        f"4 + 1/n = {4 + 1 / n:.2f}); "
        f"reused scratch {row['onebit_scratch_bytes'] / words:.2f} ({row['backend']})\n"
    )


def run_optimizer_bench(args: argparse.Namespace) -> int:
    shapes = bert_shapes(args.scale)
    print(f"BERT-base parameter shapes (scale {args.scale}), 1 thread per rank, median of")
    print(
        f"{args.repeats} interleaved steps; LAMB = Lamb.step() with the fused backend + the "
        "dense allreduce of its gradients\n"
    )
    rows = []
    for world in args.world_sizes:
        world_rows = [
            _rank_zero_result(rank_step_times, world, shapes, args.repeats, backend)
            for backend in cpu_backends()
        ]
        _print_optimizer_rows(world_rows)
        rows.extend(world_rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0
