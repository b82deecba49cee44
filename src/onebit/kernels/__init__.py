"""Backends: the local work of the 1-bit exchange and of the optimizers' updates.

A :class:`Backend` is selected once (:func:`select`) and passed down as an object. It has
two parts, each declared by a protocol:

* ``compression`` (:class:`CompressionKernels`): the five stages of the two-phase exchange
  (worker compression and error update, server compression and error update, decoding), for
  one buffer, or (:class:`SegmentedCompressionKernels`, numba's) for all segments at once;
* ``updates`` (:class:`UpdateKernels`): the optimizers' updates over flat state, or ``None``
  where the backend has none, and the pure-torch reference in
  :mod:`onebit.optim.functional` runs instead.

Three backends:

* ``"torch"``: the pure-torch reference, any device and dtype; one torch op per pass; no
  update kernels of its own (the reference is the torch code).
* ``"numba"``: fused CPU kernels for float32/float64 (the ``numba`` package); one pass over
  memory per stage, and fused update kernels.
* ``"triton"``: fused CUDA kernels (the ``triton`` package that CUDA builds of torch ship)
  for the exchange and for every update, one launch per pass over all parameters.

For the same input every backend produces the same packed signs and error states as the
reference when given the same scales; a fused backend sums the squares behind a scale in
another order, so its scales agree with the reference's to float32 rounding. All ranks of
a group must use the same backend (the exchange checks it on every call, at no extra
message). ``ONEBIT_KERNELS`` (or the ``kernels=`` argument) picks one by name; ``auto`` (the
default) takes the fused backend for the device when it is installed and supports the
dtype, else the reference.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from onebit.coefficients import TrustBound
from onebit.compression import ExchangeResult
from onebit.kernels._reference import ReferenceKernels

__all__ = [
    "BACKENDS",
    "Backend",
    "CompressionKernels",
    "ReferenceKernels",
    "SegmentedCompressionKernels",
    "UpdateKernels",
    "available",
    "native_device",
    "select",
]

BACKENDS = ("torch", "numba", "triton")
"""Backend names; a backend's position (from 1) is the code ranks compare."""

_MODULES = {  # compression: module, class; updates: module, class
    "numba": (
        ("onebit.kernels._numba", "NumbaKernels"),
        ("onebit.kernels._numba_optim", "NumbaUpdates"),
    ),
    "triton": (
        ("onebit.kernels._triton", "TritonKernels"),
        ("onebit.kernels._triton_optim", "TritonUpdates"),
    ),
}
_AUTO_FOR_DEVICE = {"cpu": "numba", "cuda": "triton"}


class CompressionKernels(Protocol):
    """The five stages of the exchange's local work (:class:`ReferenceKernels` documents
    them); every call works on flat contiguous tensors of one dtype and device."""

    name: str

    def supports(self, tensor: Tensor) -> bool: ...

    def scratch(self, numel: int, n: int, dtype: torch.dtype, device: torch.device) -> Any: ...

    def worker_compress(
        self, buffer: Tensor, error: Tensor, packed: Tensor, x: Tensor, scratch: Any
    ) -> Tensor: ...

    def worker_error_update(
        self,
        buffer: Tensor,
        error: Tensor,
        packed: Tensor,
        x_scale: Tensor,
        x: Tensor,
        scratch: Any,
    ) -> None: ...

    def server_compress(
        self, received: Tensor, scales: Tensor, server_error: Tensor, packed: Tensor, scratch: Any
    ) -> Tensor: ...

    def server_error_update(
        self,
        received: Tensor,
        scales: Tensor,
        server_error: Tensor,
        packed: Tensor,
        y_scale: Tensor,
        scratch: Any,
        out: Tensor | None = None,
    ) -> None:
        """``out = y - y_scale sign(y)`` (default ``out``: ``server_error``, in place), ``y``
        formed from ``server_error`` as in :meth:`server_compress`; ``out`` may not overlap
        ``server_error`` otherwise."""

    def decode(self, gathered: Tensor, scales: Tensor, out: Tensor) -> None: ...


@runtime_checkable
class SegmentedCompressionKernels(CompressionKernels, Protocol):
    """Compression kernels that also run each stage once for all segments of a layout
    (:class:`~onebit.compression.Layout`; a segment per tensor, each compressed alone),
    giving what compressing each segment alone gives. Worker-side buffers are flat over the
    layout's ``width`` (segment after segment; ``segments`` the tensors themselves),
    server-side ones over this rank's chunks; scales are one per segment (``[n, K]`` where
    gathered)."""

    def worker_compress_segments(
        self, segments: Sequence[Tensor], error: Tensor, packed: Tensor, layout: Any
    ) -> Tensor: ...

    def worker_error_update_segments(
        self, segments: Sequence[Tensor], error: Tensor, packed: Tensor, scales: Tensor, layout: Any
    ) -> None: ...

    def server_compress_segments(
        self,
        received: Tensor,
        worker_scales: Tensor,
        server_error: Tensor,
        packed: Tensor,
        layout: Any,
    ) -> Tensor: ...

    def server_error_update_segments(
        self,
        received: Tensor,
        worker_scales: Tensor,
        server_error: Tensor,
        packed: Tensor,
        scales: Tensor,
        layout: Any,
        out: Tensor | None = None,
    ) -> None: ...

    def gather_columns(self, packed: Tensor, send: Tensor, layout: Any) -> None:
        """Chunk ``j`` of every segment's signs into row ``j`` of ``send``."""

    def decode_segments(self, gathered: Tensor, scales: Tensor, out: Tensor, layout: Any) -> None:
        """Every segment's first ``numels[t]`` values, one after another, into ``out``."""


