"""One rank of the emulated-cluster comparison; started by :mod:`onebit.bench.comparison`.

Run as ``python -m onebit.bench._worker SETTINGS_JSON`` (a
:class:`~onebit.bench.settings.ComparisonSettings` as a dict) inside a node's namespace with the
environment ``torchrun`` gives a multi-node job (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``GLOO_SOCKET_IFNAME``); the process group is created through ``env://``.

Every rank builds the same model (same seed) and the same per-rank synthetic batches, then runs
the methods one after the other on a fresh copy of the initial model. Each method runs
untimed steps, then timed blocks of steps (0/1 Adam: each of its steps timed alone, grouped by
kind of step afterwards). Around every timed block all ranks meet at a
barrier and rank 0 asks the parent for the interfaces' byte counters: it writes
``@@mark`` on stdout and waits for the parent's answer (the counters of every host, read
with :meth:`EmulatedCluster.interface_bytes`) on stdin. Rank 0 reports each method as one
``@@method {json}`` line as soon as it is done, so a later failure keeps earlier results.

A method that raises on every rank (a deterministic failure) is reported with its error and
the next method runs; a failure on some ranks only leaves the others waiting in a collective
until the process-group timeout, and the parent's deadline ends the run.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at runtime.
import collections
import contextlib
import copy
import datetime
import gc
import json
import logging
import os
import resource
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist

from onebit.bench.settings import (
    ADAM_LR_SHARE,
    DELAYED_METHOD,
    DILOCO_METHODS,
    DILOCO_SYNC_EVERY,
    FUSED_OVERLAP_METHODS,
    HIERARCHICAL_METHOD,
    HSDP_METHODS,
    METHODS,
    OVERLAP_METHODS,
    PLAIN_METHODS,
    ZERO_ONE_ADAM_METHOD,
    ZERO_ONE_ADAM_SCHEDULE,
    diloco_step_kinds,
    untimed_before_compression,
    zero_one_adam_arm,
)
from onebit.exchange.transport import TrafficCounter, all_gather_into
from onebit.optim.registry import PAPER_BERT_SETTINGS, optimizer_spec
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE
from onebit.train.powersgd import POWERSGD_START_ITER, CountedPowerSGD, one_bucket

logger = logging.getLogger("onebit.bench.worker")

#: Every host's (tx, rx) interface byte counters, as rank 0 reads them.
Counters = list[list[int]]


def _emit(kind: str, record: dict[str, Any]) -> None:
    sys.stdout.write(f"@@{kind} {json.dumps(record)}\n")
    sys.stdout.flush()


def _interface_counters() -> Counters:
    """Ask the parent for every host's (tx, rx) byte counters (rank 0 only)."""
    _emit("mark", {})
    line = sys.stdin.readline()
    if not line:
        raise RuntimeError("the parent closed stdin; cannot read interface counters")
    return json.loads(line)["counters"]


