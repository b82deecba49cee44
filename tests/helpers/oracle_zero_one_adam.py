"""An independent float64 model of ALGORITHM.md's "0/1 Adam" over n simulated workers.

Written from the text with plain tensor arithmetic: every worker keeps its own weights and
momentum (they differ during local intervals), the schedules are built as the text states
them, and each tensor's 1-bit exchange is onebit.compression.oracle_compressed_allreduce of
that tensor zero-padded alone (itself tested against a numpy model and the distributed
exchange). Used as the reference the multi-process ZeroOneAdam must follow.
"""

from __future__ import annotations

import math

import torch

from helpers.oracle import oracle_compressed_allreduce


def padded(numel, n):
    """A tensor's padded size in the per-tensor exchange: a multiple of n * lcm(n, 8)."""
    unit = n * math.lcm(n, 8)
    return max(unit, -(-numel // unit) * unit)


def variance_update_steps(freeze, kappa):
    """T_v: kappa updates at each interval 1, 2, 4, ..., on the multiples of the interval that
    follow the previous interval's last update; up to the freeze."""
    steps, last, exponent = set(), 0, 0
    while last < freeze:
        interval = 2**exponent
        first = (last // interval + 1) * interval
        steps.update(first + j * interval for j in range(kappa))
        last, exponent = first + (kappa - 1) * interval, exponent + 1
    return {t for t in steps if t <= freeze}


def is_sync_step(t, freeze, scaler, clipper):
    interval = min(clipper, 2 ** ((t - freeze - 1) // scaler))
    return t % interval == 0


def _exchange(rows, worker_errors, server_errors):
    """Each worker's values of one tensor (rows), padded alone, through the simulation."""
    n, numel = len(rows), rows[0].numel()
    buffers = torch.zeros(n, worker_errors.shape[1], dtype=torch.float64)
    for r, row in enumerate(rows):
        buffers[r, :numel] = row.reshape(-1)
    result, worker_errors, server_errors = oracle_compressed_allreduce(
        buffers, worker_errors, server_errors
    )
    return result[:numel].reshape(rows[0].shape), worker_errors, server_errors


def oracle_zero_one_adam(
    init, grad_fn, lr_fn, n, steps, hyper, masks=None, refreshes=(), grad_scale=None
):
    """Each worker's parameters after every step: ``history[t][r][i]`` (float64).

    ``hyper``: betas, eps, weight_decay (per tensor, a list), var_freeze_step,
    var_update_scaler, local_step_scaler, local_step_clipper and optionally
    pre_freeze_exchange ("gradient", the default, or "momentum"). ``lr_fn(t, i)``: the learning
    rate of tensor i at step t; ``grad_fn(r, i, p)``: worker r's gradient of tensor i at its
    weights p, times ``grad_scale(t)`` where given; ``masks[i]``: tensor i's exp_avg_mask or
    None (the elements whose variance is 0 are masked too). ``refreshes``: the ``(first,
    last)`` steps of each refresh of the guard after the freeze, taken as given (ALGORITHM.md,
    "The guard after the freeze", 0/1 Adam): dense steps, both error buffers zeroed at the
    first, and after the last, r, the steps run as after the freeze with T = r.
    """
    b1, b2 = hyper["betas"]
    eps, decay = hyper["eps"], hyper["weight_decay"]
    freeze, kappa = hyper["var_freeze_step"], hyper["var_update_scaler"]
    scaler, clipper = hyper["local_step_scaler"], hyper["local_step_clipper"]
    exchange_momentum = hyper.get("pre_freeze_exchange", "gradient") == "momentum"
    updates = variance_update_steps(freeze, kappa)
    k = len(init)
    masks = masks or [None] * k
    p = [[x.clone().double() for x in init] for _ in range(n)]
    m = [[torch.zeros_like(x, dtype=torch.float64) for x in init] for _ in range(n)]
    v = [torch.zeros_like(x, dtype=torch.float64) for x in init]
    synced, lr_sum = None, [0.0] * k
    sizes = [padded(x.numel(), n) for x in init]
    we = [torch.zeros(n, size, dtype=torch.float64) for size in sizes]
    se = [torch.zeros(n, size // n, dtype=torch.float64) for size in sizes]

    def masked(x, i):
        """x where tensor i's exp_avg_mask (if any) and [v > 0] keep it, else 0."""
        kept = x * (v[i] > 0).double()
        return kept if masks[i] is None else kept * masks[i].double()

    def refreshing(t):
        return any(first <= t <= last for first, last in refreshes)

    def last_freeze(t):
        """T, or the last step of the last refresh before t."""
        return max([freeze, *(last for _, last in refreshes if last < t)])

    history = []
    for t in range(1, steps + 1):
        scale = 1.0 if grad_scale is None else grad_scale(t)
        if any(first == t for first, _ in refreshes):
            we = [torch.zeros_like(e) for e in we]
            se = [torch.zeros_like(e) for e in se]
        for i in range(k):
            lr, wd = lr_fn(t, i), decay[i]
            grads = [grad_fn(r, i, p[r][i]) * scale for r in range(n)]
            d = v[i].sqrt() + eps
            if (t <= freeze and t in updates) or refreshing(t):
                g = sum(grads) / n
                v[i] = b2 * v[i] + (1 - b2) * g * g
                d = v[i].sqrt() + eps
                for r in range(n):
                    m[r][i] = b1 * m[r][i] + (1 - b1) * g
                    p[r][i] = p[r][i] - lr * (m[r][i] / d + wd * p[r][i])
            elif t <= freeze and not exchange_momentum:
                g, we[i], se[i] = _exchange(grads, we[i], se[i])
                g = masked(g, i)
                for r in range(n):
                    m[r][i] = b1 * m[r][i] + (1 - b1) * g
                    p[r][i] = p[r][i] - lr * (m[r][i] / d + wd * p[r][i])
            else:
                frozen_after = last_freeze(t)
                if t <= frozen_after + 1 and i == 0:  # an interval starts at t - 1's weights
                    synced = [x.clone() for x in p[0]]
                    lr_sum = [0.0] * k
                if t == freeze + 1 and i == 0 and not exchange_momentum:
                    we = [torch.zeros_like(e) for e in we]
                    se = [torch.zeros_like(e) for e in se]
                for r in range(n):
                    m[r][i] = b1 * m[r][i] + (1 - b1) * grads[r]
                    p[r][i] = p[r][i] - lr * (m[r][i] / d + wd * p[r][i])
                lr_sum[i] += lr
                if t <= freeze or is_sync_step(t, frozen_after, scaler, clipper):
                    deltas = [(p[r][i] - synced[i]) * d for r in range(n)]
                    delta, we[i], se[i] = _exchange(deltas, we[i], se[i])
                    delta = masked(delta, i)
                    momentum = -delta / lr_sum[i] if lr_sum[i] > 0 else torch.zeros_like(delta)
                    synced[i] = synced[i] + delta / d
                    for r in range(n):
                        m[r][i] = momentum.clone()
                        p[r][i] = synced[i].clone()
                    lr_sum[i] = 0.0
        history.append([[x.clone() for x in p[r]] for r in range(n)])
    return history
