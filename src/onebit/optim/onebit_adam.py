"""1-bit Adam (Tang et al., 2021), the compressed baseline of the 1-bit LAMB paper."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from onebit.exchange import NodeGroups
from onebit.optim import checks
from onebit.optim._onebit import OneBitOptimizer
from onebit.optim._rules import AdamRule
from onebit.optim._schedule import FreezeSchedule

__all__ = ["OneBitAdam"]


class OneBitAdam(OneBitOptimizer):
    r"""1-bit Adam: Adam warm-up, then 1-bit momentum with the variance frozen.

    Warm-up (steps ``1 .. freeze_step``), on gradients averaged over ranks:
    ``m, v <- moments(g)``, ``p <- p - lr (m / (sqrt(v) + eps) + wd p)``.
    Compression (later steps): ``m <- b1 m + (1 - b1) g_local`` on each rank, exchanged at
    1 bit per element, then the same update with ``v`` frozen. No bias correction.

    Arguments as DeepSpeed's ``OnebitAdam``; ``freeze_step="auto"`` with ``max_freeze_step``,
    ``process_group``, ``on_nonfinite``, ``verify_every``, ``kernels``, ``node_groups``,
    ``max_grad_norm``, ``bucket_cap_mb``, ``overlap_backward``, ``delayed_exchange``,
    ``variance_guard`` and the
    ``exp_avg_mask`` group option as in :class:`onebit.OneBitLamb`, and ``compression``, how
    the momentum is exchanged:

    * ``"per_tensor"``: DeepSpeed's scheme, each tensor compressed alone with its own scales
      and error buffers and no ``s_p`` (:func:`onebit.compressed_allreduce_per_tensor`, all
      tensors in the same two collectives; in buckets of whole tensors with
      ``bucket_cap_mb``, ``overlap_backward`` or ``delayed_exchange``; shard by shard
      between nodes with ``node_groups``).
    * ``"fused"``: one :func:`onebit.compressed_allreduce` of all tensors, each scaled by
      ``s_p`` as in DeepSpeed's 1-bit LAMB (it blew up in 3 of 10 short runs where per-tensor
      compression did not: docs/ONEBIT-ADAM.md).
    * ``None`` (default): ``"per_tensor"``.

    A checkpoint loads only into an optimizer of the compression it was saved with.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int | str = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
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
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        checks.check_group(defaults)
        super().__init__(
            params,
            defaults,
            schedule=FreezeSchedule(freeze_step, max_freeze_step),
            rule=AdamRule(),
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
