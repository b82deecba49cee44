"""PowerSGD for the main job's dense baselines: torch's DDP comm hook with its bytes counted
and its state in the job's checkpoints (exact resume)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from onebit.collectives import TrafficCounter, ring_allreduce_bytes

#: PowerSGD's ``start_powerSGD_iter``: the smallest its error feedback and warm start accept.
POWERSGD_START_ITER = 2
_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression")
#: Per bucket, flat in the bucket's order of parameters: the error, and the warm start's P
#: (``n x r`` of each compressed ``n x m`` matrix) and Q (``m x r``).
_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")


def one_bucket(params: Sequence[Tensor]) -> dict[str, float]:
    """DDP's options that put every gradient of ``params`` in one bucket. PowerSGD issues its
    second and third collectives from the completion callback of the previous one; with gloo
    those callbacks run when the data has arrived, so with several buckets the ranks issue
    collectives in different orders, and gloo fails ("Received data size doesn't match")."""
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    return {"bucket_cap_mb": total_bytes / 2**20 + 1}


class CountedPowerSGD:
    """torch's PowerSGD comm hook (``powerSGD_hook``: rank ``rank``, error feedback, warm
    start, the first :data:`POWERSGD_START_ITER` steps a dense allreduce) for ``params``,
    with the bytes of its allreduces counted in ``traffic``: per step and bucket, the ring
    allreduce of the floats it sends (``r·(n + m)`` for each ``n x m`` matrix it compresses,
    all of every other tensor; the whole bucket in the dense steps).

    PowerSGD keeps its state flat in each bucket's order of parameters, and DDP orders a
    bucket by parameter index in a new process's first step, by gradient arrival after it: a
    resumed run would add a saved error to the wrong parameters in its first step. The hook
    therefore records the order each bucket's state was made in and reorders the state,
    parameter by parameter, when a bucket arrives in another order."""

    def __init__(self, rank: int, params: Sequence[Tensor], traffic: TrafficCounter) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        self.state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=POWERSGD_START_ITER,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        self.traffic = traffic
        self._index = {id(p): i for i, p in enumerate(params)}
        self._matrices = [(p.shape[0], p.numel() // p.shape[0]) for p in params]
        self._pieces = [self._sizes(*matrix) for matrix in self._matrices]
        #: Per bucket, the parameter indices in the order its state is laid out in.
        self.layouts: dict[int, list[int]] = {}

    def register(self, model: nn.parallel.DistributedDataParallel) -> None:
        model.register_comm_hook(self, _counted_powersgd_hook)

    def _sizes(self, n: int, m: int) -> tuple[int, int, int]:
        """The elements an ``n x m`` parameter has in the error, P and Q (by the hook's own
        rule of which matrices to compress)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        r = min(n, m, self.state.matrix_approximation_rank)
        compressed = _should_compress(n, m, r, self.state.min_compression_rate)[0]
        return n * m, n * r * compressed, m * r * compressed

    def _follow_layout(self, bucket: dist.GradBucket) -> None:
        """Reorder ``bucket``'s state from the order it was made in to the bucket's own."""
        layout = [self._index[id(p)] for p in bucket.parameters()]
        made_in = self.layouts.setdefault(bucket.index(), layout)
        if made_in == layout:
            return
        for kind, name in enumerate(_MEMORIES):
            memory = getattr(self.state, name)
            if bucket.index() in memory:
                old, new = (self._memory_order(order, kind) for order in (made_in, layout))
                sizes = [self._pieces[i][kind] for i in old]
                piece = dict(zip(old, memory[bucket.index()].split(sizes), strict=True))
                memory[bucket.index()] = torch.cat([piece[i] for i in new])
        self.layouts[bucket.index()] = layout

    def _memory_order(self, layout: list[int], kind: int) -> list[int]:
        """The order of the parameters in memory ``kind`` of a bucket laid out as ``layout``:
        the error in the bucket's order; P and Q hold the compressed matrices grouped by
        shape, the shapes in order of first appearance (as the hook lays them out)."""
        if kind == 0:
            return layout
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i in layout:
            if self._pieces[i][kind]:
                by_shape.setdefault(self._matrices[i], []).append(i)
        return [i for group in by_shape.values() for i in group]

    def state_dict(self) -> dict[str, Any]:
        """What changes as it runs (error and warm-start matrices with their layouts, step,
        random state), as tensors and numbers (``torch.load(weights_only=True)`` reads them)."""
        _, keys, position, has_gauss, gauss = self.state.rng.get_state()
        state: dict[str, Any] = {name: getattr(self.state, name) for name in _COUNTERS}
        state.update({name: dict(getattr(self.state, name)) for name in _MEMORIES})
        rng = {"keys": torch.from_numpy(keys.astype(np.int64)), "position": position}
        rng.update(has_gauss=has_gauss, gauss=gauss)
        return {**state, "rng": rng, "layouts": dict(self.layouts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in (*_COUNTERS, *_MEMORIES):
            setattr(self.state, name, dict(state[name]) if name in _MEMORIES else state[name])
        rng = state["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        self.state.rng.set_state(("MT19937", keys, rng["position"], rng["has_gauss"], rng["gauss"]))
        self.layouts = {int(b): list(layout) for b, layout in state["layouts"].items()}


# No annotations: DistributedDataParallel inspects them and rejects postponed (string) ones.
def _counted_powersgd_hook(counted, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    state, buffer = counted.state, bucket.buffer()
    counted._follow_layout(bucket)
    dense = state.iter < state.start_powerSGD_iter
    before = state.total_numel_after_compression  # the hook adds what it sends of this bucket
    future = powerSGD_hook(state, bucket)
    numel = buffer.numel() if dense else state.total_numel_after_compression - before
    counted.traffic.record(
        "allreduce", ring_allreduce_bytes(numel * buffer.element_size(), dist.get_world_size())
    )
    return future
