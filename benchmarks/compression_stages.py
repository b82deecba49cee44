"""Each compression stage of one exchange's local work on this rank, alone: the worker's
compression and error update of ``n * 2^k`` float32 elements, and the server's compression
and error update of its chunk of ``2^k`` elements from ``n`` ranks' signs (the error update
both in place and into ``out``); one thread, every stage and a copy of ``2^k`` float32 (the
unit of a pass over memory) timed in turn, medians over the repeats.

    .venv/bin/python benchmarks/compression_stages.py [--ranks 2,4] [--log2 22] \\
        [--kernels numba,torch]

Prints one Markdown row per backend, world size and stage: milliseconds, and copies of the
stage's elements (a worker stage handles ``n`` chunks).

Run it under ``PYTHONPATH`` of another checkout's ``src`` to time that version's kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def stage_times(backend_name: str, n: int, log2: int, repeats: int) -> dict[str, float]:
    """Median seconds of each stage for ``n`` ranks and a server chunk of ``2^log2``."""
    import torch

    from onebit import kernels
    from onebit.compression import scale_dtype
    from onebit.exchange.protocol import Layout, Stages
    from onebit.timing import copy_fn, interleaved

    chunk = 1 << log2
    numel = n * chunk
    generator = torch.Generator().manual_seed(n)
    buffer = torch.randn(numel, generator=generator)
    worker_error = torch.randn(numel, generator=generator) * 0.1
    server_error = torch.randn(chunk, generator=generator) * 0.1
    received = torch.randint(0, 256, (n, chunk // 8), generator=generator, dtype=torch.uint8)
    worker_scales = torch.rand(1, n, generator=generator).to(scale_dtype(torch.float32))
    backend = kernels.select(buffer, backend_name)
    stages = Stages(Layout.flat(numel, n), backend, torch.float32, torch.device("cpu"))
    x, next_server_error = torch.empty(numel), torch.empty(chunk)
    worker_packed = torch.empty(numel // 8, dtype=torch.uint8)
    server_packed = torch.empty(chunk // 8, dtype=torch.uint8)
    scales = torch.empty(1, dtype=worker_scales.dtype)
    server_scales = torch.empty(1, dtype=worker_scales.dtype)
    view = stages.server_view(received)
    stages.compress_worker([buffer], [x], worker_error, worker_packed, scales)
    stages.compress_server(view, worker_scales, server_error, server_packed, server_scales)
    original_worker_error, original_server_error = worker_error.clone(), server_error.clone()

    def worker_update() -> None:  # from the same error each time: an update never compounds
        worker_error.copy_(original_worker_error)
        stages.update_worker_errors([buffer], [x], worker_error, worker_packed, scales)

    def server_update_in_place() -> None:
        server_error.copy_(original_server_error)
        stages.update_server_errors(view, worker_scales, server_error, server_packed, server_scales)

    fns = {
        "copy of the chunk": copy_fn(chunk),
        "worker compression": lambda: stages.compress_worker(
            [buffer], [x], worker_error, worker_packed, scales
        ),
        "worker error update (+ a copy of n chunks)": worker_update,
        "copy of n chunks": copy_fn(numel),
        "server compression": lambda: stages.compress_server(
            view, worker_scales, server_error, server_packed, server_scales
        ),
        "server error update in place (+ a copy of the chunk)": server_update_in_place,
        "server error update into out": lambda: stages.update_server_errors(
            view, worker_scales, server_error, server_packed, server_scales, next_server_error
        ),
        "copy of the chunk, again": copy_fn(chunk),
    }
    return interleaved(fns, repeats, sync=lambda: None)


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name.strip()]


def _ints(text: str) -> list[int]:
    values = [int(n) for n in text.split(",") if n.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ranks", type=_ints, default=[2, 4], help="comma-separated world sizes (default: 2,4)"
    )
    parser.add_argument(
        "--log2", type=int, default=22, help="a server chunk of 2^LOG2 elements (default: 22)"
    )
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed calls of each stage (default: 15)"
    )
    parser.add_argument(
        "--kernels",
        type=_names,
        default=None,
        help="comma-separated backends (default: every CPU backend installed: torch, numba)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.log2 < 3 or args.repeats < 1:
        parser.error("--log2 must be at least 3 and --repeats at least 1")

    import torch

    from onebit.timing import cpu_backends

    torch.set_num_threads(1)
    rows = []
    print(f"server chunk 2^{args.log2} float32; one thread; medians of {args.repeats} (ms)")
    print("| backend | ranks | stage | ms | copies of its elements |")
    print("|---|---:|---|---:|---:|")
    for name in args.kernels or cpu_backends():
        for n in args.ranks:
            times = stage_times(name, n, args.log2, args.repeats)
            copy = (times["copy of the chunk"] + times["copy of the chunk, again"]) / 2
            for stage, seconds in times.items():
                elements = n if stage.startswith("worker") or "n chunks" in stage else 1
                copies = seconds / (copy * elements)
                rows.append(
                    {"backend": name, "ranks": n, "stage": stage, "ms": seconds * 1e3,
                     "copies": copies}
                )  # fmt: skip
                print(f"| {name} | {n} | {stage} | {seconds * 1e3:.3f} | {copies:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"log2": args.log2, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
