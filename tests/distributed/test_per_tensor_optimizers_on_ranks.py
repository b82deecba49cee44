"""OneBitAdam and OneBitLamb with compression="per_tensor" (their default: every tensor
compressed alone, DeepSpeed's 1-bit Adam scheme) on real gloo processes against the float64
model of the spec: trajectories, bytes, resume, the DDP hook."""

from __future__ import annotations

import pytest
import torch
from helpers.onebit_problem import (
    FREEZE,
    GROUP_HYPER,
    HYPER,
    KINDS,
    MASK,
    NUMELS,
    OPTIMIZERS,
    STEPS,
    assert_follows_model_and_ranks_agree,
    assert_resumed_runs_are_exact,
    initial_params,
    set_grads,
    uninterrupted_and_resumed,
)
from helpers.onebit_problem import build as build_optimizer
from helpers.onebit_problem import build_per_tensor as build
from helpers.onebit_problem import grad_fn as model_grad_fn
from helpers.oracle_onebit import oracle_run

import onebit
from onebit.collectives import compressed_allreduce_per_tensor_bytes
from onebit.testing import spawn_workers


def _trajectories(rank, world_size):
    out = {}
    for kind in KINDS:
        for dtype in (torch.float64, torch.float32):
            params, opt = build(dtype, kind=kind)
            history = []
            for _ in range(STEPS):
                set_grads(params, rank)
                opt.step()
                history.append([p.detach().clone() for p in params])
            errors = opt.state_dict()
            out[kind, dtype] = {"history": history, "bytes": opt.bytes_sent, "errors": errors}
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_follows_float64_model_and_ranks_stay_bit_identical(world_size):
    results = spawn_workers(_trajectories, world_size, timeout_s=180)
    for kind in KINDS:
        _check_trajectories(kind, world_size, results)


def _check_trajectories(kind, world_size, results):
    masks = [None, None, None, MASK]
    expected, fused = (
        oracle_run(
            kind,
            initial_params(),
            model_grad_fn,
            world_size,
            STEPS,
            FREEZE,
            GROUP_HYPER,
            HYPER,
            masks,
            compression=mode,
        )
        for mode in ("per_tensor", "fused")
    )
    assert not torch.allclose(expected[-1][0], fused[-1][0], rtol=1e-3), "modes must differ"
    n = world_size
    for dtype in (torch.float64, torch.float32):
        run = results[0][kind, dtype]
        # As for the fused optimizers: float64 differs from the model by summation order
        # only (1e-9 is far below a formula error); float32 by rounding (2e-4).
        tol = 1e-9 if dtype == torch.float64 else 2e-4
        histories = [results[rank][kind, dtype]["history"] for rank in range(n)]
        assert_follows_model_and_ranks_agree(histories, expected, tol, f"{kind} {dtype}")
        # The masked column's momentum stays zero: those entries follow weight decay 0.
        assert torch.equal(run["history"][-1][3][:, 1], run["history"][FREEZE - 1][3][:, 1])
        elem = 8 if dtype == torch.float64 else 4
        dense = 2 * (n - 1) * (sum(NUMELS) + len(NUMELS)) * elem // n
        compressed = compressed_allreduce_per_tensor_bytes(NUMELS, n, dtype)
        compressed += 2 * (n - 1) * len(NUMELS) // n  # a byte per tensor: its gradient's flag
        assert run["bytes"] == {
            "warmup": FREEZE * dense,
            "compression": (STEPS - FREEZE) * compressed + 8 * (n - 1),  # + gradient check
            "refresh": 0,
        }
        saved = run["errors"]["onebit"]
        sizes = onebit.per_tensor_error_sizes(NUMELS, n)
        assert (saved["worker_error"].numel(), saved["server_error"].numel()) == sizes
        assert saved["compression"] == "per_tensor"


def _lamb_by_backend(rank, world_size):
    """Rank's parameters after every step of per-tensor 1-bit LAMB: float32 with the numba
    kernels and with the torch reference, and the reference in float64."""
    out = {}
    for backend, dtype in (
        ("numba", torch.float32),
        ("torch", torch.float32),
        ("torch", torch.float64),
    ):
        params, opt = build_optimizer("lamb", dtype, "per_tensor", kernels=backend)
        history = []
        for _ in range(STEPS):
            set_grads(params, rank)
            opt.step()
            history.append(torch.cat([p.detach().reshape(-1).double() for p in params]))
        out[backend, dtype] = history
    return out


@pytest.mark.slow
@pytest.mark.skipif("numba" not in onebit.kernels.available(), reason="numba is not installed")
def test_numba_reads_every_servers_signs_as_the_reference_in_float32():
    """On 3 ranks the update kernels read each tensor's momentum from 3 servers' rows of the
    exchange's result: in float32 they stay within twice the reference's own distance from
    float64 (a sign read from the wrong place moves a parameter by lr times its scale)."""
    results = spawn_workers(_lamb_by_backend, 3, timeout_s=180)
    runs = results[0]
    largest = {"deviation": 0.0, "own_error": 0.0}
    for got, ref, truth in zip(
        runs["numba", torch.float32],
        runs["torch", torch.float32],
        runs["torch", torch.float64],
        strict=True,
    ):
        scale = float(truth.abs().max())
        largest["deviation"] = max(largest["deviation"], float((got - ref).abs().max()) / scale)
        largest["own_error"] = max(largest["own_error"], float((ref - truth).abs().max()) / scale)
    assert largest["deviation"] <= 2 * largest["own_error"], largest
    ours = runs["numba", torch.float32]
    for rank in (1, 2):
        theirs = results[rank]["numba", torch.float32]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), rank


@pytest.mark.parametrize("kind", [pytest.param("adam", marks=pytest.mark.slow), "lamb"])
def test_resume_mid_compression_is_bit_identical(tmp_path, kind):
    args = (str(tmp_path), FREEZE + 5, kind, "per_tensor")
    assert_resumed_runs_are_exact(
        spawn_workers(uninterrupted_and_resumed, 2, args=args, timeout_s=120)
    )


def _trajectory(rank, use_ddp, kind):
    torch.manual_seed(0)  # identical initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = OPTIMIZERS[kind](
        model.parameters(), lr=0.01, freeze_step=4, weight_decay=0.01, compression="per_tensor"
    )
    if use_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
        onebit.ddp.register_comm_hook(model, opt)
    gen = torch.Generator().manual_seed(100 + rank)
    history = []
    for _ in range(12):
        x = torch.randn(16, 6, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return torch.stack(history), opt.bytes_sent


def _plain_and_ddp(rank, world_size):
    return {kind: (_trajectory(rank, False, kind), _trajectory(rank, True, kind)) for kind in KINDS}


def test_plain_loop_and_ddp_hook_give_the_same_trajectory():
    runs = spawn_workers(_plain_and_ddp, 2, timeout_s=120)
    for kind in KINDS:
        for (plain, sent_plain), (ddp, sent_ddp) in (run[kind] for run in runs):
            assert torch.equal(plain, ddp)
            assert torch.equal(plain, runs[0][kind][0][0])  # ranks bit-identical
            assert sent_plain["compression"] == sent_ddp["compression"] > 0
