"""The readiness statistic R check by check, and where ``freeze_step="auto"`` freezes.

    .venv/bin/python benchmarks/readiness_trajectory.py main [--optimizer NAME] [--record FILE]
    .venv/bin/python benchmarks/readiness_trajectory.py plateau [--record FILE]

``main``: the main job's default run (its model, data, masks, learning-rate schedule and
clipping) in one process on the whole global batch, with ``--freeze-step auto``. ``plateau``:
:class:`onebit.plateau.PointerTask` with ``OneBitAdam(lr=1e-3, freeze_step="auto")`` on a
batch of 64. Every 10 steps of the warm-up it prints the largest R_j over the parameters
(ALGORITHM.md, "Variance readiness") and the parameter it belongs to; then the step the
variance froze after. ``--record`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import onebit
from onebit.optim._readiness import READINESS_WINDOW
from onebit.plateau import PointerTask


def main_job(optimizer_name: str):
    """The main job: yields its named parameters and optimizer, then once after each step."""
    from onebit.train import data, job_data
    from onebit.train.config import TrainConfig
    from onebit.train.gradients import build_optimizer
    from onebit.train.model import build_mlm_model

    config = TrainConfig(optimizer=optimizer_name, freeze_step="auto").resolved()
    mlm, _ = job_data.load_data(config)
    torch.manual_seed(config.seed)
    model = build_mlm_model(job_data.model_config(config, mlm.vocab_size))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(config, [p for _, p in named], max_grad_norm=config.grad_clip)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: job_data.lr_factor(i, config.lr_warmup_steps, config.steps)
    )
    yield named, optimizer
    batches = data.global_batches(
        mlm.train.shape[0], config.batch_size, config.steps, config.seed, 0
    )
    for step, indices in enumerate(batches, start=1):
        inputs, labels = job_data.masked_batch(config, mlm, step, indices)
        model(inputs, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        yield None


def plateau():
    """The plateau task, as :func:`main_job`."""
    task = PointerTask()
    torch.manual_seed(0)
    model = task.model()
    named = list(model.named_parameters())
    optimizer = onebit.OneBitAdam(model.parameters(), lr=1e-3, freeze_step="auto")
    yield named, optimizer
    for step in range(1, 501):
        inputs, targets = task.batch(step, 64)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        yield None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=["main", "plateau"])
    parser.add_argument(
        "--optimizer", default="onebit-lamb", choices=["onebit-lamb", "onebit-adam"]
    )
    parser.add_argument("--record", type=Path, default=None, help="write the checks as JSON")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    steps = main_job(args.optimizer) if args.task == "main" else plateau()
    named, optimizer = next(steps)
    checks = []
    for step, _ in enumerate(steps, start=1):
        if optimizer.stage != "warmup" and step > optimizer.freeze_step:
            print(f"froze after step {optimizer.freeze_step}")
            break
        if step % READINESS_WINDOW == 0:
            ratios = optimizer.variance_readiness()
            index = int(ratios.argmax())
            largest, parameter = float(ratios[index]), named[index][0]
            checks.append({"step": step, "largest_ratio": largest, "parameter": parameter})
            print(f"step {step}: largest R {largest:.2f} ({parameter})", flush=True)
    dist.destroy_process_group()
    if args.record is not None:
        command = f".venv/bin/python benchmarks/readiness_trajectory.py {args.task}"
        if args.task == "main" and args.optimizer != "onebit-lamb":
            command += f" --optimizer {args.optimizer}"
        optimizer_name = args.optimizer if args.task == "main" else "onebit-adam"
        record = {
            "command": command,
            "task": args.task,
            "optimizer": optimizer_name,
            "checks": checks,
            "froze_after": optimizer.freeze_step,
        }
        args.record.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
