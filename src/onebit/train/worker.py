"""One data-parallel training process of the main job (one per rank).

Started by ``onebit train`` through torch's elastic launcher, or by a user's own ``torchrun``
with ``onebit train --no-launch``: either way it reads its rank and the rendezvous from
torchrun's environment variables. It continues from the run folder's newest usable
checkpoint, so a restart by ``--max-restarts`` resumes where the job stopped.

Determinism: the global batch of step ``t`` (``data.global_batches``), its BERT masking (a
generator seeded by ``(seed, t)`` over the whole global batch, then sliced per rank) and the
dropout seed (``(seed, t, rank)``) depend only on the step, so a resumed run replays exactly
the steps an uninterrupted run would take.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import onebit
from onebit.collectives import TrafficCounter, allreduce_bytes
from onebit.exchange import NodeGroups
from onebit.optim.registry import optimizer_spec
from onebit.train import checkpoint, data, report
from onebit.train.atomic import write_bytes_atomic
from onebit.train.config import TrainConfig
from onebit.train.run_dir import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    TOKENIZER_FILE,
    prepare_run_dir,
    read_config,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger("onebit.train.worker")  # also when run as __main__

#: Evaluation batch (sequences per forward pass) on each rank.
EVAL_BATCH = 128
#: Stage label of the steps of the uncompressed optimizers.
DENSE = "dense"


def step_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (the run seed, the step, the rank)."""
    digest = hashlib.sha256(":".join(map(str, ("onebit-train", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def lr_factor(step_index: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to 1 over ``warmup_steps``, then linear decay towards 0 at ``total_steps``.

    ``step_index`` counts from 0; the value is the multiplier of the base LR for that step.
    """
    if step_index < warmup_steps:
        return (step_index + 1) / warmup_steps
    return max(0.0, (total_steps - step_index) / (total_steps - warmup_steps))


def load_documents(config: TrainConfig) -> list[str]:
    """The pre-training documents of ``config``: its own files, or the built-in corpus."""
    return data.read_text_files(config.corpus) if config.corpus else data.load_corpus()


def load_data(config: TrainConfig) -> tuple[data.MLMData, str]:
    """The MLM sequences and the tokenizer (as JSON) of ``config``, cached on first use."""
    documents = load_documents(config)
    tokenizer = data.train_tokenizer(documents, config.vocab_size)
    mlm = data.build_mlm_dataset(documents, tokenizer, config.seq_len, seed=config.seed)
    return mlm, tokenizer.to_str()


def masked_batch(
    config: TrainConfig, mlm: data.MLMData, step: int, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step`` (1, 2, ...): the training sequences ``indices``
    with BERT's masks, seeded by the run's seed and the step alone (the same at any number of
    workers), as ``(inputs, labels)``."""
    return data.mask_tokens(
        mlm.train[indices],
        torch.Generator().manual_seed(step_seed(config.seed, step)),
        vocab_size=mlm.vocab_size,
        special_ids=mlm.special_ids,
        mask_id=mlm.mask_id,
    )


def model_config(config: TrainConfig, vocab_size: int) -> PretrainedConfig:
    """The job's model configuration: ``config``'s architecture and sizes for a tokenizer of
    ``vocab_size`` tokens."""
    from onebit.train.model import bert_config

    return bert_config(
        vocab_size=vocab_size,
        seq_len=config.seq_len,
        layers=config.layers,
        hidden=config.hidden,
        heads=config.heads,
        dropout=config.dropout,
        architecture=config.architecture,
    )


def build_optimizer(
    config: TrainConfig,
    params: list[nn.Parameter],
    node_groups: NodeGroups | None = None,
    max_grad_norm: float = 0.0,
) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer`` (:data:`onebit.optim.registry.OPTIMIZERS`)
    with the config's hyper-parameters; the 1-bit optimizers exchange hierarchically over
    ``node_groups`` when given; onebit's optimizers clip at ``max_grad_norm`` in ``step()``
    (torch's AdamW does not clip)."""
    values = {
        **dataclasses.asdict(config),
        "compression": config.onebit_adam_compression,
        "node_groups": node_groups,
        "max_grad_norm": max_grad_norm,
    }
    return optimizer_spec(config.optimizer).build(params, values)


def clips_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` clips the gradients in its ``step()`` (onebit's optimizers)."""
    return hasattr(optimizer, "max_grad_norm")


# No annotations: DistributedDataParallel inspects them and rejects postponed (string) ones.
def counted_allreduce_hook(traffic, bucket):
    """DDP's default mean allreduce, with its bytes counted in ``traffic``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    traffic.record("allreduce", allreduce_bytes(bucket.buffer(), dist.get_world_size()))
    return allreduce_hook(None, bucket)


def average_gradients(params: list[nn.Parameter], traffic: TrafficCounter) -> None:
    """Mean of every gradient over ranks in one dense allreduce (what DDP does, without it),
    for the dense baselines of a plain loop (onebit's optimizers average in ``step()``).

    Every parameter has its place whatever gradients this rank has, with one flag each that
    says whether it had one (so ranks that differ in which gradients exist still send the
    same buffer): a gradient missing on some ranks counts as zero, and a parameter no rank
    has a gradient for keeps none."""
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes) + len(params), dtype=params[0].dtype, device=params[0].device)
    values, flags = flat[: sum(sizes)].split(sizes), flat[sum(sizes) :]
    for index, (param, value) in enumerate(zip(params, values, strict=True)):
        if param.grad is not None:
            value.copy_(param.grad.reshape(-1))
            flags[index] = 1
    onebit.allreduce_mean_(flat, traffic=traffic)
    for param, value, flag in zip(params, values, flags.tolist(), strict=True):
        if flag > 0:
            param.grad = value.view_as(param).clone()


@dataclasses.dataclass
class Rank:
    """Where this process sits in the job."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class WorkerEnvironmentError(RuntimeError):
    """The process was not started by torchrun or torch's elastic launcher."""


def _rank_from_env(config: TrainConfig) -> Rank:
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") if v not in os.environ
    ]
    if missing:
        raise WorkerEnvironmentError(
            f"the training worker needs torchrun's environment variables; {missing} are not set. "
            "Run `onebit train` (which launches workers), or start it under torchrun with "
            "`onebit train --no-launch ...`"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but CUDA is not available")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return Rank(
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
        local_rank=local_rank,
        local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device=device,
    )


def _configure_logging(rank: Rank) -> None:
    logging.basicConfig(format=f"%(asctime)s rank{rank.rank} %(name)s %(message)s")
    logging.getLogger("onebit").setLevel(logging.INFO if rank.is_main else logging.WARNING)
    logging.getLogger("onebit.train.data").setLevel(logging.WARNING)


def _collective_ok(error: str | None, what: str) -> None:
    """Raise on every rank if any rank failed ``what`` (the first error message is shown)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"{what} failed on rank {rank}: {message}")


def run(config: TrainConfig, run_dir: Path, *, kill_at_step: int | None = None) -> None:
    """Train (or continue) the run in ``run_dir`` on this rank; rank 0 writes the report.

    ``kill_at_step`` (tests only): after that step the last rank kills itself with SIGKILL,
    on the first attempt of an elastic job only.
    """
    rank = _rank_from_env(config)
    config.check_world_size(rank.world)
    _configure_logging(rank)
    threads = max(1, len(os.sched_getaffinity(0)) // rank.local_world)
    torch.set_num_threads(threads)
    dist.init_process_group(config.backend, timeout=timedelta(seconds=config.timeout))
    try:
        _Trainer(config, run_dir, rank, kill_at_step).train()
    finally:
        dist.destroy_process_group()


class _Trainer:
    """The state of one rank's training run, and the loop."""

    def __init__(
        self, config: TrainConfig, run_dir: Path, rank: Rank, kill_at_step: int | None
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.rank = rank
        self.kill_at_step = kill_at_step
        self.checkpoints = run_dir / CHECKPOINT_DIR
        self.traffic: dict[str, int] = {}
        self.workers = rank.world  # data-parallel workers

    def _launch(self) -> dict[str, Any]:
        """What the run folder records of how the run was launched."""
        return {"world_size": self.workers}

    def _report_extra(self) -> dict[str, Any]:
        """Entries of ``summary.json`` beyond :func:`report.summarize`'s."""
        return {}

    # ----------------------------------------------------------------- setup
    def _prepare(self) -> tuple[data.MLMData, str]:
        error = None
        if self.rank.is_main:
            try:
                prepare_run_dir(self.run_dir, self.config, self._launch())
            except (ValueError, OSError) as exc:
                error = str(exc)
        _collective_ok(error, "preparing the run folder")
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        # One process per node fills the data cache; the others then read it.
        loaded = None
        if self.rank.local_rank == 0:
            loaded = load_data(self.config)
        dist.barrier()
        if loaded is None:
            loaded = load_data(self.config)
        return loaded

    def _build(self, mlm: data.MLMData) -> None:
        from onebit.train.model import build_mlm_model

        config = self.config
        self.bert_config = model_config(config, mlm.vocab_size)
        torch.manual_seed(config.seed)
        self.model = build_mlm_model(self.bert_config).to(self.rank.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)

        resumed = checkpoint.load_latest(self.checkpoints)
        if resumed is not None and resumed.model is not None:
            self.model.load_state_dict(resumed.model["model"])
        # Identical initial (or restored) weights on every rank.
        onebit.broadcast_parameters(self.model.state_dict().values())
        self._parallelize()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda i: lr_factor(i, config.lr_warmup_steps, config.steps),
        )
        self.start_step = 0
        self.metrics_bytes = 0
        if resumed is not None:
            state = resumed.rank_state
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.traffic = dict(state["traffic"])
            self.start_step = resumed.step
            if resumed.model is not None:
                self.metrics_bytes = int(resumed.model["metrics_bytes"])
            logger.info("Resuming at step %d from %s", resumed.step, resumed.path)

    def _parallelize(self) -> None:
        """The optimizer, how gradients are averaged (``self.dense_traffic`` counts the dense
        averaging's bytes) and the module the forward pass runs through."""
        config = self.config
        groups = onebit.node_groups(config.node_size) if config.hierarchical else None
        self.optimizer = build_optimizer(config, self.params, groups, config.grad_clip)
        self.dense_traffic = TrafficCounter()  # the dense baselines' gradient averaging
        self.forward: nn.Module = self.model
        if config.ddp:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.rank.local_rank] if self.rank.device.type == "cuda" else None
            self.forward = DistributedDataParallel(self.model, device_ids=device_ids)
            if config.uses_onebit:
                onebit.ddp.register_comm_hook(self.forward, self.optimizer)
            else:
                self.forward.register_comm_hook(self.dense_traffic, counted_allreduce_hook)

    def _link_bytes(self) -> dict[str, int]:
        """Bytes this rank has sent in the hierarchical exchange so far, per link kind."""
        sent = self.optimizer.traffic_by_kind
        return {kind: sent.get(kind, 0) for kind in report.LINKS}

    def _stage(self) -> str:
        return self.optimizer.stage if self.config.uses_onebit else DENSE

    def _bytes_sent(self) -> int:
        """Bytes this rank has sent for gradients and momenta so far."""
        sent = self.dense_traffic.total()  # gradients averaged by the job or DDP's default hook
        if self.config.uses_onebit:
            sent += sum(self.optimizer.bytes_sent.values())
        return sent

    # ----------------------------------------------------------------- the loop
    def train(self) -> None:
        mlm, tokenizer_json = self._prepare()
        if self.rank.is_main and not (self.run_dir / TOKENIZER_FILE).exists():
            write_bytes_atomic(self.run_dir / TOKENIZER_FILE, tokenizer_json.encode())
        self._build(mlm)
        config = self.config
        val_inputs, val_labels = self._validation_set(mlm)
        batches = data.global_batches(
            mlm.train.shape[0], config.batch_size, config.steps, config.seed, self.start_step
        )
        with self._metrics_file() as metrics, self._progress() as bar:
            for step, indices in enumerate(batches, start=self.start_step + 1):
                row = self._train_step(step, mlm, indices)
                self._write(metrics, row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{row['loss']:.3f}",
                        stage=row["stage"],
                        sent=report.human_bytes(row["bytes_total"]),
                    )
                if step == self.kill_at_step and self._first_attempt_last_rank():
                    os.kill(os.getpid(), signal.SIGKILL)
                if step % config.eval_every == 0 or step == config.steps:
                    val = self._evaluate(val_inputs, val_labels)
                    self._write(
                        metrics,
                        {
                            "kind": "validation",
                            "step": step,
                            "samples": row["samples"],
                            "loss": val,
                        },
                    )
                    logger.info("step %d: validation MLM loss %.4f", step, val)
                if step % config.checkpoint_every == 0 or step == config.steps:
                    self._save(step, metrics)
        if self.rank.is_main:
            summary = report.write_run_report(
                self.run_dir,
                config,
                world_size=self.workers,
                numel=self.numel,
                extra={
                    "unigram_entropy": data.unigram_cross_entropy(mlm),
                    **self._report_extra(),
                },
            )
            print(report.format_summary(summary), flush=True)
        # No rank exits before the summary is written: torch sometimes aborts a process as it
        # exits, and once the summary is there such an abort is no failure (launch_job).
        dist.barrier()

    def _validation_set(self, mlm: data.MLMData) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed random subset of ``eval_seqs`` validation sequences with fixed masks."""
        generator = torch.Generator().manual_seed(step_seed(self.config.seed, -1))
        sequences = mlm.validation
        if 0 < self.config.eval_seqs < sequences.shape[0]:
            chosen = torch.randperm(sequences.shape[0], generator=generator)
            sequences = sequences[chosen[: self.config.eval_seqs].sort().values]
        return data.mask_tokens(
            sequences,
            generator,
            vocab_size=mlm.vocab_size,
            special_ids=mlm.special_ids,
            mask_id=mlm.mask_id,
        )

    def _first_attempt_last_rank(self) -> bool:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return restarts == 0 and self.rank.rank == self.rank.world - 1

    def _train_step(self, step: int, mlm: data.MLMData, indices: torch.Tensor) -> dict[str, Any]:
        config = self.config
        started = time.perf_counter()
        inputs, labels = masked_batch(config, mlm, step, indices)
        stage = self._stage()
        lr = self.optimizer.param_groups[0]["lr"]
        sent_before = self._bytes_sent()
        links_before = self._link_bytes() if config.hierarchical else None
        loss_sum, masked = self._gradient_step(step, inputs, labels)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sent = self._bytes_sent() - sent_before
        self.traffic[stage] = self.traffic.get(stage, 0) + sent
        links = {}
        if links_before is not None:
            links = {f"bytes_{k}": n - links_before[k] for k, n in self._link_bytes().items()}
        return {
            "kind": "train",
            "step": step,
            "stage": stage,
            "loss": loss_sum / max(masked, 1),
            "lr": lr,
            "samples": step * config.batch_size,
            "bytes": sent,
            "bytes_total": sum(self.traffic.values()),
            **links,
            "step_time": time.perf_counter() - started,
        }

    def _worker_loss(
        self, step: int, worker: int, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Worker ``worker``'s MLM loss on its slice of the global batch, and its number of
        masked tokens (dropout seeded by the step and the worker)."""
        inputs = data.rank_slice(inputs, worker, self.workers).to(self.rank.device)
        labels = data.rank_slice(labels, worker, self.workers).to(self.rank.device)
        torch.manual_seed(step_seed(self.config.seed, step, worker))  # dropout
        return self.forward(inputs, labels), int((labels != data.IGNORE_INDEX).sum())

    def _gradient_step(
        self, step: int, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[float, int]:
        """This rank's forward and backward pass on its slice of the global batch, then the
        optimizer step; returns the global batch's summed MLM loss and number of masked
        tokens. The 1-bit optimizers average (in their dense steps) and clip in ``step()``;
        the dense baselines' gradients are averaged by DDP or, in a plain loop, here."""
        config = self.config
        loss, masked = self._worker_loss(step, self.rank.rank, inputs, labels)
        loss.backward()
        if not config.ddp and not config.uses_onebit:
            average_gradients(self.params, self.dense_traffic)
        if config.grad_clip > 0 and not clips_in_step(self.optimizer):
            torch.nn.utils.clip_grad_norm_(self.params, config.grad_clip)
        self.optimizer.step()
        totals = torch.tensor([loss.item() * masked, masked], dtype=torch.float64)
        dist.all_reduce(totals)
        return float(totals[0]), int(totals[1])

    @torch.no_grad()
    def _evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """MLM loss over the whole (fixed-masked) validation set, split across ranks."""
        self.model.eval()
        mine = torch.arange(self.rank.rank, inputs.shape[0], self.rank.world)
        totals = torch.zeros(2, dtype=torch.float64)
        for chunk in mine.split(EVAL_BATCH):
            batch_labels = labels[chunk].to(self.rank.device)
            loss = self.model(inputs[chunk].to(self.rank.device), batch_labels)
            masked = int((batch_labels != data.IGNORE_INDEX).sum())
            totals += torch.tensor([loss.item() * masked, masked], dtype=torch.float64)
        dist.all_reduce(totals)
        self.model.train()
        return float(totals[0] / totals[1].clamp(min=1))

    def _save(self, step: int, metrics: Any) -> None:
        model_state = None
        if self.rank.is_main:
            metrics.flush()
            os.fsync(metrics.fileno())
            model_state = {
                "model": self.model.state_dict(),
                "step": step,
                "metrics_bytes": metrics.tell(),
                "bert_config": self.bert_config.to_dict(),
            }
        rank_state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "traffic": dict(self.traffic),
            "step": step,
        }
        checkpoint.save(
            self.checkpoints, step, model_state, rank_state, self.config.keep_checkpoints
        )

    # ----------------------------------------------------------------- output (rank 0)
    @contextlib.contextmanager
    def _metrics_file(self) -> Iterator[Any]:
        """Rank 0: ``metrics.jsonl`` cut back to the resumed checkpoint's rows, for appending."""
        if not self.rank.is_main:
            yield None
            return
        path = self.run_dir / METRICS_FILE
        with path.open("a+b") as f:
            f.truncate(self.metrics_bytes)
            f.seek(self.metrics_bytes)
            yield f

    @staticmethod
    def _write(metrics: Any, row: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.write((json.dumps(row) + "\n").encode())

    @contextlib.contextmanager
    def _progress(self) -> Iterator[Any]:
        if not self.rank.is_main:
            yield None
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        with (
            logging_redirect_tqdm(),
            tqdm(
                total=self.config.steps,
                initial=self.start_step,
                desc=f"{self.config.optimizer} x{self.workers}",
                unit="step",
                mininterval=1.0,
                dynamic_ncols=True,
                file=sys.stderr,
            ) as bar,
        ):
            yield bar


@record
def main(argv: list[str] | None = None) -> int:
    """``python -m onebit.train.worker RUN_DIR``: continue the run in RUN_DIR on this rank."""
    parser = argparse.ArgumentParser(prog="python -m onebit.train.worker", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="run folder holding config.json")
    parser.add_argument("--kill-at-step", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    run(read_config(args.run_dir), args.run_dir, kill_at_step=args.kill_at_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
