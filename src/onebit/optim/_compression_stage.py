"""The compression stage's own state: the buffer the momentum is exchanged in, the masks of the
tensors' elements (``exp_avg_mask`` and the elements whose variance is 0), the limits of the
decoded momentum they give (with ``momentum_bound``, Adam's largest ``|m| / sqrt(v)``) and the
scaling coefficients ``s_p`` set at the switch (ALGORITHM.md, "1-bit LAMB", "Elements whose
variance is 0", "A bound on each element's momentum")."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from onebit.coefficients import adam_momentum_bound
from onebit.exchange import Exchange
from onebit.optim._flat import FlatState
from onebit.optim._sharding import ShardGroup

__all__ = [
    "CompressionStage",
    "check_group_masks",
    "flat_limit",
    "flat_mask",
    "scaling_coefficients_",
]

logger = logging.getLogger("onebit")


def group_masks(params: Sequence[Tensor], masks: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """One ``exp_avg_mask`` per parameter: ``masks`` itself for each, or its entries."""
    if isinstance(masks, Tensor):
        return [masks] * len(params)
    masks = list(masks)
    if len(masks) != len(params) or not all(isinstance(m, Tensor) for m in masks):
        raise ValueError(
            f"exp_avg_mask must be a tensor or a list of one tensor per parameter; got "
            f"{len(masks)} entries for {len(params)} parameters"
        )
    return masks


def check_group_masks(param_group: Mapping[str, Any]) -> dict[str, Any]:
    """``param_group`` with its parameters as a list, after checking that its
    ``exp_avg_mask`` (if any) has one mask of each parameter's shape."""
    if "exp_avg_mask" not in param_group:
        return param_group
    params = param_group["params"]
    params = [params] if isinstance(params, Tensor) else list(params)
    masks = group_masks(params, param_group["exp_avg_mask"])
    for index, (param, mask) in enumerate(zip(params, masks, strict=True)):
        if mask.shape != param.shape:
            raise ValueError(
                f"exp_avg_mask for parameter {index} of its group has shape "
                f"{tuple(mask.shape)}; the parameter has shape {tuple(param.shape)}"
            )
    return {**param_group, "params": params}


def flat_mask(
    flat: FlatState,
    has_state: Sequence[bool],
    param_groups: Sequence[Mapping[str, Any]],
    shards: ShardGroup | None,
) -> Tensor | None:
    """The tensors' masks as one flat buffer: ``[v > 0]`` times the groups' ``exp_avg_mask``;
    ``None`` where that is 1 everywhere. Tensors without state count as ones."""
    mask = torch.gt(flat.exp_avg_sq, 0, out=torch.empty_like(flat.exp_avg_sq))
    for index, active in enumerate(has_state):
        if not active:
            flat.view(mask, index).fill_(1)
    index_of = {id(param): index for index, param in enumerate(flat.params)}
    for group in param_groups:
        if "exp_avg_mask" in group:
            masks = group_masks(group["params"], group["exp_avg_mask"])
            for param, param_mask in zip(group["params"], masks, strict=True):
                if id(param) in index_of:
                    local = param_mask if shards is None else shards.local_slice(param_mask)
                    flat.view(mask, index_of[id(param)]).mul_(local)
    least, most = torch.aminmax(mask)  # one pass, where (mask == 1).all() took five
    return None if bool(least == 1) and bool(most == 1) else mask


def flat_limit(
    flat: FlatState,
    has_state: Sequence[bool],
    param_groups: Sequence[Mapping[str, Any]],
    shards: ShardGroup | None,
) -> Tensor | None:
    """The limit ``l`` of the decoded momentum, ``m = clamp(decoded, -l, l)``, as one flat
    buffer: 0 where :func:`flat_mask` is 0; elsewhere ``B sqrt(v)`` in the groups with
    ``momentum_bound`` (:func:`adam_momentum_bound` of their betas), ``inf`` in the others and
    in tensors without state. ``None`` where it is ``inf`` everywhere."""
    mask = flat_mask(flat, has_state, param_groups, shards)
    bounds = [
        adam_momentum_bound(group["betas"]) if active and group.get("momentum_bound") else math.inf
        for group, active in zip(flat.groups, has_state, strict=True)
    ]
    if mask is None and not any(map(math.isfinite, bounds)):
        return None
    limit = torch.sqrt(flat.exp_avg_sq)
    for index, bound in enumerate(bounds):
        if math.isfinite(bound):
            flat.view(limit, index).mul_(bound)
        else:
            flat.view(limit, index).fill_(math.inf)
    if mask is not None:
        limit.masked_fill_(mask == 0, 0)
    return limit


class CompressionStage:
    """The momentum's exchange buffer and the limits of its decoded values (:func:`flat_limit`),
    set up at the stage's first step (:meth:`set_up`) and again after a checkpoint load
    (:meth:`reset`); 0/1 Adam's buffer and mask (:meth:`set_up_accumulator`)."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.mask: Tensor | None = None
        self.limit: Tensor | None = None

    @property
    def ready(self) -> bool:
        return self.buffer is not None

    def reset(self) -> None:
        self.buffer = self.mask = self.limit = None

    def set_up(
        self,
        flat: FlatState,
        has_state: Sequence[bool],
        exchange: Exchange,
        param_groups: Sequence[Mapping[str, Any]],
        shards: ShardGroup | None,
    ) -> Tensor:
        """The buffer (the bound ``exchange``'s own, padded as it needs: its error updates go
        there early) and the limits."""
        if not any(has_state):
            raise RuntimeError(
                "no parameter received a gradient during the warm-up stage; nothing to compress"
            )
        skipped = list(has_state).count(False)
        if skipped:
            logger.warning(
                "%d trainable parameter tensor(s) had no gradient during warm-up; they are "
                "left out of the compression stage and no longer updated",
                skipped,
            )
        self.limit = flat_limit(flat, has_state, param_groups, shards)
        self.buffer = exchange.send_buffer()
        return self.buffer

    def set_up_accumulator(
        self,
        flat: FlatState,
        has_state: Sequence[bool],
        param_groups: Sequence[Mapping[str, Any]],
        shards: ShardGroup | None,
        refresh_mask: bool,
    ) -> Tensor:
        """0/1 Adam's buffer of ``N`` elements (allocated once), returned, and the mask,
        computed anew where ``refresh_mask`` (the variance may have changed)."""
        if self.buffer is None:
            self.buffer = torch.empty(flat.numel, dtype=flat.dtype, device=flat.device)
        elif not refresh_mask:
            return self.buffer
        self.mask = flat_mask(flat, has_state, param_groups, shards)
        return self.buffer

    def nbytes(self) -> int:
        """Bytes of the buffer, the limits and the mask, where they exist."""
        held = [t for t in (self.buffer, self.limit, self.mask) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)


def scaling_coefficients_(flat: FlatState, has_state: Sequence[bool]) -> None:
    """At the switch of the fused exchange: ``s_p = mean_q rms(m_q) / rms(m_p)`` (1 where
    ``rms(m_p)`` is 0; of the whole tensors when sharded), into ``flat.scalars``."""
    indices = [i for i, has in enumerate(has_state) if has]
    momenta = [flat.view(flat.exp_avg, i) for i in indices]
    sizes = [flat.params[i].numel() for i in indices]
    sizes = torch.tensor(sizes, dtype=flat.dtype, device=flat.device)
    rms = flat.norms(momenta) / sizes.sqrt()
    scaling = torch.where(rms > 0, rms.mean() / torch.where(rms > 0, rms, 1), 1)
    flat.scalars["scaling_coeff"][indices] = scaling
