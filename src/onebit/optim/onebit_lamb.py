"""1-bit LAMB (Li et al., 2021, arXiv 2104.06069)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from onebit.exchange import NodeGroups
from onebit.optim import checks
from onebit.optim._onebit import OneBitOptimizer
from onebit.optim._rules import OneBitLambRule, last_coefficients
from onebit.optim._schedule import FreezeSchedule

__all__ = ["OneBitLamb"]


class OneBitLamb(OneBitOptimizer):
    r"""1-bit LAMB: LAMB warm-up, then 1-bit momentum with a bounded adaptive trust ratio.

    **Warm-up** (steps ``1 .. freeze_step``): exactly :class:`onebit.Lamb` on gradients
    averaged over ranks, recording an EMA of the trust ratio,
    ``c_frz <- coeff_beta c_frz + (1 - coeff_beta) c`` (from 0, never de-biased).

    **Compression** (later steps): ``m <- b1 m + (1 - b1) g_local`` on each rank; the momenta
    of all tensors, scaled by ``s_p = mean_q rms(m_q) / rms(m_p)`` (fixed at the switch), are
    averaged by :func:`onebit.compressed_allreduce`. The variance ``v`` stays frozen, while
    ``v_fresh`` tracks the gradient reconstructed from consecutive momenta,
    ``g = (m_t - b1 m_{t-1}) / (1 - b1)``. Each tensor then steps by
    ``p <- p - lr (c_frz f) (m / (sqrt(v) + eps) + wd p)`` with the factor
    ``f = max(d / (sqrt(v_fresh) + eps))`` (``d = sqrt(v) + eps``), pulled towards 1 by the
    weight-decay share of the update, clamped to ``[factor_min, factor_max]`` and to within
    ``factor_threshold`` of its previous value.

    By default each tensor is compressed alone, with its own scales and error buffers and
    ``s_p = 1`` (:func:`onebit.compressed_allreduce_per_tensor`, all tensors in the same four
    collectives); ``compression="fused"`` exchanges DeepSpeed's one buffer scaled by ``s_p``.

    Argument names and defaults follow DeepSpeed's ``OnebitLamb``. Param groups may override
    the hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``, the coefficient and
    factor bounds, ``coeff_beta``, ``trust_bound``, ``momentum_bound``) and may carry
    ``exp_avg_mask`` (a tensor, or one per parameter, of the parameter's shape) that
    multiplies the exchanged momentum so masked entries stay zero; a bad value, or an
    argument of the optimizer as a whole (``freeze_step``, ...) set in a group, is refused
    by name. Every ``step()`` updates the parameters.

    Gradients: in a plain loop each rank calls ``backward()`` and ``step()``; the optimizer
    averages warm-up gradients itself. Under ``DistributedDataParallel``, register
    :func:`onebit.ddp.register_comm_hook` so DDP averages in warm-up and stays silent after.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        freeze_step: number of warm-up steps (LAMB) before compression starts; the reference
            tutorial suggests 15-25 % of all steps. A warning says when the variance has not
            settled by then (ALGORITHM.md, "Variance readiness"). ``"auto"``: freeze once it
            has, checked every 10 steps, at ``max_freeze_step`` (default 100000) at the latest.
        betas: ``(beta1, beta2)``.
        eps: added to ``sqrt(v)``.
        weight_decay: decoupled weight decay, part of the update ``u``.
        max_coeff, min_coeff: clamp of the warm-up trust ratio.
        coeff_beta: EMA factor of the frozen trust ratio ``c_frz``.
        factor_max, factor_min: clamp of the compression-stage factor ``f``.
        factor_threshold: largest relative change of ``f`` per step.
        process_group: the data-parallel group (default: the world).
        on_nonfinite: ``"skip"`` (default) skips a step on every rank when any rank's
            gradients hold NaN/Inf, with a warning; ``"raise"`` raises on every rank.
        verify_every: every this many steps, check that all ranks hold bit-identical
            parameters (a checksum each, one small all-gather) and raise
            :class:`onebit.ReplicaMismatchError` naming the step and tensor if not; 0 checks
            only at the first step.
        kernels: the backend of the update and the exchange (:mod:`onebit.kernels`):
            ``None`` or ``"auto"`` (``$ONEBIT_KERNELS``, else the fused backend of the
            parameters' device where installed), ``"torch"``, ``"numba"`` or ``"triton"``.
            Every rank must use the same one.
        node_groups: ``(intra_group, inter_group)`` from :func:`onebit.node_groups` to
            exchange hierarchically: dense within a node, 1 bit between nodes (about ``L``
            times fewer bytes between nodes of ``L`` ranks); ``None`` for the flat exchange.
        compression: how the momentum is exchanged. ``"per_tensor"``: every tensor alone
            (ALGORITHM.md, "Each tensor compressed alone"); ``"fused"``: DeepSpeed's one
            buffer of all tensors, each scaled by ``s_p``, one scale per rank and chunk (it
            diverged in 5 of 10 short runs where per-tensor compression did not:
            docs/VARIANCE-READINESS.md). ``None`` (default): ``"per_tensor"``. A checkpoint
            loads only into an optimizer of the compression it was saved with.
        max_grad_norm: if positive, ``step()`` clips the gradients its update uses (as
            ``torch.nn.utils.clip_grad_norm_`` does): the averaged ones at ``max_grad_norm``
            in the warm-up (after its own average, or DDP's), each rank's own at
            ``max_grad_norm·√W`` in the compression stage (W ranks; ALGORITHM.md,
            "Gradient clipping"). 0 (default): no clipping.
        bucket_cap_mb: exchange the momentum in buckets of this many MiB, each compressed
            alone (ALGORITHM.md, "Bucketed exchange"; not with ``node_groups``); per tensor,
            buckets of whole tensors, every tensor compressed as without buckets; ``None``
            (default): the whole buffer in one exchange, or 25 MiB buckets with
            ``overlap_backward``. The buckets' phases are pipelined (one on the wire while
            another is compressed).
        overlap_backward: in the compression stage, start each bucket's exchange during
            backward, as soon as its last gradient is accumulated (ALGORITHM.md, "Exchange
            overlapped with backward"); ``step()`` waits for the rest. The same result as
            without, bit for bit; the gradients are read when backward produces them, so
            not with ``max_grad_norm`` or ``GradScaler``, a change made to them before
            ``step()`` comes too late, and passes that only accumulate gradients run under
            :meth:`no_sync`. Plain loops and DDP (with :func:`onebit.ddp.register_comm_hook`)
            alike.
        max_freeze_step: the latest step ``freeze_step="auto"`` freezes at.
        delayed_exchange: run each compression step's exchange while the caller computes
            the next step's gradients, and apply its update there, one step late
            (ALGORITHM.md, "Delayed exchange"), so that a slow link's bytes travel while the
            next step computes. Experimental: the stale gradients cost convergence
            (docs/CONVERGENCE.md, "The delayed exchange"). The weights lack
            the last update until :meth:`finish_exchange` (call it at the end of training);
            checkpoints keep the pending update. Over more than one rank the exchange is
            bucketed (25 MiB unless ``bucket_cap_mb`` is given). Not with
            ``overlap_backward``, ``node_groups`` or FSDP.
        variance_guard: what a growth of a tensor's momentum against the frozen variance
            does (ALGORITHM.md, "The guard after the freeze"): ``"refresh"`` (default), dense
            steps that refresh the variance until it has caught up, then a new freeze, with a
            warning; ``"warn"``, the warning alone; ``"off"``, nothing (DeepSpeed's).
            :attr:`refreshes` lists the refreshes; their bytes count under ``"refresh"``.
        trust_bound: κ > 0 lets a compression step grow at most κ-fold against the weights
            over the stage: ``c = min(c_frz f, κ ρ_0 ||p|| / ||u||)``, ρ_0 the stage's first
            ``c_frz f ||u|| / ||p||`` (ALGORITHM.md, "A bound on the frozen coefficient");
            ``None`` (default): the paper's ``c_frz f`` alone.
        momentum_bound: clamp each element's exchanged momentum to ``+-B sqrt(v)``, ``B =
            (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))`` the largest ``|m| / sqrt(v)`` Adam
            itself can reach (ALGORITHM.md, "A bound on each element's momentum"), so that an
            element whose own gradients are far below its tensor's 1-bit scale does not step
            by that scale over its small ``sqrt(v)`` (default); ``False``: the paper's, and
            DeepSpeed's.

    Works with ``torch.amp.GradScaler`` (without ``overlap_backward``;
    ``scaler.step(optimizer)``): the step unscales the
    gradients itself and skips on every rank when any rank overflowed. A failed collective
    (a peer that died or hangs past the process group's timeout) raises
    :class:`onebit.CommunicationError`.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int | str = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        process_group: dist.ProcessGroup | None = None,
        on_nonfinite: str = "skip",
        verify_every: int = 0,
        kernels: str | None = None,
        node_groups: NodeGroups | None = None,
        compression: str | None = None,
        max_grad_norm: float = 0.0,
        bucket_cap_mb: float | None = None,
        overlap_backward: bool = False,
        max_freeze_step: int | None = None,
        delayed_exchange: bool = False,
        variance_guard: str = "refresh",
        trust_bound: float | None = None,
        momentum_bound: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
            trust_bound=trust_bound,
            momentum_bound=momentum_bound,
        )
        checks.check_group(defaults)
        super().__init__(
            params,
            defaults,
            schedule=FreezeSchedule(freeze_step, max_freeze_step),
            rule=OneBitLambRule(),
            process_group=process_group,
            on_nonfinite=on_nonfinite,
            verify_every=verify_every,
            kernels=kernels,
            compression=compression,
            node_groups=node_groups,
            max_grad_norm=max_grad_norm,
            bucket_cap_mb=bucket_cap_mb,
            overlap_backward=overlap_backward,
            delayed_exchange=delayed_exchange,
            variance_guard=variance_guard,
        )

    def get_lamb_coeffs(self) -> list[float]:
        """Each parameter's last step coefficient (``c``, then ``c_frz * f``, or its
        ``trust_bound``'s bound where that held), in parameter order, for the parameters that have
        state (one host read)."""
        return last_coefficients(self._parameters.flat, self._parameters.has_state)
