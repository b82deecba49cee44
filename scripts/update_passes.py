"""The numba update passes of LAMB and of 1-bit LAMB's compression stage, each alone on one
thread over ``2^k`` float32 elements of one parameter, against a copy of ``2^k`` float32 (the
unit of a pass over memory), medians over the repeats, every function timed in turn:

* 1-bit LAMB pass A: decode the exchanged signs, write ``m`` and ``v_fresh``, sum ``||u0||^2``
  and ``||u||^2`` and take the maximum of ``d / (sqrt(v_fresh) + eps)`` (reads ``m, v,
  v_fresh, p``, writes ``m, v_fresh``: 3 copies of memory traffic), two square roots and two
  divisions an element;
* 1-bit LAMB pass B: ``p -= lr c f (m / (sqrt(v) + eps) + wd p)`` (reads ``m, v, p``, writes
  ``p``: 2 copies);
* LAMB's two passes: the sums (reads ``g, m, v, p``: 2 copies) and the update (reads ``g, m,
  v, p``, writes ``m, v, p``: 3.5 copies).

With ``--huge-pages`` every pass also runs on a second set of buffers advised as transparent
huge pages (``madvise(MADV_HUGEPAGE)`` before their first touch), interleaved with the first.

    .venv/bin/python scripts/update_passes.py [--log2 24] [--repeats 15] [--huge-pages]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
from collections.abc import Callable

HUGE_PAGE = 1 << 21


def advise_huge_pages(tensor) -> None:
    """Advise the 2 MiB-aligned pages inside ``tensor``'s memory as transparent huge pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = (tensor.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (tensor.data_ptr() + tensor.nbytes) & ~(HUGE_PAGE - 1)
    if end > start and libc.madvise(start, end - start, mmap.MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")


def passes(numel: int, huge_pages: bool, seed: int) -> dict[str, Callable[[], object]]:
    """The passes over fresh buffers of ``numel`` float32 (one parameter)."""
    import numpy as np
    import torch

    from onebit.kernels import _numba_optim as kernels

    generator = torch.Generator().manual_seed(seed)

    def buffer(scale: float = 1.0, square: bool = False):
        tensor = torch.empty(numel)
        if huge_pages:
            advise_huge_pages(tensor)
        tensor.normal_(generator=generator).mul_(scale)
        return (tensor.square_() if square else tensor).numpy()

    g, m, p, source = buffer(1e-3), buffer(1e-3), buffer(), buffer()
    v, fresh = buffer(1e-3, square=True), buffer(1e-3, square=True)
    signs = torch.randint(0, 256, (numel // 8,), generator=generator, dtype=torch.uint8).numpy()
    f32, no_mask, int_bits = np.float32, np.zeros(0, np.float32), np.zeros(0, np.int32)
    b1, b2, eps, wd, step = f32(0.9), f32(0.999), f32(1e-6), f32(0.01), f32(-1e-9)
    return {
        "copy": lambda: np.copyto(source, p),
        "1-bit LAMB pass A": lambda: kernels._onebit_lamb_block_a(
            signs,
            0,
            f32(1e-3),
            no_mask,
            m,
            v,
            fresh,
            p,
            b1,
            f32(10),
            b2,
            f32(1e-3),
            eps,
            wd,
            int_bits,
        ),
        "1-bit LAMB pass B": lambda: kernels._step_block(m, v, p, eps, wd, step),
        "LAMB sums": lambda: kernels._lamb_block_sums(
            g, m, v, p, b1, f32(0.1), b2, f32(1e-3), eps, wd
        ),
        "LAMB update": lambda: kernels._adam_block_apply(
            g, m, v, p, b1, f32(0.1), b2, f32(1e-3), eps, wd, step
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log2", type=int, default=24, help="2^k elements (24)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--huge-pages", action="store_true", help="also on huge pages")
    args = parser.parse_args()

    import numba
    import torch

    from onebit.timing import interleaved

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    kinds = ["4 KiB pages", "huge pages"] if args.huge_pages else ["4 KiB pages"]
    fns = {
        (kind, name): fn
        for seed, kind in enumerate(kinds)
        for name, fn in passes(1 << args.log2, kind == "huge pages", seed).items()
    }
    times = interleaved(fns, args.repeats, sync=lambda: None)
    print(f"2^{args.log2} float32, one thread; medians of {args.repeats} (ms)")
    print("| pages | pass | ms | copies |")
    print("|---|---|---:|---:|")
    for (kind, name), seconds in times.items():
        print(f"| {kind} | {name} | {seconds * 1e3:.1f} | {seconds / times[kind, 'copy']:.2f} |")
    with open("/proc/self/smaps_rollup") as smaps:
        print(*(line.strip() for line in smaps if line.startswith("AnonHugePages")))


if __name__ == "__main__":
    main()
