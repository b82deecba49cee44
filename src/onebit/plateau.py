"""A task whose loss sits on a plateau before it falls: pointing at a position.

Each input is a pointer token naming a position k in 0..L-1 followed by L random values in
0..V-1; the target is the value at position k. A one-layer transformer can only solve it once
its attention has learnt to match the pointer with the position embeddings, and until then
its loss stays at chance (ln V): Adam with lr 1e-3 holds it there for about 200 of 500 steps
at L = 24, V = 8, then falls to near 0. A variance frozen before that growth of the attention's
gradients, or while it is under way, stalls training at chance for good (ALGORITHM.md,
"Variance readiness"), which makes the task the test of ``freeze_step="auto"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class PointerTask:
    """The task's sizes: ``positions`` (L), ``values`` (V), the model's ``width``."""

    positions: int = 24
    values: int = 8
    width: int = 32
    heads: int = 2

    def model(self) -> nn.Module:
        """A one-layer transformer encoder reading the pointer's position."""
        return _PointerModel(self)

    def batch(self, step: int, size: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """Batch ``step`` (the same for every caller with the same arguments): inputs
        ``[size, L + 1]`` and targets ``[size]``."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        values = torch.randint(0, self.values, (size, self.positions), generator=generator)
        pointed = torch.randint(0, self.positions, (size,), generator=generator)
        inputs = torch.cat([(self.values + pointed)[:, None], values], dim=1)
        return inputs, values[torch.arange(size), pointed]


class _PointerModel(nn.Module):
    def __init__(self, task: PointerTask) -> None:
        super().__init__()
        self.tokens = nn.Embedding(task.values + task.positions, task.width)
        self.position = nn.Embedding(task.positions + 1, task.width)
        self.layer = nn.TransformerEncoderLayer(
            task.width, task.heads, 2 * task.width, dropout=0.0, batch_first=True
        )
        self.out = nn.Linear(task.width, task.values)

    def forward(self, inputs: Tensor) -> Tensor:
        hidden = self.tokens(inputs) + self.position.weight[: inputs.shape[1]]
        return self.out(self.layer(hidden)[:, 0])


def train(
    task: PointerTask,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    steps: int = 500,
    batch_size: int = 64,
    seed: int = 0,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """Train on ``task`` for ``steps``, each rank of ``group`` (if initialised) on its slice
    of every global batch, the same initial weights everywhere; return the loss of every
    step, averaged over the ranks. A dense optimizer's gradients are averaged here; onebit's
    optimizers average (or exchange) their own."""
    torch.manual_seed(seed)
    model = task.model()
    optimizer = make_optimizer(model.parameters())
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    averages_itself = hasattr(optimizer, "needs_averaged_gradients")
    share = batch_size // world
    losses = []
    for step in range(1, steps + 1):
        inputs, targets = task.batch(step, batch_size, seed)
        inputs, targets = (x[rank * share : (rank + 1) * share] for x in (inputs, targets))
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        if world > 1 and not averages_itself:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(world)
        optimizer.step()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean, group=group)
            mean /= world
        losses.append(float(mean))
    return losses
