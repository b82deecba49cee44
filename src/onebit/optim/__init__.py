"""The optimizers: :class:`Lamb`, :class:`OneBitLamb`, :class:`OneBitAdam` and
:class:`ZeroOneAdam`, and what tools built on them use: the kinds of step, the compressions,
the state kept per element, sharded parameters' local slices, clipping by the total norm.
Argument checks are in :mod:`onebit.optim.checks`."""

from onebit.optim._common import PER_ELEMENT_STATE, clip_by_total_norm_, params_in_order
from onebit.optim._data_parallel import COMPRESSIONS, CommunicationError
from onebit.optim._onebit import DEFAULT_BUCKET_CAP_MB, OneBitOptimizer
from onebit.optim._parameters import holding_weights
from onebit.optim._readiness import AUTO
from onebit.optim._schedule import (
    COMPRESSION,
    GRADIENT_1BIT,
    LOCAL,
    SYNC,
    VARIANCE_UPDATE,
    WARMUP,
)
from onebit.optim._sharding import local_tensor
from onebit.optim.lamb import Lamb
from onebit.optim.onebit_adam import OneBitAdam
from onebit.optim.onebit_lamb import OneBitLamb
from onebit.optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "AUTO",
    "COMPRESSION",
    "COMPRESSIONS",
    "DEFAULT_BUCKET_CAP_MB",
    "GRADIENT_1BIT",
    "LOCAL",
    "PER_ELEMENT_STATE",
    "SYNC",
    "VARIANCE_UPDATE",
    "WARMUP",
    "CommunicationError",
    "Lamb",
    "OneBitAdam",
    "OneBitLamb",
    "OneBitOptimizer",
    "ZeroOneAdam",
    "clip_by_total_norm_",
    "holding_weights",
    "local_tensor",
    "params_in_order",
]
