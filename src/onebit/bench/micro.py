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
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FLOAT_BYTES = 4


def register(commands: argparse._SubParsersAction) -> None:
    allreduce = commands.add_parser(
        "allreduce",
        help="compressed_allreduce: local work in copies, and against dist.all_reduce",
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
        help="OneBitLamb.step() per stage vs Lamb.step() + its allreduce, in copies; memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    optimizer.add_argument(
        "--world-sizes", type=int, nargs="+", default=[1, 2], help="ranks (default: 1 2)"
    )
    optimizer.add_argument("--repeats", type=int, default=3, help="timed steps per figure (3)")
    optimizer.add_argument(
        "--scale", type=float, default=1.0, help="shrink the model's widths by this factor (1.0)"
    )
    optimizer.add_argument("--json", type=Path, help="also write the results here")
    optimizer.set_defaults(handler=run_optimizer_bench)


def cpu_backends() -> list[str]:
    """The compression backends to compare on CPU: the reference first."""
    from onebit import kernels

    return [name for name in kernels.available() if name != "triton"]


def _rank_zero_result(worker: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run ``worker`` on ``world`` local gloo ranks (long timeouts: large buffers on a
    shared machine) and return rank 0's result."""
    from onebit.testing import spawn_workers

    return spawn_workers(worker, world, args=args, timeout_s=3600, collective_timeout_s=600)[0]


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int, sync: Callable[[], Any]):
    """Median seconds of each function, run in turn ``repeats`` times (after one untimed
    round), so that all see the same machine load; ``sync`` runs before each timing."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            if round_index:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _copy_fn(numel: int) -> Callable[[], Any]:
    import torch

    source, target = torch.randn(numel), torch.empty(numel)
    target.copy_(source)  # touch the pages once
    return lambda: target.copy_(source)


# ---------------------------------------------------------------------------- allreduce


def local_compression_work(numel: int, repeats: int) -> dict[str, float]:
    """Seconds of a copy and of one whole compressed_allreduce in a world of one rank with
    each backend (the worker's and the server's compression and the decoding)."""
    import torch

    import onebit

    source = torch.randn(numel)
    fns = {"copy": _copy_fn(numel)}
    for backend in cpu_backends():
        state = (torch.zeros(numel), torch.zeros(numel), torch.empty(numel))
        workspace = onebit.CompressionWorkspace()
        fns[backend] = lambda b=backend, s=state, w=workspace: onebit.compressed_allreduce(
            source, s[0], s[1], out=s[2], workspace=w, kernels=b
        )
    return _interleaved(fns, repeats, sync=lambda: None)


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
        medians = _interleaved(fns, repeats, sync=dist.barrier)
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


def bert_base_shapes(scale: float = 1.0) -> list[tuple[int, ...]]:
    """Parameter shapes of BERT-base (vocabulary 30522, 12 layers, hidden 768): ~110M.

    ``scale`` shrinks the widths (hidden and feed-forward) for quick runs."""
    hidden, ff, vocab = int(768 * scale), int(3072 * scale), 30522
    shapes: list[tuple[int, ...]] = [
        (vocab, hidden),
        (512, hidden),
        (2, hidden),
        (hidden,),
        (hidden,),
    ]
    for _ in range(12):
        shapes += [(hidden, hidden), (hidden,)] * 4  # query, key, value, attention output
        shapes += [(hidden,), (hidden,)]  # attention LayerNorm
        shapes += [(ff, hidden), (ff,), (hidden, ff), (hidden,)]  # feed-forward
        shapes += [(hidden,), (hidden,)]  # output LayerNorm
    return shapes


def _optimizer_worker(rank: int, world: int, shapes, repeats: int, backend: str) -> dict:
    """Times, interleaved: a copy, Lamb.step() (fused backend: LAMB at its fastest), the
    dense allreduce of the gradients, and OneBitLamb's steps in each stage with ``backend``;
    then the compressed allreduce alone and the memory."""
    import torch
    import torch.distributed as dist

    import onebit
    from onebit.collectives import padded_size

    def parameters():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]

    lamb_params, onebit_params = parameters(), parameters()
    numel = sum(p.numel() for p in lamb_params)
    # The same gradients on every rank: Lamb (which does not communicate) then keeps its
    # replicas identical, as it would under DDP.
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=gen) * 1e-3 for shape in shapes]
    dense = torch.cat([g.reshape(-1) for g in grads])
    lamb = onebit.Lamb(lamb_params, lr=1e-4, weight_decay=0.01)
    optimizer = onebit.OneBitLamb(
        onebit_params, lr=1e-4, freeze_step=repeats + 1, weight_decay=0.01, kernels=backend
    )

    def step(opt, params):
        for p, g in zip(params, grads, strict=True):
            p.grad = g  # the optimizers only read gradients
        opt.step()

    sync = dist.barrier if world > 1 else (lambda: None)
    fns = {
        "copy": _copy_fn(numel),
        "lamb_step": lambda: step(lamb, lamb_params),
        "dense_allreduce": lambda: dist.all_reduce(dense) if world > 1 else None,
        "onebit_warmup_step": lambda: step(optimizer, onebit_params),
    }
    warmup = _interleaved(fns, repeats, sync)  # repeats + 1 warm-up steps: the last switches
    warmup_memory = optimizer.memory_bytes()
    del fns["onebit_warmup_step"], fns["dense_allreduce"]
    dense.resize_(0)
    size = padded_size(numel, world)
    exchange = (torch.randn(size), torch.zeros(size), torch.zeros(size // world))
    workspace = onebit.CompressionWorkspace()
    fns["onebit_compression_step"] = lambda: step(optimizer, onebit_params)
    fns["compressed_allreduce"] = lambda: onebit.compressed_allreduce(
        *exchange, out=exchange[0], workspace=workspace, kernels=backend
    )
    compression = _interleaved(fns, repeats, sync)
    assert optimizer.stage == "compression"
    memory = optimizer.memory_bytes()
    return {
        "world_size": world,
        "backend": backend,
        "parameters": numel,
        "copy_s": statistics.median([warmup["copy"], compression["copy"]]),
        "lamb_step_s": statistics.median([warmup["lamb_step"], compression["lamb_step"]]),
        "dense_allreduce_s": warmup["dense_allreduce"] if world > 1 else 0.0,
        "onebit_warmup_step_s": warmup["onebit_warmup_step"],
        "onebit_compression_step_s": compression["onebit_compression_step"],
        "compressed_allreduce_s": compression["compressed_allreduce"],
        "lamb_state_bytes": lamb.memory_bytes()["state"],
        "onebit_warmup_state_bytes": warmup_memory["state"],
        "onebit_compression_state_bytes": memory["state"] + memory["error_feedback"],
        "onebit_scratch_bytes": memory["scratch"],
    }


def _print_optimizer_rows(rows: list[dict[str, Any]]) -> None:
    n, numel = rows[0]["world_size"], rows[0]["parameters"]
    print(f"world size {n}, {numel / 1e6:.1f}M parameters; times in copies of all parameters")
    print(
        f"{'backend':>8} {'Lamb.step':>10} {'+allreduce':>11} {'warm-up':>8} {'compress':>9} "
        f"{'exchange':>9} {'warm-up/LAMB':>13} {'compress/LAMB':>14}"
    )
    for row in rows:
        copy = row["copy_s"]
        lamb = row["lamb_step_s"] + row["dense_allreduce_s"]
        print(
            f"{row['backend']:>8} {row['lamb_step_s'] / copy:>10.1f} "
            f"{row['dense_allreduce_s'] / copy:>11.1f} "
            f"{row['onebit_warmup_step_s'] / copy:>8.1f} "
            f"{row['onebit_compression_step_s'] / copy:>9.1f} "
            f"{row['compressed_allreduce_s'] / copy:>9.1f} "
            f"{row['onebit_warmup_step_s'] / lamb:>13.2f} "
            f"{row['onebit_compression_step_s'] / lamb:>14.2f}"
        )
    words = FLOAT_BYTES * numel
    row = rows[-1]
    print(
        f"state per parameter, fp32 words: Lamb {row['lamb_state_bytes'] / words:.2f}, "
        f"OneBitLamb warm-up {row['onebit_warmup_state_bytes'] / words:.2f}, compression "
        f"{row['onebit_compression_state_bytes'] / words:.2f} (5 + 1/n = {5 + 1 / n:.2f}); "
        f"reused scratch {row['onebit_scratch_bytes'] / words:.2f} ({row['backend']})\n"
    )


def run_optimizer_bench(args: argparse.Namespace) -> int:
    shapes = bert_base_shapes(args.scale)
    print(f"BERT-base parameter shapes (scale {args.scale}), 1 thread per rank, median of")
    print(
        f"{args.repeats} interleaved steps; LAMB = Lamb.step() with the fused backend + the "
        "dense allreduce of its gradients\n"
    )
    rows = []
    for world in args.world_sizes:
        world_rows = [
            _rank_zero_result(_optimizer_worker, world, shapes, args.repeats, backend)
            for backend in cpu_backends()
        ]
        _print_optimizer_rows(world_rows)
        rows.extend(world_rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0
