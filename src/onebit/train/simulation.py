"""``onebit simulate``: the main job with ``n`` data-parallel workers simulated in one process.

The trainer of ``onebit train`` (:mod:`onebit.train.trainer`) with its model, data order,
masking, dropout seeds, learning-rate schedule, evaluation, metrics, checkpoints and report;
only the workers differ: :class:`onebit.simulate.SimulatedDataParallel` runs worker ``i`` on
slice ``i`` of the global batch (with worker ``i``'s dropout seed), averages the gradients of
uncompressed steps in rank order, clips as the job does, and exchanges 1-bit momenta through
the simulated flat or hierarchical exchange. The process is a torch.distributed world of one
rank, so checkpoints and evaluation run the job's own code; a checkpoint's one optimizer state
holds every worker's error-feedback buffers. With ``--sync-every`` the workers train with
DiLoCo, simulated by :class:`onebit.simulate.SimulatedDiLoCo` (each worker's own weights and
inner optimizer state; a checkpoint holds them all). Options of the real job that choose how
workers communicate or shard (``--ddp``, ``--backend``, ``--timeout``, ``--powersgd-rank``,
``--fsdp``, ``--outer-implementation``) have no meaning here.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from onebit.collectives import TrafficCounter
from onebit.diloco import outer_sgd
from onebit.simulate import SimulatedDataParallel, SimulatedDiLoCo
from onebit.train import checkpoint
from onebit.train.config import TrainConfig
from onebit.train.gradients import build_optimizer
from onebit.train.rank import Rank
from onebit.train.trainer import Trainer
from onebit.train.worker import configure_logging

__all__ = ["SimulatedTrainer", "check_simulated", "simulate"]

#: The optimizers ``onebit simulate`` runs.
SIMULATED_OPTIMIZERS = ("onebit-lamb", "onebit-adam", "lamb", "adam")


class SimulatedTrainer(Trainer):
    """The main job's trainer with ``workers`` simulated workers in this process."""

    def __init__(self, config: TrainConfig, run_dir: Path, workers: int, rank: Rank) -> None:
        super().__init__(config, run_dir, rank, kill_at_step=None)
        self.workers = workers

    def _launch(self) -> dict[str, Any]:
        return {"world_size": self.workers, "simulated": True}

    def _parallelize(self) -> None:
        config = self.config
        self.optimizer = build_optimizer(config, self.params)
        self.forward = self.model
        if config.diloco:
            outer = outer_sgd(self.params, config.outer_lr, config.outer_momentum)
            self.simulation: SimulatedDataParallel | SimulatedDiLoCo = SimulatedDiLoCo(
                self.params,
                self.optimizer,
                self.workers,
                outer_optimizer=outer,
                **config.diloco_options(),
            )
            self.diloco = self.simulation.diloco
            self.dense_traffic = TrafficCounter()  # DiLoCo's inner steps send nothing
            return
        self.simulation = SimulatedDataParallel(
            self.optimizer,
            self.workers,
            config.node_size if config.hierarchical else 1,
            max_grad_norm=config.grad_clip,
            prediction=config.delayed_prediction,
        )
        self.dense_traffic = self.simulation.traffic

    def _gradient_step(
        self, step: int, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[float, int]:
        def worker_backward(worker: int) -> tuple[float, int]:
            loss, masked = self._worker_loss(step, worker, inputs, labels)
            loss.backward()
            if self.diloco is not None:  # each DiLoCo worker clips its own gradient
                self._clip_gradients()
            return loss.item() * masked, masked

        totals = self.simulation.step(worker_backward)
        return sum(loss for loss, _ in totals), sum(masked for _, masked in totals)

    def _optimizer_checkpoint(self) -> dict[str, Any]:
        state = super()._optimizer_checkpoint()
        if self.diloco is None:  # the simulated workers' own part (delayed: predictions)
            state["simulation"] = self.simulation.state_dict()
        return state

    def _restore_state(self, resumed: checkpoint.Checkpoint) -> None:
        super()._restore_state(resumed)
        if self.diloco is None and "simulation" in resumed.rank_state:
            self.simulation.load_state_dict(resumed.rank_state["simulation"])

    def _end_round(self) -> None:
        self.simulation.sync(deliver_errors=self.config.deliver_errors)

    def _rounds_state(self) -> dict[str, Any]:
        return {"diloco": self.simulation.state_dict()}  # every worker's weights inside

    def _restore_rounds(self, rank_state: dict[str, Any]) -> None:
        self.simulation.load_state_dict(rank_state["diloco"])

    def _report_extra(self) -> dict[str, Any]:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        simulation = self.simulation
        return {
            "simulation": {
                "node_size": 1 if self.diloco is not None else simulation.exchange.topology[0],
                "memory_bytes": simulation.memory_bytes(),
                "peak_rss_bytes": 1024 * peak_kib,
            }
        }


def check_simulated(config: TrainConfig) -> None:
    """Raise ``ValueError`` if ``config``'s optimizer cannot be simulated."""
    if config.optimizer not in SIMULATED_OPTIMIZERS:
        raise ValueError(
            f"--optimizer {config.optimizer} cannot be simulated; choose one of "
            f"{list(SIMULATED_OPTIMIZERS)}"
        )
    if config.diloco_nodes:
        raise ValueError(
            "--sync-every with --node-size > 1 (DiLoCo between nodes) is not simulated: "
            "the simulated DiLoCo workers are single workers"
        )
    if config.bucket_cap_mb is not None or config.overlap_backward:
        raise ValueError(
            "--bucket-cap-mb and --overlap-backward are not simulated (the simulation "
            "exchanges the whole momentum buffer at once)"
        )


def simulate(
    config: TrainConfig, run_dir: Path, workers: int, *, threads: int | None = None
) -> None:
    """Train (or continue) the simulated run in ``run_dir`` on ``threads`` torch threads
    (default: every core this process may use), then write its report."""
    check_simulated(config)
    config.check_world_size(workers)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    if dist.is_initialized():
        raise RuntimeError("onebit simulate runs in a process without a torch.distributed group")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but CUDA is not available")
    device = torch.device(config.device)
    rank = Rank(rank=0, world=1, local_rank=0, local_world=1, device=device)
    configure_logging(rank)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        SimulatedTrainer(config, run_dir, workers, rank).train()
    finally:
        dist.destroy_process_group()
