"""How fast the variance still changes during the main job's warm-up, tensor by tensor.

Runs the main job's warm-up (its default model, data, masks, learning-rate schedule and
clipping, 1-bit LAMB never freezing) in one process on the whole global batch, and every
``--window`` steps prints, for the tensors whose mean bias-corrected variance
``mean(exp_avg_sq) / (1 - beta2^t)`` changed most since the previous print, the factor of
that change. A variance frozen while it still grows several-fold costs accuracy (README, "The
main job")::

    .venv/bin/python scripts/variance_growth.py --steps 100
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist

from onebit.train import data, job_data
from onebit.train.config import TrainConfig
from onebit.train.gradients import build_optimizer
from onebit.train.model import build_mlm_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="warm-up steps to run")
    parser.add_argument("--window", type=int, default=10, help="steps between two prints")
    parser.add_argument("--top", type=int, default=3, help="tensors printed per line")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    config = TrainConfig().resolved()
    mlm, _ = job_data.load_data(config)
    torch.manual_seed(config.seed)
    model = build_mlm_model(job_data.model_config(config, mlm.vocab_size))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    never = TrainConfig(steps=config.steps, freeze_step=config.steps).resolved()
    optimizer = build_optimizer(never, params, max_grad_norm=config.grad_clip)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: job_data.lr_factor(i, config.lr_warmup_steps, config.steps)
    )
    beta2 = config.betas[1]
    batches = data.global_batches(
        mlm.train.shape[0], config.batch_size, config.steps, config.seed, 0
    )
    previous = None
    for step, indices in enumerate(batches, start=1):
        if step > args.steps:
            break
        inputs, labels = job_data.masked_batch(config, mlm, step, indices)
        model(inputs, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if step % args.window:
            continue
        means = torch.stack([optimizer.state[p]["exp_avg_sq"].double().mean() for p in params])
        means /= 1 - beta2**step
        if previous is not None:
            factor = torch.where(previous > 0, means / previous, 1.0)
            change = torch.maximum(factor, 1 / factor.clamp(min=1e-300))
            top = change.topk(args.top).indices.tolist()
            listed = ", ".join(f"{named[i][0]} x{factor[i]:.3g}" for i in top)
            print(f"step {step}: median x{factor.median():.3g}; {listed}", flush=True)
        previous = means
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
