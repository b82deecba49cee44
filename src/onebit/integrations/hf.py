"""onebit with Hugging Face ``accelerate`` and ``transformers.Trainer`` (``onebit[hf]``).

Accelerate: prepare as usual, then register onebit's hook on what ``prepare`` returned::

    model, optimizer, loader = accelerator.prepare(model, onebit.OneBitLamb(...), loader)
    onebit.integrations.hf.register_comm_hook(model, optimizer)

Trainer: pass the onebit optimizer and add :class:`OneBitCallback`, which registers the hook
on the model the Trainer wraps, when training begins::

    optimizer = onebit.OneBitLamb(model.parameters(), lr=2e-3, freeze_step=1000)
    trainer = Trainer(model, args, train_dataset=data, optimizers=(optimizer, None))
    trainer.add_callback(onebit.integrations.hf.OneBitCallback(trainer))
    trainer.train()

Gradient clipping (the Trainer's ``max_grad_norm``, ``accelerator.clip_grad_norm_``) clips
each rank's local gradients at ``max_grad_norm`` in the compression stage, as DeepSpeed's
engine did; with many ranks of small batches that shrinks the update. To clip them at
``max_grad_norm·√W`` instead, give the optimizer ``max_grad_norm`` and the Trainer
``max_grad_norm=0``: ``step()`` then clips what its update uses.

With ``delayed_exchange=True`` the callback applies the last update when training ends
(``finish_exchange()``); the Trainer's evaluations during training see each rank's predicted
weights (ALGORITHM.md, "Delayed exchange").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback

from onebit import ddp
from onebit.collectives import world_size
from onebit.optim import OneBitOptimizer

__all__ = ["OneBitCallback", "register_comm_hook"]


def register_comm_hook(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Register :func:`onebit.ddp.onebit_hook` on ``model`` following ``optimizer``.

    Takes what ``accelerator.prepare`` returns: ``model`` is a ``DistributedDataParallel``
    module when there are several processes (in one process, where nothing is exchanged, this
    does nothing), and ``optimizer`` a onebit optimizer, or accelerate's
    ``AcceleratedOptimizer`` around one. Call once, before the first backward pass.

    Raises:
        TypeError: if the optimizer is not a onebit optimizer, or several processes train a
            model that is not plain ``DistributedDataParallel`` (FSDP, DeepSpeed...).
    """
    inner = _unwrapped(optimizer)
    if not isinstance(inner, OneBitOptimizer):
        raise TypeError(
            f"the optimizer is a {type(inner).__name__}; onebit's hook needs the OneBitLamb or "
            "OneBitAdam that steps this model (e.g. Trainer(..., optimizers="
            "(onebit.OneBitLamb(model.parameters(), ...), None)))"
        )
    if isinstance(model, DistributedDataParallel):
        ddp.register_comm_hook(model, inner)
    elif world_size(inner.process_group) > 1:
        raise TypeError(
            f"{world_size(inner.process_group)} processes train a {type(model).__name__}; "
            "onebit's 1-bit exchange runs under plain data parallelism "
            "(DistributedDataParallel), not FSDP or DeepSpeed"
        )


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


class OneBitCallback(TrainerCallback):
    """Registers onebit's hook on the model ``trainer`` trains, when training begins, and
    applies a delayed exchange's last update when it ends.

    The Trainer wraps its model in ``DistributedDataParallel`` inside ``train()``, after
    callbacks are added and before ``on_train_begin``; this callback then calls
    :func:`register_comm_hook` on ``trainer.model_wrapped`` and ``trainer.optimizer``, once
    per wrapped model (``train()`` may run again on the same one). At ``on_train_end`` it
    calls the optimizer's ``finish_exchange()``, so that the weights the Trainer saves are
    final and the same on every rank.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._registered_on: torch.nn.Module | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.trainer.model_wrapped
        if model is not self._registered_on:
            register_comm_hook(model, self.trainer.optimizer)
            self._registered_on = model

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = _unwrapped(self.trainer.optimizer)
        if isinstance(optimizer, OneBitOptimizer):
            optimizer.finish_exchange()
