"""One data-parallel training process of the main job (one per rank).

Started by ``onebit train`` through torch's elastic launcher, or by a user's own ``torchrun``
with ``onebit train --no-launch``: either way it reads its rank and the rendezvous from
torchrun's environment variables. It continues from the run folder's newest usable
checkpoint, so a restart by ``--max-restarts`` resumes where the job stopped (replaying
exactly the steps an uninterrupted run would take: :mod:`onebit.train.job_data`). The run itself
is :class:`onebit.train.trainer.Trainer`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from onebit.train.config import TrainConfig
from onebit.train.rank import Rank
from onebit.train.run_dir import read_config
from onebit.train.sharded import ShardedTrainer
from onebit.train.trainer import Trainer


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


def configure_logging(rank: Rank) -> None:
    """Log with the rank in every line; INFO on rank 0, warnings only on the others."""
    logging.basicConfig(format=f"%(asctime)s rank{rank.rank} %(name)s %(message)s")
    logging.getLogger("onebit").setLevel(logging.INFO if rank.is_main else logging.WARNING)
    logging.getLogger("onebit.train.data").setLevel(logging.WARNING)


def run(config: TrainConfig, run_dir: Path, *, kill_at_step: int | None = None) -> None:
    """Train (or continue) the run in ``run_dir`` on this rank; rank 0 writes the report.

    ``kill_at_step`` (tests only): after that step the last rank kills itself with SIGKILL,
    on the first attempt of an elastic job only.
    """
    rank = _rank_from_env(config)
    config.check_world_size(rank.world)
    configure_logging(rank)
    threads = max(1, len(os.sched_getaffinity(0)) // rank.local_world)
    torch.set_num_threads(threads)
    dist.init_process_group(config.backend, timeout=timedelta(seconds=config.timeout))
    trainer = ShardedTrainer if config.fsdp else Trainer
    try:
        trainer(config, run_dir, rank, kill_at_step).train()
    finally:
        dist.destroy_process_group()


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
