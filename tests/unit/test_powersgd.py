"""The main job's PowerSGD hook state: reordered parameter by parameter when DDP lays a bucket
out in another order (the job's resume test runs it end to end with real ranks)."""

from __future__ import annotations

import torch

from onebit.collectives import TrafficCounter
from onebit.train.powersgd import CountedPowerSGD

# Two 16 x 12 matrices (one shape group), a 1-D tensor and a 4 x 3 matrix (too small to be
# worth compressing at rank 2), a 10 x 9 matrix.
SHAPES = [(16, 12), (5,), (10, 9), (4, 3), (16, 12)]
RANK = 2


class Bucket:
    """What the hook reads of a DDP ``GradBucket``: its index and its parameters in order."""

    def __init__(self, params, order):
        self._params = [params[i] for i in order]

    def index(self):
        return 0

    def parameters(self):
        return self._params


def memories(order: list[int]) -> dict[str, torch.Tensor]:
    """The hook's flat error, P and Q of a bucket in ``order``, each parameter's piece filled
    with its own index: the error in bucket order; P (n x r) and Q (m x r) of the compressed
    matrices grouped by shape, shapes in order of first appearance."""
    error = torch.cat([torch.full((torch.Size(SHAPES[i]).numel(),), float(i)) for i in order])
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in order:
        n, m = (*SHAPES[i], 1)[:2]
        if 2 * RANK * (n + m) < n * m:
            groups.setdefault(SHAPES[i], []).append(i)
    grouped = [i for group in groups.values() for i in group]
    p = torch.cat([torch.full((SHAPES[i][0] * RANK,), float(i)) for i in grouped])
    q = torch.cat([torch.full((SHAPES[i][1] * RANK,), float(i)) for i in grouped])
    return {"error_dict": error, "p_memory_dict": p, "q_memory_dict": q}


def test_state_follows_the_bucket_order_parameter_by_parameter():
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    counted = CountedPowerSGD(RANK, params, TrafficCounter())
    first, second = [0, 1, 2, 3, 4], [4, 2, 3, 1, 0]
    counted._follow_layout(Bucket(params, first))  # the layout the state is made in
    for name, flat in memories(first).items():
        getattr(counted.state, name)[0] = flat
    counted._follow_layout(Bucket(params, second))
    for name, flat in memories(second).items():
        assert torch.equal(getattr(counted.state, name)[0], flat), name
    resumed = CountedPowerSGD(RANK, params, TrafficCounter())
    resumed.load_state_dict(counted.state_dict())
    resumed._follow_layout(Bucket(params, first))
    for name, flat in memories(first).items():
        assert torch.equal(getattr(resumed.state, name)[0], flat), name
