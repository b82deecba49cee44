"""``onebit bench sweep``: the comparison over link bandwidths and worker counts, and its plot
of the speedups over LAMB against bandwidth beside the ideal for the measured ``s``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onebit.bench.comparison import ComparisonError, run_comparison
from onebit.bench.report import COMPARED_METHODS, bandwidth_label, format_report, write_json
from onebit.bench.settings import ComparisonSettings
from onebit.units import parse_bandwidth

logger = logging.getLogger(__name__)

_UNSHAPED_X = 4e10
"""Where an unshaped link sits on a bandwidth axis: right of every shaped rate swept here."""


def run_sweep(
    base: ComparisonSettings,
    bandwidths: Sequence[str | None],
    worker_counts: Sequence[int],
    worker_bandwidth: str | None,
    out_dir: Path,
) -> dict[str, Any]:
    """The comparison ``base`` at every bandwidth (with ``base``'s workers) and at every
    worker count (at ``worker_bandwidth``), in nodes of ``base.workers_per_node`` workers;
    writes one JSON per configuration, a summary JSON and a PNG. A configuration that fails
    is recorded with its error and the sweep goes on."""
    base_workers, _ = base.topology()
    per_node = base.workers_per_node
    configs: list[tuple[int, str | None]] = [(base_workers, b) for b in bandwidths]
    configs += [
        (n, worker_bandwidth) for n in worker_counts if (n, worker_bandwidth) not in configs
    ]
    model = base.model
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for workers, bandwidth in configs:
        shape = f"{workers}w" if per_node == 1 else f"{workers // per_node}x{per_node}"
        label = f"{model}-{shape}-{bandwidth_label(bandwidth)}"
        logger.info("sweep: %s", label)
        settings = dataclasses.replace(base, workers=workers, nodes=None, bandwidth=bandwidth)
        try:
            result = run_comparison(settings)
        except ComparisonError as exc:
            logger.error("sweep: %s failed: %s", label, exc)
            results.append({"workers": workers, "bandwidth": bandwidth, "error": str(exc)})
            continue
        write_json(result, out_dir / f"cluster-{label}.json")
        print(format_report(result), flush=True)
        results.append(sweep_row(result))
    sweep = {
        "model": model,
        "bandwidth_workers": base_workers,
        "worker_bandwidth": worker_bandwidth,
        "rows": results,
    }
    if bandwidths and not worker_counts:
        tag = f"bandwidth-{base_workers}w"
    elif worker_counts and not bandwidths:
        tag = f"workers-{bandwidth_label(worker_bandwidth)}"
    else:
        tag = "bandwidth-workers"
    write_json(sweep, out_dir / f"sweep-{model}-{tag}.json")
    plot_sweep(sweep, out_dir / f"speedup-{model}-{tag}.png")
    return sweep


def sweep_row(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one comparison that a sweep's table and plot show."""
    settings, summary, derived = result["settings"], result["summary"], result["derived"]
    tcp = result.get("tcp_check") or {}
    return {
        "workers": settings["workers"],
        "workers_per_node": settings.get("workers_per_node", 1),
        "bandwidth": settings["bandwidth"],
        "tcp_bits_per_second": tcp.get("bits_per_second"),
        "comm_share": derived.get("comm_share"),
        "ideal_compression_stage_speedup": derived.get("ideal_compression_stage_speedup"),
        "ideal_end_to_end_speedup": derived.get("ideal_end_to_end_speedup"),
        "lamb_step_seconds": summary.get("lamb", {}).get("t_comp"),
        "compute_step_seconds": summary.get("lamb-compute", {}).get("t_comp"),
        "model": settings["model"],
        "parameters": result.get("info", {}).get("parameters"),
        "methods": {
            name: {
                "t_warm": item.get("t_warm"),
                "t_comp": item.get("t_comp"),
                "compression_stage_speedup": item.get("compression_stage_speedup"),
                "end_to_end_speedup": item.get("end_to_end_speedup"),
                "compression_stage_bytes_reduction": item.get("compression_stage_bytes_reduction"),
            }
            for name, item in summary.items()
        },
        "targets": {k: v.get("met") for k, v in result["targets"].items() if isinstance(v, dict)},
        "requested_methods": list(settings["methods"]),
    }


def plot_sweep(sweep: dict[str, Any], path: Path) -> None:
    """Speedup over LAMB against link bandwidth (and against workers), with the ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in sweep["rows"] if "error" not in r and r["comm_share"] is not None]
    by_bandwidth = sorted(
        (r for r in rows if r["workers"] == sweep["bandwidth_workers"]),
        key=lambda r: x_of(r),
    )
    by_workers = sorted(
        (r for r in rows if r["bandwidth"] == sweep["worker_bandwidth"]), key=lambda r: r["workers"]
    )
    panels = [
        (data, xkey)
        for data, xkey in ((by_bandwidth, "bandwidth"), (by_workers, "workers"))
        if len(data) > 1 or (data and len(rows) == 1)
    ]
    if not panels:
        logger.warning("nothing to plot: no configuration of the sweep completed")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.8 * len(panels) + 2.6, 5), squeeze=False)
    for ax, (data, xkey) in zip(axes[0], panels, strict=False):
        xs = [x_of(r) if xkey == "bandwidth" else r["workers"] for r in data]
        for name in COMPARED_METHODS:
            pts = [
                (x, r["methods"][name]["compression_stage_speedup"])
                for x, r in zip(xs, data, strict=False)
                if r["methods"].get(name, {}).get("compression_stage_speedup") is not None
            ]
            if pts:
                style = "-o" if name.startswith("onebit") else "--s"
                ax.plot(*zip(*pts, strict=False), style, label=f"{name} (compr. stage)")
        whole_run = [
            (x, r["methods"]["onebit-lamb-ddp"]["end_to_end_speedup"])
            for x, r in zip(xs, data, strict=False)
            if "onebit-lamb-ddp" in r["methods"]
        ]
        if whole_run:
            label = "onebit-lamb-ddp whole run (w=0.2)"
            ax.plot(*zip(*whole_run, strict=False), ":^", color="black", label=label)
        for key, style, label in (
            ("ideal_compression_stage_speedup", "-", "ideal 1/((1-s)+s/32), measured s"),
            ("ideal_end_to_end_speedup", ":", "ideal whole run, measured s, w=0.2"),
        ):
            ideal = [r[key] for r in data]
            ax.plot(xs, ideal, style, color="grey", linewidth=3, alpha=0.5, label=label)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_ylabel("speedup over LAMB + DDP (step time ratio)")
        for x, r in zip(xs, data, strict=False):
            ax.annotate(
                f"s={r['comm_share']:.2f}",
                (x, r["ideal_compression_stage_speedup"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
        if xkey == "bandwidth":
            ax.set_xscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([_x_label(r) for r in data], fontsize=8)
            ax.minorticks_off()
            ax.set_xlabel(
                f"per-link bandwidth, configured (measured TCP rate of one stream); "
                f"{sweep['bandwidth_workers']} workers"
            )
        else:
            ax.set_xticks(xs)
            ax.set_xlabel(f"workers ({bandwidth_label(sweep['worker_bandwidth'])} links)")
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(
        f"Emulated cluster, model {sweep['model']}: speedup over LAMB "
        "(all workers share 2 CPU cores)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def x_of(row: dict[str, Any]) -> float:
    """The position of a sweep row on the bandwidth axis, in bits/s."""
    if row["bandwidth"] is not None:
        return parse_bandwidth(row["bandwidth"])
    return _UNSHAPED_X


def _x_label(row: dict[str, Any]) -> str:
    tcp = row.get("tcp_bits_per_second")
    measured = f"\n(TCP {tcp / 1e9:.2f} Gbit/s)" if tcp else ""
    return bandwidth_label(row["bandwidth"]) + measured
