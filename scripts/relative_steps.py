"""Each tensor's step relative to its norm, ``||Δp|| / ||p||``, in the shortened main job under
LAMB and under 1-bit LAMB with each of its two exchanges (docs/ALGORITHM.md, "Each tensor
compressed alone").

    .venv/bin/python scripts/relative_steps.py [--seed 0] [--after 5 15 30 40]

Runs the job of scripts/seed_study.py (4 gloo workers on this machine, 150 steps, the variance
frozen after step 30) once per arm with the job's own trainer, records rank 0's parameters
after every step, and prints the relative step of the tensors whose steps differ most between
the two exchanges, ``--after`` steps after the switch.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from onebit.testing import spawn_workers
from onebit.train.config import TrainConfig
from onebit.train.trainer import Rank, Trainer

FREEZE = 30
ARMS = {  # name -> (optimizer, compression)
    "LAMB": ("lamb", None),
    "1-bit LAMB, fused": ("onebit-lamb", "fused"),
    "1-bit LAMB, per tensor": ("onebit-lamb", "per_tensor"),
}
SHOWN = 6  # tensors in the table


def job(optimizer: str, compression: str | None, seed: int) -> TrainConfig:
    """The shortened main job (scripts/seed_study.py's settings)."""
    return TrainConfig(
        optimizer=optimizer,
        compression=compression,
        steps=150,
        freeze_step=FREEZE,
        batch_size=256,
        seq_len=32,
        vocab_size=4096,
        heads=2,
        architecture="bert",
        eval_every=150,
        eval_seqs=2048,
        checkpoint_every=150,
        seed=seed,
    ).resolved()


class _Traced(Trainer):
    """The job's trainer, keeping ``||Δp|| / ||p||`` of every tensor after every step."""

    def _parallelize(self) -> None:
        super()._parallelize()
        self.names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        self.relative: list[list[float]] = []
        before = [p.detach().clone() for p in self.params]

        def record(optimizer, args, kwargs) -> None:
            now = [p.detach() for p in self.params]
            pairs = zip(now, before, strict=True)
            self.relative.append(
                [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in pairs]
            )
            for kept, value in zip(before, now, strict=True):
                kept.copy_(value)

        self.optimizer.register_step_post_hook(record)


def _train(rank: int, world: int, config: dict, out: str):
    torch.set_num_threads(1)
    where = Rank(
        rank=rank, world=world, local_rank=rank, local_world=world, device=torch.device("cpu")
    )
    trainer = _Traced(TrainConfig.from_json(config), Path(out), where, kill_at_step=None)
    trainer.train()
    return (trainer.names, trainer.relative) if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--after", type=int, nargs="+", default=[5, 15, 30, 40])
    args = parser.parse_args()
    relative = {}
    with tempfile.TemporaryDirectory(prefix="onebit-relative-steps-") as tmp:
        for arm, (optimizer, compression) in ARMS.items():
            config = job(optimizer, compression, args.seed).to_json()
            out = str(Path(tmp) / optimizer / str(compression))
            names, relative[arm] = spawn_workers(_train, 4, (config, out), timeout_s=1800)[0]
    steps = [FREEZE + after for after in args.after]
    fused, alone = relative["1-bit LAMB, fused"], relative["1-bit LAMB, per tensor"]
    gap = [
        max(fused[s - 1][i] / max(alone[s - 1][i], 1e-30) for s in steps) for i in range(len(names))
    ]
    shown = sorted(range(len(names)), key=lambda i: -gap[i])[:SHOWN]
    print(
        f"||Δp|| / ||p|| of rank 0's tensors, seed {args.seed}, the variance frozen after "
        f"step {FREEZE}"
    )
    print("| tensor | arm | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|---|" + "---:|" * len(steps))
    for i in shown:
        for arm, values in relative.items():
            cells = " | ".join(f"{values[s - 1][i]:.3f}" for s in steps)
            print(f"| {names[i]} | {arm} | {cells} |")


if __name__ == "__main__":
    main()
