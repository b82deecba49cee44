"""Start the workers of a training run on this machine with torch's elastic launcher.

The launcher is ``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun`` runs):
a c10d rendezvous on 127.0.0.1 whose store binds a port of its own choosing (port 0, as
``torchrun --standalone`` asks for), ``workers`` processes of
``python -m onebit.train.worker RUN_DIR``, and up to ``max_restarts`` restarts of all of
them when one fails; every restart resumes from the run folder's newest usable checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from pathlib import Path

from onebit.train.config import TrainConfig
from onebit.train.report import format_summary
from onebit.train.run_dir import SUMMARY_FILE, prepare_run_dir

logger = logging.getLogger(__name__)

#: Environment variable that makes each restart of the workers use a fresh store.
SHARED_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def complete_summary(run_dir: Path, config: TrainConfig) -> dict | None:
    """The summary of the run in ``run_dir`` if it has finished all its steps (rank 0 writes
    it after the last step's collectives and the final checkpoint), else None."""
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    return summary if summary["steps"] == config.steps else None


def print_if_complete(run_dir: Path, config: TrainConfig) -> bool:
    """Whether the run in ``run_dir`` has finished all its steps; if so its summary is
    printed again."""
    summary = complete_summary(run_dir, config)
    if summary is None:
        return False
    logger.info("%s is complete; nothing to train", run_dir)
    print(format_summary(summary), flush=True)
    return True


def launch_job(
    config: TrainConfig,
    run_dir: Path,
    *,
    workers: int,
    max_restarts: int,
    kill_at_step: int | None = None,
) -> int:
    """Prepare ``run_dir`` and the data cache, then train on ``workers`` local processes.

    Returns 0 on success and 1 if the workers failed (after ``max_restarts`` restarts).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from onebit.train.job_data import load_data

    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    config.check_world_size(workers)
    continuing = prepare_run_dir(run_dir, config, {"world_size": workers})
    if continuing and print_if_complete(run_dir, config):
        return 0
    logger.info("%s run in %s", "Continuing the" if continuing else "New", run_dir)
    load_data(config)  # fill the cache once, before the workers read it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # With the rendezvous store shared across restarts, restarted workers can read the previous
    # attempt's gloo/NCCL addresses and fail to connect (pytorch/pytorch#135712, #167288).
    os.environ.setdefault(SHARED_STORE_SWITCH, "1")
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers,
        run_id=f"onebit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    args = ["-m", "onebit.train.worker", str(run_dir)]
    if kill_at_step is not None:
        args += ["--kill-at-step", str(kill_at_step)]
    try:
        elastic_launch(launch_config, sys.executable)(*args)
    except ChildFailedError as exc:
        if complete_summary(run_dir, config) is not None:
            # Every step, the final checkpoint and the summary are written; torch sometimes
            # aborts a worker while it exits ("terminate called without an active
            # exception"), which changes none of them.
            logger.warning("The run finished, but a worker then exited abnormally:\n%s", exc)
            return 0
        logger.error(
            "Training failed after %d restart(s); the run folder keeps its checkpoints, continue "
            "with `onebit train --resume %s`.\n%s",
            max_restarts,
            run_dir,
            exc,
        )
        return 1
    return 0
