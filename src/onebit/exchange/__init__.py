"""The exchange seam: every 1-bit exchange behind one interface (:class:`Exchange`).

* :mod:`~onebit.exchange.protocol`: the two-phase protocol, written once, over segments;
* :mod:`~onebit.exchange.transport`: ``torch.distributed`` collectives and the checks every
  rank agrees on;
* the exchanges an optimizer is built with: :class:`FlatExchange`,
  :class:`BucketedExchange` and :class:`PerTensorExchange` over a process group,
  :class:`HierarchicalExchange` over nodes, :class:`SimulatedExchange` for many workers in
  one process.
"""

from onebit.exchange.base import Exchange
from onebit.exchange.bucketed import (
    BucketedExchange,
    BucketedResult,
    BucketPipeline,
    PerTensorBucketedExchange,
)
from onebit.exchange.flat import FlatExchange, PerTensorExchange, per_tensor_error_sizes
from onebit.exchange.hierarchical import (
    HierarchicalExchange,
    HierarchicalWorkspace,
    NodeGroups,
    PerTensorHierarchicalExchange,
    hierarchical_bytes,
    node_groups,
    node_topology,
    per_tensor_hierarchical_bytes,
)
from onebit.exchange.protocol import (
    Layout,
    PackedResult,
    exchange_bytes,
    padded_size,
)
from onebit.exchange.simulated import (
    PerTensorSimulatedExchange,
    SimulatedExchange,
    SimulationDiverged,
)
from onebit.exchange.transport import (
    KernelMismatchError,
    NonFiniteError,
    TrafficCounter,
    world_size,
)
from onebit.exchange.workspace import CompressionWorkspace

__all__ = [
    "BucketedExchange",
    "BucketedResult",
    "PerTensorBucketedExchange",
    "BucketPipeline",
    "CompressionWorkspace",
    "Exchange",
    "FlatExchange",
    "HierarchicalExchange",
    "HierarchicalWorkspace",
    "KernelMismatchError",
    "Layout",
    "NodeGroups",
    "NonFiniteError",
    "PackedResult",
    "PerTensorExchange",
    "PerTensorHierarchicalExchange",
    "PerTensorSimulatedExchange",
    "SimulatedExchange",
    "SimulationDiverged",
    "TrafficCounter",
    "exchange_bytes",
    "hierarchical_bytes",
    "node_groups",
    "node_topology",
    "padded_size",
    "per_tensor_hierarchical_bytes",
    "per_tensor_error_sizes",
    "world_size",
]
