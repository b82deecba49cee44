"""``onebit estimate``: a cost model of a training step on a cluster (docs/ESTIMATE.md)."""

from onebit.estimate.model import Cluster, Machine, MethodEstimate, estimate

__all__ = ["Cluster", "Machine", "MethodEstimate", "estimate"]
