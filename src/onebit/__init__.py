"""onebit: 1-bit LAMB and 1-bit Adam for PyTorch, on plain ``torch.distributed``.

Public API:

* :class:`OneBitLamb`, :class:`OneBitAdam`: the 1-bit optimizers (warm-up, then momentum
  exchanged at 1 bit per element with two-sided error feedback).
* :class:`ZeroOneAdam`: 0/1 Adam (variance updated on exponentially spaced steps, 1-bit
  gradients in between, then local steps with 1-bit synchronisations at growing intervals).
* :class:`Lamb`: the uncompressed LAMB baseline (the warm-up stage of 1-bit LAMB).
* :func:`compressed_allreduce`, :func:`padded_size`: the compressed collective itself, with
  :class:`CompressionWorkspace` (reused scratch) and :class:`TrafficCounter` (bytes sent).
* :func:`compressed_allreduce_per_tensor`, :func:`per_tensor_error_sizes`: the same exchange
  with every tensor compressed alone (DeepSpeed's 1-bit Adam), in fused collectives.
* :func:`hierarchical_compressed_allreduce`, :func:`node_groups`: the exchange for nodes of
  several ranks (dense inside a node, 1 bit between nodes).
* :mod:`onebit.exchange`: the exchanges the optimizers are built with, behind one seam
  (:class:`onebit.exchange.Exchange`), and the two-phase protocol they share.
* :class:`DiLoCo`: local inner steps and an outer step every ``sync_every`` steps whose
  pseudo-gradients go through a dense or a 1-bit exchange (``DILOCO_EXCHANGES``).
* :func:`from_deepspeed_config`: the optimizer a DeepSpeed JSON config describes.
* :func:`clip_grad_norm_`: gradient clipping that knows whether ``step()`` averages the
  gradients or uses each rank's own.
* :mod:`onebit.integrations`: HF Trainer, Accelerate and Lightning (optional extras).
"""

from onebit import ddp
from onebit.clipping import clip_grad_norm_
from onebit.collectives import (
    CompressionWorkspace,
    KernelMismatchError,
    NonFiniteError,
    TrafficCounter,
    allreduce_mean_,
    compressed_allreduce,
    compressed_allreduce_per_tensor,
    padded_size,
    per_tensor_error_sizes,
)
from onebit.consistency import ReplicaMismatchError, broadcast_parameters, verify_replicas
from onebit.deepspeed import from_deepspeed_config
from onebit.diloco import EXCHANGES as DILOCO_EXCHANGES
from onebit.diloco import DiLoCo
from onebit.exchange import HierarchicalWorkspace, node_groups
from onebit.exchange.hierarchical import hierarchical_compressed_allreduce
from onebit.optim import (
    CommunicationError,
    Lamb,
    OneBitAdam,
    OneBitLamb,
    OneBitOptimizer,
    ZeroOneAdam,
)

__all__ = [
    "CommunicationError",
    "DILOCO_EXCHANGES",
    "DiLoCo",
    "Lamb",
    "clip_grad_norm_",
    "ddp",
    "from_deepspeed_config",
    "OneBitAdam",
    "OneBitLamb",
    "OneBitOptimizer",
    "ZeroOneAdam",
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
    "compressed_allreduce_per_tensor",
    "padded_size",
    "per_tensor_error_sizes",
]
__version__ = "0.1.0"
