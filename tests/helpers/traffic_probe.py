"""Traffic counted at torch.distributed's process group, below onebit.

Every collective issued from Python goes through a method of ``torch.distributed.ProcessGroup``;
:class:`TrafficProbe` patches those methods to record what each call is handed. A call's
bytes are those this rank sends in a bandwidth-optimal implementation: an allreduce of S
bytes sends 2 (n-1)/n S, an all-gather of S local bytes (n-1) S, an all-to-all of S bytes
(n-1)/n S, a broadcast (n-1) S at its root, a point-to-point send of S bytes S.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import onebit

# Bytes one rank of a group sends in a collective, from the bytes of the tensors it hands
# over (argument 0 for allreduce and broadcast, 1, the input, for the others).
_SENT = {
    "allreduce": lambda group, args, size: 2 * (group.size() - 1) * size // group.size(),
    "all_gather_single": lambda group, args, size: (group.size() - 1) * size,
    "allgather": lambda group, args, size: (group.size() - 1) * size,
    "all_to_all_single": lambda group, args, size: (group.size() - 1) * size // group.size(),
    "broadcast": lambda group, args, size: (
        (group.size() - 1) * size if group.rank() == args[1].rootRank else 0
    ),
    "send": lambda group, args, size: size,
}
_PAYLOAD_ARG = {"allreduce": 0, "broadcast": 0, "send": 0}


class TrafficProbe:
    """Records ``(optimizer steps so far, collective, bytes sent)`` for every collective and
    point-to-point send."""

    def __init__(self) -> None:
        self.optimizer: onebit.OneBitOptimizer | None = None
        self.records: list[tuple[int, str, int]] = []

    def __enter__(self) -> TrafficProbe:
        # The raw class attributes (pybind's instancemethod), to be put back as they were.
        self._originals = {name: vars(dist.ProcessGroup)[name] for name in _SENT}
        for name, original in self._originals.items():
            setattr(dist.ProcessGroup, name, self._counting(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist.ProcessGroup, name, original)

    def _counting(self, name, original):
        def counted(group, *args, **kwargs):
            tensors = args[_PAYLOAD_ARG.get(name, 1)]
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
            size = sum(t.numel() * t.element_size() for t in tensors)
            step = -1 if self.optimizer is None else self.optimizer.step_count
            self.records.append((step, name, _SENT[name](group, args, size)))
            return original(group, *args, **kwargs)

        return counted
