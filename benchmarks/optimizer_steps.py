"""Optimizer steps side by side on BERT shapes, in milliseconds and in copies of the parameters.

Every step of torch's AdamW (``fused=True`` and ``foreach=True``), onebit's Lamb and each kind
of step of OneBitLamb, OneBitAdam (both exchanges: ``fused`` and ``per_tensor``) and
ZeroOneAdam (variance update, 1-bit gradient, local, synchronisation) runs in a world of one
rank (the exchange's local work and the update, nothing on a wire) on the same BERT tensor
shapes (fp32 parameters, the same gradients), one after the other, round after round (as
:func:`onebit.timing.interleaved` does), and the median of each is kept; a *copy* is one copy
of all parameters (fp32) timed in the same rounds. The steps run in three groups (LAMB's,
1-bit Adam's and 0/1 Adam's), each with its own AdamW(fused=True) and copy so that every ratio
is measured side by side, and only one group's optimizers are in memory at a time. Prints one
table per model (ms, copies, ratio to AdamW(fused=True), backend) and the targets with the
measured ratios; ``--out`` writes the results as JSON. Exit status 77 when ``--device cuda``
finds no GPU.

    .venv/bin/python benchmarks/optimizer_steps.py --device cpu --models base --scale 0.25
    .venv/bin/python benchmarks/optimizer_steps.py --device cuda   # part of scripts/gpu_check.sh
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

import onebit
from onebit.bert_shapes import PRESETS, bert_shapes
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE
from onebit.timing import copy_fn

# ZeroOneAdam schedules (DeepSpeed's) in which almost every step is of one kind (steps of
# other kinds are run but not counted): variance updates at every step; 1-bit gradients
# between variance updates at the powers of two; after a freeze at step 1, local intervals
# that double; after it, a synchronisation at every step.
ZERO_ONE_ADAM_SCHEDULES = {
    "variance_update": dict(var_freeze_step=10**9, var_update_scaler=10**9),
    "gradient_1bit": dict(var_freeze_step=10**9, var_update_scaler=1),
    "local": dict(var_freeze_step=1, local_step_scaler=1, local_step_clipper=1 << 20),
    "sync": dict(var_freeze_step=1, local_step_clipper=1),
}


@dataclass
class Method:
    """One kind of step: an optimizer on its own parameters, counted when ``counts()``."""

    name: str
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    counts: Callable[[], bool]


def _constructors(group: str) -> dict[str, tuple[Callable, str | None]]:
    """Each step of ``group``: how to build its optimizer (from the parameters and the common
    settings) and, for ZeroOneAdam, the kind of step that is counted."""
    adamw = {"AdamW(fused=True)": (lambda p, **s: torch.optim.AdamW(p, fused=True, **s), None)}
    if group == "lamb":
        return {
            **adamw,
            "AdamW(foreach=True)": (lambda p, **s: torch.optim.AdamW(p, foreach=True, **s), None),
            "Lamb": (onebit.Lamb, None),
            "OneBitLamb warm-up": (partial(onebit.OneBitLamb, freeze_step=10**9), None),
            **{
                f"OneBitLamb compression ({compression})": (
                    partial(onebit.OneBitLamb, freeze_step=1, compression=compression),
                    None,
                )
                for compression in ("fused", "per_tensor")
            },
        }
    if group == "onebit-adam":
        steps = {"OneBitAdam warm-up": (partial(onebit.OneBitAdam, freeze_step=10**9), None)}
        for compression in ("fused", "per_tensor"):
            build = partial(onebit.OneBitAdam, freeze_step=1, compression=compression)
            steps[f"OneBitAdam compression ({compression})"] = (build, None)
        return {**adamw, **steps}
    return {
        **adamw,
        **{
            f"ZeroOneAdam {kind}": (
                partial(onebit.ZeroOneAdam, **(DEEPSPEED_SCHEDULE | schedule)),
                kind,
            )
            for kind, schedule in ZERO_ONE_ADAM_SCHEDULES.items()
        },
    }


#: Rounds of steps allowed per counted step (0/1 Adam's rarest counted kind comes about every
#: 4th step here) before the benchmark says which method never reaches its kind.
MAX_ROUNDS_PER_REPEAT = 16


def build_group(group: str, shapes, device, lr: float = 1e-4) -> list[Method]:
    """The group's optimizers, each on its own copy of the same initial parameters."""
    methods = []
    for name, (build, kind) in _constructors(group).items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
        optimizer = build(params, lr=lr, weight_decay=0.01)

        def counts(optimizer=optimizer, kind=kind) -> bool:
            return kind is None or optimizer.kind_of_step(optimizer.step_count + 1) == kind

        methods.append(Method(name, params, optimizer, counts))
    return methods


