"""The problem ZeroOneAdam is tested on, in one process and on real ranks: four tensors in two
parameter groups (one with a momentum mask), each rank's gradient a quadratic of its own, a
learning rate that changes every step, and a schedule that puts every phase of ALGORITHM.md's
"0/1 Adam" in 32 steps.

The schedule: variance updates at steps 1, 2, 4, 6, 8 and 12 (kappa = 2, freeze after 12),
1-bit gradients at 3, 5, 7, 9, 10 and 11, then synchronisations every step (13-15), every 2
(16, 18) and every 4 steps (20, 24, 28, 32) with local steps in between. With
``pre_freeze_exchange="momentum"`` the 1-bit gradient steps are synchronisations instead.
"""

from __future__ import annotations

import pytest
import torch

import onebit
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE

STEPS = 32
SCHEDULE = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
VARIANCE = {1, 2, 4, 6, 8, 12}
SYNCS = {13, 14, 15, 16, 18, 20, 24, 28, 32}
SHAPES = [(7, 5), (5,), (4,), (6, 2)]  # 56 elements in 4 tensors
BASE_LR = [0.02, 0.02, 0.01, 0.01]
DECAY = [0.01, 0.01, 0.0, 0.0]
MASK = torch.tensor([[1.0, 0.0]] * 6)  # the second column's momentum stays zero
HYPER = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=DECAY, **SCHEDULE)


EXCHANGES = ("gradient", "momentum")
#: The same as test parameters: DeepSpeed's (gradient) in the slow group, the default in both.
EXCHANGE_PARAMS = [pytest.param("gradient", marks=pytest.mark.slow), "momentum"]


def kind_of(t, exchange="gradient"):
    if t <= 12:
        if t in VARIANCE:
            return "variance_update"
        return "gradient_1bit" if exchange == "gradient" else "sync"
    return "sync" if t in SYNCS else "local"


def lr_fn(t, index):
    """A learning rate that changes every step (0.5, 1, 1.5 times the base, in turn), so
    that the accumulated update must weigh each step by its own rate."""
    return BASE_LR[index] * (0.5 + 0.5 * (t % 3))


def initial_params():
    gen = torch.Generator().manual_seed(42)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def grad_fn(rank, index, param):
    """Worker rank's gradient of tensor index at its own weights: a per-rank quadratic, zero
    in tensor 0's last row (a row that no input reads: variance 0, masked)."""
    gen = torch.Generator().manual_seed(1000 + 10 * rank + index)
    a = torch.rand(param.shape, generator=gen, dtype=torch.float64) + 0.5
    c = torch.randn(param.shape, generator=gen, dtype=torch.float64)
    grad = a.to(param.dtype) * (param - c.to(param.dtype))
    if index == 0:
        grad[-1] = 0
    return grad


def build(dtype, **options):
    params = [torch.nn.Parameter(p.clone().to(dtype)) for p in initial_params()]
    groups = [
        {"params": params[:2], "lr": BASE_LR[0], "weight_decay": DECAY[0]},
        {"params": params[2:], "lr": BASE_LR[2], "exp_avg_mask": [torch.ones(4), MASK]},
    ]
    options = DEEPSPEED_SCHEDULE | SCHEDULE | options
    return params, onebit.ZeroOneAdam(groups, betas=HYPER["betas"], **options)


def train_step(params, opt, rank, t):
    for group, first in zip(opt.param_groups, (0, 2), strict=True):
        group["lr"] = lr_fn(t, first)
    for index, p in enumerate(params):
        p.grad = grad_fn(rank, index, p.detach().double()).to(p.dtype)
    opt.step()
