"""The base of every onebit optimizer: flat state built at the first step, one backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from onebit.kernels import BACKENDS, Backend, UpdateKernels, select
from onebit.optim import _common, functional
from onebit.optim._flat import FlatState
from onebit.optim._sharding import ShardGroup, local_tensor


class FlatOptimizer(Optimizer):
    """An optimizer whose state is a :class:`FlatState` built at the first step.

    ``self.state[p]`` holds views of the flat buffers for every parameter that has had a
    gradient; ``_SCALARS`` names the per-parameter scalar state and its initial value. After
    ``load_state_dict`` the flat state is rebuilt from the loaded per-parameter state. The
    backend (:mod:`onebit.kernels`) is selected with the flat state, once; its update part,
    or the torch reference where it has none, is :attr:`updates`.
    """

    _SCALARS: dict[str, float] = {}
    #: Whether parameters FSDP2 shards on a 2-D mesh (its own HSDP, which all-reduces every
    #: gradient across replicas) are taken: by optimizers that use the averaged gradient.
    _TAKES_FSDP_HSDP = False

    def __init__(self, params, defaults: dict[str, Any], kernels: str | None) -> None:
        if kernels not in (None, "auto", *BACKENDS):
            raise ValueError(f"Invalid kernels={kernels!r}: use None, 'auto' or one of {BACKENDS}")
        self.kernels = kernels
        self._flat: FlatState | None = None
        self._has_state: list[bool] = []
        self._backend: Backend | None = None
        super().__init__(params, defaults)
        #: The FSDP2 shard group of the parameters, or ``None`` when they are not sharded.
        self.shards = self._shard_group()

    def _shard_group(self) -> ShardGroup | None:
        return ShardGroup.of(_common.trainable_params(self), self._TAKES_FSDP_HSDP)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_flat", None) is not None:
            raise RuntimeError(
                "cannot add a parameter group after the first step: the flat state (and a 1-bit "
                "optimizer's fused momentum buffer and error-feedback state) is laid out then"
            )
        super().add_param_group(param_group)
        if hasattr(self, "shards"):  # a group added after construction
            self.shards = self._shard_group()

    def check_checkpoint(self, state_dict: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the first thing in ``state_dict`` that does not fit
        this optimizer (its parameter groups, the shapes of its state); nothing changes."""
        _common.validate_checkpoint(self, state_dict)

    @staticmethod
    def _evaluate(closure) -> Any:
        """The loss from ``closure`` (with gradients enabled), or ``None``."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _flat_state(self) -> FlatState:
        """The flat state of the trainable parameters, with whatever per-parameter state
        they already have (e.g. loaded from a checkpoint)."""
        if self._flat is None:
            pairs = [
                (group, param)
                for group in self.param_groups
                for param in group["params"]
                if param.requires_grad
            ]
            self._flat = FlatState(pairs, self._SCALARS, self.shards)
            self._has_state = self._flat.adopt([self.state[p] for _, p in pairs])
            self._backend = select(self._flat.exp_avg, self.kernels)
        return self._flat

    @property
    def backend(self) -> Backend | None:
        """The backend the steps run on (:mod:`onebit.kernels`), selected at the first step."""
        return self._backend

    @property
    def updates(self) -> UpdateKernels:
        """The update kernels: the backend's, or the torch reference where it has none or
        the parameters are sharded (the fused kernels update a flat weights buffer)."""
        if self.shards is not None:
            return functional.REFERENCE
        return self._backend.updates or functional.REFERENCE

    def _local_numels(self) -> list[int]:
        """Elements of each trainable parameter on this rank (its slice when sharded)."""
        return [local_tensor(p).numel() for p in _common.trainable_params(self)]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the optimizer holds now: ``"state"`` (moments, fp32 master weights of
        low-precision parameters, per-tensor scalars) and ``"scratch"`` (buffers every step
        reuses, such as the gathered gradients); both 0 before the first step."""
        if self._flat is None:
            return {"state": 0, "scratch": 0}
        state, scratch = self._flat.nbytes()
        return {"state": state, "scratch": scratch}

    def _expose_new_state(self, flat: FlatState, present: Sequence[bool]) -> None:
        """Give the parameters that got their first gradient their state views."""
        for index, has_grad in enumerate(present):
            if has_grad and not self._has_state[index]:
                flat.expose(self.state[flat.params[index]], index)
                self._has_state[index] = True

    def _forget_flat_state(self) -> None:
        """After a checkpoint load: rebuild the flat state from ``self.state`` next step."""
        self._flat = None
