"""One rank's training run of the main job: set-up, resumption from the newest checkpoint, the
loop of steps, evaluation, checkpoints, metrics, progress and the report. ``onebit simulate``
runs the same trainer with its workers simulated (:mod:`onebit.train.simulation`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import onebit
from onebit.atomic import write_bytes_atomic
from onebit.collectives import TrafficCounter
from onebit.train import checkpoint, data, report
from onebit.train.config import TrainConfig
from onebit.train.gradients import (
    CountedAllreduce,
    average_gradients,
    build_optimizer,
    clips_in_step,
    counted_allreduce_hook,
)
from onebit.train.job_data import (
    load_data,
    lr_factor,
    masked_batch,
    model_config,
    run_inputs,
    step_seed,
    tensors_digest,
)
from onebit.train.powersgd import CountedPowerSGD, one_bucket
from onebit.train.rank import Rank, collective_ok
from onebit.train.run_dir import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    TOKENIZER_FILE,
    prepare_run_dir,
)
from onebit.train.torchft_diloco import TorchftDiLoCo

logger = logging.getLogger(__name__)

#: Evaluation batch (sequences per forward pass) on each rank.
EVAL_BATCH = 128
#: Stage label of the steps of the uncompressed optimizers.
DENSE = "dense"
#: DiLoCo's kinds of step: an inner step (nothing sent), the step that ends a round.
INNER, OUTER = "inner", "outer"


@contextlib.contextmanager
def _subnormals_flushed(device: torch.device) -> Iterator[None]:
    """On the CPU, floats below 2^-126 (subnormals) are taken as zero inside the block (where
    the CPU can). A model whose attention saturates produces them in its backward pass, where
    x86 CPUs handle them in microcode: the main job's 1-bit LAMB frozen after step 50 took
    0.84 s for a forward and backward pass that takes 0.19 s with them flushed."""
    flushed = device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flushed:
            torch.set_flush_denormal(False)


class Trainer:
    """The state of one rank's training run, and the loop."""

    #: The PowerSGD hook whose state the checkpoints keep (``--powersgd-rank``), if any.
    powersgd: CountedPowerSGD | None = None
    #: DiLoCo's rounds over the inner optimizer (``--sync-every``), if any: onebit's, or its
    #: peer torchft's (``--outer-implementation``).
    diloco: onebit.DiLoCo | TorchftDiLoCo | None = None
    #: The ranks the dense gradients are averaged over (``None``: the world; DiLoCo's node).
    dense_group: dist.ProcessGroup | None = None

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
        collective_ok(error, "preparing the run folder")
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
        self.initial_weights = tensors_digest(self.model.state_dict().values())
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)

        resumed = checkpoint.load_latest(self.checkpoints)
        if resumed is not None and resumed.model is not None and "model" in resumed.model:
            self.model.load_state_dict(resumed.model["model"])  # rank 0; not with --fsdp
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
            self._restore_state(resumed)
            self.scheduler.load_state_dict(state["scheduler"])
            self.traffic = dict(state["traffic"])
            if self.powersgd is not None:
                self.powersgd.load_state_dict(state["powersgd"])
            self.start_step = resumed.step
            if resumed.model is not None:
                self.metrics_bytes = int(resumed.model["metrics_bytes"])
            logger.info("Resuming at step %d from %s", resumed.step, resumed.path)

    def _restore_state(self, resumed: checkpoint.Checkpoint) -> None:
        """The optimizer's state from ``resumed`` (the weights came with rank 0's model;
        inside a DiLoCo round each rank's own weights come with its state)."""
        self.optimizer.load_state_dict(resumed.rank_state["optimizer"])
        if self.diloco is not None:
            self._restore_rounds(resumed.rank_state)

    def _restore_rounds(self, rank_state: dict[str, Any]) -> None:
        """DiLoCo's state, and inside a round this rank's own weights."""
        self.diloco.load_state_dict(rank_state["diloco"])
        own = rank_state.get("own_weights")
        if own is not None:
            with torch.no_grad():
                for param, saved in zip(self.params, own, strict=True):
                    param.copy_(saved)

    def _rounds_state(self) -> dict[str, Any]:
        """What :meth:`_restore_rounds` takes back: DiLoCo's state, and inside a round (where
        the ranks' weights differ) this rank's own weights."""
        state: dict[str, Any] = {"diloco": self.diloco.state_dict()}
        if not self.diloco.weights_shared:
            state["own_weights"] = [p.detach().clone() for p in self.params]
        return state

    def _end_round(self) -> None:
        """End every DiLoCo round now (the run's last step ends the rounds it is in), and
        with ``--deliver-errors`` deliver the 1-bit exchange's errors."""
        self.diloco.sync(deliver_errors=self.config.deliver_errors)

    def _parallelize(self) -> None:
        """The optimizer, how gradients are averaged (``self.dense_traffic`` counts the dense
        averaging's bytes, over ``self.dense_group``) and the module the forward pass runs
        through."""
        config = self.config
        groups = onebit.node_groups(config.node_size) if config.counts_links else None
        hierarchical = groups if config.hierarchical else None
        self.optimizer = build_optimizer(config, self.params, hierarchical, config.grad_clip)
        self.dense_traffic = TrafficCounter()  # the dense baselines' gradient averaging
        self.forward: nn.Module = self.model
        if config.diloco:  # each worker, or each node of DDP inside it, is a DiLoCo worker
            intra, inter = groups if config.diloco_nodes else (None, None)
            self.dense_group = intra
            self.diloco = self._rounds(inter)
        if config.ddp and (config.diloco_nodes or not config.diloco):
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.rank.local_rank] if self.rank.device.type == "cuda" else None
            buckets = one_bucket(self.params) if config.powersgd_rank else {}
            self.forward = DistributedDataParallel(
                self.model, device_ids=device_ids, process_group=self.dense_group, **buckets
            )
            if config.uses_onebit:
                onebit.ddp.register_comm_hook(self.forward, self.optimizer)
            elif config.powersgd_rank:
                self.powersgd = CountedPowerSGD(
                    config.powersgd_rank, self.params, self.dense_traffic
                )
                self.powersgd.register(self.forward)
            else:
                hook_state = CountedAllreduce(self.dense_traffic, self.dense_group)
                self.forward.register_comm_hook(hook_state, counted_allreduce_hook)

    def _rounds(self, group: dist.ProcessGroup | None) -> onebit.DiLoCo | TorchftDiLoCo:
        """DiLoCo's rounds over the inner optimizer between ``group``'s workers (``None``:
        every rank): onebit's, or torchft's (``--outer-implementation``)."""
        config = self.config
        outer = onebit.diloco.outer_sgd(self.params, config.outer_lr, config.outer_momentum)
        if config.outer_implementation == "torchft":
            return TorchftDiLoCo(
                self.model,
                self.params,
                self.optimizer,
                outer,
                sync_every=config.sync_every,
                timeout=config.timeout,
            )
        return onebit.DiLoCo(
            self.params,
            self.optimizer,
            outer_optimizer=outer,
            process_group=group,
            **config.diloco_options(),
        )

    def _link_bytes(self) -> dict[str, int]:
        """Bytes this rank has sent inside its node and between nodes so far: the
        hierarchical exchange's, or DiLoCo's nodes' (their gradients, their outer exchange)."""
        if self.diloco is not None:
            return {"intra_node": self.dense_traffic.total(), "inter_node": self.diloco.bytes_sent}
        sent = self.optimizer.traffic_by_kind
        return {kind: sent.get(kind, 0) for kind in report.LINKS}

    def _stage(self, step: int) -> str:
        """The kind of step ``step``: the 1-bit optimizer's stage; DiLoCo's ``"outer"`` at
        the end of a turn and in the steps its exchange runs behind (and at the last step,
        which ends the turn it is in), else ``"inner"``; else dense."""
        if self.diloco is not None:
            diloco = self.diloco  # the steps an outer exchange runs behind, and its end
            exchanging = diloco.local_step + 1 >= diloco.turn_steps - diloco.delay
            return OUTER if exchanging or step == self.config.steps else INNER
        return self.optimizer.stage if self.config.uses_onebit else DENSE

    def _bytes_sent(self) -> int:
        """Bytes this rank has sent for gradients, momenta and pseudo-gradients so far."""
        sent = self.dense_traffic.total()  # gradients averaged by the job or DDP's default hook
        if self.config.uses_onebit:
            sent += sum(self.optimizer.bytes_sent.values())
        if self.diloco is not None:
            sent += self.diloco.bytes_sent
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
        with (
            self._metrics_file() as metrics,
            self._progress() as bar,
            _subnormals_flushed(self.rank.device),
        ):
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
        if self.diloco is not None:
            self.diloco.close()
        if self.rank.is_main:
            summary = report.write_run_report(
                self.run_dir,
                config,
                world_size=self.workers,
                numel=self.numel,
                extra={
                    "unigram_entropy": data.unigram_cross_entropy(mlm),
                    "inputs": run_inputs(mlm, tokenizer_json, self.initial_weights),
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
        stage = self._stage(step)
        lr = self.optimizer.param_groups[0]["lr"]
        sent_before = self._bytes_sent()
        links_before = self._link_bytes() if config.counts_links else None
        loss_sum, masked = self._gradient_step(step, inputs, labels)
        if step == config.steps and isinstance(self.optimizer, onebit.OneBitOptimizer):
            self.optimizer.finish_exchange()  # a delayed exchange's last update lands
        if step == config.steps and self.diloco is not None:
            if not self.diloco.weights_shared or config.deliver_errors:
                self._end_round()
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

    def _averages_gradients(self) -> bool:
        """Whether the job averages the gradients itself (a plain loop's dense baselines, and
        DiLoCo's nodes; DiLoCo's single workers step on their own)."""
        config = self.config
        if config.ddp or config.uses_onebit:
            return False
        return config.diloco_nodes or not config.diloco

    def _clip_gradients(self) -> None:
        """Clip the gradients at ``--grad-clip`` where the optimizer does not clip in its
        ``step()`` (onebit's optimizers do)."""
        if self.config.grad_clip > 0 and not clips_in_step(self.optimizer):
            torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)

    def _gradient_step(
        self, step: int, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[float, int]:
        """This rank's forward and backward pass on its slice of the global batch, then the
        optimizer step; returns the global batch's summed MLM loss and number of masked
        tokens. The 1-bit optimizers average (in their dense steps) and clip in ``step()``;
        the dense baselines' gradients are averaged by DDP or, in a plain loop, here."""
        loss, masked = self._worker_loss(step, self.rank.rank, inputs, labels)
        loss.backward()
        if self._averages_gradients():
            average_gradients(self.params, self.dense_traffic, self.dense_group)
        self._clip_gradients()
        self.optimizer.step()
        totals = torch.tensor([loss.item() * masked, masked], dtype=torch.float64)
        dist.all_reduce(totals)
        return float(totals[0]), int(totals[1])

    @torch.no_grad()
    def _evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """MLM loss over the whole (fixed-masked) validation set, split across ranks, of
        weights the same on every rank: with DiLoCo, the current round's start weights; with
        a delayed exchange, the shared weights (not each rank's prediction)."""
        if self.diloco is not None:
            with self.diloco.round_start_weights():
                return self._validation_loss(inputs, labels)
        if isinstance(self.optimizer, onebit.OneBitOptimizer):
            with self.optimizer.holding_shared_weights():
                return self._validation_loss(inputs, labels)
        return self._validation_loss(inputs, labels)

    def _validation_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        self.model.eval()
        mine = torch.arange(self.rank.rank, inputs.shape[0], self.rank.world)
        totals = torch.zeros(2, dtype=torch.float64)
        for chunk in self._eval_batches(mine, inputs.shape[0]):
            batch_labels = labels[chunk].to(self.rank.device)
            loss = self.model(inputs[chunk].to(self.rank.device), batch_labels)
            masked = int((batch_labels != data.IGNORE_INDEX).sum())
            totals += torch.tensor([loss.item() * masked, masked], dtype=torch.float64)
        dist.all_reduce(totals)
        self.model.train()
        return float(totals[0] / totals[1].clamp(min=1))

    def _eval_batches(self, mine: torch.Tensor, sequences: int) -> tuple[torch.Tensor, ...]:
        """This rank's validation sequences ``mine`` (of ``sequences`` in all) in batches."""
        return mine.split(EVAL_BATCH)

    def _save(self, step: int, metrics: Any) -> None:
        model_state = None
        if self.rank.is_main:
            metrics.flush()
            os.fsync(metrics.fileno())
            model_state = {
                **self._weights_checkpoint(),
                "step": step,
                "metrics_bytes": metrics.tell(),
                "bert_config": self.bert_config.to_dict(),
            }
        rank_state = {
            **self._optimizer_checkpoint(),
            "scheduler": self.scheduler.state_dict(),
            "traffic": dict(self.traffic),
            "step": step,
        }
        if self.powersgd is not None:
            rank_state["powersgd"] = self.powersgd.state_dict()
        if self.diloco is not None:
            rank_state.update(self._rounds_state())
        checkpoint.save(
            self.checkpoints,
            step,
            model_state,
            rank_state,
            self.config.keep_checkpoints,
            self._write_shared_checkpoint,
        )

    #: Writes the state every rank holds a part of into a checkpoint's shared folder (FSDP).
    _write_shared_checkpoint = None

    def _weights_checkpoint(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def _optimizer_checkpoint(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

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
