"""onebit with PyTorch Lightning (``onebit[lightning]``).

Return one onebit optimizer from ``configure_optimizers`` and train with
:class:`OneBitDDPStrategy`::

    class Model(lightning.LightningModule):
        def configure_optimizers(self):
            return onebit.OneBitLamb(self.parameters(), lr=2e-3, freeze_step=1000)

    trainer = lightning.Trainer(strategy=OneBitDDPStrategy(), devices=8, ...)

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` cannot do this: it registers hooks only
on CUDA (silently dropping them on CPU), and before ``configure_optimizers`` has created the
optimizer the hook must follow. Gradient clipping (``gradient_clip_val``) clips each rank's
local gradients in the compression stage, as DeepSpeed's engine did; the optimizer's
``max_grad_norm`` (without ``gradient_clip_val``) clips them at ``max_grad_norm·√W`` instead.
With ``delayed_exchange=True`` the strategy validates the weights every rank shares (not each
rank's prediction) and applies the last update when training ends (ALGORITHM.md, "Delayed
exchange").
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from onebit import ddp
from onebit.optim import OneBitOptimizer

__all__ = ["OneBitDDPStrategy"]

_HOOK_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class OneBitDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose ``DistributedDataParallel`` model carries onebit's hook.

    When fitting, after the model is wrapped and ``configure_optimizers`` has run, the hook
    is registered following the optimizer, which must be exactly one
    :class:`onebit.OneBitLamb`, :class:`onebit.OneBitAdam` or :class:`onebit.ZeroOneAdam` (one
    stage for the whole model).
    Validation runs on the optimizer's shared weights (``holding_shared_weights()``), and
    the end of training calls its ``finish_exchange()`` (both matter with
    ``delayed_exchange=True`` only).
    Takes every ``DDPStrategy`` argument except the communication-hook ones, which onebit
    sets.

    Raises:
        TypeError: for a communication-hook argument, or (at ``fit``) when
            ``configure_optimizers`` returns anything but one onebit optimizer.
    """

    def __init__(self, **kwargs: Any) -> None:
        taken = sorted(set(kwargs) & set(_HOOK_ARGUMENTS))
        if taken:
            raise TypeError(f"OneBitDDPStrategy sets the communication hook itself; drop {taken}")
        super().__init__(**kwargs)
        self._validating = contextlib.ExitStack()

    def _onebit_optimizer(self) -> OneBitOptimizer | None:
        """The one onebit optimizer ``configure_optimizers`` returned (``None``: it returned
        something else)."""
        optimizers = self.optimizers
        single = len(optimizers) == 1 and isinstance(optimizers[0], OneBitOptimizer)
        return optimizers[0] if single else None

    def on_validation_start(self) -> None:
        super().on_validation_start()
        optimizer = self._onebit_optimizer()
        if optimizer is not None:
            self._validating.enter_context(optimizer.holding_shared_weights())

    def on_validation_end(self) -> None:
        self._validating.close()
        super().on_validation_end()

    def on_train_end(self) -> None:
        optimizer = self._onebit_optimizer()
        if optimizer is not None:
            optimizer.finish_exchange()
        super().on_train_end()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return  # only fitting wraps the model in DDP
        optimizer = self._onebit_optimizer()
        if optimizer is None:
            names = [type(optimizer).__name__ for optimizer in self.optimizers]
            raise TypeError(
                f"configure_optimizers returned {names}; OneBitDDPStrategy needs exactly one "
                "OneBitLamb, OneBitAdam or ZeroOneAdam for all the model's parameters"
            )
        ddp.register_comm_hook(self.model, optimizer)
