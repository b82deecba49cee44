"""The parameters an optimizer updates, as one :class:`~onebit.optim._flat.FlatState` laid out at
the first step, and the backend its update passes run on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from onebit.kernels import BACKENDS, Backend, UpdateKernels, select
from onebit.optim import functional
from onebit.optim._flat import FlatState
from onebit.optim._sharding import ShardGroup, local_tensor

__all__ = ["FlatParameters", "check_kernels", "holding_weights", "views_of_flat_parameters"]


def check_kernels(kernels: str | None) -> None:
    if kernels not in (None, "auto", *BACKENDS):
        raise ValueError(f"Invalid kernels={kernels!r}: use None, 'auto' or one of {BACKENDS}")


def _read_only(name: str, doc: str) -> property:
    return property(lambda optimizer: getattr(optimizer._parameters, name), doc=doc)


def views_of_flat_parameters() -> tuple[property, ...]:
    """An optimizer's read-only properties ``kernels, flat_state, backend, updates, shards``,
    which read its :class:`FlatParameters` (``self._parameters``)."""
    return (
        _read_only("kernels", "The backend asked for (None, 'auto' or a name)."),
        _read_only(
            "flat",
            "The flat state the steps update (FlatState), read-only for tools and tests; "
            "None before the first step and after a checkpoint load.",
        ),
        _read_only("backend", "The backend the steps run on, selected at the first step."),
        _read_only("updates", "The update kernels: the backend's, or the torch reference."),
        _read_only("shards", "The FSDP2 shard group of the parameters, or None."),
    )


def trainable(param_groups: Iterable[Mapping[str, Any]]) -> list[Tensor]:
    """The parameters that take gradients, group by group."""
    return [p for group in param_groups for p in group["params"] if p.requires_grad]


@contextlib.contextmanager
def holding_weights(params: Sequence[Tensor], weights: Sequence[Tensor]) -> Iterator[None]:
    """Inside the block ``params`` hold ``weights``; after it, what they held before."""
    held = [p.detach().clone() for p in params]
    with torch.no_grad():
        torch._foreach_copy_([p.data for p in params], list(weights))
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in params], held)


class FlatParameters:
    """The trainable parameters of ``param_groups`` and their flat state.

    The state is laid out at the first step (:meth:`build`), from ``requires_grad`` then, and
    anew when a parameter joins (:meth:`lay_out_again`), with the per-parameter scalars
    ``scalars`` (name: initial value); the backend
    (:mod:`onebit.kernels`, chosen by ``kernels``) is selected with it. ``has_state[i]`` says
    whether parameter ``i`` has had a gradient (and so state). With FSDP2-sharded parameters
    :attr:`shards` is their shard group (``takes_fsdp_hsdp``: also FSDP's own HSDP on a 2-D
    mesh, for optimizers that use the averaged gradient).
    """

    def __init__(self, scalars: Mapping[str, float], kernels: str | None, takes_fsdp_hsdp: bool):
        check_kernels(kernels)
        self.kernels = kernels
        self._scalars = dict(scalars)
        self._takes_fsdp_hsdp = takes_fsdp_hsdp
        self.flat: FlatState | None = None
        self.has_state: list[bool] = []
        self.backend: Backend | None = None
        self.shards: ShardGroup | None = None
        self._laid_out: set[int] = set()  # ids of the parameters in the flat state

    def __getstate__(self) -> dict[str, Any]:
        """Without the flat state and the backend: a copy lays them out at its first step
        from the per-parameter state (the copy's parameters are not views of these buffers)."""
        return {**self.__dict__, "flat": None, "backend": None, "has_state": [], "_laid_out": set()}

    def check_can_add(self) -> None:
        """Refuse a new parameter group once the state is laid out."""
        if self.flat is not None:
            raise RuntimeError(
                "cannot add a parameter group after the first step: the flat state (and a 1-bit "
                "optimizer's momentum buffer and error-feedback state) is laid out then"
            )

    def regroup(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        """Take the optimizer's groups as they are now (a group was added)."""
        self.shards = ShardGroup.of(trainable(param_groups), self._takes_fsdp_hsdp)

    def members(
        self,
        param_groups: Sequence[Mapping[str, Any]],
        states: Mapping[Tensor, Mapping[str, Any]],
        laid_out: bool = True,
    ) -> list[tuple[Mapping[str, Any], Tensor]]:
        """``(group, parameter)`` of every parameter the flat state holds, in group order:
        those trainable now, those with state in ``states`` (one loaded from a checkpoint)
        and, with ``laid_out``, those the state holds already (frozen since)."""
        held = self._laid_out if laid_out else set()
        return [
            (group, p)
            for group in param_groups
            for p in group["params"]
            if p.requires_grad or id(p) in held or "exp_avg" in states.get(p, ())
        ]

    def build(
        self, param_groups: Sequence[Mapping[str, Any]], states: Mapping[Tensor, dict]
    ) -> FlatState:
        """The flat state (laid out on the first call over :meth:`members`, adopting whatever
        per-parameter state ``states`` already holds, e.g. loaded from a checkpoint)."""
        if self.flat is None:
            pairs = self.members(param_groups, states)
            flat = FlatState(pairs, self._scalars, self.shards)
            self.has_state = flat.adopt([states[p] for _, p in pairs])
            self.backend = select(flat.exp_avg, self.kernels)
            self.flat = flat
            self._laid_out = {id(p) for _, p in pairs}
        return self.flat

    def joining(self, param_groups: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, Tensor]]:
        """``(group index, index in the group, parameter)`` of every trainable parameter the
        laid-out state does not hold (frozen when it was laid out, unfrozen since)."""
        if self.flat is None:
            return []
        return [
            (group_index, index, param)
            for group_index, group in enumerate(param_groups)
            for index, param in enumerate(group["params"])
            if param.requires_grad and id(param) not in self._laid_out
        ]

    def lay_out_again(
        self, param_groups: Sequence[Mapping[str, Any]], states: Mapping[Tensor, dict]
    ) -> list[int | None]:
        """Lay the flat state out anew over :meth:`members` (some parameters joined), every
        parameter's state, weights and scalars copied over from their views in ``states``.
        Returns, for each parameter of the new layout, its index in the old one (``None``:
        it joined)."""
        old = {id(param): index for index, param in enumerate(self.flat.params)}
        self.regroup(param_groups)
        self.flat = None
        return [old.get(id(param)) for param in self.build(param_groups, states).params]

    @staticmethod
    def refuse_joining(joining: Sequence[tuple[int, int, Tensor]], why: str) -> None:
        """Raise naming the parameters that would join, and ``why`` they cannot."""
        named = ", ".join(
            f"parameter {index} of group {group_index} (shape {tuple(param.shape)})"
            for group_index, index, param in joining
        )
        raise RuntimeError(
            f"{named} became trainable (requires_grad=True) after the optimizer laid its "
            f"state out without it: {why}"
        )

    def forget(self) -> None:
        """Lay the state out anew at the next step (after a checkpoint load)."""
        self.flat = None
        self._laid_out = set()

    @property
    def updates(self) -> UpdateKernels:
        """The update kernels: the backend's, or the torch reference where it has none or
        the parameters are sharded (the fused kernels update a flat weights buffer)."""
        if self.shards is not None or self.backend is None or self.backend.updates is None:
            return functional.REFERENCE
        return self.backend.updates

    def expose_new(self, states: Mapping[Tensor, dict], present: Sequence[bool]) -> None:
        """Give the parameters that got their first gradient their state views."""
        for index, has_grad in enumerate(present):
            if has_grad and not self.has_state[index]:
                self.flat.expose(states[self.flat.params[index]], index)
                self.has_state[index] = True

    def expose_all(self, states: Mapping[Tensor, dict]) -> None:
        """Point every parameter with state at the flat buffers again (one was added)."""
        for index, has_state in enumerate(self.has_state):
            if has_state:
                self.flat.expose(states[self.flat.params[index]], index)

    def local_numels(
        self,
        param_groups: Sequence[Mapping[str, Any]],
        states: Mapping[Tensor, Mapping[str, Any]],
        laid_out: bool = True,
    ) -> list[int]:
        """Elements of each of :meth:`members` on this rank (its slice when sharded)."""
        return [local_tensor(p).numel() for _, p in self.members(param_groups, states, laid_out)]

    def memory_bytes(self) -> dict[str, int]:
        """``"state"`` (moments, fp32 masters, per-tensor scalars) and ``"scratch"`` (buffers
        every step reuses); both 0 before the first step."""
        if self.flat is None:
            return {"state": 0, "scratch": 0}
        state, scratch = self.flat.nbytes()
        return {"state": state, "scratch": scratch}
