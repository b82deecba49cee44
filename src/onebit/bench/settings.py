"""The settings of one emulated-cluster comparison, and the methods it compares.

:class:`ComparisonSettings` is the single list of a comparison's parameters: its fields are the
options of ``onebit bench cluster`` and ``onebit bench sweep``, the sweep varies its
``workers`` and ``bandwidth``, the workers receive it as JSON, and the result JSON records it.

The cluster is ``nodes`` emulated hosts, each a network namespace with one shaped link to the
switch, holding ``workers_per_node`` workers that talk to each other over the namespace's
loopback (the fast local link): ``--workers N`` alone is N nodes of one worker,
``--nodes M --workers-per-node L`` is M nodes of L workers (ranks ``node * L + l``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import NamedTuple

from onebit.bert_shapes import PRESETS
from onebit.cli import option
from onebit.optim.zero_one_adam import GRADIENT_1BIT, LOCAL, SYNC, VARIANCE_UPDATE, step_kind
from onebit.units import delay_option, parse_bandwidth, parse_latency, rate_option


class Method(NamedTuple):
    """How one method of the comparison is named."""

    label: str
    """What it runs, as results and reports name it."""
    short: str
    """Its column header in the sweep table."""
    optimizer: str
    """The optimizer it steps with (a name of :data:`onebit.optim.registry.OPTIMIZERS`)."""


#: Every method a comparison can run.
METHODS: dict[str, Method] = {
    "lamb": Method("LAMB + DDP (fp32 allreduce)", "LAMB", "lamb"),
    "lamb-compute": Method("LAMB + DDP, no-op hook (compute only)", "compute-only", "lamb"),
    "onebit-lamb-ddp": Method("1-bit LAMB, DDP hook path", "1-bit LAMB (DDP hook)", "onebit-lamb"),
    "onebit-lamb": Method("1-bit LAMB, plain path", "1-bit LAMB (plain)", "onebit-lamb"),
    "onebit-lamb-ddp-overlap": Method(
        "1-bit LAMB, DDP hook path, exchange overlapped with backward (25 MB buckets)",
        "1-bit LAMB overlapped (DDP hook)",
        "onebit-lamb",
    ),
    "onebit-lamb-overlap": Method(
        "1-bit LAMB, plain path, exchange overlapped with backward (25 MB buckets)",
        "1-bit LAMB overlapped (plain)",
        "onebit-lamb",
    ),
    "onebit-lamb-overlap-per-tensor": Method(
        "1-bit LAMB, plain path, per-tensor compression in buckets of whole tensors, "
        "overlapped with backward (25 MB buckets)",
        "1-bit LAMB overlapped per tensor (plain)",
        "onebit-lamb",
    ),
    "onebit-lamb-delayed": Method(
        "1-bit LAMB, plain path, per-tensor compression, each step's exchange run behind the "
        "next step's forward and backward (delayed_exchange)",
        "1-bit LAMB delayed (plain)",
        "onebit-lamb",
    ),
    "onebit-lamb-hier": Method(
        "1-bit LAMB, hierarchical exchange (dense in a node, 1-bit between nodes), DDP hook path",
        "1-bit LAMB (hier.)",
        "onebit-lamb",
    ),
    "onebit-adam": Method("1-bit Adam, DDP hook path", "1-bit Adam", "onebit-adam"),
    "hsdp-lamb": Method(
        "LAMB on FSDP2's HSDP (sharded in a node, dense fp32 allreduce between nodes)",
        "HSDP LAMB",
        "lamb",
    ),
    "hsdp-onebit-lamb": Method(
        "1-bit LAMB on FSDP2 sharded in a node, 1-bit between nodes",
        "HSDP 1-bit LAMB",
        "onebit-lamb",
    ),
    "zero-one-adam": Method("0/1 Adam, DDP hook path", "0/1 Adam (whole run)", "zero-one-adam"),
    "diloco-dense": Method(
        "DiLoCo over LAMB, H = 4, dense outer exchange (plain path)", "DiLoCo dense", "lamb"
    ),
    "diloco-1bit": Method(
        "DiLoCo over LAMB, H = 4, 1-bit outer exchange (plain path)", "DiLoCo 1-bit", "lamb"
    ),
    "diloco-dense-k2-d1": Method(
        "Streaming DiLoCo over LAMB, H = 4, 2 fragments, delay 1, dense outer exchange",
        "Streaming DiLoCo dense",
        "lamb",
    ),
    "diloco-1bit-k2-d1": Method(
        "Streaming DiLoCo over LAMB, H = 4, 2 fragments, delay 1, 1-bit outer exchange",
        "Streaming DiLoCo 1-bit",
        "lamb",
    ),
    "fp16": Method("LAMB + DDP fp16_compress_hook", "fp16 hook", "lamb"),
    "powersgd-1": Method("LAMB + DDP PowerSGD rank 1", "PowerSGD r1", "lamb"),
    "powersgd-4": Method("LAMB + DDP PowerSGD rank 4", "PowerSGD r4", "lamb"),
}
#: The baseline and its compute-only twin, against which the others are compared.
BASELINE_METHODS = ("lamb", "lamb-compute")
#: 1-bit LAMB with ``overlap_backward=True``.
OVERLAP_METHODS = (
    "onebit-lamb-ddp-overlap",
    "onebit-lamb-overlap",
    "onebit-lamb-overlap-per-tensor",
)
#: The overlapped methods that exchange the fused buffer (the other: each tensor alone).
FUSED_OVERLAP_METHODS = ("onebit-lamb-ddp-overlap", "onebit-lamb-overlap")
#: 1-bit LAMB with ``delayed_exchange=True``, and the method it is compared with (the same
#: path and compression, undelayed).
DELAYED_METHOD = "onebit-lamb-delayed"
UNDELAYED_METHOD = "onebit-lamb"
#: The methods that run without DDP (the optimizer averages warm-up gradients itself).
PLAIN_METHODS = (
    "onebit-lamb",
    "onebit-lamb-overlap",
    "onebit-lamb-overlap-per-tensor",
    DELAYED_METHOD,
)
ONEBIT_LAMB_METHODS = (
    "onebit-lamb-ddp",
    "onebit-lamb",
    "onebit-lamb-hier",
    *OVERLAP_METHODS,
    DELAYED_METHOD,
)
ONEBIT_METHODS = (*ONEBIT_LAMB_METHODS, "onebit-adam")
#: The flat 1-bit LAMB methods, against which the hierarchical one is compared.
FLAT_ONEBIT_LAMB_METHODS = ("onebit-lamb-ddp", "onebit-lamb")
HIERARCHICAL_METHOD = "onebit-lamb-hier"
#: The methods whose model FSDP2 shards over the workers of a node (no DDP), and the one of
#: them whose traffic between nodes the 1-bit one is measured against.
HSDP_METHODS = ("hsdp-lamb", "hsdp-onebit-lamb")
HSDP_BASELINE = "hsdp-lamb"
#: 0/1 Adam, whose steps are of four kinds (:data:`onebit.optim.zero_one_adam.STEP_KINDS`),
#: each timed apart.
ZERO_ONE_ADAM_METHOD = "zero-one-adam"
ZERO_ONE_ADAM_SCHEDULE = {"var_update_scaler": 2, "local_step_scaler": 1, "local_step_clipper": 4}
"""0/1 Adam's schedule in the comparison, short enough for every kind of step to occur within
a few steps: two variance updates at each interval (steps 1, 2, 4, 6, 8, 12, ... before the
freeze, 1-bit gradients in between), and after the freeze a local interval that doubles at
every step up to 4 (a synchronisation, then three local steps and a synchronisation)."""
#: DiLoCo's round in the comparison, short so that every kind of step occurs within a few.
DILOCO_SYNC_EVERY = 4


class DilocoArm(NamedTuple):
    """A DiLoCo method of the comparison: its outer exchange, and Streaming DiLoCo's fragments
    and delay (each fragment's exchange started ``delay`` steps before the end of its turn of
    ``DILOCO_SYNC_EVERY / fragments`` steps)."""

    exchange: str
    fragments: int = 1
    delay: int = 0

    @property
    def turn(self) -> int:
        """Inner steps a turn, the last with the outer step."""
        return DILOCO_SYNC_EVERY // self.fragments


#: DiLoCo over LAMB, method -> its arm; its inner steps and the last step of each turn, with
#: the outer step, are timed apart.
DILOCO_METHODS = {
    "diloco-dense": DilocoArm("dense"),
    "diloco-1bit": DilocoArm("1bit"),
    "diloco-dense-k2-d1": DilocoArm("dense", fragments=2, delay=1),
    "diloco-1bit-k2-d1": DilocoArm("1bit", fragments=2, delay=1),
}
#: The learning rate of the Adam methods, as a share of the LAMB methods' ``lr``.
ADAM_LR_SHARE = 0.1
#: Workers when neither ``workers`` nor ``nodes`` is given.
DEFAULT_WORKERS = 4


def untimed_before_compression(method: str, skip_steps: int) -> int:
    """Untimed steps of ``method`` from the switch to its timed compression-stage block: the
    first ``skip_steps`` of the stage, and with the delayed exchange one more, since its first
    step of the stage applies no update (ALGORITHM.md, "Delayed exchange"): ``skip_steps``
    steps that do are left untimed, as for every other method."""
    return skip_steps + (method == DELAYED_METHOD)


def zero_one_adam_arm(occurrences: int) -> tuple[int, list[str]]:
    """0/1 Adam's ``var_freeze_step`` in the comparison (with :data:`ZERO_ONE_ADAM_SCHEDULE`)
    and the kinds of its steps 1, 2, ...: the variance freezes at the first step by which
    variance updates and 1-bit gradient steps have each occurred ``occurrences`` times, and the
    steps end when local and synchronisation steps have too."""

    def extend_until(schedule: list[str], wanted: tuple[str, str], freeze: int) -> None:
        while min(schedule.count(kind) for kind in wanted) < occurrences:
            schedule.append(step_kind(len(schedule) + 1, freeze, **ZERO_ONE_ADAM_SCHEDULE))

    schedule: list[str] = []
    extend_until(schedule, (VARIANCE_UPDATE, GRADIENT_1BIT), sys.maxsize)  # no freeze yet
    freeze = len(schedule)
    extend_until(schedule, (LOCAL, SYNC), freeze)
    return freeze, schedule


def diloco_step_kinds(occurrences: int, turn: int = DILOCO_SYNC_EVERY) -> list[str]:
    """DiLoCo's kinds of its steps 1, 2, ... in the comparison: turns of ``turn`` steps,
    ``"inner"`` steps and a last ``"outer"`` one, until the outer step has occurred
    ``occurrences`` times."""
    return (["inner"] * (turn - 1) + ["outer"]) * occurrences


def _check_methods(methods: tuple[str, ...]) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")


def _methods_option(text: str) -> tuple[str, ...]:
    if text == "all":
        return tuple(METHODS)
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    _check_methods(methods)
    return methods


@dataclass(frozen=True)
class ComparisonSettings:
    """What one comparison runs: the cluster, the model and batch, the timing, the methods."""

    workers: int | None = option(
        None,
        help="workers in all (a sweep: those of its bandwidth sweep)",
        default_help=f"{DEFAULT_WORKERS}, or --nodes x --workers-per-node",
    )
    nodes: int | None = option(
        None,
        help="emulated nodes, each a network namespace with one shaped link",
        default_help="--workers / --workers-per-node",
    )
    workers_per_node: int = option(
        1, help="workers per node; they talk to each other over the node's unshaped loopback"
    )
    bandwidth: str | None = option(
        "1gbit",
        parse=rate_option,
        help="per-link rate such as 100mbit or 1gbit; 'none' = unshaped",
    )
    latency: str | None = option(
        None,
        parse=delay_option,
        help="added one-way delay such as 0.1ms (needs the netem qdisc)",
    )
    model: str = option("base", choices=tuple(PRESETS), help="BERT preset (see onebit.bert_shapes)")
    batch_size: int = option(1, help="per-worker batch")
    seq_len: int = option(128, help="tokens per sequence")
    steps: int = option(3, help="timed steps of the compression / steady stage")
    warm_steps: int = option(2, help="timed warm-up-stage steps of the 1-bit methods")
    skip_steps: int = option(
        1,
        help="untimed steps before each timed block (and the delayed exchange's first step of "
        "the stage, which applies no update)",
    )
    methods: tuple[str, ...] = option(
        tuple(METHODS),
        parse=_methods_option,
        help="comma-separated subset of " + ",".join(METHODS) + "; all: every one (those "
        "that shard with FSDP2 only on nodes of several workers)",
        default_help="all",
    )
    freeze_fraction: float = option(0.2, help="warm-up fraction w of the computed end-to-end run")
    run_steps: int = option(10000, help="steps S of the computed end-to-end run")
    tcp_seconds: float = option(2.0, help="length of the raw TCP shaping check, 0 to skip")
    threads: int | None = option(
        None, help="torch threads per worker", default_help="cores // workers, at least 1"
    )
    timeout: float = option(1800.0, help="seconds before a configuration is abandoned")
    seed: int = option(0, help="seed of the initial weights and the batches")
    lr: float = option(
        1e-3,
        help=f"learning rate of the LAMB methods (1-bit Adam, 0/1 Adam: {ADAM_LR_SHARE} of it)",
    )
    rounds: int = option(
        2,
        help="run every method this many times, alternating the order; a stage's step time "
        "is its fastest round's",
    )
    memory_check: bool = option(
        True, help="refuse to start when the workers' estimated memory exceeds what is free"
    )

    def topology(self) -> tuple[int, int]:
        """``(workers, nodes)``, from whichever of ``workers`` and ``nodes`` is given, checked
        against ``workers_per_node``; raises ``ValueError`` if they disagree."""
        per_node = self.workers_per_node
        if per_node < 1:
            raise ValueError(f"--workers-per-node must be at least 1, got {per_node}")
        if self.nodes is None:
            workers = DEFAULT_WORKERS if self.workers is None else self.workers
            if workers % per_node:
                raise ValueError(
                    f"--workers-per-node {per_node} does not divide --workers {workers}"
                )
            return workers, workers // per_node
        if self.workers is not None and self.workers != self.nodes * per_node:
            raise ValueError(
                f"--workers {self.workers} disagrees with --nodes {self.nodes} x "
                f"--workers-per-node {per_node}; give one or the other"
            )
        return self.nodes * per_node, self.nodes

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that is out of range."""
        workers, nodes = self.topology()
        if workers < 2:
            raise ValueError(f"--workers must be at least 2, got {workers}")
        if nodes < 2:
            raise ValueError(
                f"--nodes must be at least 2 (the links between nodes are what is measured), "
                f"got {nodes}"
            )
        if self.bandwidth is not None:
            parse_bandwidth(self.bandwidth)
        if self.latency is not None:
            parse_latency(self.latency)
        _check_methods(tuple(self.methods))
        sharded = [m for m in self.methods if m in HSDP_METHODS]
        if sharded and self.workers_per_node < 2 and tuple(self.methods) != tuple(METHODS):
            raise ValueError(
                f"{', '.join(sharded)} shard the model over the workers of a node: give "
                "--nodes M --workers-per-node L with L > 1"
            )
        if self.model not in PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; choose from {sorted(PRESETS)}")
        for name in ("steps", "warm_steps", "skip_steps", "batch_size", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0.0 <= self.freeze_fraction <= 1.0:
            raise ValueError(f"--freeze-fraction must be in [0, 1], got {self.freeze_fraction}")

    def resolved(self) -> ComparisonSettings:
        """A validated copy with ``workers``, ``nodes`` and ``threads`` filled in."""
        self.validate()
        workers, nodes = self.topology()
        threads = self.threads or max(1, (os.cpu_count() or 1) // workers)
        methods = tuple(self.methods)
        if self.workers_per_node < 2:  # "all": the FSDP2 methods need nodes of several workers
            methods = tuple(m for m in methods if m not in HSDP_METHODS)
        return dataclasses.replace(
            self, workers=workers, nodes=nodes, methods=methods, threads=threads
        )
