"""Micro-benchmarks: ``onebit bench allreduce`` and ``onebit bench optimizer``.

``allreduce``: for buffers of 2^k float32 elements, the time of
:func:`onebit.compressed_allreduce` against ``dist.all_reduce`` of the same buffer on
loopback gloo (one process per rank, one thread each, measured interleaved), the bytes each
sends per rank, and the throughput of the local compression work against a plain memory
copy of the same buffer (the physical limit of this memory-bound work).

``optimizer``: the time of one ``step()`` of :class:`onebit.OneBitLamb` in each stage against
:class:`onebit.Lamb`'s on a model of BERT-base's parameter shapes (~110M parameters), with
the collectives timed on their own, and the optimizer's memory per parameter.

Every figure is a median over repeats measured side by side in one run; ratios are the
result, absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import functools
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
        help="compressed_allreduce vs dist.all_reduce on loopback, and local compression speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    allreduce.add_argument("--min-log2", type=int, default=20, help="smallest size 2^k (20)")
    allreduce.add_argument("--max-log2", type=int, default=26, help="largest size 2^k (26)")
    allreduce.add_argument(
        "--world-sizes", type=int, nargs="+", default=[2, 4], help="ranks (default: 2 4)"
    )
    allreduce.add_argument("--repeats", type=int, default=5, help="timed calls per method (5)")
    allreduce.add_argument("--json", type=Path, help="also write the results here")
    allreduce.set_defaults(handler=run_allreduce_bench)

    optimizer = commands.add_parser(
        "optimizer",
        help="OneBitLamb.step() per stage vs Lamb.step(), and optimizer memory per parameter",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    optimizer.add_argument(
        "--world-sizes", type=int, nargs="+", default=[1, 2], help="ranks (default: 1 2)"
    )
    optimizer.add_argument("--repeats", type=int, default=3, help="timed steps per stage (3)")
    optimizer.add_argument(
        "--scale", type=float, default=1.0, help="shrink the model's widths by this factor (1.0)"
    )
    optimizer.add_argument("--json", type=Path, help="also write the results here")
    optimizer.set_defaults(handler=run_optimizer_bench)


def _rank_zero_result(worker: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run ``worker`` on ``world`` local gloo ranks (long timeouts: large buffers on a
    shared machine) and return rank 0's result."""
    from onebit.testing import spawn_workers

    return spawn_workers(worker, world, args=args, timeout_s=3600, collective_timeout_s=600)[0]


def _median_time(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None):
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---------------------------------------------------------------------------- allreduce


def local_compression_work(numel: int, repeats: int) -> dict[str, float]:
    """Seconds of a plain copy and of one whole compressed_allreduce in a world of one rank
    (all of the local work: the worker's and the server's compression and the decoding)."""
    import torch

    import onebit
    from onebit.collectives import world_size

    assert world_size() == 1
    source = torch.randn(numel)
    target = torch.empty(numel)
    target.copy_(source)  # touch the pages once
    worker_error = torch.zeros(numel)
    server_error = torch.zeros(numel)
    result = torch.empty(numel)
    onebit.compressed_allreduce(source, worker_error, server_error, out=result)
    copy_s = _median_time(lambda: target.copy_(source), repeats)
    compress_s = _median_time(
        lambda: onebit.compressed_allreduce(source, worker_error, server_error, out=result),
        repeats,
    )
    return {"copy_s": copy_s, "compressed_allreduce_local_s": compress_s}


