"""The cost model's machine constants, measured on the machine where the user runs it.

``R_c``, the bytes of fp32 parameters per second through the compression stage's local work
beyond LAMB's update, ``R_h``, the bytes per second a rank moves through gloo's dense
allreduce, and ``R_m``, the bytes of fp32 per second through a copy of the weights, from one
measurement (:func:`onebit.timing.optimizer_step_times`, the same as ``onebit bench
optimizer``) on BERT-base's parameter shapes:

    R_c = 4N / (t(OneBitLamb compression-stage step) - t(Lamb.step()))
    R_h = 4N / t(dist.all_reduce)     (2 ranks send 2 (n-1)/n 4N = 4N bytes each)
    R_m = 4N / t(copy of the N parameters)

On CPU: 2 local gloo ranks, one thread each, the fastest CPU kernels. On an accelerator: one
device, its default kernels; ``R_h`` is ``inf`` (NCCL reduces on the device).

``onebit estimate --calibrate`` saves the result in the cache (:mod:`onebit.cache`), and later
estimates on this machine use it; without one they fall back to the constants measured on the
2-core machine of docs/bench (:data:`~onebit.estimate.model.COMPRESSION_THROUGHPUT`,
:data:`~onebit.estimate.model.HOST_THROUGHPUT`, :data:`~onebit.estimate.model.COPY_THROUGHPUT`)
and say so.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from onebit.atomic import write_json_atomic
from onebit.cache import default_cache_dir
from onebit.estimate.model import (
    COMPRESSION_THROUGHPUT,
    COPY_THROUGHPUT,
    FP32_BYTES,
    HOST_THROUGHPUT,
)

__all__ = [
    "calibrate",
    "calibration_file",
    "load_calibration",
    "machine_constants",
    "save_calibration",
]

#: The shipped throughputs, measured on the 2-core CPU of docs/bench.
DEFAULT_THROUGHPUTS = {
    "compression_throughput": COMPRESSION_THROUGHPUT,
    "host_throughput": HOST_THROUGHPUT,
    "copy_throughput": COPY_THROUGHPUT,
}
#: Where the fallback constants were measured.
FALLBACK_SOURCE = "onebit's defaults, measured on a 2-core CPU (docs/ESTIMATE.md)"


def calibrate(
    device: str = "cpu", scale: float | None = None, repeats: int | None = None
) -> dict[str, Any]:
    """Measure ``R_c``, ``R_h`` and ``R_m`` here on ``device`` (widths of BERT-base times ``scale``:
    0.5 on CPU, 1 on an accelerator; ``repeats`` interleaved rounds: 3 on CPU, 10 otherwise).
    Returns the step times too. Raises ``RuntimeError`` when the machine is too busy to tell
    the two steps apart."""
    from onebit.bert_shapes import bert_shapes
    from onebit.testing import spawn_workers
    from onebit.timing import cpu_backends, optimizer_step_times, rank_step_times

    on_cpu = device == "cpu"
    shapes = bert_shapes(scale if scale is not None else 0.5 if on_cpu else 1.0)
    repeats = repeats if repeats is not None else 3 if on_cpu else 10
    if on_cpu:
        fused = cpu_backends()[-1]
        times = spawn_workers(
            rank_step_times,
            2,
            args=(shapes, repeats, fused),
            timeout_s=3600,
            collective_timeout_s=600,
        )[0]
        where = f"2 ranks, {fused} kernels"
    else:
        times = optimizer_step_times(shapes, repeats, device=device)
        where = f"{device} ({times['backend']} kernels)"
    nbytes = FP32_BYTES * times["parameters"]
    extra = times["onebit_compression_step_s"] - times["lamb_step_s"]
    if not extra > 0:
        raise RuntimeError(
            f"calibration failed: the compression-stage step ({times['onebit_compression_step_s']}"
            f" s) was not slower than Lamb.step() ({times['lamb_step_s']} s); the machine is too "
            "busy to measure, try again"
        )
    return {
        **times,
        "device": device,
        "measured_on": where,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "compression_throughput": nbytes / extra,
        "host_throughput": nbytes / times["dense_allreduce_s"] if on_cpu else math.inf,
        "copy_throughput": nbytes / times["copy_s"],
    }


def calibration_file(device: str = "cpu") -> Path:
    """Where this machine's calibration on ``device`` is saved."""
    return default_cache_dir() / f"calibration-{device}.json"


def save_calibration(measured: dict[str, Any]) -> Path:
    """Save ``measured`` (from :func:`calibrate`) for later estimates on this machine."""
    path = calibration_file(measured["device"])
    write_json_atomic(path, {k: (None if v == math.inf else v) for k, v in measured.items()})
    return path


def load_calibration(device: str = "cpu") -> dict[str, Any] | None:
    """This machine's saved calibration on ``device``, or ``None`` (none, or unreadable)."""
    try:
        saved = json.loads(calibration_file(device).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not saved.get("compression_throughput"):
        return None
    if saved.get("host_throughput") is None:
        saved["host_throughput"] = math.inf
    return saved


def machine_constants(device: str = "cpu") -> tuple[dict[str, float], str]:
    """The throughputs (``compression_throughput`` R_c, ``host_throughput`` R_h,
    ``copy_throughput`` R_m) and where they come from: this machine's saved calibration on
    ``device``, else the shipped constants (R_m alone where a calibration saved before it
    was measured has none)."""
    saved = load_calibration(device)
    if saved is None:
        return dict(DEFAULT_THROUGHPUTS), FALLBACK_SOURCE
    source = f"calibrated here on {saved['measured_on']} at {saved['measured_at']}"
    if saved.get("copy_throughput") is None:
        source += "; copy throughput: onebit's default"
    return {name: saved.get(name) or value for name, value in DEFAULT_THROUGHPUTS.items()}, source
