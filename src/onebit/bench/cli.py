"""``onebit bench cluster``, ``sweep``, ``report`` and ``exchange``.

The options of ``cluster`` and ``sweep`` are the fields of
:class:`~onebit.bench.settings.ComparisonSettings`; ``sweep`` adds the bandwidths and worker
counts it goes through.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from onebit.bench.settings import ComparisonSettings
from onebit.cli import add_options, checked_type, given_options
from onebit.optim.checks import check_bucket_cap_mb
from onebit.units import rate_option

logger = logging.getLogger(__name__)


def _bandwidth_list(text: str) -> list[str | None]:
    return [rate_option(b) for b in text.split(",") if b.strip()]


def _int_list(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n.strip()]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def _settings(args: argparse.Namespace) -> ComparisonSettings:
    return ComparisonSettings(**given_options(ComparisonSettings, args))


def _cluster_command(args: argparse.Namespace) -> int:
    from onebit.bench.comparison import ComparisonError, run_comparison
    from onebit.bench.report import format_report, write_json

    try:
        result = run_comparison(_settings(args))
    except ComparisonError as exc:
        print(f"onebit bench cluster: {exc}", file=sys.stderr)
        return 2
    if args.output:
        write_json(result, Path(args.output))
        logger.info("wrote %s", args.output)
    print(format_report(result))
    return 0 if not result["errors"] else 1


def _cluster_available(command: str) -> bool:
    """Whether the emulated cluster can be built here; says why not otherwise."""
    from onebit.bench.netns import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(
            f"onebit bench {command}: the emulated cluster needs root and iproute2: {reason}",
            file=sys.stderr,
        )
    return reason is None


def _sweep_command(args: argparse.Namespace) -> int:
    from onebit.bench.report import bandwidth_label
    from onebit.bench.sweep import run_sweep

    if not _cluster_available("sweep"):
        return 2
    sweep = run_sweep(
        _settings(args),
        bandwidths=args.bandwidths,
        worker_counts=args.worker_counts,
        worker_bandwidth=args.worker_bandwidth,
        out_dir=Path(args.out_dir),
    )
    failed = [r for r in sweep["rows"] if "error" in r]
    for row in failed:
        print(
            f"failed: {row['workers']} workers, {bandwidth_label(row['bandwidth'])}: "
            f"{row['error']}",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _report_command(args: argparse.Namespace) -> int:
    from onebit.bench.analysis import analyze
    from onebit.bench.report import format_report, format_sweep_table
    from onebit.bench.sweep import plot_sweep, sweep_row, x_of

    rows: list[dict[str, Any]] = []
    for path in args.files:
        result = json.loads(Path(path).read_text())
        if "rows" in result:  # a sweep summary
            rows.extend(result["rows"])
            continue
        if args.run_steps is not None:  # the computed whole runs, for another length
            result["settings"]["run_steps"] = args.run_steps
            result = analyze(result)
        if args.full:
            print(f"<!-- {path} -->")
            print(format_report(result))
            print()
        rows.append(sweep_row(result))
    rows.sort(key=lambda r: (str(r.get("model")), r["workers"], x_of(r)))
    print(format_sweep_table(rows))
    if args.plot:
        workers = {r["workers"] for r in rows}
        bandwidths = {r["bandwidth"] for r in rows}
        models = {r.get("model") for r in rows} - {None}
        sweep = {
            "model": ", ".join(sorted(models)) or "?",
            "bandwidth_workers": next(iter(workers)) if len(workers) == 1 else None,
            "worker_bandwidth": next(iter(bandwidths)) if len(bandwidths) == 1 else None,
            "rows": rows,
        }
        plot_sweep(sweep, Path(args.plot))
    return 0


def _exchange_command(args: argparse.Namespace) -> int:
    from onebit.bench.exchange_wire import format_rows, run_exchange_bench

    if not _cluster_available("exchange"):
        return 2
    if args.output and not Path(args.output).resolve().parent.is_dir():
        print(f"onebit bench exchange: no folder for --output {args.output}", file=sys.stderr)
        return 2
    rows = run_exchange_bench(
        args.log2, args.bandwidths, args.bucket_cap_mb, args.calls, args.hosts
    )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1) + "\n")
    print(format_rows(rows, args.log2))
    return 0


def _hosts(text: str) -> int:
    from onebit.bench.cluster import MAX_HOSTS

    value = int(text)
    if not 2 <= value <= MAX_HOSTS:
        raise ValueError(f"must be from 2 to {MAX_HOSTS}, got {value}")
    return value


def _bucket_cap_mb(text: str) -> float:
    value = float(text)
    check_bucket_cap_mb("--bucket-cap-mb", value)
    return value


def register(subparsers: Any) -> None:
    """Add ``cluster``, ``sweep``, ``report`` and ``exchange`` to ``onebit bench``."""
    cluster = subparsers.add_parser(
        "cluster",
        help="1-bit LAMB against LAMB and DDP hooks on an emulated cluster",
        description="1-bit LAMB against LAMB and the alternatives on an emulated "
        "bandwidth-limited cluster: one network namespace per worker, links shaped with tc.",
    )
    add_options(cluster, ComparisonSettings)
    cluster.add_argument("--output", default=None, help="write the result JSON here")
    cluster.set_defaults(handler=_cluster_command)

    sweep = subparsers.add_parser(
        "sweep",
        help="the cluster comparison over bandwidths and worker counts",
    )
    add_options(sweep, ComparisonSettings, exclude={"bandwidth"}, defaults={"model": "small"})
    sweep.add_argument(
        "--bandwidths",
        type=checked_type(_bandwidth_list),
        default=["100mbit", "1gbit", "10gbit", None],
        help="comma-separated link rates, 'none' = unshaped (default: 100mbit,1gbit,10gbit,none)",
    )
    sweep.add_argument(
        "--worker-counts",
        type=_int_list,
        default=[2, 4, 8],
        help="worker counts to sweep (default: 2,4,8)",
    )
    sweep.add_argument(
        "--worker-bandwidth",
        type=checked_type(rate_option),
        default="1gbit",
        help="link rate of the worker sweep (default: 1gbit)",
    )
    sweep.add_argument("--out-dir", default="docs/bench", help="where JSON and PNG go")
    sweep.set_defaults(handler=_sweep_command)

    report = subparsers.add_parser("report", help="Markdown tables and plots from result files")
    report.add_argument("files", nargs="+", help="cluster-*.json or sweep-*.json files")
    report.add_argument("--full", action="store_true", help="also each comparison's full report")
    report.add_argument("--plot", default=None, help="write the speedup plot (PNG) here")
    report.add_argument(
        "--run-steps",
        type=checked_type(_positive_int),
        default=None,
        help="compute the whole runs of the comparison files for this many steps "
        "(default: the --run-steps each was run with)",
    )
    report.set_defaults(handler=_report_command)

    exchange = subparsers.add_parser(
        "exchange",
        help="the 1-bit exchange alone against the dense allreduce",
        description="Time the 1-bit exchange of 2^LOG2 float32 on emulated hosts (one rank "
        "each) per link rate, whole-buffer and bucketed, beside the dense allreduce and the sign "
        "bytes' time at line rate.",
    )
    exchange.add_argument(
        "--hosts",
        type=checked_type(_hosts),
        default=2,
        help="emulated hosts, one rank each (2)",
    )
    exchange.add_argument(
        "--log2", type=checked_type(_positive_int), default=25, help="2^LOG2 elements (25)"
    )
    exchange.add_argument(
        "--bandwidths",
        type=checked_type(_bandwidth_list),
        default=[None, "1gbit", "100mbit"],
        help="comma-separated link rates, 'none' = unshaped (default: none,1gbit,100mbit)",
    )
    exchange.add_argument(
        "--bucket-cap-mb",
        type=checked_type(_bucket_cap_mb),
        default=25.0,
        help="buckets of the bucketed exchange, MiB (25)",
    )
    exchange.add_argument(
        "--calls",
        type=checked_type(_positive_int),
        default=5,
        help="calls timed per exchange (5; the first is not counted)",
    )
    exchange.add_argument("--output", default=None, help="write the rows as JSON here")
    exchange.set_defaults(handler=_exchange_command)
