"""The numba backend: fused CPU kernels for float32 and float64 tensors.

Kernels are compiled on first use. With one torch thread (the usual setting for one
process per rank) they run serially, compiled once and cached on disk; with more threads a
parallel build of the same code runs on ``torch.get_num_threads()`` threads. Both give the
same bits: work is split into fixed blocks whatever the thread count.
"""

from __future__ import annotations

import math
import types

import numba
import numpy as np
import torch
from torch import Tensor

from onebit.kernels import _numba_compression as compression
from onebit.kernels._reference import ReferenceKernels

_DRIVERS = (
    "worker_compress",
    "worker_error_update",
    "server_compress",
    "server_error_update",
    "decode",
)


class Compiled:
    """Serial and parallel builds of a module's driver functions, compiled on first use and
    cached on disk (numba's cache keys a function by its qualified name, so the parallel
    build is made from a renamed copy of each function)."""

    def __init__(self, module, names) -> None:
        self._module, self._names = module, names
        self._builds: dict[bool, dict] = {}

    def __call__(self, name: str):
        threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
        parallel = threads > 1
        build = self._builds.get(parallel)
        if build is None:
            jit = numba.njit(parallel=parallel, error_model="numpy", cache=True)
            build = {n: jit(_variant(getattr(self._module, n), parallel)) for n in self._names}
            self._builds[parallel] = build
        if parallel:
            numba.set_num_threads(threads)
        return build[name]

    def compile_all(self) -> None:
        """Compile (or load from the disk cache) every driver of the current build."""
        for name in self._names:
            self(name)


def _variant(function, parallel: bool):
    """``function`` itself, or a copy named ``<name>_parallel`` for the parallel build."""
    if not parallel:
        return function
    copy = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__ + "_parallel",
        function.__defaults__,
        function.__closure__,
    )
    copy.__qualname__ = function.__qualname__ + "_parallel"
    copy.__module__ = function.__module__
    return copy


_COMPRESSION = Compiled(compression, _DRIVERS)


def to_numpy(tensor: Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (no copy)."""
    return tensor.detach().numpy()


def _scale(sumsq: float, numel: int, dtype: torch.dtype) -> Tensor:
    return torch.tensor(math.sqrt(sumsq) / math.sqrt(numel), dtype=dtype)


class NumbaKernels(ReferenceKernels):
    """Fused compression on CPU: worker side, server side and decoding, one pass each."""

    name = "numba"

    def supports(self, tensor: Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64)

    def scratch(self, numel, n, dtype, device) -> None:
        return None  # intermediates are recomputed, never stored

    def worker_compress(self, buffer, error, packed, x, scratch):
        sumsq = _COMPRESSION("worker_compress")(to_numpy(buffer), to_numpy(error), to_numpy(packed))
        return _scale(sumsq, buffer.numel(), self.scale_dtype(buffer.dtype))

    def worker_error_update(self, buffer, error, packed, x_scale, x, scratch):
        _COMPRESSION("worker_error_update")(
            to_numpy(buffer), to_numpy(error), _scalar(x_scale, error)
        )

    def server_compress(self, received, scales, server_error, packed, scratch):
        weights = to_numpy((scales / received.shape[0]).to(server_error.dtype))
        sumsq = _COMPRESSION("server_compress")(
            to_numpy(received), weights, to_numpy(server_error), to_numpy(packed)
        )
        return _scale(sumsq, server_error.numel(), self.scale_dtype(server_error.dtype))

    def server_error_update(self, received, scales, server_error, packed, y_scale, scratch):
        weights = to_numpy((scales / received.shape[0]).to(server_error.dtype))
        _COMPRESSION("server_error_update")(
            to_numpy(received), weights, to_numpy(server_error), _scalar(y_scale, server_error)
        )

    def decode(self, gathered, scales, out):
        _COMPRESSION("decode")(to_numpy(gathered), to_numpy(scales.to(out.dtype)), to_numpy(out))


def _scalar(value: Tensor, like: Tensor):
    """A 0-d tensor as a numpy scalar of ``like``'s dtype (keeps float32 maths float32)."""
    return to_numpy(value.to(like.dtype))[()]
