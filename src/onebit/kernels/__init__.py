"""Backends for the local work of the compressed allreduce.

Three implementations of the same five stages (see :class:`ReferenceKernels`):

* ``"torch"``: the pure-torch reference, any device and dtype; one torch op per pass.
* ``"numba"``: fused CPU kernels for float32/float64 (the ``numba`` package); one pass
  over memory per stage.
* ``"triton"``: fused CUDA kernels (the ``triton`` package that CUDA builds of torch ship).

For the same input every backend produces the same packed signs and error states as the
reference when given the same scales; a fused backend sums the squares behind a scale in
another order, so its scales agree with the reference's to float32 rounding. All ranks of
a group must use the same backend (:func:`onebit.compressed_allreduce` checks it on every
call, at no extra message). ``ONEBIT_KERNELS`` (or the ``kernels=`` argument) picks one by
name; ``auto`` (the default) takes the fused backend for the device when it is installed
and supports the dtype, else the reference.
"""

from __future__ import annotations

import functools
import importlib
import os

from torch import Tensor

from onebit.kernels._reference import ReferenceKernels

__all__ = ["BACKENDS", "ReferenceKernels", "available", "select"]

BACKENDS = ("torch", "numba", "triton")
"""Backend names; a backend's position (from 1) is the code ranks compare."""

_MODULES = {
    "numba": ("onebit.kernels._numba", "NumbaKernels"),
    "triton": ("onebit.kernels._triton", "TritonKernels"),
}
_AUTO_FOR_DEVICE = {"cpu": "numba", "cuda": "triton"}


@functools.cache
def _load(name: str) -> ReferenceKernels | None:
    """The backend called ``name``, or ``None`` if its package is not installed."""
    if name == "torch":
        return ReferenceKernels()
    module_name, class_name = _MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, class_name)()


def available() -> list[str]:
    """Names of the backends whose packages are installed."""
    return [name for name in BACKENDS if _load(name) is not None]


def code(backend: ReferenceKernels) -> int:
    """The number ranks exchange to check that they use the same backend."""
    return BACKENDS.index(backend.name) + 1


def select(tensor: Tensor, name: str | None = None) -> ReferenceKernels:
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
