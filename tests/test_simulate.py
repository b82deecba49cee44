"""The many-worker simulation (onebit.simulate): bit for bit what real processes compute.

Equality of a simulated and a real run needs equal averaged gradients in the warm-up. gloo's
allreduce sums the ranks' gradients in an order of its own (and DDP divides before summing),
so the test model rounds every gradient to a multiple of 2^-12 below 2^8 in magnitude
(:func:`dyadic`): then every partial sum of up to 4 gradients is exact in float32, and so is
the division by 2 or 4, whatever the order. Everything after the averaging (moments, trust
ratios, the compressed exchange, clipping) is ordinary float arithmetic and must agree to the
last bit, which the tests check with ``torch.equal`` on the parameters after every step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.jobs import FREEZE as TINY_FREEZE
from helpers.jobs import STEPS as TINY_STEPS
from helpers.jobs import TINY, final_model, write_corpus
from helpers.oracle import oracle_compressed_allreduce, oracle_hierarchical_compressed_allreduce
from torch import nn

import onebit
from onebit import kernels as backends
from onebit.cli import main as onebit_main
from onebit.collectives import TrafficCounter, compressed_allreduce_bytes
from onebit.simulate import SimulatedDataParallel, SimulatedExchange, SimulationDiverged
from onebit.testing import spawn_workers

STEPS = 8
FREEZE = 3
MICRO_BATCH = 4
GRID = 2.0**12  # gradients are multiples of 1 / GRID


def dyadic(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` rounded to the grid, so that sums of a few of them are exact in float32."""
    return torch.round(grad.clamp(-200, 200) * GRID) / GRID


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    for param in model.parameters():
        param.register_hook(dyadic)
    return model


def micro_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(MICRO_BATCH, 8, generator=generator)
    return inputs, torch.randn(MICRO_BATCH, 4, generator=generator) + inputs[:, :4]


def build_optimizer(
    name: str, params, kernels: str, node_groups=None, max_grad_norm: float = 0.0
) -> torch.optim.Optimizer:
    clip = dict(kernels=kernels, max_grad_norm=max_grad_norm)
    if name == "lamb":
        return onebit.Lamb(params, lr=0.02, weight_decay=0.01, **clip)
    clip["compression"] = "fused"  # the simulated exchange is the fused one
    if name == "onebit-adam":
        return onebit.OneBitAdam(
            params, lr=0.01, freeze_step=FREEZE, node_groups=node_groups, **clip
        )
    return onebit.OneBitLamb(
        params,
        lr=0.02,
        freeze_step=FREEZE,
        weight_decay=0.01,
        max_coeff=0.5,
        node_groups=node_groups,
        **clip,
    )


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# (optimizer, workers per node, gradient clipping, kernels); clipping by the optimizers'
# max_grad_norm in the real runs, by SimulatedDataParallel's in the simulation.
CASES = {
    2: [
        ("onebit-lamb", 1, 0.0, "numba"),
        ("onebit-adam", 1, 0.0, "numba"),
        ("onebit-lamb", 1, 0.05, "torch"),
    ],
    4: [
        ("onebit-lamb", 1, 0.0, "numba"),
        ("onebit-lamb", 2, 0.05, "numba"),
        ("onebit-adam", 2, 0.0, "torch"),
        ("lamb", 1, 0.05, "numba"),
    ],
}


def _real_runs(rank: int, world: int, cases) -> list[tuple[list[torch.Tensor], int]]:
    """On each of ``world`` gloo processes: every case, the parameters after every step and
    the number of compression steps that clipped this rank's own gradient."""
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
            trajectory.append(flat_params(model))
        trajectories.append((trajectory, clipped_locally))
    return trajectories


def worker_backward(model: nn.Module, step: int):
    """Worker ``rank``'s forward and backward pass at ``step``; returns its loss."""

    def backward(rank: int) -> float:
        inputs, targets = micro_batch(step, rank)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss.item()

    return backward


