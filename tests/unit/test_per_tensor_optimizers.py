"""OneBitAdam and OneBitLamb with compression="per_tensor" (their default: every tensor
compressed alone, DeepSpeed's 1-bit Adam scheme) in one process: bf16 masters, checkpoints of
either mode, argument errors, the default and what a DeepSpeed config builds."""

from __future__ import annotations

import pytest
import torch
from helpers.onebit_problem import FREEZE, KINDS, NUMELS, OPTIMIZERS, set_grads
from helpers.onebit_problem import build_per_tensor as build

import onebit
from onebit.exchange import SimulatedExchange


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
def test_an_invalid_compression_is_a_clear_error(kind):
    param = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="Invalid compression='per-tensor'"):
        OPTIMIZERS[kind]([param], compression="per-tensor")


def test_a_simulated_exchange_of_the_other_compression_is_refused():
    params, opt = build(torch.float32)
    for _ in range(FREEZE):
        set_grads(params, 0)
        opt.step()
    with pytest.raises(ValueError, match="a SimulatedExchange simulates compression='fused'"):
        opt.use_exchange(SimulatedExchange(2))
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
    assert made(bucket_cap_mb=1.0).compression == "per_tensor"  # buckets of whole tensors
    assert made(overlap_backward=True).compression == "per_tensor"
    assert made(compression="fused", overlap_backward=True).compression == "fused"
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
    assert refused.compression == "per_tensor"
    started = made()  # past its first exchange: too late to simulate, and it stays per tensor
    for _ in range(3):
        started.param_groups[0]["params"][0].grad = torch.ones(3)
        started.step()
    with pytest.raises(ValueError, match="must come before the first exchange"):
        started.use_exchange(SimulatedExchange(2))
    assert started.compression == "per_tensor"
