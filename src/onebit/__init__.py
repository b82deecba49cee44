"""onebit: 1-bit LAMB and 1-bit Adam for PyTorch, on plain ``torch.distributed``.

Public API:

* :class:`OneBitLamb`, :class:`OneBitAdam`: the 1-bit optimizers (warm-up, then momentum
  exchanged at 1 bit per element with two-sided error feedback).
* :class:`Lamb`: the uncompressed LAMB baseline (the warm-up stage of 1-bit LAMB).
* :func:`compressed_allreduce`, :func:`padded_size`: the compressed collective itself, with
  :class:`CompressionWorkspace` (reused scratch) and :class:`TrafficCounter` (bytes sent).
* :func:`hierarchical_compressed_allreduce`, :func:`node_groups`: the exchange for nodes of
  several ranks (dense inside a node, 1 bit between nodes).
* :func:`from_deepspeed_config`: the optimizer a DeepSpeed JSON config describes.
* :mod:`onebit.integrations`: HF Trainer, Accelerate and Lightning (optional extras).
"""

from onebit import ddp
from onebit.collectives import (
    CompressionWorkspace,
    KernelMismatchError,
    NonFiniteError,
    TrafficCounter,
    allreduce_mean_,
    compressed_allreduce,
    padded_size,
)
from onebit.consistency import ReplicaMismatchError, broadcast_parameters, verify_replicas
from onebit.deepspeed import from_deepspeed_config
from onebit.hierarchical import (
    HierarchicalWorkspace,
    hierarchical_compressed_allreduce,
    node_groups,
)
from onebit.optim import CommunicationError, Lamb, OneBitAdam, OneBitLamb, OneBitOptimizer

__all__ = [
    "CommunicationError",
    "Lamb",
    "ddp",
    "from_deepspeed_config",
    "OneBitAdam",
    "OneBitLamb",
    "OneBitOptimizer",
    "ReplicaMismatchError",
    "broadcast_parameters",
    "verify_replicas",
    "CompressionWorkspace",
    "HierarchicalWorkspace",
    "hierarchical_compressed_allreduce",
    "node_groups",
    "KernelMismatchError",
    "NonFiniteError",
    "TrafficCounter",
    "allreduce_mean_",
    "compressed_allreduce",
    "padded_size",
]
__version__ = "0.1.0"