def _simulated_run(name: str, workers: int, local: int, clip: float, kernels: str):
    model = build_model()
    optimizer = build_optimizer(name, model.parameters(), kernels)
    simulation = SimulatedDataParallel(optimizer, workers, local, max_grad_norm=clip)
    trajectory = []
    for step in range(STEPS):
        losses = simulation.step(worker_backward(model, step))
        assert len(losses) == workers
        trajectory.append(flat_params(model))
    return trajectory, optimizer, simulation


@pytest.mark.parametrize("workers", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_simulation_equals_real_processes_bit_for_bit(workers: int) -> None:
    real = spawn_workers(_real_runs, workers, args=(CASES[workers],), timeout_s=180)
    for index, (name, local, clip, kernels) in enumerate(CASES[workers]):
        case = f"{name}, {workers} workers in nodes of {local}, clip {clip}, {kernels}"
        ranks = [trajectories[index][0] for trajectories in real]
        if clip and name != "lamb":  # the case tests clipping at clip·√W in compression steps
            assert all(trajectories[index][1] > 0 for trajectories in real), case
        simulated, optimizer, _ = _simulated_run(name, workers, local, clip, kernels)
        for step in range(STEPS):
            for rank, trajectory in enumerate(ranks):
                assert torch.equal(trajectory[step], ranks[0][step]), (case, step, rank)
            assert torch.equal(simulated[step], ranks[0][step]), f"{case}: step {step + 1}"
        assert not torch.equal(simulated[FREEZE], simulated[-1]), case  # it trains
        if name != "lamb":
            assert optimizer.stage == "compression"


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
    _, optimizer, simulation = _simulated_run("onebit-lamb", 4, 1, 0.0, "numba")
    numel = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    padded = onebit.padded_size(numel, 4)
    worker_error, server_error = optimizer.error_feedback
    assert worker_error.numel() == 4 * padded and server_error.numel() == padded
    compressed = compressed_allreduce_bytes(padded, 4, torch.float32)
    assert optimizer.bytes_sent["compression"] == (STEPS - FREEZE) * compressed
    assert simulation.traffic.bytes_sent["allreduce"] == FREEZE * 2 * 3 * 4 * numel // 4
    memory = simulation.memory_bytes()
    assert memory["worker_errors"] == 4 * 4 * padded and memory["server_errors"] == 4 * padded
    assert memory["exchange_scratch"] == 4 * padded // 8 + 4 * padded // 8 // 4 + 2 * 4 * 4

    # Checkpoints hold every worker's error state and continue the same trajectory.
    _, hierarchical, _ = _simulated_run("onebit-adam", 4, 2, 0.0, "numba")
    state = hierarchical.state_dict()
    assert state["onebit"]["world_size"] == 4 and state["onebit"]["ranks_per_node"] == 2
    assert state["onebit"]["worker_error"].numel() == 4 * padded // 2


def test_resume_from_a_checkpoint_continues_the_same_trajectory() -> None:
    expected, _, _ = _simulated_run("onebit-lamb", 4, 2, 0.0, "numba")
    model = build_model()
    optimizer = build_optimizer("onebit-lamb", model.parameters(), "numba")
    simulation = SimulatedDataParallel(optimizer, 4, 2)
    for step in range(STEPS):
        if step == FREEZE + 2:  # resume into a fresh model, optimizer and simulation
            state, weights = optimizer.state_dict(), model.state_dict()
            model = build_model()
            model.load_state_dict(weights)
            optimizer = build_optimizer("onebit-lamb", model.parameters(), "numba")
            simulation = SimulatedDataParallel(optimizer, 4, 2)
            optimizer.load_state_dict(state)
        simulation.step(worker_backward(model, step))
        assert torch.equal(flat_params(model), expected[step]), step


def test_bad_input_is_named() -> None:
    model = build_model()
    with pytest.raises(ValueError, match="node_size=3 must divide workers=4"):
        SimulatedDataParallel(build_optimizer("onebit-lamb", model.parameters(), "numba"), 4, 3)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        SimulatedDataParallel(build_optimizer("lamb", model.parameters(), "numba"), 0)
    optimizer = build_optimizer("onebit-lamb", model.parameters(), "numba")
    SimulatedDataParallel(optimizer, 2)
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


@pytest.mark.slow
def test_cli_simulation_equals_onebit_train_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``onebit simulate --workers 2`` on the tiny job of test_train: the same parameters as
    ``onebit train`` with 2 worker processes (a mean of two gradients is exact in any order),
    the same run-folder files, and an interrupted simulation that resumes to the same end."""
    monkeypatch.setenv("ONEBIT_CACHE", str(tmp_path / "cache"))
    corpus = str(write_corpus(tmp_path / "corpus.txt"))
    # --workers 2; the fused exchange, which the simulation runs
    options = [*TINY, "--corpus", corpus, "--compression", "fused"]
    assert onebit_main(["train", *options, "--out", str(tmp_path / "real")]) == 0
    # Each worker's pass on the threads a real worker has (bit-identical results need that).
    threads = ["--threads", str(max(1, len(os.sched_getaffinity(0)) // 2))]
    default_threads = torch.get_num_threads()
    try:
        assert onebit_main(["simulate", *options, *threads, "--out", str(tmp_path / "sim")]) == 0
        partial = tmp_path / "partial"  # the simulation as if stopped after step 8
        shutil.copytree(tmp_path / "sim", partial)
        shutil.rmtree(partial / "checkpoints" / f"step-{TINY_STEPS:08d}")
        (partial / "summary.json").unlink()
        assert onebit_main(["simulate", "--resume", str(partial), *threads]) == 0
    finally:
        torch.set_num_threads(default_threads)

    real, simulated = final_model(tmp_path / "real"), final_model(tmp_path / "sim")
    assert real.keys() == simulated.keys()
    for name, tensor in real.items():
        assert torch.equal(tensor, simulated[name]), f"{name}: simulation != onebit train"
    for name, tensor in final_model(partial).items():
        assert torch.equal(tensor, simulated[name]), f"{name}: resumed != uninterrupted"
    rows = {
        kind: [json.loads(line) for line in (tmp_path / kind / "metrics.jsonl").open()]
        for kind in ("real", "sim", "partial")
    }
    for row in (row for kind in rows.values() for row in kind):
        row.pop("step_time", None)
    assert rows["partial"] == rows["sim"]

    train = {kind: [r for r in rows[kind] if r["kind"] == "train"] for kind in rows}
    assert [r["loss"] for r in train["sim"]] == [r["loss"] for r in train["real"]]
    assert [r["stage"] for r in train["sim"]] == [r["stage"] for r in train["real"]]
    assert [r["bytes"] for r in train["sim"][:TINY_FREEZE]] == [
        r["bytes"] for r in train["real"][:TINY_FREEZE]
    ]
    # The real run also sends the one-time gradient check (8 bytes) at the first 1-bit step.
    compressed = [r["bytes"] for r in train["real"][TINY_FREEZE:]]
    compressed[0] -= 8
    assert [r["bytes"] for r in train["sim"][TINY_FREEZE:]] == compressed
    # Validation: the same model, but evaluated in one process rather than split over two
    # ranks, so the batches and the summation of the mean loss differ.
    validation = {
        kind: [r["loss"] for r in rows[kind] if r["kind"] == "validation"] for kind in rows
    }
    assert validation["sim"] == pytest.approx(validation["real"], rel=1e-6)

    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["simulation"]["node_size"] == 1
    memory = summary["simulation"]["memory_bytes"]
    numel = summary["parameters"]
    assert memory["worker_errors"] == 2 * 4 * onebit.padded_size(numel, 2)
    capsys.readouterr()
    assert onebit_main(["train", "--resume", str(tmp_path / "sim")]) == 2
    assert "holds a simulation of 2 workers" in capsys.readouterr().err
    assert onebit_main(["simulate", "--resume", str(tmp_path / "real")]) == 2
    assert "holds a run of worker processes" in capsys.readouterr().err
    assert onebit_main(["simulate", *options, "--optimizer", "zero-one-adam"]) == 2
    assert "cannot be simulated" in capsys.readouterr().err
