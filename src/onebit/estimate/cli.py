"""``onebit estimate``: predicted step times and speedups of LAMB, DDP's fp16 hook and the 1-bit
optimizers on a cluster, the model's check against the emulated cluster (``--validate``), its
two network constants fitted again (``--fit``), and this machine's local costs measured
(``--calibrate``).

The options of the job and the machine are the fields of :class:`EstimateSettings`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onebit.cli import add_options, given_options, option
from onebit.estimate.calibration import DEFAULT_THROUGHPUTS
from onebit.estimate.model import (
    TCP_PAYLOAD_SHARE,
    Cluster,
    Machine,
    MethodEstimate,
    estimate,
)
from onebit.estimate.models import model_parameters, model_tail_share
from onebit.optim import DEFAULT_BUCKET_CAP_MB
from onebit.units import parse_bandwidth, parse_latency, rate_option

__all__ = ["EstimateSettings", "register"]


def _share_option(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(f"a share must be in [0, 1], got {text!r}")
    return value


def _model_option(text: str) -> str:
    model_parameters(text)
    return text


def _bandwidth_option(text: str) -> str:
    parse_bandwidth(text)
    return text


def _latency_option(text: str) -> str:
    parse_latency(text)
    return text


def _throughput_option(text: str) -> float:
    """Bytes per second such as ``2.3e9``; ``inf`` (or ``none``) for no cost."""
    value = math.inf if text.lower() in ("inf", "none") else float(text)
    if not value > 0:
        raise ValueError(f"a throughput must be a positive number of bytes/s or inf, got {text!r}")
    return value


@dataclass(frozen=True)
class EstimateSettings:
    """The job and the machine of one estimate."""

    model: str = option(
        "bert-base",
        parse=_model_option,
        group="job",
        help="bert-base, bert-large, small, mini, or a parameter count such as 340M",
    )
    compute: float | None = option(
        None,
        group="job",
        help="seconds of one step without communication (forward, backward, LAMB's update), "
        "as measured on one of your GPUs or nodes; required for an estimate",
    )
    nodes: int = option(4, group="job", help="nodes M")
    gpus_per_node: int = option(1, group="job", help="ranks (GPUs) per node L")
    warmup_fraction: float = option(
        0.2, group="job", help="share w of the run's steps in the warm-up stage"
    )
    backward_share: float = option(
        0.6,
        group="job",
        help="share of --compute spent in backward, from whose start an overlapped exchange "
        "keeps the link busy (this machine's BERT-base: 0.6, benchmarks/step_phases.py)",
    )
    update_share: float = option(
        0.17,
        parse=_share_option,
        group="job",
        help="share of --compute spent in the optimizer's update (LAMB's step()), which the "
        "delayed exchange's chain of exchanges waits for (this machine's BERT-base: 0.17)",
    )
    bucket_cap_mb: float = option(
        DEFAULT_BUCKET_CAP_MB,
        group="job",
        help="MiB per bucket of the overlapped exchange (the optimizer's bucket_cap_mb)",
    )
    tail_share: float | None = option(
        None,
        parse=_share_option,
        group="job",
        help="share of the parameters whose gradients backward completes last (the "
        "embeddings), sent after backward by an overlapped exchange",
        default_help="the named model's embeddings (bert-base 0.22), else 0",
    )
    sync_every: list[int] = option(
        [],
        group="job",
        help="add DiLoCo over the ranks, dense and 1-bit outer exchange, with rounds of each "
        "of these numbers of inner steps (onebit train --sync-every)",
        default_help="none",
    )
    fragments: int = option(
        1,
        group="job",
        help="with --sync-every: add Streaming DiLoCo, its model in this many fragments that "
        "take turns (onebit train --fragments)",
    )
    fragment_delay: int = option(
        0,
        group="job",
        help="with --sync-every: add Streaming DiLoCo, each fragment's outer exchange running "
        "behind this many inner steps (onebit train --fragment-delay)",
    )
    outer_block_size: int | None = option(
        None,
        group="job",
        help="with --sync-every: the 1-bit outer exchange in blocks of this many times the "
        "ranks elements, each block with its own scales (onebit train --outer-block-size)",
        default_help="one scale",
    )
    mixed_precision: bool = option(
        False,
        group="job",
        help="fp16 gradients: LAMB and the warm-up allreduce 2 bytes per element (the paper's "
        "runs); the fp16 hook row is then LAMB itself",
    )
    bandwidth: str = option(
        "10gbit",
        parse=_bandwidth_option,
        group="network",
        help="line rate of each node's link per direction, such as 100mbit, 40gbit",
    )
    latency: str = option(
        "50us",
        parse=_latency_option,
        group="network",
        help="alpha, the time of one message step of a collective",
    )
    intra_bandwidth: str | None = option(
        None,
        parse=rate_option,
        group="network",
        help="rate between two ranks of a node (NVLink, PCIe); 'none': only the host "
        "throughput limits it",
    )
    link_efficiency: float = option(
        TCP_PAYLOAD_SHARE,
        group="network",
        help="payload share of the line rate (TCP over Ethernet 1448/1514)",
        default_help="0.956",
    )
    burst_efficiency: float = option(
        1.0,
        group="network",
        help="share of the payload rate the 1-bit exchange's short collectives reach "
        "(the emulated cluster: 0.65)",
    )
    compression_throughput: float | None = option(
        None,
        parse=_throughput_option,
        group="machine",
        help="bytes of fp32 parameters per second through the compression stage's local work "
        "beyond LAMB's update (an H200 measured 23e9 with --calibrate --device cuda)",
        default_help="this machine's, saved by --calibrate; else 2.27e9, measured on a 2-core CPU",
    )
    host_throughput: float | None = option(
        None,
        parse=_throughput_option,
        group="machine",
        help="bytes per second a rank's processor moves through gloo's dense allreduce; inf "
        "where the library reduces on the device (NCCL)",
        default_help="this machine's, saved by --calibrate; else 1.59e9, measured on a 2-core CPU",
    )
    copy_throughput: float | None = option(
        None,
        parse=_throughput_option,
        group="machine",
        help="bytes of fp32 per second through a copy of the weights, read and written: the "
        "delayed exchange's own passes over them",
        default_help="this machine's, saved by --calibrate; else 5.4e9, measured on a 2-core CPU",
    )
    cpu_sharing: float = option(
        1.0, group="machine", help="ranks sharing one processor core for the local work"
    )

    def cluster(self) -> Cluster:
        """The job; raises ``ValueError`` naming what is missing or wrong."""
        if self.compute is None:
            raise ValueError(
                "--compute SECONDS is required: the step time without communication, e.g. "
                "measured with a no-op DDP communication hook"
            )
        intra = self.intra_bandwidth
        return Cluster(
            parameters=model_parameters(self.model),
            compute_seconds=self.compute,
            bandwidth=parse_bandwidth(self.bandwidth) / 8,
            nodes=self.nodes,
            ranks_per_node=self.gpus_per_node,
            intra_bandwidth=math.inf if intra is None else parse_bandwidth(intra) / 8,
            warmup_fraction=self.warmup_fraction,
            mixed_precision=self.mixed_precision,
            backward_share=self.backward_share,
            update_share=self.update_share,
            bucket_cap_mb=self.bucket_cap_mb,
            tail_share=model_tail_share(self.model) if self.tail_share is None else self.tail_share,
            sync_every=tuple(self.sync_every),
            fragments=self.fragments,
            fragment_delay=self.fragment_delay,
            outer_block_size=self.outer_block_size,
        )

    def machine(self, **throughputs: float) -> Machine:
        """The machine: each throughput the options give, else the one in ``throughputs``
        (this machine's saved calibration), else the shipped one."""
        for name in DEFAULT_THROUGHPUTS:
            given = getattr(self, name)
            if given is not None:
                throughputs[name] = given
        return Machine(
            **throughputs,
            latency=parse_latency(self.latency),
            link_efficiency=self.link_efficiency,
            burst_efficiency=self.burst_efficiency,
            cpu_sharing=self.cpu_sharing,
        )


def _megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f}"


