"""The cost model against the emulated cluster: every measured step time of
``onebit bench cluster`` result files (docs/bench/cluster-*.json) next to its prediction.

Each run gives the model what a user would measure or know: the parameters, the topology, the
link's rate (the run's own TCP stream check, a payload rate, so ``eta = 1``), the step without
communication (the run's ``lamb-compute`` method) and its update's share (rank 0's
``step()`` in it), and the cores its ranks share. The machine's
throughputs are measured on this machine (:mod:`onebit.estimate.model`); the emulated
network's per-message latency and burst efficiency are the two constants fitted once, on all
runs together (:func:`fit_emulation`), never per run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onebit.bert_shapes import PRESETS
from onebit.estimate.model import (
    Cluster,
    Exchange,
    Machine,
    delayed_exchange,
    dense_allreduce,
    flat_exchange,
    hierarchical_exchange,
    local_compression_seconds,
    overlapped_exchange,
    turn_seconds,
)

__all__ = [
    "EMULATED_BURST_EFFICIENCY",
    "EMULATED_LATENCY",
    "OLDER_COMPRESSION_THROUGHPUT",
    "Prediction",
    "emulated_machine",
    "fit_emulation",
    "load_results",
    "predict_result",
    "validate",
]

#: alpha of the emulated cluster (veth pairs on a bridge, gloo over TCP, ranks sharing two
#: cores), fitted by :func:`fit_emulation` on docs/bench.
EMULATED_LATENCY = 2e-3
#: eta_b of the emulated cluster's tbf-shaped links, fitted with it.
EMULATED_BURST_EFFICIENCY = 0.65
#: R_c of the library before the fused kernels (result files without a ``code`` record, the
#: ``mini`` worker sweep): its compression-stage step took 1.91 s against 0.11 s for
#: ``Lamb.step()`` on 108.9M parameters at world size 1 (docs/BENCHMARKS.md).
OLDER_COMPRESSION_THROUGHPUT = 4 * 108.9e6 / (1.91 - 0.11)
#: Within this relative error a prediction meets the target.
TOLERANCE = 0.2

#: The methods of the result files (``onebit bench cluster``'s names) whose exchange overlaps
#: backward.
_OVERLAP_METHODS = ("onebit-lamb-ddp-overlap", "onebit-lamb-overlap")
#: What a Streaming DiLoCo method's summary records of it, :func:`turn_seconds`'s arguments.
_STREAMING_KEYS = ("exchange", "fragments", "delay")
#: The measured (method, stage) pairs the model predicts, and which of its costs applies.
_PREDICTED = {
    ("lamb", "steady"): "dense",
    ("fp16", "steady"): "fp16",
    **{(m, "warmup"): "dense" for m in ("onebit-lamb", "onebit-lamb-ddp", "onebit-adam")},
    **{(m, "compression"): "flat" for m in ("onebit-lamb", "onebit-lamb-ddp", "onebit-adam")},
    ("onebit-lamb-hier", "warmup"): "dense",
    ("onebit-lamb-hier", "compression"): "hierarchical",
    **{(m, "warmup"): "dense" for m in _OVERLAP_METHODS},
    **{(m, "compression"): "overlapped" for m in _OVERLAP_METHODS},
    ("onebit-lamb-delayed", "warmup"): "dense",
    ("onebit-lamb-delayed", "compression"): "delayed",
    ("zero-one-adam", "variance_update"): "dense",
    ("zero-one-adam", "gradient_1bit"): "flat",
    ("zero-one-adam", "sync"): "flat",
    ("zero-one-adam", "local"): "local",
    **{(m, "inner"): "local" for m in ("diloco-dense", "diloco-1bit")},
    ("diloco-dense", "outer"): "dense",
    ("diloco-1bit", "outer"): "flat",
}


@dataclass(frozen=True)
class Prediction:
    """One measured step time and the model's prediction of it."""

    run: str
    method: str
    stage: str
    measured: float
    predicted: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured

    @property
    def within_tolerance(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


def load_results(paths: Iterable[Path]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, result)`` of every cluster comparison among ``paths`` (files, or folders whose
    ``cluster-*.json`` are read); other JSON files (sweep summaries, micro-benchmarks) are
    skipped. Raises ``ValueError`` naming a path that holds none."""
    results = []
    for path in map(Path, paths):
        files = sorted(path.glob("cluster-*.json")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"{path}: no cluster-*.json result files in this folder")
        for file in files:
            try:
                result = json.loads(file.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{file}: not a readable JSON file ({exc})") from exc
            if isinstance(result, dict) and "summary" in result and "tcp_check" in result:
                results.append((file.stem, result))
    if not results:
        raise ValueError(f"no onebit bench cluster results among {[str(p) for p in paths]}")
    return results


def _cluster_and_machine(result: dict[str, Any], machine: Machine) -> tuple[Cluster, Machine]:
    """The run's job as the model sees it (with its BERT preset's tail share and, where the
    run recorded it, the update's share of the step without communication), and
    ``machine`` with the run's own link efficiency (1: the TCP check is a payload rate), core
    sharing and, for a run of the library before the fused kernels, that library's
    compression throughput."""
    settings, info = result["settings"], result["info"]
    world, per_node = info["world_size"], settings.get("workers_per_node") or 1
    compute = result["summary"]["lamb-compute"]["stages"]["steady"]["step_seconds"]
    preset = PRESETS.get(settings.get("model"))
    cluster = Cluster(
        parameters=info["parameters"],
        compute_seconds=compute,
        bandwidth=result["tcp_check"]["bits_per_second"] / 8,
        nodes=world // per_node,
        ranks_per_node=per_node,
        tail_share=0.0 if preset is None else preset.tail_share(),
        **_update_share(result),
    )
    run_machine = dataclasses.replace(
        machine,
        link_efficiency=1.0,
        cpu_sharing=max(1.0, world / settings["cpu_cores"]),
        **({} if "code" in result else {"compression_throughput": OLDER_COMPRESSION_THROUGHPUT}),
    )
    return cluster, run_machine


def _update_share(result: dict[str, Any]) -> dict[str, float]:
    """``{"update_share": u_p}`` of the run's step without communication: rank 0's seconds
    in ``optimizer.step()`` over its seconds of whole steps, every timed step of every round
    of ``lamb-compute`` (nothing where the run did not record them)."""
    update = whole = 0.0
    for run in result.get("methods", {}).get("lamb-compute", {}).get("runs", []):
        for block in run.get("blocks", []):
            update += sum(block.get("rank0_optimizer_step_seconds", []))
            whole += sum(block.get("rank0_step_seconds", []))
    return {"update_share": update / whole} if update and whole else {}


def predict_result(name: str, result: dict[str, Any], machine: Machine) -> list[Prediction]:
    """A prediction for every step time of ``result`` the model covers (not ``lamb-compute``,
    its input, nor PowerSGD, which it does not model). 0/1 Adam's steps are timed by their
    exchange: a variance update as LAMB's dense step, a 1-bit gradient step and a
    synchronisation as the 1-bit exchange with its local work, a local step as ``t_c``.
    DiLoCo's inner step is ``t_c``, the last of a round adds its outer exchange: the dense
    allreduce of fp32 pseudo-gradients, or the 1-bit exchange with its local work;
    streaming, the last of a turn adds ``T_stream`` (:func:`turn_seconds`)."""
    cluster, run_machine = _cluster_and_machine(result, machine)
    local = local_compression_seconds(cluster, run_machine)
    costs: dict[str, tuple[Exchange, float]] = {
        "dense": (dense_allreduce(cluster, run_machine, 4), 0.0),
        "fp16": (dense_allreduce(cluster, run_machine, 2), 0.0),
        "flat": (flat_exchange(cluster, run_machine), local),
        "hierarchical": (hierarchical_exchange(cluster, run_machine), local),
        "overlapped": (overlapped_exchange(cluster, run_machine), local),
        "delayed": (delayed_exchange(cluster, run_machine), local),
        "local": (Exchange(0.0, 0, 0), 0.0),
    }
    predictions = []
    for method, summary in result["summary"].items():
        for stage, measured in summary.get("stages", {}).items():
            if summary.get("fragments", 1) > 1:  # Streaming DiLoCo, as its summary records
                arm = (summary[k] for k in _STREAMING_KEYS)
                added = turn_seconds(cluster, run_machine, *arm)[0] if stage == "outer" else 0.0
                exchange, extra = Exchange(added, 0, 0), 0.0
            elif (method, stage) in _PREDICTED:
                exchange, extra = costs[_PREDICTED[(method, stage)]]
            else:
                continue
            predicted = cluster.compute_seconds + extra + exchange.seconds
            predictions.append(Prediction(name, method, stage, measured["step_seconds"], predicted))
    return predictions


def validate(results: Sequence[tuple[str, dict[str, Any]]], machine: Machine) -> list[Prediction]:
    """:func:`predict_result` for every result."""
    return [p for name, result in results for p in predict_result(name, result, machine)]


def _score(predictions: Sequence[Prediction]) -> tuple[int, float]:
    """(predictions outside the tolerance, root mean square of log(predicted / measured))."""
    misses = sum(not p.within_tolerance for p in predictions)
    rms = math.sqrt(sum(math.log(p.ratio) ** 2 for p in predictions) / len(predictions))
    return misses, rms


def fit_emulation(
    results: Sequence[tuple[str, dict[str, Any]]],
    machine: Machine,
    latencies: Sequence[float] = tuple(i * 0.5e-3 for i in range(11)),
    burst_efficiencies: Sequence[float] = tuple(0.4 + 0.05 * i for i in range(13)),
) -> tuple[Machine, int, float]:
    """``machine`` with the latency and burst efficiency from the grids that leave the fewest
    predictions of the current library's runs (those with a ``code`` record) outside the
    tolerance, ties broken by the smallest RMS log error; with that count and RMS."""
    current = [(name, result) for name, result in results if "code" in result]
    if not current:
        raise ValueError("fitting needs result files of the current library (a 'code' record)")
    best = None
    for latency in latencies:
        for efficiency in burst_efficiencies:
            candidate = dataclasses.replace(
                machine, latency=latency, burst_efficiency=min(1.0, efficiency)
            )
            score = _score(validate(current, candidate))
            if best is None or score < best[0]:
                best = (score, candidate)
    (misses, rms), fitted = best
    return fitted, misses, rms


def emulated_machine(machine: Machine) -> Machine:
    """``machine`` with the emulated cluster's fitted latency and burst efficiency."""
    return dataclasses.replace(
        machine, latency=EMULATED_LATENCY, burst_efficiency=EMULATED_BURST_EFFICIENCY
    )
