"""The norm of one worker's gradient against the norm of the global batch's mean gradient, at
the newest checkpoint of a main-job run: what clipping each worker's own gradient does at W
workers (docs/ALGORITHM.md, "Gradient clipping when step() uses each rank's own gradient").

    .venv/bin/python scripts/local_gradient_norms.py runs/study/lamb [--workers 1 4 16 64 256]

The global batch of the step after the checkpoint (the last step's after the last; its
samples and masks as the job draws them) is split into W equal slices; for each W the script
prints the mean gradient norm of up to --slices of them (W = 1: the whole batch).
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch

from onebit.train import checkpoint, data, job_data
from onebit.train.model import build_mlm_model
from onebit.train.run_dir import CHECKPOINT_DIR, read_config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder of onebit train or simulate")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--slices", type=int, default=16, help="slices averaged per W")
    return parser.parse_args()


def gradient_norm(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    model(inputs, labels).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


def main() -> None:
    args = parse_args()
    config = read_config(args.run)
    for workers in args.workers:
        if workers < 1 or config.batch_size % workers:
            raise SystemExit(f"--workers {workers} does not divide the batch {config.batch_size}")
    step, state = checkpoint.latest_model_state(args.run / CHECKPOINT_DIR)
    batch_step = min(step + 1, config.steps)  # after the last step: the last step's batch
    mlm, _ = job_data.load_data(config)
    model = build_mlm_model(job_data.model_config(config, mlm.vocab_size))
    model.load_state_dict(state["model"])
    batches = data.global_batches(mlm.train.shape[0], config.batch_size, config.steps, config.seed)
    indices = next(itertools.islice(batches, batch_step - 1, None))
    inputs, labels = job_data.masked_batch(config, mlm, batch_step, indices)
    print(f"{args.run}, weights after step {step}, the global batch of step {batch_step}:")
    for workers in args.workers:
        size = config.batch_size // workers
        norms = [
            gradient_norm(
                model, inputs[i * size : (i + 1) * size], labels[i * size : (i + 1) * size]
            )
            for i in range(min(workers, args.slices))
        ]
        mean = sum(norms) / len(norms)
        print(f"  W = {workers:4d} ({size:4d} sequences per worker): |g_worker| = {mean:.3f}")


if __name__ == "__main__":
    main()
