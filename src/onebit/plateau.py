"""Tasks whose loss sits on a plateau before it falls, and a data-parallel loop to train them.

:class:`PointerTask`: each input is a pointer token naming a position k in 0..L-1 followed by
L random values in 0..V-1; the target is the value at position k. A one-layer transformer can
only solve it once its attention has learnt to match the pointer with the position
embeddings, and until then its loss stays at chance (ln V): Adam with lr 1e-3 holds it there
for about 200 of 500 steps at L = 24, V = 8, then falls to near 0. A variance frozen before
that growth of the attention's gradients, or while it is under way, stalls training at chance
(ALGORITHM.md, "Variance readiness", "The guard after the freeze").

:class:`DeepNarrowTask`: a deep, narrow tanh network with small initial weights learns the
argmax of a random teacher network; its signal takes tens of steps to reach through the
layers, and its gradients keep changing in size after that.
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


@dataclass(frozen=True)
class DeepNarrowTask:
    """The task's sizes: ``depth`` layers of ``width`` units, ``inputs`` features, ``classes``
    outputs; ``gain`` scales PyTorch's initial weights (biases start at 0)."""

    depth: int = 10
    width: int = 12
    inputs: int = 16
    classes: int = 8
    gain: float = 0.3

    def model(self) -> nn.Module:
        """The student: ``depth`` linear layers with tanh between them."""
        sizes = [self.inputs] + [self.width] * (self.depth - 1) + [self.classes]
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
            layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
        model = nn.Sequential(*layers[:-1])
        with torch.no_grad():
            for layer in model:
                if isinstance(layer, nn.Linear):
                    layer.weight.mul_(self.gain)
                    layer.bias.zero_()
        return model

    def batch(self, step: int, size: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """Batch ``step``: Gaussian inputs ``[size, inputs]`` and the teacher's class of each
        (the teacher is fixed: one tanh layer of 32 units with weights drawn from seed 1234)."""
        teacher = torch.Generator().manual_seed(1234)
        hidden = torch.randn(self.inputs, 32, generator=teacher) / self.inputs**0.5
        readout = torch.randn(32, self.classes, generator=teacher) / 32**0.5
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        inputs = torch.randn(size, self.inputs, generator=generator)
        return inputs, (torch.tanh(inputs @ hidden) @ readout).argmax(dim=-1)


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


def warm_up_learning_rate(
    optimizer: torch.optim.Optimizer, peaks: list[float], step: int, warmup_steps: int
) -> None:
    """Each group's rate at ``step``: its peak times ``min(1, step / warmup_steps)``."""
    for param_group, peak in zip(optimizer.param_groups, peaks, strict=True):
        param_group["lr"] = peak * min(1.0, step / warmup_steps)


def train(
    task: PointerTask | DeepNarrowTask,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    steps: int = 500,
    batch_size: int = 64,
    seed: int = 0,
    group: dist.ProcessGroup | None = None,
    lr_warmup_steps: int = 0,
) -> list[float]:
    """Train on ``task`` for ``steps``, each rank of ``group`` (if initialised) on its slice
    of every global batch, the same initial weights everywhere; return the loss of every
    step, averaged over the ranks. A dense optimizer's gradients are averaged here; onebit's
    optimizers average (or exchange) their own. With ``lr_warmup_steps``, each group's rate
    rises linearly to its own over that many steps."""
    torch.manual_seed(seed)
    model = task.model()
    optimizer = make_optimizer(model.parameters())
    peaks = [param_group["lr"] for param_group in optimizer.param_groups]
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    averages_itself = hasattr(optimizer, "needs_averaged_gradients")
    share = batch_size // world
    losses = []
    for step in range(1, steps + 1):
        if lr_warmup_steps:
            warm_up_learning_rate(optimizer, peaks, step, lr_warmup_steps)
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
