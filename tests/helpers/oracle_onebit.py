"""An independent float64 model of ALGORITHM.md: 1-bit LAMB and 1-bit Adam over n workers.

Written from the spec with plain tensor arithmetic, one worker per row; the
compressed exchange is the test oracle's (oracle.py: oracle_compressed_allreduce, or
oracle_hierarchical_compressed_allreduce for nodes of several workers; itself tested
against a numpy model). The oracle the multi-process optimizers must follow.
"""

from __future__ import annotations

import math

import torch

from helpers.oracle import oracle_compressed_allreduce, oracle_hierarchical_compressed_allreduce


def _rms(x):
    return math.sqrt(float((x * x).sum()) / x.numel())


def oracle_run(
    kind,
    init,
    grad_fn,
    n,
    steps,
    freeze,
    groups,
    hyper,
    masks=None,
    compression="fused",
    node_size=1,
    bucket_elements=None,
    refreshes=(),
    grad_scale=None,
):
    """Return the parameters after each step, as lists of float64 tensors.

    groups[i] = (lr, weight_decay) of tensor i; hyper holds betas, eps, the LAMB bounds and
    1-bit LAMB's trust_bound (if any) and momentum_bound (default: on for 1-bit LAMB, as in
    OneBitLamb);
    masks[i] is tensor i's exp_avg_mask or None (the elements whose variance is 0 are masked
    too); grad_fn(rank, i, p) is worker rank's gradient of tensor i at parameter value p.
    compression="per_tensor" exchanges each tensor alone (s_p = 1), as DeepSpeed's OnebitAdam
    does; node_size > 1 exchanges the fused buffer hierarchically over nodes of that many
    workers; bucket_elements cuts the fused buffer into buckets of that many elements
    (rounded down to a multiple of 8n), each exchanged alone with its own error buffers
    (ALGORITHM.md, "Bucketed exchange"). refreshes: the (first, last) steps of each refresh
    of the guard after the freeze (ALGORITHM.md, "The guard after the freeze"): dense steps as
    in the warm-up, the error feedback zeroed at the first, and at the last a freeze as at the
    warm-up's end (v_fresh, f_last; s_p from the momentum at the next step). grad_scale(t), if
    given, multiplies every gradient of step t.
    """
    b1, b2 = hyper["betas"]
    eps = hyper["eps"]
    params = [p.clone().double() for p in init]
    k = len(params)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    v_fresh = [None] * k
    c_frz = [0.0] * k
    f_last = [1.0] * k
    trust_base = [0.0] * k  # trust_bound's ratio of step to weights at the stage's first step
    scaling = None
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    unit = 8 * n
    padded = max(unit, -(-total // unit) * unit)
    we = torch.zeros(n, padded // node_size, dtype=torch.float64)
    bucket = max(unit, (bucket_elements or padded) // unit * unit)
    buckets = [(start, min(start + bucket, padded)) for start in range(0, padded, bucket)]
    bucket_errors = [
        (
            torch.zeros(n, e - s, dtype=torch.float64),
            torch.zeros(n, (e - s) // n, dtype=torch.float64),
        )
        for s, e in buckets
    ]
    se = torch.zeros(n, padded // n, dtype=torch.float64)
    # Per tensor: padded alone to a multiple of n * lcm(n, 8), its own error buffers.
    unit_alone = n * math.lcm(n, 8)
    alone = [max(unit_alone, -(-size // unit_alone) * unit_alone) for size in sizes]
    tensor_errors = [
        (torch.zeros(n, size, dtype=torch.float64), torch.zeros(n, size // n, dtype=torch.float64))
        for size in alone
    ]

    def mask(i):
        """Tensor i's exp_avg_mask (if any) times [v > 0]: what a decoded value is kept at."""
        kept = (v[i] > 0).double()
        return kept if masks is None or masks[i] is None else kept * masks[i].double()

    def grad(r, i, t):
        g = grad_fn(r, i, params[i])
        return g if grad_scale is None else g * grad_scale(t)

    def exchange(t):
        """Every tensor's exchanged momentum (divided by its s_p), before the mask."""
        nonlocal scaling, we, se
        local = [[b1 * m[i] + (1 - b1) * grad(r, i, t) for i in range(k)] for r in range(n)]
        if compression == "per_tensor":
            exchanged = []
            for i in range(k):
                buffers = torch.zeros(n, alone[i], dtype=torch.float64)
                for r in range(n):
                    buffers[r, : sizes[i]] = local[r][i].reshape(-1)
                result, *tensor_errors[i] = oracle_compressed_allreduce(buffers, *tensor_errors[i])
                exchanged.append(result[: sizes[i]].reshape(params[i].shape))
            return exchanged
        if scaling is None:
            rms = [_rms(x) for x in m]
            mean = sum(rms) / k
            scaling = [mean / r if r > 0 else 1.0 for r in rms]
        buffers = torch.zeros(n, padded, dtype=torch.float64)
        for r in range(n):
            buffers[r, :total] = torch.cat([scaling[i] * local[r][i].reshape(-1) for i in range(k)])
        if node_size > 1:
            result, we, se = oracle_hierarchical_compressed_allreduce(buffers, we, se, node_size)
        elif len(buckets) > 1:
            result = torch.empty(padded, dtype=torch.float64)
            for b, (start, end) in enumerate(buckets):
                result[start:end], *bucket_errors[b] = oracle_compressed_allreduce(
                    buffers[:, start:end].contiguous(), *bucket_errors[b]
                )
        else:
            result, we, se = oracle_compressed_allreduce(buffers, we, se)
        offsets = [sum(sizes[:i]) for i in range(k + 1)]
        return [
            result[offsets[i] : offsets[i + 1]].reshape(params[i].shape) / scaling[i]
            for i in range(k)
        ]

    history = []
    for t in range(1, steps + 1):
        if any(first == t for first, _ in refreshes):
            for error in (we, se, *(e for pair in (*bucket_errors, *tensor_errors) for e in pair)):
                error.zero_()
            scaling = None
        freezes_after = t == freeze or any(last == t for _, last in refreshes)
        if t <= freeze or any(first <= t <= last for first, last in refreshes):
            for i in range(k):
                lr, wd = groups[i]
                g = sum(grad(r, i, t) for r in range(n)) / n
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                u = m[i] / (v[i].sqrt() + eps) + wd * params[i]
                if kind == "lamb":
                    pn, un = params[i].norm().item(), u.norm().item()
                    c = 1.0
                    if pn > 0 and un > 0:
                        c = min(max(pn / un, hyper["min_coeff"]), hyper["max_coeff"])
                        c_frz[i] = hyper["coeff_beta"] * c_frz[i] + (1 - hyper["coeff_beta"]) * c
                    params[i] = params[i] - lr * c * u
                else:
                    params[i] = params[i] - lr * u
                if freezes_after:
                    v_fresh[i] = v[i].clone()
                    f_last[i] = 1.0
                    trust_base[i] = 0.0
        else:
            decoded = exchange(t)
            for i in range(k):
                lr, wd = groups[i]
                m_prev = m[i]
                m[i] = decoded[i] * mask(i)
                if hyper.get("momentum_bound", kind == "lamb"):  # |m| <= B sqrt(v), B Adam's
                    # largest |m| / sqrt(v)
                    bound = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
                    limit = bound * v[i].sqrt() * mask(i)
                    m[i] = torch.minimum(torch.maximum(decoded[i], -limit), limit)
                d = v[i].sqrt() + eps
                u0 = m[i] / d
                u = u0 + wd * params[i]
                if kind == "lamb":
                    g_hat = (m[i] - b1 * m_prev) / (1 - b1)
                    v_fresh[i] = b2 * v_fresh[i] + (1 - b2) * g_hat * g_hat
                    f = (d / (v_fresh[i].sqrt() + eps)).max().item()
                    if wd > 0:
                        rho = min(1.0, u0.norm().item() / u.norm().item())
                        f = rho * f + (1 - rho)
                    f = min(max(f, hyper["factor_min"]), hyper["factor_max"])
                    tau = hyper["factor_threshold"]
                    f = min(max(f, f_last[i] * (1 - tau)), f_last[i] * (1 + tau))
                    f_last[i] = f
                    c = c_frz[i] * f
                    kappa = hyper.get("trust_bound")
                    pn, un = params[i].norm().item(), u.norm().item()
                    if kappa and pn > 0 and un > 0:
                        if trust_base[i] == 0:
                            trust_base[i] = c * un / pn
                        c = min(c, kappa * trust_base[i] * pn / un)
                    params[i] = params[i] - lr * c * u
                else:
                    params[i] = params[i] - lr * u
        history.append([p.clone() for p in params])
    return history