def _allreduce_worker(rank: int, world: int, sizes: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    import onebit

    rows = []
    for numel in sizes:
        buffer = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        dense = buffer.clone()
        worker_error = torch.zeros(numel)
        server_error = torch.zeros(numel // world)
        result = torch.empty(numel)
        traffic = onebit.TrafficCounter()
        compressed = functools.partial(
            onebit.compressed_allreduce,
            buffer,
            worker_error,
            server_error,
            out=result,
            workspace=onebit.CompressionWorkspace(),
            traffic=traffic,
        )
        allreduce = functools.partial(dist.all_reduce, dense)
        compressed()
        allreduce()
        traffic.reset()
        compressed_times, dense_times = [], []
        for _ in range(repeats):  # interleaved, so both see the same machine load
            dist.barrier()
            start = time.perf_counter()
            compressed()
            compressed_times.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            allreduce()
            dense_times.append(time.perf_counter() - start)
        compressed_bytes = traffic.bytes_sent["compressed_allreduce"] // repeats
        rows.append(
            {
                "numel": numel,
                "world_size": world,
                "compressed_s": statistics.median(compressed_times),
                "allreduce_s": statistics.median(dense_times),
                "compressed_bytes_per_rank": compressed_bytes,
                "allreduce_bytes_per_rank": 2 * (world - 1) * numel * FLOAT_BYTES // world,
            }
        )
    return rows


def run_allreduce_bench(args: argparse.Namespace) -> int:
    import torch

    if not 3 <= args.min_log2 <= args.max_log2 <= 30:
        raise SystemExit("need 3 <= --min-log2 <= --max-log2 <= 30")
    torch.set_num_threads(1)
    sizes = [1 << k for k in range(args.min_log2, args.max_log2 + 1)]
    print(f"torch {torch.__version__}, 1 thread per process, median of {args.repeats}\n")
    print("Local compression work (world size 1: worker + server + decode), float32:")
    print(f"{'N':>10} {'copy GB/s':>10} {'compress GB/s':>14} {'copies':>7}")
    local_rows = []
    for numel in sizes:
        row = {"numel": numel, **local_compression_work(numel, args.repeats)}
        row["copy_gbps"] = FLOAT_BYTES * numel / row["copy_s"] / 1e9
        row["compress_gbps"] = FLOAT_BYTES * numel / row["compressed_allreduce_local_s"] / 1e9
        row["copies"] = row["compressed_allreduce_local_s"] / row["copy_s"]
        local_rows.append(row)
        print(
            f"{numel:>10} {row['copy_gbps']:>10.2f} {row['compress_gbps']:>14.2f} "
            f"{row['copies']:>7.1f}"
        )
    distributed_rows = []
    for world in args.world_sizes:
        distributed_rows.extend(_rank_zero_result(_allreduce_worker, world, sizes, args.repeats))
    print("\nLoopback gloo, per call, per rank:")
    print(
        f"{'n':>2} {'N':>10} {'compressed s':>13} {'all_reduce s':>13} {'time ratio':>10} "
        f"{'bytes 1-bit':>12} {'bytes dense':>12} {'bytes ratio':>11}"
    )
    for row in distributed_rows:
        print(
            f"{row['world_size']:>2} {row['numel']:>10} {row['compressed_s']:>13.4f} "
            f"{row['allreduce_s']:>13.4f} {row['allreduce_s'] / row['compressed_s']:>10.2f} "
            f"{row['compressed_bytes_per_rank']:>12} {row['allreduce_bytes_per_rank']:>12} "
            f"{row['allreduce_bytes_per_rank'] / row['compressed_bytes_per_rank']:>11.1f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"local": local_rows, "loopback": distributed_rows}, indent=1)
        )
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


def _state_bytes(optimizer: Any) -> tuple[int, int]:
    """(bytes of per-parameter state tensors, bytes of optimizer-level buffers)."""
    import torch

    per_param = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )
    extra = 0
    for name in ("_worker_error", "_server_error"):
        tensor = getattr(optimizer, name, None)
        if tensor is not None:
            extra += tensor.numel() * tensor.element_size()
    return per_param, extra


def _scratch_bytes(optimizer: Any) -> int:
    """Bytes of reused scratch: the fused buffers and the collective's workspace."""


    total = 0
    layout = getattr(optimizer, "_layout", None)
    if layout is not None:
        total += layout.buffer.numel() * layout.buffer.element_size()
    flat = getattr(optimizer, "_flat_grads", None)
    if flat is not None:
        total += flat.numel() * flat.element_size()
    total += optimizer._workspace.nbytes()
    return total


def _optimizer_worker(rank: int, world: int, shapes: list[tuple[int, ...]], repeats: int):
    """Times Lamb and OneBitLamb steps interleaved (so both see the same machine load)."""
    import torch
    import torch.distributed as dist

    import onebit
    from onebit.collectives import padded_size

    torch.manual_seed(0)
    onebit_params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
    lamb_params = [torch.nn.Parameter(p.detach().clone()) for p in onebit_params]
    numel = sum(p.numel() for p in onebit_params)
    # The same gradients on every rank: Lamb (which does not communicate) then keeps its
    # replicas identical, as it would under DDP.
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=gen) * 1e-3 for shape in shapes]
    flat_grads = torch.cat([g.reshape(-1) for g in grads])
    size = padded_size(numel, world)
    buffer = torch.randn(size)
    worker_error, server_error = torch.zeros(size), torch.zeros(size // world)

    def prepare() -> None:
        for params in (lamb_params, onebit_params):
            for p, g in zip(params, grads, strict=True):
                p.grad = g  # the optimizers only read gradients
        if world > 1:
            dist.barrier()

    def timed(fn: Callable[[], Any]) -> float:
        prepare()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    lamb = onebit.Lamb(lamb_params, lr=1e-4, weight_decay=0.01)
    onebit_lamb = onebit.OneBitLamb(
        onebit_params, lr=1e-4, freeze_step=repeats + 1, weight_decay=0.01
    )
    timed(lamb.step)
    timed(onebit_lamb.step)
    times: dict[str, list[float]] = {}
    for stage, collective in (
        ("warmup", functools.partial(onebit.allreduce_mean_, flat_grads)),
        (
            "compression",
            functools.partial(
                onebit.compressed_allreduce, buffer, worker_error, server_error, out=buffer
            ),
        ),
    ):
        for _ in range(repeats):
            assert onebit_lamb.stage == stage
            times.setdefault(f"lamb_step_{stage}", []).append(timed(lamb.step))
            times.setdefault(f"onebit_{stage}_step", []).append(timed(onebit_lamb.step))
            times.setdefault(f"collective_{stage}", []).append(timed(collective))
        if stage == "warmup":
            state_after_warmup = _state_bytes(onebit_lamb)
            flat_grads.resize_(0)  # free it before the compression stage's buffers arrive
            timed(onebit_lamb.step)  # the switch: scaling coefficients, fused buffer
    median = {name: statistics.median(values) for name, values in times.items()}
    return {
        "world_size": world,
        "parameters": numel,
        "lamb_step_s": median["lamb_step_compression"],
        "lamb_step_during_warmup_s": median["lamb_step_warmup"],
        "dense_allreduce_s": median["collective_warmup"],
        "onebit_warmup_step_s": median["onebit_warmup_step"],
        "onebit_compression_step_s": median["onebit_compression_step"],
        "compressed_allreduce_s": median["collective_compression"],
        "lamb_state_bytes": sum(_state_bytes(lamb)),
        "onebit_warmup_state_bytes": sum(state_after_warmup),
        "onebit_compression_state_bytes": sum(_state_bytes(onebit_lamb)),
        "onebit_scratch_bytes": _scratch_bytes(onebit_lamb),
    }


def _print_optimizer_row(row: dict[str, Any]) -> None:
    n, numel = row["world_size"], row["parameters"]
    bound = 1.5 * (row["lamb_step_s"] + row["compressed_allreduce_s"])
    print(f"world size {n}, {numel / 1e6:.1f}M parameters:")
    print(f"  Lamb.step() (beside the warm-up)    {row['lamb_step_during_warmup_s']:8.3f} s")
    print(f"  OneBitLamb.step(), warm-up          {row['onebit_warmup_step_s']:8.3f} s")
    print(f"  dense allreduce of the gradients    {row['dense_allreduce_s']:8.3f} s")
    print(f"  Lamb.step() (beside compression)    {row['lamb_step_s']:8.3f} s")
    print(f"  OneBitLamb.step(), compression      {row['onebit_compression_step_s']:8.3f} s")
    print(f"  compressed_allreduce alone          {row['compressed_allreduce_s']:8.3f} s")
    ratio = row["onebit_compression_step_s"] / (row["lamb_step_s"] + row["compressed_allreduce_s"])
    print(
        f"  compression step / (Lamb step + its collective) = {ratio:.2f} "
        f"(target <= 1.5: {'met' if row['onebit_compression_step_s'] <= bound else 'missed'})"
    )
    words = FLOAT_BYTES * numel
    print(
        f"  state per parameter, fp32 words: Lamb {row['lamb_state_bytes'] / words:.2f}, "
        f"OneBitLamb warm-up {row['onebit_warmup_state_bytes'] / words:.2f}, "
        f"compression {row['onebit_compression_state_bytes'] / words:.2f} "
        f"(target <= 5 + 1/n = {5 + 1 / n:.2f}); reused scratch "
        f"{row['onebit_scratch_bytes'] / words:.2f}\n"
    )


def run_optimizer_bench(args: argparse.Namespace) -> int:

    shapes = bert_base_shapes(args.scale)
    print(f"BERT-base parameter shapes (scale {args.scale}), 1 thread per rank,")
    print(f"median of {args.repeats} steps per figure, Lamb and OneBitLamb interleaved\n")
    rows = []
    for world in args.world_sizes:
        row = _rank_zero_result(_optimizer_worker, world, shapes, args.repeats)
        rows.append(row)
        _print_optimizer_row(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0
