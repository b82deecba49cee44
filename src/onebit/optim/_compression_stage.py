"""The compression stage's state, shared by 1-bit LAMB, 1-bit Adam and 0/1 Adam: the buffer the
momentum is exchanged in, the masks of the tensors' elements (``exp_avg_mask`` and the elements
whose variance is 0), the scaling coefficients ``s_p`` set at the switch, each rank's scaled
local momentum, and the step's exchange begun during backward (``overlap_backward``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from onebit.optim import _common
from onebit.optim._communicating import CommunicatingOptimizer
from onebit.optim._flat import FlatState
from onebit.optim._overlap import bucket_members

__all__ = ["COMPRESSION", "CompressionStage"]

logger = logging.getLogger("onebit")

#: The kind of step that exchanges the momentum at 1 bit.
COMPRESSION = "compression"


class CompressionStage(CommunicatingOptimizer):
    """What the compression stage keeps beyond the flat state: ``_exchange_buffer`` (built at
    the stage's first step, with the masks and ``s_p``) and ``_mask``, which the subclass's
    ``__init__`` sets to ``None``. The subclass gives ``stage``, ``freeze_step``,
    ``max_grad_norm``, ``_overlap`` and its own compression-stage state
    (``_start_compression``)."""

    def memory_bytes(self) -> dict[str, int]:
        """:meth:`FlatOptimizer.memory_bytes` plus ``"error_feedback"`` (the exchange's
        worker and server errors, once created); ``"scratch"`` includes the exchange buffer
        and the exchange's own scratch."""
        memory = super().memory_bytes()
        errors = [] if self._exchange is None else [e for e in self.error_feedback if e is not None]
        memory["error_feedback"] = sum(e.numel() * e.element_size() for e in errors)
        if self._exchange_buffer is not None:
            buffer = self._exchange_buffer
            memory["scratch"] += buffer.numel() * buffer.element_size()
        if self._exchange is not None:
            memory["scratch"] += self._exchange.nbytes()
        return memory

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after checking the group's ``exp_avg_mask`` (nothing is added when it is
        wrong); a group added after construction gets the overlap's hooks too."""
        if "exp_avg_mask" in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            param_group = {**param_group, "params": params}
            masks = self._masks_of(params, param_group["exp_avg_mask"])
            for index, (param, mask) in enumerate(zip(params, masks, strict=True)):
                if mask.shape != param.shape:
                    raise ValueError(
                        f"exp_avg_mask for parameter {index} of its group has shape "
                        f"{tuple(mask.shape)}; the parameter has shape {tuple(param.shape)}"
                    )
        super().add_param_group(param_group)
        if getattr(self, "_overlap", None) is not None:
            self._overlap.watch([p for p in self.param_groups[-1]["params"] if p.requires_grad])

    @staticmethod
    def _masks_of(params: list[Tensor], masks: Tensor | Sequence[Tensor]) -> list[Tensor]:
        """One mask per parameter: ``masks`` itself for each, or its entries."""
        if isinstance(masks, Tensor):
            return [masks] * len(params)
        masks = list(masks)
        if len(masks) != len(params) or not all(isinstance(m, Tensor) for m in masks):
            raise ValueError(
                f"exp_avg_mask must be a tensor or a list of one tensor per parameter; got "
                f"{len(masks)} entries for {len(params)} parameters"
            )
        return masks

    def _clip_own_gradients(self, grads: Sequence[Tensor | None]) -> None:
        """With ``max_grad_norm``: this rank's own gradients clipped at ``max_grad_norm·√W``
        (W workers of the exchange; ALGORITHM.md, "Gradient clipping")."""
        if self.max_grad_norm:
            threshold = self.max_grad_norm * math.sqrt(self.exchange.world_size)
            _common.clip_by_total_norm_([g for g in grads if g is not None], threshold, self.shards)

    def _begin_overlap(self):
        """The step's bucketed exchange, for :class:`~onebit.optim._overlap.BackwardOverlap`:
        its pipeline, the tensors in each bucket, how to form their momenta, and which
        tensors need no gradient (those left out of the stage)."""
        flat, buffer, exchange = self._flat, self._exchange_buffer, self.exchange
        buffer[flat.numel :].zero_()
        members = bucket_members(flat.offsets, exchange.buckets())

        def form(only: Sequence[int]) -> None:
            grads = [None] * len(flat.params)
            for index in only:
                grads[index] = _common.dense_grad(flat.params[index], flat.dtype)
            self._scaled_local_momentum(flat, grads, buffer, only)

        ready = [not has for has in self._has_state]
        return exchange.begin(buffer), members, form, ready

    def _scaled_local_momentum(
        self,
        flat: FlatState,
        grads: Sequence[Tensor | None],
        buffer: Tensor,
        only: Sequence[int] | None = None,
    ) -> None:
        """``buffer = s_p (b1 m_p + (1 - b1) g_p)`` of this rank's gradients, padded; with
        ``only``, just those tensors' ranges (the padding untouched)."""
        selected = set(range(len(grads)) if only is None else only)
        local = [  # a parameter without a gradient on this rank contributes zeros
            torch.zeros(t.shape, dtype=flat.dtype, device=flat.device)
            if g is None and index in selected
            else g
            for index, (t, g) in enumerate(zip(flat.tensors, grads, strict=True))
        ]
        self.updates.scaled_momentum(
            flat, local, flat.scalars["scaling_coeff"], buffer, self._has_state, only
        )
        if only is None:
            buffer[flat.numel :].zero_()

    @torch.no_grad()
    def local_momentum(self) -> Tensor:
        """In the compression stage: the momentum the next ``step()`` would send for the
        gradients in ``.grad``, ``s_p (b1 m_p + (1 - b1) g_p)`` in the padded exchange buffer
        (overwritten by the next call and by ``step()``), from the gradients clipped as
        ``step()`` clips them (``max_grad_norm``). Nothing else changes, except that the first
        call of the stage sets up its state, as its first ``step()`` would."""
        if self.stage != COMPRESSION:
            raise RuntimeError(
                f"local_momentum() is for the compression stage; step {self.step_count + 1} "
                f"is in the warm-up (freeze_step={self.freeze_step})"
            )
        if self._overlap is not None and self._overlap.in_flight:
            raise RuntimeError(
                "local_momentum() would overwrite the momentum whose exchange started during "
                "backward (overlap_backward=True); call it before backward or after step()"
            )
        flat = self._flat_state()
        grads = [_common.dense_grad(p, flat.dtype) for p in flat.params]
        buffer = self._exchange_buffer_for(flat)
        self._clip_own_gradients(grads)
        self._scaled_local_momentum(flat, grads, buffer)
        return buffer

    def _exchange_buffer_for(self, flat: FlatState) -> Tensor:
        """The buffer the momentum is exchanged in (padded as :attr:`exchange` needs); at the
        first compression step also the masks, the scaling coefficients ``s_p`` and the
        subclass's compression-stage state."""
        if self._exchange_buffer is not None:
            return self._exchange_buffer
        if not any(self._has_state):
            raise RuntimeError(
                "no parameter received a gradient during the warm-up stage; nothing to compress"
            )
        skipped = self._has_state.count(False)
        if skipped:
            logger.warning(
                "%d trainable parameter tensor(s) had no gradient during warm-up; they are "
                "left out of the compression stage and no longer updated",
                skipped,
            )
        exchange = self._bind_exchange(flat)
        self._mask = self._flat_mask(flat)
        if self.step_count == self.freeze_step:  # not when resuming later in the stage
            self._start_compression(flat)
        self._exchange_buffer = exchange.send_buffer()  # its own: error updates go there early
        return self._exchange_buffer

    def _flat_mask(self, flat: FlatState) -> Tensor | None:
        """The tensors' masks as one flat buffer: ``[v > 0]`` times the groups'
        ``exp_avg_mask`` (ALGORITHM.md, "Elements whose variance is 0"); ``None`` where that
        is 1 everywhere. Tensors left out of the exchange count as ones."""
        mask = torch.gt(flat.exp_avg_sq, 0, out=torch.empty_like(flat.exp_avg_sq))
        for index, active in enumerate(self._has_state):
            if not active:
                flat.view(mask, index).fill_(1)
        index_of = {id(param): index for index, param in enumerate(flat.params)}
        for group in self.param_groups:
            if "exp_avg_mask" in group:
                group_masks = self._masks_of(group["params"], group["exp_avg_mask"])
                for param, param_mask in zip(group["params"], group_masks, strict=True):
                    if id(param) in index_of:
                        index = index_of[id(param)]
                        flat.view(mask, index).mul_(self._local_mask(param_mask))
        least, most = torch.aminmax(mask)  # one pass, where (mask == 1).all() took five
        return None if bool(least == 1) and bool(most == 1) else mask

    def _local_mask(self, mask: Tensor) -> Tensor:
        """A parameter's ``exp_avg_mask`` on this rank: its slice when sharded."""
        return mask if self.shards is None else self.shards.local_slice(mask)

    def _start_compression(self, flat: FlatState) -> None:
        """At the first compression step: ``s_p = mean_q rms(m_q) / rms(m_p)`` (1 if 0; stays 1
        with per-tensor compression; of the whole tensors when sharded); subclasses add their
        compression-stage state."""
        indices = [i for i, has in enumerate(self._has_state) if has]
        momenta = [flat.view(flat.exp_avg, i) for i in indices]
        if self.compression == "fused":
            sizes = [flat.params[i].numel() for i in indices]
            sizes = torch.tensor(sizes, dtype=flat.dtype, device=flat.device)
            rms = flat.norms(momenta) / sizes.sqrt()
            scaling = torch.where(rms > 0, rms.mean() / torch.where(rms > 0, rms, 1), 1)
            flat.scalars["scaling_coeff"][indices] = scaling
        if self._is_logging_rank():
            logger.info(
                "%s: switching to 1-bit compressed momentum at step %d (%d tensors, %d "
                "elements, %d ranks)",
                type(self).__name__,
                self.step_count + 1,
                len(indices),
                sum(m.numel() for m in momenta),
                self.world_size,
            )
