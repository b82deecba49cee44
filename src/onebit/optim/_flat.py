"""Flat optimizer state: each quantity of every parameter in one buffer, with per-parameter views.

A :class:`FlatState` lays the parameters out one after another, group by group (a
*segment* per parameter), and keeps ``exp_avg``, ``exp_avg_sq`` (and, where the optimizer has
them, ``exp_avg_sq_fresh`` and 0/1 Adam's synchronised weights ``synced_param``) as flat
buffers. The weights the update is applied to live in a flat buffer too: a
parameter whose dtype is the state dtype is re-pointed at its view of that buffer
(``param.data = view``, as ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)``
does), and a half-precision parameter gets an fp32 master copy there and is refreshed from it
after each step. The optimizer's per-parameter ``state`` holds views of these buffers, so
``state_dict()`` stays per parameter while the maths runs in a few whole-buffer passes.

Parameters sharded by FSDP2 (DTensors, :mod:`onebit.optim._sharding`) are laid out by their
local slices: the state holds only this rank's slices, the update writes into FSDP's storage
of them in place (:meth:`FlatState.weight_views`; there is no flat weights buffer), and the
whole-tensor quantities (:meth:`FlatState.norms`, :meth:`FlatState.segment_max`,
:meth:`FlatState.all_finite`) are reduced over the shard group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from onebit.optim._common import all_finite, state_dtype
from onebit.optim._sharding import ShardGroup, local_tensor

FLAT_BUFFERS = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "synced_param")


class FlatState:
    """Flat moments and weights of ``params`` (``(group, param)`` pairs, in group order);
    with ``shards``, of their local slices."""

    def __init__(
        self,
        params: Sequence[tuple[dict[str, Any], Tensor]],
        scalar_defaults: dict[str, float] | None = None,
        shards: ShardGroup | None = None,
    ) -> None:
        if not params:
            raise ValueError("no trainable parameters")
        if any(p.is_sparse for _, p in params):
            raise RuntimeError("onebit optimizers do not support sparse parameters")
        devices = {p.device for _, p in params}
        if len(devices) > 1:
            raise ValueError(
                f"all parameters must be on one device, got {sorted(map(str, devices))}"
            )
        dtypes = {state_dtype(p) for _, p in params}
        if len(dtypes) > 1:
            raise ValueError(
                "float64 parameters cannot be mixed with parameters of other dtypes in one "
                "onebit optimizer (their state would be float32); use one dtype or two optimizers"
            )
        self.groups = [group for group, _ in params]
        self.params = [param for _, param in params]
        #: What the state mirrors: the parameters, or their local slices when sharded.
        self.tensors = [local_tensor(param) for param in self.params]
        self.shards = shards
        self.dtype, self.device = dtypes.pop(), devices.pop()
        if shards is not None and any(p.dtype != self.dtype for p in self.params):
            raise ValueError(
                "FSDP-sharded parameters must be float32 or float64 (keep FSDP's sharded "
                "parameters in full precision; MixedPrecisionPolicy(param_dtype=...) casts "
                "only the unsharded ones)"
            )
        sizes = [t.numel() for t in self.tensors]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.numel = int(self.offsets[-1])
        self.counts = torch.tensor(sizes, dtype=torch.int64, device=self.device)
        zeros = dict(dtype=self.dtype, device=self.device)
        self.exp_avg = torch.zeros(self.numel, **zeros)
        self.exp_avg_sq = torch.zeros(self.numel, **zeros)
        self.exp_avg_sq_fresh: Tensor | None = None
        self.synced_param: Tensor | None = None
        # Gradients, then one flag per parameter (did this rank have a gradient for it).
        self.grad_and_flags = torch.zeros(self.numel + len(self.params), **zeros)
        self.grad = self.grad_and_flags[: self.numel]
        self.grad_flags = self.grad_and_flags[self.numel :]
        # Per-parameter scalars (trust ratios, factors...), one device vector each.
        self.scalars = {
            name: torch.full((len(self.params),), value, **zeros)
            for name, value in (scalar_defaults or {}).items()
        }
        self.half_params: list[tuple[Tensor, Tensor]] = []  # (param, its fp32 master view)
        self.weights: Tensor | None = None  # None when sharded: FSDP's storage is updated
        if shards is None:
            self.weights = torch.empty(self.numel, **zeros)
            for param, view in zip(self.params, self.views(self.weights), strict=True):
                view.copy_(param.detach())
                if param.dtype == self.dtype:
                    param.data = view
                else:
                    self.half_params.append((param, view))
        self._scratch: dict[int, Tensor] = {}

    # ----------------------------------------------------------------- views
    def views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's view of a flat buffer of ``numel`` (or more) elements."""
        return [
            flat[int(start) : int(start) + t.numel()].view_as(t)
            for start, t in zip(self.offsets, self.tensors, strict=False)
        ]

    def weight_views(self) -> list[Tensor]:
        """The weights the update is applied to: views of :attr:`weights`, or the local
        slices in FSDP's storage when sharded."""
        return self.tensors if self.weights is None else self.views(self.weights)

    @contextlib.contextmanager
    def weights_in(self, buffer: Tensor) -> Iterator[None]:
        """Inside the block :attr:`weights` is ``buffer`` (of its size and dtype), so that
        the update reads and writes there; the parameters keep what they hold. Used by the
        delayed exchange, whose update lands on the shared weights kept aside while the
        parameters hold this rank's prediction."""
        held = self.weights
        if held is None or buffer.shape != held.shape or buffer.dtype != held.dtype:
            raise ValueError("weights_in() takes a buffer of the flat weights' size and dtype")
        self.weights = buffer
        try:
            yield
        finally:
            self.weights = held

    def copy_weights_into(self, flat: Tensor) -> None:
        """Copy every parameter's weights into its view of ``flat``."""
        torch._foreach_copy_(self.views(flat), self.weight_views())

    # ----------------------------------------------------------------- whole tensors
    def norms(self, tensors: Sequence[Tensor], ord: int = 2) -> Tensor:
        """Each tensor's norm as one device vector (one call, no host sync); when sharded,
        of the whole tensors whose local slices ``tensors`` are."""
        if not tensors:
            return self.exp_avg.new_zeros(0)
        local = torch.stack(torch._foreach_norm(list(tensors), ord=ord))
        return local if self.shards is None else self.shards.norms(local, ord)

    def segment_max(self, flat: Tensor) -> Tensor:
        """Each parameter's maximum of ``flat`` (of ``numel`` elements; an empty slice counts
        as ``-inf``), over the whole tensor when sharded."""
        local = torch.segment_reduce(flat, "max", lengths=self.counts)
        if self.shards is None:
            return local
        return self.shards.max_(torch.where(self.counts > 0, local, -torch.inf))

    def all_finite(self, tensors: Sequence[Tensor]) -> bool:
        """Whether every element of ``tensors`` is finite, on every rank of the shard group."""
        finite = all_finite(tensors)
        return finite if self.shards is None else not self.shards.any_(not finite, self.device)

    def scratch(self, slot: int) -> Tensor:
        """A reused flat scratch buffer (contents undefined), allocated on first use."""
        if slot not in self._scratch:
            self._scratch[slot] = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self._scratch[slot]

    def enable_fresh_variance(self) -> Tensor:
        """``exp_avg_sq_fresh``, created as a copy of ``exp_avg_sq`` where there is none yet
        (1-bit LAMB's switch)."""
        if self.exp_avg_sq_fresh is None:
            self.exp_avg_sq_fresh = self.exp_avg_sq.clone()
        return self.exp_avg_sq_fresh

    def enable_synced_param(self) -> Tensor:
        """``synced_param``, created as a copy of the weights where there is none yet (0/1
        Adam's freeze)."""
        if self.synced_param is None:
            self.synced_param = torch.empty_like(self.exp_avg)
            self.copy_weights_into(self.synced_param)
        return self.synced_param

    def nbytes(self) -> tuple[int, int]:
        """Bytes of optimizer state (moments, masters, scalars) and of reused scratch
        (gradients, scratch buffers)."""
        size = self.exp_avg.element_size()
        state = 2 + (self.exp_avg_sq_fresh is not None) + (self.synced_param is not None)
        masters = sum(p.numel() for p, _ in self.half_params)
        scalars = sum(v.numel() for v in self.scalars.values())
        scratch = self.grad_and_flags.numel() + sum(t.numel() for t in self._scratch.values())
        return size * (state * self.numel + masters + scalars), size * scratch

    # ----------------------------------------------------------------- optimizer state
    def view(self, flat: Tensor, index: int) -> Tensor:
        """Parameter ``index``'s view of a flat buffer."""
        start, tensor = int(self.offsets[index]), self.tensors[index]
        return flat[start : start + tensor.numel()].view_as(tensor)

    def expose(self, state: dict[str, Any], index: int) -> None:
        """Point a parameter's optimizer state at its views of the flat buffers."""
        for name in FLAT_BUFFERS:
            flat = getattr(self, name)
            if flat is not None:
                state[name] = self.view(flat, index)
        if self.params[index].dtype != self.dtype:
            state["master_param"] = self.view(self.weights, index)
        for name, values in self.scalars.items():
            state[name] = values[index]

    def adopt(self, states: Sequence[dict[str, Any]]) -> list[bool]:
        """Take over per-parameter states (e.g. just loaded from a checkpoint): copy their
        tensors and scalars into the flat buffers and re-point them at their views.
        Returns, per parameter, whether it has state."""
        has_state = []
        for index, state in enumerate(states):
            has_state.append("exp_avg" in state)
            if not has_state[-1]:
                continue
            if "exp_avg_sq_fresh" in state:
                self.enable_fresh_variance()
            if "synced_param" in state:
                self.enable_synced_param()
            for name in (*FLAT_BUFFERS, "master_param"):
                if name in state:
                    target = self.weights if name == "master_param" else getattr(self, name)
                    self.view(target, index).copy_(state[name])
            for name, values in self.scalars.items():
                if name in state:
                    values[index] = float(state[name])
            self.expose(state, index)
        return has_state

    # ----------------------------------------------------------------- per step
    def load_grads(self, grads: Sequence[Tensor | None]) -> None:
        """Copy each parameter's gradient into :attr:`grad` (zeros where ``None``) and set
        :attr:`grad_flags` (1 where a gradient was given)."""
        views = self.views(self.grad)
        present = [(view, g) for view, g in zip(views, grads, strict=True) if g is not None]
        missing = [view for view, g in zip(views, grads, strict=True) if g is None]
        if present:
            destinations, sources = zip(*present, strict=True)
            torch._foreach_copy_(list(destinations), list(sources))
        if missing:
            torch._foreach_zero_(missing)
        flags = [1.0 if g is not None else 0.0 for g in grads]
        self.grad_flags.copy_(torch.tensor(flags, dtype=self.dtype))

    def reciprocal(self, value: float) -> float:
        """``1 / value`` rounded to the state dtype (what the update multiplies by)."""
        real = np.float64 if self.dtype == torch.float64 else np.float32
        return float(real(1) / real(value))

    def segment_values(self, value_of) -> Tensor:
        """``value_of(group)`` for each parameter's group, as a device vector."""
        values = [float(value_of(group)) for group in self.groups]
        return torch.tensor(values, dtype=self.dtype, device=self.device)

    def refresh_half_params(self) -> None:
        """Copy the fp32 masters into their half-precision parameters."""
        if self.half_params:
            params, masters = zip(*self.half_params, strict=True)
            torch._foreach_copy_([p.data for p in params], list(masters))
