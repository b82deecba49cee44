"""The many-worker simulation (onebit.simulate): bit for bit what real gloo processes compute
(the test model, whose averaged gradients are exact in any order: helpers/simulation.py),
fused and per tensor, with the exchange delayed by a step too (each worker's gradients at its
own prediction)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.simulation import (
    FREEZE,
    STEPS,
    build_model,
    build_optimizer,
    flat_params,
    micro_batch,
    shared_params,
    simulated_run,
)
from torch import nn

import onebit
from onebit.collectives import TrafficCounter
from onebit.testing import spawn_workers

# (optimizer, workers per node, gradient clipping, kernels); clipping by the optimizers'
# max_grad_norm in the real runs, by SimulatedDataParallel's in the simulation.
CASES = {
    2: [
        ("onebit-lamb", 1, 0.0, "numba"),
        ("onebit-adam", 1, 0.0, "numba"),
        ("onebit-lamb", 1, 0.05, "torch"),
        ("onebit-lamb-delayed", 1, 0.05, "numba"),
        ("onebit-lamb-per-tensor", 1, 0.0, "numba"),
        ("onebit-adam-per-tensor-delayed", 1, 0.05, "torch"),
        ("onebit-lamb-per-tensor", 2, 0.0, "numba"),  # one node of two
    ],
    4: [
        ("onebit-lamb", 1, 0.0, "numba"),
        ("onebit-lamb", 2, 0.05, "numba"),
        ("onebit-adam", 2, 0.0, "torch"),
        ("onebit-adam-delayed", 1, 0.0, "torch"),
        ("onebit-lamb-per-tensor", 1, 0.05, "torch"),
        ("onebit-adam-per-tensor", 2, 0.0, "numba"),
        ("lamb", 1, 0.05, "numba"),
    ],
}


def _real_runs(rank: int, world: int, cases) -> list[tuple[list[torch.Tensor], int]]:
    """On each of ``world`` gloo processes: every case, the shared weights and the parameters
    (with the delay this rank's prediction) after every step, and the number of compression
    steps that clipped this rank's own gradient."""
    from onebit.train.gradients import average_gradients

    trajectories = []
    for name, local, clip, kernels in cases:
        model = build_model()
        params = list(model.parameters())
        groups = onebit.node_groups(local) if local > 1 else None
        optimizer = build_optimizer(name, params, kernels, groups, max_grad_norm=clip)
        traffic, trajectory, clipped_locally = TrafficCounter(), [], 0
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            inputs, targets = micro_batch(step, rank)
            nn.functional.mse_loss(model(inputs), targets).backward()
            compressing = getattr(optimizer, "stage", None) == "compression"
            if name == "lamb":  # the main job averages its dense baseline's gradients
                average_gradients(params, traffic)
            if clip and compressing:  # the optimizer clips each rank's own at clip·√W
                norms = torch.stack([torch.linalg.vector_norm(p.grad) for p in params])
                clipped_locally += bool(torch.linalg.vector_norm(norms) > clip * math.sqrt(world))
            optimizer.step()
            trajectory.append((shared_params(model, optimizer), flat_params(model)))
        trajectories.append((trajectory, clipped_locally))
    return trajectories


@pytest.mark.parametrize("workers", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_simulation_equals_real_processes_bit_for_bit(workers: int) -> None:
    real = spawn_workers(_real_runs, workers, args=(CASES[workers],), timeout_s=180)
    for index, (name, local, clip, kernels) in enumerate(CASES[workers]):
        case = f"{name}, {workers} workers in nodes of {local}, clip {clip}, {kernels}"
        ranks = [trajectories[index][0] for trajectories in real]
        if clip and name != "lamb":  # the case tests clipping at clip·√W in compression steps
            assert all(trajectories[index][1] > 0 for trajectories in real), case
        simulated, predicted, optimizer, _ = simulated_run(name, workers, local, clip, kernels)
        for step in range(STEPS):
            for rank, trajectory in enumerate(ranks):
                assert torch.equal(trajectory[step][0], ranks[0][step][0]), (case, step, rank)
            assert torch.equal(simulated[step], ranks[0][step][0]), f"{case}: step {step + 1}"
            # the parameters: the last worker's own prediction where delayed
            last = ranks[-1][step][1]
            assert torch.equal(predicted[step], last), f"{case}: step {step + 1}"
            delayed = name.endswith("-delayed") and step >= FREEZE
            assert torch.equal(last, ranks[0][step][1]) != delayed, (case, step)
        assert not torch.equal(simulated[FREEZE], simulated[-1]), case  # it trains
        if name != "lamb":
            assert optimizer.stage == "compression"
            assert optimizer.update_pending == name.endswith("-delayed"), case
            assert optimizer.compression == ("per_tensor" if "-per-tensor" in name else "fused")
