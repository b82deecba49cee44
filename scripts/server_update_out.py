"""What the server error update into ``out`` saves against a copy of the server error followed
by the update in place (how an exchange of its own buffer computed its server update ahead
before): one server chunk of ``2^k`` float32 (an exchange of ``2^(k+1)`` among 2 ranks), the
selected backend, one thread, both ways alternating; medians over the repeats.

    .venv/bin/python scripts/server_update_out.py [--log2 24] [--repeats 15] [--kernels numba]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log2", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kernels", default="numba")
    args = parser.parse_args()

    import torch

    from onebit import kernels
    from onebit.compression import scale_dtype
    from onebit.exchange.protocol import Layout, Stages

    torch.set_num_threads(1)
    n, chunk = 2, 1 << args.log2
    generator = torch.Generator().manual_seed(0)
    received = [torch.randint(0, 256, (n, chunk // 8), generator=generator, dtype=torch.uint8)]
    server_error = torch.randn(chunk, generator=generator)
    next_error = torch.empty(chunk)
    backend = kernels.select(server_error, args.kernels)
    stages = Stages(Layout.flat(n * chunk, n), backend, torch.float32, torch.device("cpu"))
    worker_scales = torch.tensor([[0.5, 0.7]], dtype=scale_dtype(torch.float32))
    packed = torch.empty(chunk // 8, dtype=torch.uint8)
    scales = torch.empty(1, dtype=worker_scales.dtype)
    stages.compress_server(received, worker_scales, server_error, packed, scales)

    def copy_then_in_place() -> None:
        next_error.copy_(server_error)
        stages.update_server_errors(received, worker_scales, next_error, packed, scales)

    def into_out() -> None:
        stages.update_server_errors(
            received, worker_scales, server_error, packed, scales, next_error
        )

    seconds: dict[str, list[float]] = {"copy, then in place": [], "into out": []}
    for _ in range(args.repeats):
        for name, run in zip(seconds, (copy_then_in_place, into_out), strict=True):
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    for name, median in medians.items():
        print(f"{name}: {median * 1e3:.1f} ms")
    ratio = medians["into out"] / medians["copy, then in place"]
    print(f"into out / copy, then in place: {ratio:.2f} ({backend.name}, 2^{args.log2} float32)")


if __name__ == "__main__":
    main()