def time_group(methods: list[Method], grads, repeats: int, device) -> dict[str, float]:
    """Median seconds of each method's counted steps and of a copy, run in turn round after
    round (as :func:`onebit.timing.interleaved`, which cannot skip the steps of other kinds)
    until every method has ``repeats`` counted steps."""
    cuda = torch.device(device).type == "cuda"

    def completed() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step(m: Method) -> None:
        for p, g in zip(m.params, grads, strict=True):
            p.grad = g  # the optimizers only read gradients
        m.optimizer.step()

    for m in methods:  # the first step: state, compilation, the switch of freeze_step=1
        step(m)
    copy = copy_fn(sum(p.numel() for p in methods[0].params), device)
    runs = {"copy": (lambda: True, copy)}
    runs.update({m.name: (m.counts, lambda m=m: step(m)) for m in methods})
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(MAX_ROUNDS_PER_REPEAT * repeats):
        if min(len(values) for values in times.values()) >= repeats:
            break
        for name, (counts, fn) in runs.items():
            counted = counts()
            completed()
            start = time.perf_counter()
            fn()
            completed()
            if counted:
                times[name].append(time.perf_counter() - start)
    else:
        missing = [name for name, values in times.items() if len(values) < repeats]
        raise RuntimeError(
            f"{missing} took fewer than {repeats} steps of their counted kind in "
            f"{MAX_ROUNDS_PER_REPEAT * repeats} rounds: does their schedule reach that kind?"
        )
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda", help="where the steps run: cuda or cpu (default: cuda)"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=["base", "large"],
        choices=sorted(PRESETS),
        help="BERT shapes to time (default: base large)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply the models' widths by this factor; below 1 shrinks them (default: 1.0)",
    )
    parser.add_argument(
        "--repeats", type=int, default=20, help="timed steps of each kind (default: 20)"
    )
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a CPU run", file=sys.stderr)
        return 77
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    results = {}
    for model in args.models:
        shapes = bert_shapes(args.scale, model)
        gen = torch.Generator(device=device).manual_seed(1)
        grads = [torch.randn(s, generator=gen, device=device) * 1e-3 for s in shapes]
        numel = sum(g.numel() for g in grads)
        rows = {}
        for group in ("lamb", "onebit-adam", "zero-one-adam"):
            methods = build_group(group, shapes, device)
            times = time_group(methods, grads, args.repeats, device)
            backends = {m.name: getattr(m.optimizer, "backend", None) for m in methods}
            adamw = times["AdamW(fused=True)"]
            for name, seconds in times.items():
                if name == "copy" or (name == "AdamW(fused=True)" and group != "lamb"):
                    continue
                rows[name] = {
                    "ms": 1e3 * seconds,
                    "copies": seconds / times["copy"],
                    "vs_adamw_fused": seconds / adamw,
                    "backend": backends[name].name if backends[name] else "torch",
                }
            del methods
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results[model] = {"parameters": numel, "tensors": len(shapes), "steps": rows}
        print_table(model, numel, len(shapes), rows, device)
    print_targets(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "results": results}, f, indent=2)
    return 0


def print_table(model, numel, tensors, rows, device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\nBERT-{model}: {numel / 1e6:.1f}M parameters in {tensors} tensors, fp32, {name}")
    print(f"{'step':<36} {'ms':>9} {'copies':>8} {'/ AdamW(fused)':>15} backend")
    for step, row in rows.items():
        print(
            f"{step:<36} {row['ms']:9.3f} {row['copies']:8.1f} {row['vs_adamw_fused']:15.2f} "
            f"{row['backend']}"
        )


TARGETS = [  # (what, step, against, bound): step / against <= bound; against None: copies
    ("Lamb / AdamW(fused)", "Lamb", "AdamW(fused=True)", 1.3),
    ("OneBitLamb compression (fused), copies", "OneBitLamb compression (fused)", None, 12.0),
    ("OneBitLamb compression (per_tensor), copies", "OneBitLamb compression (per_tensor)", None,
     12.0),
    ("OneBitLamb warm-up / Lamb", "OneBitLamb warm-up", "Lamb", 1.1),
    ("OneBitAdam warm-up / AdamW(fused)", "OneBitAdam warm-up", "AdamW(fused=True)", 1.3),
    ("ZeroOneAdam variance update / AdamW(fused)", "ZeroOneAdam variance_update",
     "AdamW(fused=True)", 1.3),
    ("ZeroOneAdam local / AdamW(fused)", "ZeroOneAdam local", "AdamW(fused=True)", 1.3),
    ("OneBitAdam compression (fused), copies", "OneBitAdam compression (fused)", None, 12.0),
    ("OneBitAdam compression (per_tensor), copies", "OneBitAdam compression (per_tensor)", None,
     12.0),
    ("ZeroOneAdam gradient_1bit, copies", "ZeroOneAdam gradient_1bit", None, 12.0),
    ("ZeroOneAdam sync, copies", "ZeroOneAdam sync", None, 12.0),
]  # fmt: skip


def print_targets(results) -> None:
    print("\ntargets (measured; 'met' where within the bound)")
    for what, step, against, bound in TARGETS:
        measured = []
        for model, result in results.items():
            rows = result["steps"]
            if against is None:
                value = rows[step]["copies"]
            elif against == "AdamW(fused=True)":  # the one timed in the same group
                value = rows[step]["vs_adamw_fused"]
            else:  # (both in the same group)
                value = rows[step]["ms"] / rows[against]["ms"]
            measured.append(f"{model} {value:.2f} ({'met' if value <= bound else 'NOT met'})")
        print(f"  {what} <= {bound}: " + ", ".join(measured))


if __name__ == "__main__":
    sys.exit(main())
