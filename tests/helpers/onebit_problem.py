"""The problem 1-bit LAMB and 1-bit Adam are tested on, in one process and on real ranks:
four tensors in two parameter groups (one with a momentum mask), each rank's gradient a
quadratic of its own (:func:`grad_fn`), 10 warm-up steps then 22 compressed; and the checks
shared by the tests of every exchange (a trajectory against the float64 model of
``helpers.oracle_onebit``, a resumed run against an uninterrupted one)."""

from __future__ import annotations

import math
import os

import torch

import onebit

FREEZE, STEPS = 10, 32  # 10 warm-up steps, 22 compressed
SHAPES = [(7, 5), (5,), (4,), (6, 2)]  # 56 elements: padded for every world size
HYPER = dict(
    betas=(0.9, 0.999),
    eps=1e-8,
    max_coeff=0.3,
    min_coeff=0.01,
    coeff_beta=0.9,
    factor_max=4.0,
    factor_min=0.5,
    factor_threshold=0.1,
)
GROUP_HYPER = [(0.02, 0.01), (0.02, 0.01), (0.01, 0.0), (0.01, 0.0)]  # (lr, weight_decay)
MASK = torch.tensor([[1.0, 0.0]] * 6)  # the second column's momentum must stay zero


def initial_params():
    gen = torch.Generator().manual_seed(42)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def _coefficients(rank, index):
    gen = torch.Generator().manual_seed(1000 + 10 * rank + index)
    shape = SHAPES[index]
    return torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5, torch.randn(
        shape, generator=gen, dtype=torch.float64
    )


def grad_fn(rank, index, param):
    """Worker rank's gradient of tensor index: a per-rank quadratic; tensor 2 gets zeros,
    so its momentum is all zeros at the switch (s_p = 1), and so does tensor 0's last row (a
    row that no input reads): their variance is 0, so they are masked after the switch."""
    if index == 2:
        return torch.zeros_like(param)
    a, c = _coefficients(rank, index)
    grad = a.to(param.dtype) * (param - c.to(param.dtype))
    if index == 0:
        grad[-1] = 0
    return grad


def build(kind, dtype, compression="fused", **options):
    params = [torch.nn.Parameter(p.clone().to(dtype)) for p in initial_params()]
    groups = [
        {"params": params[:2], "lr": 0.02, "weight_decay": 0.01},
        {
            "params": params[2:],
            "lr": 0.01,
            "weight_decay": 0.0,
            "exp_avg_mask": [torch.ones(4), MASK],
        },
    ]
    if kind == "lamb":
        opt = onebit.OneBitLamb(
            groups, freeze_step=FREEZE, **HYPER, compression=compression, **options
        )
    else:
        opt = onebit.OneBitAdam(
            groups, freeze_step=FREEZE, betas=HYPER["betas"], compression=compression, **options
        )
    return params, opt


def set_grads(params, rank):
    for index, p in enumerate(params):
        p.grad = grad_fn(rank, index, p.detach().double()).to(p.dtype)


def assert_follows_model_and_ranks_agree(histories, expected, tol, label):
    """Rank 0's parameters after every step within ``tol`` of the model's ``expected``, and
    every other rank's bit-identical to rank 0's (``histories[rank][step]``: the tensors)."""
    for step, reference in enumerate(expected):
        for index, (got, ref) in enumerate(zip(histories[0][step], reference, strict=True)):
            torch.testing.assert_close(
                got.double(),
                ref,
                rtol=tol,
                atol=tol,
                msg=lambda m, s=step, i=index: f"{label} step {s + 1} tensor {i}: {m}",
            )
        for rank, history in enumerate(histories[1:], start=1):
            assert all(
                torch.equal(a, b) for a, b in zip(histories[0][step], history[step], strict=True)
            ), f"{label}: rank {rank} differs from rank 0 after step {step + 1}"


def _run_with_checkpoint(
    rank, world_size, directory, start, stop, save_at, kind="lamb", compression="fused"
):
    params, opt = build(kind, torch.float32, compression)
    path = os.path.join(directory, f"rank{rank}.pt")
    if start > 0:
        saved = torch.load(path, weights_only=True)
        with torch.no_grad():
            for p, value in zip(params, saved["params"], strict=True):
                p.copy_(value)
        opt.load_state_dict(saved["optimizer"])
    for step in range(start, stop):
        set_grads(params, rank)
        opt.step()
        if step + 1 == save_at:
            torch.save(
                {"params": [p.detach() for p in params], "optimizer": opt.state_dict()}, path
            )
    return [p.detach().clone() for p in params], opt.step_count, opt.bytes_sent


def uninterrupted_and_resumed(rank, world_size, directory, save_at, *mode):
    """The run straight through (saving at ``save_at``), then resumed from that checkpoint
    by a fresh optimizer, in the same processes (``mode``: kind and compression)."""
    return (
        _run_with_checkpoint(rank, world_size, directory, 0, STEPS, save_at, *mode),
        _run_with_checkpoint(rank, world_size, directory, save_at, STEPS, -1, *mode),
    )


def assert_resumed_runs_are_exact(runs) -> None:
    """Every rank's resumed run (from :func:`uninterrupted_and_resumed`) equals its
    uninterrupted one: steps, bytes and parameters bit for bit."""
    for (a, step_a, bytes_a), (b, step_b, bytes_b) in runs:
        assert step_a == step_b == STEPS
        assert bytes_a == bytes_b
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# The problem with compression="per_tensor" (the optimizers' default).
NUMELS = [math.prod(p.shape) for p in initial_params()]
KINDS = ("adam", "lamb")
OPTIMIZERS = {"adam": onebit.OneBitAdam, "lamb": onebit.OneBitLamb}


def build_per_tensor(dtype, compression="per_tensor", kind="adam"):
    return build(kind, dtype, compression)