def format_estimate(
    cluster: Cluster, machine: Machine, rows: list[MethodEstimate], constants: str | None = None
) -> str:
    """The job, the machine (``constants``: where its throughputs come from, when the options
    do not give them) and a table of every method's prediction."""
    head = (
        f"{cluster.parameters / 1e6:.1f}M parameters, {cluster.nodes} node(s) x "
        f"{cluster.ranks_per_node} rank(s), link {cluster.bandwidth * 8 / 1e9:g} Gbit/s "
        f"(payload share {machine.link_efficiency:.3f}, 1-bit bursts "
        f"{machine.burst_efficiency:.2f}), alpha {machine.latency * 1e6:g} us, compute "
        f"{cluster.compute_seconds:g} s/step, warm-up fraction {cluster.warmup_fraction:g}"
        f"{', fp16 gradients' if cluster.mixed_precision else ''}\n"
        f"compression throughput {machine.compression_throughput / 1e9:g} GB/s, host "
        f"throughput {machine.host_throughput / 1e9:g} GB/s, copy throughput "
        f"{machine.copy_throughput / 1e9:g} GB/s, cpu sharing {machine.cpu_sharing:g}"
        + (f" ({constants})" if constants else "")
    )
    header = (
        "method",
        "warm-up step (s)",
        "compr. step (s)",
        "mean step (s)",
        "speedup",
        "compr. speedup",
        "MB/step/rank",
        "MB/step/node link",
        "traffic vs LAMB",
    )
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        reduction = "-" if row.traffic_reduction is None else f"{row.traffic_reduction:.2f}x"
        cells = (
            row.label,
            f"{row.warmup_step:.4g}",
            f"{row.compression_step:.4g}",
            f"{row.mean_step:.4g}",
            f"{row.speedup:.2f}x",
            f"{row.compression_speedup:.2f}x",
            _megabytes(row.rank_bytes),
            _megabytes(row.node_link_bytes),
            reduction,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n\n" + "\n".join(lines)


def format_validation(predictions: list[Any], machine: Machine) -> str:
    """Every prediction against its measurement, and how many are within the tolerance."""
    from onebit.estimate.validate import TOLERANCE

    lines = [
        f"alpha {machine.latency * 1e3:g} ms, burst efficiency {machine.burst_efficiency:g}, "
        f"compression throughput {machine.compression_throughput / 1e9:g} GB/s, host "
        f"throughput {machine.host_throughput / 1e9:g} GB/s, copy throughput "
        f"{machine.copy_throughput / 1e9:g} GB/s",
        "",
        "| run | method | stage | measured (s) | predicted (s) | predicted / measured |",
        "|---|---|---|---:|---:|---:|",
    ]
    for p in predictions:
        flag = "" if p.within_tolerance else " **miss**"
        lines.append(
            f"| {p.run} | {p.method} | {p.stage} | {p.measured:.3f} | {p.predicted:.3f} | "
            f"{p.ratio:.2f}{flag} |"
        )
    within = sum(p.within_tolerance for p in predictions)
    worst = max(predictions, key=lambda p: abs(math.log(p.ratio)))
    lines += [
        "",
        f"{within} of {len(predictions)} predictions within {TOLERANCE:.0%} of the measured step "
        f"time; worst {worst.ratio:.2f} ({worst.run}, {worst.method}, {worst.stage})",
    ]
    return "\n".join(lines)


def _validate_command(args: argparse.Namespace, settings: EstimateSettings) -> int:
    from onebit.estimate.validate import emulated_machine, fit_emulation, load_results, validate

    results = load_results(args.validate)
    machine = emulated_machine(settings.machine())
    if args.fit:
        machine, misses, rms = fit_emulation(results, machine)
        print(
            f"fitted on the current library's runs: alpha {machine.latency * 1e3:g} ms, burst "
            f"efficiency {machine.burst_efficiency:g} ({misses} outside the tolerance, RMS log "
            f"error {rms:.3f})\n"
        )
    predictions = validate(results, machine)
    if args.json:
        rows = [{**dataclasses.asdict(p), "ratio": p.ratio} for p in predictions]
        print(json.dumps({"machine": dataclasses.asdict(machine), "predictions": rows}, indent=1))
    else:
        print(format_validation(predictions, machine))
    return 0


def _estimate_command(args: argparse.Namespace) -> int:
    from onebit.estimate.calibration import calibrate, machine_constants, save_calibration

    try:
        settings = EstimateSettings(**given_options(EstimateSettings, args))
        if args.calibrate:
            try:
                measured = calibrate(args.device)
            except RuntimeError as exc:  # a machine too busy to tell the two steps apart
                print(f"onebit estimate: {exc}", file=sys.stderr)
                return 1
            path = save_calibration(measured)
            print(
                f"calibrated on {measured['parameters'] / 1e6:.1f}M parameters, "
                f"{measured['measured_on']}: compression throughput "
                f"{measured['compression_throughput']:.3g} B/s, host throughput "
                f"{measured['host_throughput']:.3g} B/s, copy throughput "
                f"{measured['copy_throughput']:.3g} B/s; saved in {path} for later estimates "
                "on this machine\n"
            )
            if args.json:
                print(json.dumps(measured, indent=1))
        if args.validate:  # the emulated cluster's runs: the machine they were measured on
            return _validate_command(args, settings)
        if args.fit:
            raise ValueError("--fit refits the emulated cluster's constants: give --validate DIR")
        if args.calibrate and settings.compute is None:
            return 0
        throughputs, source = machine_constants(args.device)
        cluster, machine = settings.cluster(), settings.machine(**throughputs)
    except ValueError as exc:
        print(f"onebit estimate: {exc}", file=sys.stderr)
        return 2
    rows = estimate(cluster, machine)
    if args.json:
        document = {
            "cluster": dataclasses.asdict(cluster),
            "machine": dataclasses.asdict(machine),
            "machine_constants": source,
            "methods": [row.as_dict() for row in rows],
        }
        print(json.dumps(document, indent=1))
    else:
        print(format_estimate(cluster, machine, rows, source))
    return 0


EPILOG = """\
examples:
  onebit estimate --model bert-base --nodes 4 --bandwidth 1gbit --compute 0.8
  onebit estimate --model bert-large --nodes 16 --gpus-per-node 8 --bandwidth 40gbit \\
      --latency 50us --intra-bandwidth 1000gbit --compute 1.0 --mixed-precision \\
      --compression-throughput 23e9 --host-throughput inf --warmup-fraction 0.15
  onebit estimate --validate docs/bench            # against the emulated cluster
  onebit estimate --validate docs/bench --fit      # refit its latency and burst efficiency
  onebit estimate --calibrate                      # measure this machine's throughputs
  onebit estimate --calibrate --device cuda        # ... on a GPU
"""


def register(subparsers: Any) -> None:
    """Add ``estimate`` to the ``onebit`` sub-commands."""
    parser = subparsers.add_parser(
        "estimate",
        help="the cost model: step times and speedups on a cluster",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, EstimateSettings)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--validate",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="compare the model with onebit bench cluster results (files, or folders of "
        "cluster-*.json) instead of estimating",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="with --validate: fit the emulated network's latency and burst efficiency first",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's compression, host and copy throughputs first (about a minute)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where --calibrate measures: cpu (2 gloo ranks, as the defaults were measured) or "
        "an accelerator such as cuda (one device; host throughput inf, as NCCL reduces there); "
        "estimates use this device's saved calibration",
    )
    parser.set_defaults(handler=_estimate_command)
