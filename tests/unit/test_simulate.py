"""The many-worker simulation (onebit.simulate) in one process: its streamed exchange
against the oracle, its state, traffic and memory, resume, the delayed exchange's workers
parting on a quadratic, and argument errors (the test model: helpers/simulation.py; against
real processes: distributed/test_simulate_on_ranks.py).
"""

from __future__ import annotations

import copy
import math
from itertools import pairwise

import pytest
import torch
from helpers.oracle import oracle_compressed_allreduce, oracle_hierarchical_compressed_allreduce
from helpers.simulation import (
    FREEZE,
    STEPS,
    build_model,
    build_optimizer,
    flat_params,
    shared_params,
    simulated_run,
    worker_backward,
)

import onebit
from onebit import kernels as backends
from onebit.collectives import TrafficCounter, compressed_allreduce_bytes, ring_allreduce_bytes
from onebit.simulate import SimulatedDataParallel, SimulatedExchange, SimulationDiverged


def test_streamed_exchange_equals_the_reference_simulations() -> None:
    """Flat and hierarchical, over several calls with the error state carried on."""
    for workers, local in [(3, 1), (4, 1), (4, 2), (6, 3)]:
        numel = 8 * workers * 29
        generator = torch.Generator().manual_seed(workers * 10 + local)
        errors = torch.zeros(workers, numel // local), torch.zeros(workers, numel // workers)
        exchange = SimulatedExchange(workers, local)
        reference_backend = backends.select(torch.zeros(8), "torch")
        exchange.bind(
            [numel], torch.float32, torch.device("cpu"), reference_backend, TrafficCounter()
        )
        for _ in range(3):
            buffers = torch.randn(workers, numel, generator=generator)
            if local == 1:
                expected, *errors = oracle_compressed_allreduce(buffers, *errors, kernels="torch")
            else:
                expected, *errors = oracle_hierarchical_compressed_allreduce(
                    buffers, *errors, local, kernels="torch"
                )
            for rank in range(workers - 1):
                exchange.add_worker(rank, buffers[rank].clone())
            result = exchange.exchange(buffers[-1].clone()).decode(torch.empty(numel))
            assert torch.equal(result, expected), (workers, local)
            streamed = (
                exchange.worker_error.view(workers, -1),
                exchange.server_error.view(workers, -1),
            )
            assert torch.equal(streamed[0], errors[0]) and torch.equal(streamed[1], errors[1])


def test_state_traffic_and_memory_model() -> None:
    _, _, optimizer, simulation = simulated_run("onebit-lamb", 4, 1, 0.0, "numba")
    numel = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    padded = onebit.padded_size(numel, 4)
    worker_error, server_error = optimizer.error_feedback
    assert worker_error.numel() == 4 * padded and server_error.numel() == padded
    compressed = compressed_allreduce_bytes(padded, 4, torch.float32)
    tensors = sum(len(group["params"]) for group in optimizer.param_groups)
    compressed += ring_allreduce_bytes(tensors, 4)  # a byte per tensor: had a gradient
    assert optimizer.bytes_sent["compression"] == (STEPS - FREEZE) * compressed
    assert simulation.traffic.bytes_sent["allreduce"] == FREEZE * 2 * 3 * 4 * numel // 4
    memory = simulation.memory_bytes()
    assert memory["worker_errors"] == 4 * 4 * padded and memory["server_errors"] == 4 * padded
    assert memory["exchange_scratch"] == 4 * padded // 8 + 4 * padded // 8 // 4 + 2 * 4 * 4

    # Checkpoints hold every worker's error state and continue the same trajectory.
    _, _, hierarchical, _ = simulated_run("onebit-adam", 4, 2, 0.0, "numba")
    state = hierarchical.state_dict()
    assert state["onebit"]["world_size"] == 4 and state["onebit"]["ranks_per_node"] == 2
    assert state["onebit"]["worker_error"].numel() == 4 * padded // 2


@pytest.mark.parametrize(
    ("name", "local", "prediction"),
    [
        ("onebit-lamb", 2, "own"),
        ("onebit-lamb-delayed", 1, "own"),
        ("onebit-lamb-delayed", 1, "mean"),
    ],
)
def test_resume_from_a_checkpoint_continues_the_same_trajectory(
    name: str, local: int, prediction: str
) -> None:
    _, expected, _, _ = simulated_run(name, 4, local, 0.0, "numba", prediction)
    model = build_model()
    optimizer = build_optimizer(name, model.parameters(), "numba")
    simulation = SimulatedDataParallel(optimizer, 4, local, prediction=prediction)
    for step in range(STEPS):
        if step == FREEZE + 2:  # resume into a fresh model, optimizer and simulation
            state, weights = optimizer.state_dict(), model.state_dict()
            simulated = copy.deepcopy(simulation.state_dict())
            model = build_model()
            model.load_state_dict(weights)
            optimizer = build_optimizer(name, model.parameters(), "numba")
            simulation = SimulatedDataParallel(optimizer, 4, local, prediction=prediction)
            optimizer.load_state_dict(state)
            simulation.load_state_dict(simulated)
        simulation.step(worker_backward(model, step))
        assert torch.equal(flat_params(model), expected[step]), step
    with pytest.raises(ValueError, match="predictions of 4 simulated workers.*has 2"):
        SimulatedDataParallel(
            build_optimizer(name, build_model().parameters(), "numba"), 2
        ).load_state_dict(simulated)


def _points_of_each_worker(
    prediction: str, name: str = "onebit-lamb-unbounded-delayed"
) -> tuple[list[list[torch.Tensor]], list]:
    """Per step, the weights each of 3 workers' gradients are taken at; and the shared ones."""
    model = build_model()
    optimizer = build_optimizer(name, model.parameters(), "torch")
    simulation = SimulatedDataParallel(optimizer, 3, prediction=prediction)
    points, shared = [], []
    for step in range(STEPS):
        backward = worker_backward(model, step)
        seen: list[torch.Tensor] = []

        def recorded(rank: int, backward=backward, seen=seen) -> float:
            seen.append(flat_params(model))
            return backward(rank)

        simulation.step(recorded)
        points.append(seen)
        shared.append(shared_params(model, optimizer))
    return points, shared


def test_the_mean_prediction_is_one_point_the_mean_of_the_workers_own() -> None:
    """Without ``momentum_bound`` the prediction is affine in the momentum, so the one made
    from the workers' mean momentum is the mean of their own predictions (ALGORITHM.md,
    "Delayed exchange"); with it (the default) it is still one point for all workers."""
    bounded, _ = _points_of_each_worker("mean", "onebit-lamb-delayed")
    for point in bounded[FREEZE + 1][1:]:
        assert torch.equal(point, bounded[FREEZE + 1][0])
    own, own_shared = _points_of_each_worker("own")
    mean, mean_shared = _points_of_each_worker("mean")
    first = FREEZE + 1  # the second compression step: the first at a prediction
    for step in range(first):  # the same run until the predictions are used
        assert torch.equal(own_shared[step], mean_shared[step]), step
        assert all(torch.equal(a, b) for a, b in zip(own[step], mean[step], strict=True))
    assert not torch.equal(own[first][0], own[first][1])  # each worker's own point
    for point in mean[first][1:]:
        assert torch.equal(point, mean[first][0])
    expected = torch.stack(own[first]).mean(dim=0)
    torch.testing.assert_close(mean[first][0], expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(own_shared[-1], mean_shared[-1])  # the runs part from then on


def test_bad_input_is_named() -> None:
    model = build_model()
    with pytest.raises(ValueError, match="node_size=3 must divide workers=4"):
        SimulatedDataParallel(build_optimizer("onebit-lamb", model.parameters(), "numba"), 4, 3)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        SimulatedDataParallel(build_optimizer("lamb", model.parameters(), "numba"), 0)
    optimizer = build_optimizer("onebit-lamb", model.parameters(), "numba")
    SimulatedDataParallel(optimizer, 2)
    with pytest.raises(ValueError, match="prediction must be one of.*'oracle'"):
        SimulatedDataParallel(
            build_optimizer("onebit-lamb", model.parameters(), "numba"), 2, prediction="oracle"
        )
    with pytest.raises(ValueError, match="of delayed_exchange=True, which OneBitLamb does not"):
        SimulatedDataParallel(
            build_optimizer("onebit-lamb", model.parameters(), "numba"), 2, prediction="mean"
        )
    with pytest.raises(ValueError, match="already simulated"):
        SimulatedDataParallel(optimizer, 2)
    exchange = SimulatedExchange(2)
    with pytest.raises(RuntimeError, match="used before bind"):
        exchange.add_worker(0, torch.zeros(16))
    exchange.bind(
        [16], torch.float32, torch.device("cpu"), backends.select(torch.zeros(8)), TrafficCounter()
    )
    with pytest.raises(ValueError, match="rank order: expected 0"):
        exchange.add_worker(1, torch.zeros(16))
    with pytest.raises(
        RuntimeError, match="takes the last of 2 workers once the others are added; 0"
    ):
        exchange.exchange(torch.zeros(16))
    with pytest.raises(SimulationDiverged, match="simulated worker 0"):
        exchange.add_worker(0, torch.full((16,), float("nan")))


@pytest.mark.parametrize("compression", ["per_tensor", "fused"])
def test_the_workers_predictions_part_by_minus_a_each_step_on_a_quadratic(compression) -> None:
    """On ``Σ_j h_j·x_j²/2 + n_i·x`` (worker i's constant gradient noise ``n_i``) each
    worker's prediction sits off the workers' mean by ``δ_i``, and ``δ_{i,t} = -a·δ_{i,t-1} -
    k·(n_i - n̄)`` with ``k = γ·(1-β1)/(sqrt(v) + ε)`` and ``a = k·h`` per element (ALGORITHM.md,
    "What the prediction leaves"): step over step the change of ``δ`` is ``-a`` times the
    last, so the workers part without bound where ``a > 1``, with either compression. The
    warm-up sees the noise alone, so that v, and with it a, is set by the noise."""
    lr, beta1, eps, workers, freeze = 0.05, 0.9, 1e-8, 4, 5
    curvature = torch.logspace(math.log10(3.0), math.log10(50.0), 48, dtype=torch.float64)
    param = torch.nn.Parameter(torch.zeros(48, dtype=torch.float64))
    generator = torch.Generator().manual_seed(0)
    noise = 1.0 + 0.1 * torch.randn(workers, 48, generator=generator, dtype=torch.float64)
    optimizer = onebit.OneBitAdam(
        [param],
        lr=lr,
        betas=(beta1, 0.999),
        eps=eps,
        freeze_step=freeze,
        delayed_exchange=True,
        compression=compression,
    )
    simulation = SimulatedDataParallel(optimizer, workers)
    deviations = []  # per step: each worker's point off the workers' mean
    for step in range(freeze + 8):
        h = curvature if step >= freeze else torch.zeros_like(curvature)
        points: list[torch.Tensor] = []

        def backward(rank: int, h=h, points=points) -> float:
            points.append(param.detach().clone())
            loss = 0.5 * (h * param**2).sum() + (noise[rank] * param).sum()
            loss.backward()
            return loss.item()

        simulation.step(backward)
        stacked = torch.stack(points)
        deviations.append(stacked - stacked.mean(dim=0))
    v = optimizer.state[param]["exp_avg_sq"]
    a = lr * (1 - beta1) * curvature / (v.sqrt() + eps)
    assert a.min() < 0.5 and a.max() > 3.0  # a ≈ 0.07·h: from about 0.2 to 3.7
    first = freeze + 1  # the stage's second step: its gradients the first at predictions
    assert all(torch.equal(d, torch.zeros_like(d)) for d in deviations[:first])
    changes = [now - before for before, now in pairwise(deviations[first:])]
    for before, now in pairwise(changes):
        torch.testing.assert_close(now, -a * before, rtol=1e-6, atol=1e-12)
    grew = changes[-1].abs() > changes[0].abs()
    assert torch.equal(grew.all(dim=0), a > 1)
