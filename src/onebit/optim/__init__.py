"""The optimizers: :class:`Lamb`, :class:`OneBitLamb`, :class:`OneBitAdam` and
:class:`ZeroOneAdam`."""

from onebit.optim._data_parallel import CommunicationError
from onebit.optim._onebit import OneBitOptimizer
from onebit.optim.lamb import Lamb
from onebit.optim.onebit_adam import OneBitAdam
from onebit.optim.onebit_lamb import OneBitLamb
from onebit.optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "CommunicationError",
    "Lamb",
    "OneBitAdam",
    "OneBitLamb",
    "OneBitOptimizer",
    "ZeroOneAdam",
]