class UpdateKernels(Protocol):
    """The optimizers' updates over a flat state (``flat``: a
    :class:`~onebit.optim._flat.FlatState`); the rules are those of
    :mod:`onebit.optim.functional`, whose reference implements the same methods. A backend
    may also fuse the delayed exchange's prediction (``predict_weights_``, with the
    reference's arguments); the optimizers run the reference where it does not."""

    def lamb_step_(
        self, flat: Any, grads: Sequence[Tensor | None], active: Sequence[bool], check_finite: bool
    ) -> tuple[Tensor, Tensor] | None: ...

    def adam_step_(
        self, flat: Any, grads: Sequence[Tensor | None], active: Sequence[bool], check_finite: bool
    ) -> bool: ...

    def scaled_momentum(
        self,
        flat: Any,
        grads: Sequence[Tensor],
        scaling: Tensor,
        out: Tensor,
        active: Sequence[bool],
        only: Sequence[int] | None = None,
    ) -> None: ...

    def adam_momentum_step_(
        self, flat: Any, grads: Sequence[Tensor], active: Sequence[bool]
    ) -> None: ...

    def onebit_lamb_compressed_step_(
        self,
        flat: Any,
        packed: ExchangeResult,
        scratch: Tensor,
        scaling: Tensor,
        limit: Tensor | None,
        active: Sequence[bool],
        lamb_coeff_freeze: Tensor,
        last_factor: Tensor,
        trust: TrustBound | None = None,
    ) -> tuple[Tensor, Tensor]: ...

    def onebit_adam_compressed_step_(
        self,
        flat: Any,
        packed: ExchangeResult,
        scratch: Tensor,
        scaling: Tensor,
        limit: Tensor | None,
        active: Sequence[bool],
    ) -> None: ...

    def onebit_adam_per_tensor_step_(
        self,
        flat: Any,
        packed: ExchangeResult,
        exchanged: Tensor,
        limit: Tensor | None,
        active: Sequence[bool],
    ) -> None: ...

    def accumulated_update(self, flat: Any, active: Sequence[bool], out: Tensor) -> Tensor: ...

    def synchronised_update_(
        self, flat: Any, exchanged: Tensor, active: Sequence[bool], lr_sum: Tensor
    ) -> None: ...


@dataclass(frozen=True)
class Backend:
    """A backend's two parts: ``compression`` (always) and ``updates`` (``None``: it has no
    update kernels and the optimizers run the torch reference); ``segmented`` is the
    compression part where it also compresses a layout's segments together
    (:class:`SegmentedCompressionKernels`), else ``None``."""

    name: str
    compression: CompressionKernels
    updates: UpdateKernels | None
    segmented: SegmentedCompressionKernels | None = None

    @property
    def code(self) -> int:
        """The number ranks exchange to check that they use the same backend."""
        return BACKENDS.index(self.name) + 1

    def supports(self, tensor: Tensor) -> bool:
        return self.compression.supports(tensor)


@functools.cache
def _load(name: str) -> Backend | None:
    """The backend called ``name``, or ``None`` if its package is not installed."""
    if name == "torch":
        return Backend(name, ReferenceKernels(), None)
    try:
        compression, updates = (
            getattr(importlib.import_module(module), class_name)()
            for module, class_name in _MODULES[name]
        )
    except ImportError:
        return None
    segmented = compression if isinstance(compression, SegmentedCompressionKernels) else None
    return Backend(name, compression, updates, segmented)


def native_device(name: str) -> str:
    """The device type a backend's kernels are built for (``"cuda"`` for triton; the torch
    reference and numba: ``"cpu"``)."""
    return next((device for device, fused in _AUTO_FOR_DEVICE.items() if fused == name), "cpu")


def available() -> list[str]:
    """Names of the backends whose packages are installed."""
    return [name for name in BACKENDS if _load(name) is not None]


def select(tensor: Tensor, name: str | None = None) -> Backend:
    """The backend for ``tensor``: ``name``, else ``$ONEBIT_KERNELS``, else ``"auto"``.

    A named backend that is not installed or cannot handle the tensor is an error.
    """
    if name in (None, "auto"):
        name = os.environ.get("ONEBIT_KERNELS") or "auto"
    if name == "auto":
        fused = _AUTO_FOR_DEVICE.get(tensor.device.type)
        backend = _load(fused) if fused else None
        if backend is not None and backend.supports(tensor):
            return backend
        return _load("torch")
    if name not in BACKENDS:
        raise ValueError(f"unknown kernels {name!r}: choose 'auto' or one of {BACKENDS}")
    backend = _load(name)
    if backend is None:
        raise ValueError(
            f"kernels {name!r} requested, but its package is not installed "
            f"(installed: {available()})"
        )
    if not backend.supports(tensor):
        raise ValueError(
            f"kernels {name!r} cannot handle {tensor.dtype} tensors on {tensor.device}; "
            "use 'auto' or 'torch'"
        )
    return backend