def _noop_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook that sends nothing: each rank keeps its local gradients (compute-only timing)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _shard_in_nodes(
    model: torch.nn.Module, cfg: dict[str, Any], onebit_between_nodes: bool
) -> tuple[list[torch.nn.Parameter], dist.ProcessGroup]:
    """``fully_shard`` each encoder layer and ``model`` over the workers of a node: on the
    node's 1-D mesh when the optimizer exchanges between nodes itself (1 bit), on FSDP's own
    HSDP mesh (dense allreduce between nodes) otherwise. Returns the sharded parameters and
    the replicate group (the ranks of one local index)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    per_node = cfg["workers_per_node"]
    mesh = init_device_mesh(
        "cpu", (dist.get_world_size() // per_node, per_node), mesh_dim_names=("replicate", "shard")
    )
    shard_mesh = mesh["shard"] if onebit_between_nodes else mesh
    for layer in model.base_model.encoder.layer:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return list(model.parameters()), mesh["replicate"].get_group()


class _Method:
    """A model copy, its optimizer and the way one training step runs for one method."""

    def __init__(self, name: str, template: torch.nn.Module, cfg: dict[str, Any]) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        import onebit

        self.name = name
        self.freeze_step: int | None = None
        self.step_kinds: list[str] | None = None  # 0/1 Adam, DiLoCo: the kind of each step
        self.diloco: onebit.DiLoCo | None = None
        self.untimed_before_steady = cfg["skip_steps"]
        model = copy.deepcopy(template)
        params = list(model.parameters())
        spec = optimizer_spec(METHODS[name].optimizer)
        values: dict[str, Any] = {
            **PAPER_BERT_SETTINGS,
            "lr": cfg["lr"] * (1.0 if spec.rule == "lamb" else ADAM_LR_SHARE),
        }
        if name == ZERO_ONE_ADAM_METHOD:
            self.freeze_step, self.step_kinds = zero_one_adam_arm(cfg["skip_steps"] + cfg["steps"])
            values.update(
                DEEPSPEED_SCHEDULE | ZERO_ONE_ADAM_SCHEDULE | {"var_freeze_step": self.freeze_step}
            )
        elif spec.compresses:
            self.freeze_step = values["freeze_step"] = cfg["skip_steps"] + cfg["warm_steps"]
            values["overlap_backward"] = name in OVERLAP_METHODS
            values["delayed_exchange"] = name == DELAYED_METHOD
            if name in FUSED_OVERLAP_METHODS:
                values["compression"] = "fused"
            if name == HIERARCHICAL_METHOD:
                values["node_groups"] = onebit.node_groups(cfg["workers_per_node"])
        if name in HSDP_METHODS:
            params, values["process_group"] = _shard_in_nodes(model, cfg, spec.compresses)
        optimizer = spec.build(params, values)
        if name in DILOCO_METHODS:  # each worker's inner steps on its own gradients
            arm = DILOCO_METHODS[name]
            self.step_kinds = diloco_step_kinds(cfg["skip_steps"] + cfg["steps"], arm.turn)
            self.diloco = onebit.DiLoCo(
                params,
                optimizer,
                sync_every=DILOCO_SYNC_EVERY,
                exchange=arm.exchange,
                fragments=arm.fragments,
                delay=arm.delay,
            )
        elif name not in (*PLAIN_METHODS, *HSDP_METHODS):
            ddp_kwargs: dict[str, Any] = {}
            if name.startswith("powersgd-"):
                ddp_kwargs.update(one_bucket(params))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers' rename
                model = DistributedDataParallel(
                    model,
                    broadcast_buffers=False,  # the only buffers are constants (position ids)
                    gradient_as_bucket_view=True,
                    init_sync=False,  # every rank built the same model from the same seed
                    **ddp_kwargs,
                )
            if name == "lamb-compute":
                model.register_comm_hook(None, _noop_hook)
            elif spec.compresses:
                onebit.ddp.register_comm_hook(model, optimizer)
            elif name == "fp16":
                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif name.startswith("powersgd-"):
                CountedPowerSGD(int(name.split("-")[1]), params, TrafficCounter()).register(model)
                self.untimed_before_steady = POWERSGD_START_ITER + cfg["skip_steps"]
        self.model = model
        self.optimizer = optimizer
        self.last_loss = float("nan")

    def step(self, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        """One training step; returns the seconds of forward + backward (which include DDP's
        gradient communication) and of ``optimizer.step()`` (which includes the 1-bit
        optimizers' own communication)."""
        start = time.perf_counter()
        loss = self.model(**batch).loss
        loss.backward()
        middle = time.perf_counter()
        self.optimizer.step()
        end = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        self.last_loss = float(loss.detach())
        return middle - start, end - middle

    def library_bytes(self) -> int:
        """Bytes onebit's optimizer or DiLoCo counted as sent (0 for the other methods)."""
        if self.diloco is not None:
            return self.diloco.bytes_sent
        bytes_sent = getattr(self.optimizer, "bytes_sent", None)
        return sum(bytes_sent.values()) if bytes_sent is not None else 0

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.close()
        del self.model, self.optimizer, self.diloco  # with them, compression workspaces
        gc.collect()


class _Runner:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.batches: list[dict[str, torch.Tensor]] = []
        self.cursor = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        batch = self.batches[self.cursor % len(self.batches)]
        self.cursor += 1
        return batch

    def counters(self) -> Counters | None:
        dist.barrier()
        counters = _interface_counters() if self.rank == 0 else None
        dist.barrier()
        return counters

    def run_untimed(self, method: _Method, steps: int) -> None:
        for _ in range(steps):
            method.step(self.next_batch())

    def run_timed(
        self, method: _Method, steps: int, stage: str, before: Counters | None
    ) -> tuple[dict[str, Any], Counters | None]:
        """Time ``steps`` steps of ``stage``, their interface bytes counted from the reading
        ``before`` (rank 0's; ``None`` on the others): the block, and the reading at its end."""
        stage_now = getattr(method.optimizer, "stage", None)
        if stage_now is not None and stage_now != stage:
            raise RuntimeError(
                f"{method.name}: expected stage {stage!r}, optimizer is {stage_now!r}"
            )
        library_before = method.library_bytes()
        step_seconds = []
        phases = []
        start = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            phases.append(method.step(self.next_batch()))
            step_seconds.append(time.perf_counter() - t)
        dist.barrier()
        seconds = time.perf_counter() - start
        library = method.library_bytes() - library_before
        after = _interface_counters() if self.rank == 0 else None
        gathered = torch.zeros(self.world, dtype=torch.int64)
        all_gather_into(gathered, torch.tensor([library], dtype=torch.int64), None, self.world)
        library_all = gathered.tolist()
        finish = getattr(method.optimizer, "finish_exchange", None)
        if finish is not None:  # untimed: the block took over one exchange in flight too
            finish()
        block: dict[str, Any] = {
            "stage": stage,
            "steps": steps,
            "seconds": seconds,
            "rank0_step_seconds": step_seconds,
            "rank0_forward_backward_seconds": [p[0] for p in phases],
            "rank0_optimizer_step_seconds": [p[1] for p in phases],
            "library_bytes_by_rank": library_all,
            "last_loss": method.last_loss,
        }
        if before is not None and after is not None:
            block["interface_tx_bytes_by_host"] = [
                a[0] - b[0] for a, b in zip(after, before, strict=False)
            ]
            block["interface_rx_bytes_by_host"] = [
                a[1] - b[1] for a, b in zip(after, before, strict=False)
            ]
        return block, after

    def run_timed_alone(self, method: _Method, steps: int, stage: str) -> dict[str, Any]:
        """:meth:`run_timed` from a fresh reading of the interface counters."""
        block, _ = self.run_timed(method, steps, stage, self.counters())
        return block

    def run_each_kind(self, method: _Method, kinds: list[str]) -> list[dict[str, Any]]:
        """Steps of the given kinds, each timed alone except the first ``skip_steps`` of its
        kind and those after the first ``skip_steps + steps``; one block per kind, of its
        timed steps. The interface counters are read after every step, and each timed step
        counts from the reading after the step before it: an exchange a step leaves in flight
        (Streaming DiLoCo's) sends its bytes within the next step's block or its own, never
        between them."""
        skip, timed = self.cfg["skip_steps"], self.cfg["steps"]
        seen: collections.Counter[str] = collections.Counter()
        by_kind: dict[str, list[dict[str, Any]]] = {}
        reading = self.counters()
        for kind in kinds:
            seen[kind] += 1
            if skip < seen[kind] <= skip + timed:
                block, reading = self.run_timed(method, 1, kind, reading)
                by_kind.setdefault(kind, []).append(block)
            else:
                self.run_untimed(method, 1)
                reading = self.counters()
        return [_joined(blocks) for blocks in by_kind.values()]

    def run_method(self, name: str, template: torch.nn.Module) -> dict[str, Any]:
        cfg = self.cfg
        method = _Method(name, template, cfg)
        try:
            blocks = []
            if method.step_kinds is not None:
                blocks = self.run_each_kind(method, method.step_kinds)
            elif method.freeze_step is not None:
                self.run_untimed(method, cfg["skip_steps"])
                blocks.append(self.run_timed_alone(method, cfg["warm_steps"], "warmup"))
                self.run_untimed(method, untimed_before_compression(name, cfg["skip_steps"]))
                blocks.append(self.run_timed_alone(method, cfg["steps"], "compression"))
            else:
                self.run_untimed(method, method.untimed_before_steady)
                blocks.append(self.run_timed_alone(method, cfg["steps"], "steady"))
            return {"freeze_step": method.freeze_step, "blocks": blocks}
        finally:
            method.close()


def _joined(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One block of the steps of ``blocks`` (timed blocks of one stage): step counts, seconds
    and byte counts added, rank 0's per-step times in order, the last block's loss."""
    joined = dict(blocks[-1])
    for key, value in joined.items():
        if key.startswith("rank0_"):
            joined[key] = [x for block in blocks for x in block[key]]
        elif isinstance(value, list):  # per rank or per host
            joined[key] = [sum(column) for column in zip(*(b[key] for b in blocks), strict=True)]
        elif key in ("steps", "seconds"):
            joined[key] = sum(block[key] for block in blocks)
    return joined


def _all_ranks_ok(ok: bool) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag) == 0


def run(cfg: dict[str, Any]) -> None:
    from onebit.bench.bert import build_model, synthetic_batches

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout"]))
    try:
        runner = _Runner(cfg)
        started = time.perf_counter()
        template = build_model(cfg["model"], cfg["seed"])
        parameters = sum(p.numel() for p in template.parameters() if p.requires_grad)
        per_method = max(
            cfg["skip_steps"]
            + cfg["warm_steps"]
            + untimed_before_compression(DELAYED_METHOD, cfg["skip_steps"])
            + cfg["steps"],
            POWERSGD_START_ITER + cfg["skip_steps"] + cfg["steps"],
            len(zero_one_adam_arm(cfg["skip_steps"] + cfg["steps"])[1]),
            len(diloco_step_kinds(cfg["skip_steps"] + cfg["steps"])),
        )
        runner.batches = synthetic_batches(
            cfg["model"], cfg["batch_size"], cfg["seq_len"], per_method, runner.rank, cfg["seed"]
        )
        if runner.rank == 0:
            _emit(
                "info",
                {
                    "parameters": parameters,
                    "world_size": runner.world,
                    "threads_per_worker": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "setup_seconds": time.perf_counter() - started,
                },
            )
        schedule = [
            (round_, name)
            for round_ in range(cfg["rounds"])
            # Every other round runs the methods in reverse order, so that a slow drift of the
            # machine's load does not favour the methods that run first.
            for name in (cfg["methods"] if round_ % 2 == 0 else cfg["methods"][::-1])
        ]
        for round_, name in schedule:
            runner.cursor = 0  # the same batches, in the same order, for every method
            t0 = time.perf_counter()
            result: dict[str, Any] = {"method": name, "label": METHODS[name].label, "round": round_}
            error = None
            try:
                result.update(runner.run_method(name, template))
            except Exception as exc:  # reported, never turned into a number
                error = f"{type(exc).__name__}: {exc}"
                logger.error(
                    "rank %d, method %s failed:\n%s", runner.rank, name, traceback.format_exc()
                )
            ok = _all_ranks_ok(error is None)
            result["ok"] = ok
            if not ok:
                result["error"] = error or "failed on another rank"
                result.pop("blocks", None)
            result["wall_seconds"] = time.perf_counter() - t0
            result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if runner.rank == 0:
                _emit("method", result)
        if runner.rank == 0:
            _emit("done", {})
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m onebit.bench._worker SETTINGS_JSON\n")
        return 2
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank {os.environ.get('RANK')}] %(message)s"
    )
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    cfg: dict[str, Any] = json.loads(args[0])
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
