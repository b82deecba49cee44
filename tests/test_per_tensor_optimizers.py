"""OneBitAdam and OneBitLamb with compression="per_tensor" (their default: every tensor
compressed alone, DeepSpeed's 1-bit Adam scheme) on real gloo processes against the float64
model of the spec: trajectories, bytes, resume, the DDP hook, checkpoints, the default."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.onebit_problem import (
    FREEZE,
    GROUP_HYPER,
    HYPER,
    MASK,
    STEPS,
    _uninterrupted_and_resumed,
    assert_follows_model_and_ranks_agree,
    assert_resumed_runs_are_exact,
    initial_params,
    set_grads,
)
from helpers.onebit_problem import build as build_optimizer
from helpers.onebit_problem import grad_fn as model_grad_fn
from helpers.oracle_onebit import oracle_run

import onebit
from onebit.collectives import compressed_allreduce_per_tensor_bytes
from onebit.exchange import SimulatedExchange
from onebit.testing import spawn_workers

NUMELS = [math.prod(p.shape) for p in initial_params()]


KINDS = ("adam", "lamb")
OPTIMIZERS = {"adam": onebit.OneBitAdam, "lamb": onebit.OneBitLamb}


def build(dtype, compression="per_tensor", kind="adam"):
    return build_optimizer(kind, dtype, compression)


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
        assert run["bytes"] == {
            "warmup": FREEZE * dense,
            "compression": (STEPS - FREEZE) * compressed + 8 * (n - 1),  # + gradient check
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
        spawn_workers(_uninterrupted_and_resumed, 2, args=args, timeout_s=120)
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


def test_bf16_parameters_follow_their_fp32_masters_exactly():
    # Gradients that do not depend on the parameters and are bf16 values: a bf16 run's fp32
    # master weights then follow an fp32 run bit for bit, and the parameters are the masters
    # rounded to bf16.
    gen = torch.Generator().manual_seed(3)
    shapes = [(64,), (8, 4)]
    init = [torch.randn(s, generator=gen).bfloat16().float() for s in shapes]
    grads = [[torch.randn(s, generator=gen).bfloat16() for s in shapes] for _ in range(12)]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.nn.Parameter(p.clone().to(dtype)) for p in init]
        opt = onebit.OneBitAdam(params, lr=0.01, freeze_step=4, compression="per_tensor")
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.to(dtype)
            opt.step()
        runs[dtype] = params, opt
    (p32, _), (p16, opt16) = runs[torch.float32], runs[torch.bfloat16]
    for full, half in zip(p32, p16, strict=True):
        master = opt16.state[half]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(master, full.detach())
        assert torch.equal(half.detach(), master.bfloat16())


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_of_one_mode_is_rejected_by_the_other(kind):
    for saved_mode, loading_mode in (("per_tensor", "fused"), ("fused", "per_tensor")):
        params, opt = build(torch.float32, saved_mode, kind)
        for _ in range(FREEZE + 2):
            set_grads(params, 0)
            opt.step()
        _, other = build(torch.float32, loading_mode, kind)
        with pytest.raises(ValueError, match=f"saved with compression='{saved_mode}'"):
            other.load_state_dict(opt.state_dict())


def test_error_buffers_of_the_wrong_size_are_rejected_on_load():
    params, opt = build(torch.float32)
    for _ in range(FREEZE + 2):
        set_grads(params, 0)
        opt.step()
    state = opt.state_dict()
    state["onebit"]["worker_error"] = torch.zeros(onebit.padded_size(sum(NUMELS), 1))
    _, other = build(torch.float32)
    with pytest.raises(ValueError, match="worker_error has 56 elements; .* need 72"):
        other.load_state_dict(state)


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_compression_and_node_groups_are_clear_errors(kind):
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="Invalid compression='per-tensor'"):
        OPTIMIZERS[kind]([param], compression="per-tensor")
    with pytest.raises(ValueError, match="does not support node_groups"):
        OPTIMIZERS[kind]([param], compression="per_tensor", node_groups=(None, None))


def test_a_simulated_exchange_is_refused():
    params, opt = build(torch.float32)
    for _ in range(FREEZE):
        set_grads(params, 0)
        opt.step()
    with pytest.raises(ValueError, match="compression='per_tensor' exchanges over the process"):
        opt.use_exchange(SimulatedExchange(2))  # simulates the fused exchange only
    set_grads(params, 0)
    opt.step()  # nothing was lost: it goes on with its own exchange
    assert opt.stage == "compression" and opt.exchange.worker_error is not None


def test_a_deepspeed_config_builds_deepspeeds_per_tensor_compression_by_default():
    config = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 5}}}
    param = torch.nn.Parameter(torch.zeros(3))
    opt = onebit.from_deepspeed_config(config, [param])
    assert isinstance(opt, onebit.OneBitAdam) and opt.compression == "per_tensor"
    assert onebit.from_deepspeed_config(config, [param], compression="fused").compression == "fused"


def test_a_deepspeed_config_builds_deepspeeds_fused_one_bit_lamb():
    config = {"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 5}}}
    param = torch.nn.Parameter(torch.zeros(3))
    assert onebit.from_deepspeed_config(config, [param]).compression == "fused"
    assert onebit.OneBitLamb([param]).compression == "per_tensor"


@pytest.mark.parametrize("kind", KINDS)
def test_the_default_is_per_tensor_and_fused_where_only_the_fused_buffer_is_exchanged(kind):
    def made(**options):
        return OPTIMIZERS[kind]([torch.nn.Parameter(torch.zeros(3))], freeze_step=2, **options)

    assert made().compression == "per_tensor"
    assert made(bucket_cap_mb=1.0).compression == "fused"
    assert made(overlap_backward=True).compression == "fused"
    with pytest.raises(ValueError, match="bucket the flat fused exchange"):
        made(compression="per_tensor", bucket_cap_mb=1.0)
    # simulated: the default becomes the simulation's fused exchange; a refusal changes nothing
    simulated = made()
    simulated.use_exchange(SimulatedExchange(2))
    assert simulated.compression == "fused"
    with pytest.raises(ValueError, match="already simulated"):
        simulated.use_exchange(SimulatedExchange(2))
    assert simulated.compression == "fused"
    refused = made(compression=None, bucket_cap_mb=1.0)
    with pytest.raises(ValueError, match="bucket_cap_mb is not simulated"):
        refused.use_exchange(SimulatedExchange(2))
    assert refused.compression == "fused"
    started = made()  # past its first exchange: too late to simulate, and it stays per tensor
    for _ in range(3):
        started.param_groups[0]["params"][0].grad = torch.ones(3)
        started.step()
    with pytest.raises(ValueError, match="must come before the first exchange"):
        started.use_exchange(SimulatedExchange(2))
    assert started.compression == "per_tensor"
