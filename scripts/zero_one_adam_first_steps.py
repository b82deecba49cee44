"""The first steps of a main-job run, one line per step: the kind of step, the training loss
and the tensors whose weights moved most relative to their norm (with their gradients' norms,
after clipping). It shows where 0/1 Adam's first 1-bit gradient steps throw a tensor far from
where it was.

    .venv/bin/python scripts/zero_one_adam_first_steps.py runs/study/zero-one-adam-n4-k16 \
        [--steps 24] [--set var_update_scaler=64]

The run folder's config.json gives the model, data, seed and optimizer (``--set`` overrides
its fields). The whole global batch runs in one process (a world of one rank: 0/1 Adam still
compresses its 1-bit steps there, with its error feedback), so the trajectory is the run's
with one worker instead of its worker count.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from onebit.train import data, gradients, job_data
from onebit.train.config import TrainConfig
from onebit.train.model import build_mlm_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder of onebit train")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--top", type=int, default=3, help="tensors listed per step")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="FIELD=JSON", help="config fields to override"
    )
    return parser.parse_args()


def load_config(run: Path, overrides: list[str]) -> TrainConfig:
    fields = json.loads((run / "config.json").read_text())["train"]
    # runs from before var_warmup_steps: DeepSpeed's schedule, kappa steps in the first interval
    fields.setdefault("var_warmup_steps", fields.get("var_update_scaler", 16))
    fields.setdefault("pre_freeze_exchange", "gradient")
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--set {item}: {name!r} is not a field of {run}/config.json")
        fields[name] = json.loads(value)
    fields["betas"] = tuple(fields["betas"])
    return TrainConfig(**fields)


def main() -> None:
    args = parse_args()
    config = load_config(args.run, args.set)
    with tempfile.TemporaryDirectory() as rendezvous:
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1
        )
        try:
            trace(config, args.steps, args.top)
        finally:
            dist.destroy_process_group()


def trace(config: TrainConfig, steps: int, top: int) -> None:
    mlm, _ = job_data.load_data(config)
    torch.manual_seed(config.seed)
    model = build_mlm_model(job_data.model_config(config, mlm.vocab_size))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer = gradients.build_optimizer(config, params)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: job_data.lr_factor(i, config.lr_warmup_steps, config.steps)
    )
    batches = data.global_batches(mlm.train.shape[0], config.batch_size, config.steps, config.seed)
    print("step  kind              loss    largest |Δp| / |p| (tensor: ratio (|g| gradient norm))")
    for step, indices in enumerate(itertools.islice(batches, steps), start=1):
        inputs, labels = job_data.masked_batch(config, mlm, step, indices)
        kind = getattr(optimizer, "stage", "dense")
        loss = model(inputs, labels)
        loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        before = [p.detach().clone() for p in params]
        gradient_norms = [0.0 if p.grad is None else float(p.grad.norm()) for p in params]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        moved = sorted(
            (
                (float((p.detach() - old).norm() / old.norm()), name, gradient)
                for (name, p), old, gradient in zip(named, before, gradient_norms, strict=True)
                if old.norm() > 0  # zero-initialised biases have no scale yet
            ),
            reverse=True,
        )
        listed = ", ".join(f"{name}: {ratio:.3g} (|g| {g:.2g})" for ratio, name, g in moved[:top])
        print(f"{step:4d}  {kind:16s}  {loss.item():.4f}  {listed}", flush=True)


if __name__ == "__main__":
    main()
