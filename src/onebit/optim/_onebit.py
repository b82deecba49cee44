"""The machinery 1-bit LAMB and 1-bit Adam share: stages, the fused momentum buffer, the
compressed exchange with its error state, gradient averaging, checkpoints and accounting."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from onebit.collectives import (
    CompressionWorkspace,
    NonFiniteError,
    TrafficCounter,
    allreduce_mean_,
    compressed_allreduce,
    padded_size,
    world_size,
)
from onebit.consistency import ReplicaMismatchError, verify_replicas
from onebit.optim import _common

logger = logging.getLogger("onebit")

WARMUP = "warmup"
COMPRESSION = "compression"
NONFINITE_POLICIES = ("skip", "raise")


class CommunicationError(RuntimeError):
    """A collective of the optimizer's step failed: a peer died, hung or diverged."""


@dataclass
class _FusedLayout:
    """Where each parameter's momentum sits in the fused buffer of the compression stage."""

    entries: list[tuple[dict[str, Any], Tensor, int, Tensor | None]]  # group, param, offset, mask
    numel: int
    buffer: Tensor  # padded_size(numel, n) elements; reused every step


class OneBitOptimizer(Optimizer):
    """Base class of :class:`OneBitLamb` and :class:`OneBitAdam`.

    Steps ``1 .. freeze_step`` form the warm-up stage: gradients are averaged over ranks at full
    precision (by this optimizer with one dense allreduce of a flat buffer, or by
    ``DistributedDataParallel`` when :func:`onebit.ddp.register_comm_hook` is used) and the
    subclass applies its uncompressed update. Later steps form the compression stage: each
    rank folds its *local* gradient into the momentum, the scaled momenta of all tensors are
    exchanged in one :func:`onebit.compressed_allreduce`, and the subclass applies its update
    with the decoded momentum, which is identical on every rank.

    Subclasses implement ``_init_state``, ``_warmup_update``, ``_compressed_update`` and may
    implement ``_start_compression``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        freeze_step: int,
        process_group: dist.ProcessGroup | None,
        on_nonfinite: str,
        verify_every: int,
    ) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"Invalid freeze_step={freeze_step}: it must be an int >= 1 (the number of "
                "warm-up steps that estimate the variance before it is frozen)"
            )
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid on_nonfinite={on_nonfinite!r}: use 'skip' or 'raise'")
        if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
            raise ValueError(f"Invalid verify_every={verify_every}: it must be an int >= 0")
        self.verify_every = verify_every
        self.freeze_step = freeze_step
        self.process_group = process_group
        self.on_nonfinite = on_nonfinite
        self.gradients_averaged_by_ddp = False
        self._counters: dict[str, Any] = {
            "step": 0,
            "skipped_steps": 0,
            "bytes_sent": {WARMUP: 0, COMPRESSION: 0},
        }
        self._worker_error: Tensor | None = None
        self._server_error: Tensor | None = None
        self._layout: _FusedLayout | None = None
        self._flat_grads: Tensor | None = None
        self._replicas_verified = False
        self._scratch = _common.ScratchPool()
        self._workspace = CompressionWorkspace()
        self._traffic = TrafficCounter()
        super().__init__(params, defaults)

    # ----------------------------------------------------------------- what users see
    @property
    def step_count(self) -> int:
        """Steps applied so far (skipped steps are not counted)."""
        return self._counters["step"]

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank's gradients were not finite."""
        return self._counters["skipped_steps"]

    @property
    def stage(self) -> str:
        """``"warmup"`` or ``"compression"``: the stage the next ``step()`` runs in."""
        return WARMUP if self._counters["step"] < self.freeze_step else COMPRESSION

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank has sent in each stage (a copy)."""
        return dict(self._counters["bytes_sent"])

    def count_bytes_sent(self, stage: str, nbytes: int) -> None:
        """Add traffic sent on this optimizer's behalf outside ``step()`` (the DDP hook)."""
        self._counters["bytes_sent"][stage] += nbytes

    @property
    def world_size(self) -> int:
        return world_size(self.process_group)

    def get_lamb_coeffs(self) -> list[float]:
        """Each parameter's last step coefficient (a copy), in parameter order."""
        return [
            self.state[p]["lamb_coeff"]
            for p in _common.params_in_order(self.param_groups)
            if "lamb_coeff" in self.state[p]
        ]

    # ----------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout", None) is not None:
            raise RuntimeError(
                "cannot add a parameter group in the compression stage: the fused momentum "
                "buffer and its error-feedback state are fixed at the switch"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "exp_avg_mask" in group:
            masks = self._masks_of(group)
            for index, (param, mask) in enumerate(zip(group["params"], masks, strict=True)):
                if mask.shape != param.shape:
                    raise ValueError(
                        f"exp_avg_mask for parameter {index} of its group has shape "
                        f"{tuple(mask.shape)}; the parameter has shape {tuple(param.shape)}"
                    )

    @staticmethod
    def _masks_of(group: dict[str, Any]) -> list[Tensor]:
        masks = group["exp_avg_mask"]
        if isinstance(masks, Tensor):
            return [masks] * len(group["params"])
        masks = list(masks)
        if len(masks) != len(group["params"]) or not all(isinstance(m, Tensor) for m in masks):
            raise ValueError(
                f"exp_avg_mask must be a tensor or a list of one tensor per parameter; got "
                f"{len(masks)} entries for {len(group['params'])} parameters"
            )
        return masks

    # ----------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step; in the compression stage, one compressed exchange."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = _common.trainable_params(self)
        self._unscale_for_grad_scaler(params)
        stage = self.stage
        traffic_before = self._traffic.total()
        try:
            due = self.verify_every and self.step_count % self.verify_every == 0
            if not self._replicas_verified or due:
                with self._collective():
                    verify_replicas(
                        self._replica_tensors(params), self.process_group, step=self.step_count + 1
                    )
                self._replicas_verified = True
            if stage == WARMUP:
                applied = self._warmup_step(params)
            else:
                applied = self._compression_step()
        finally:
            self.count_bytes_sent(stage, self._traffic.total() - traffic_before)
        if applied:
            self._counters["step"] += 1
        return loss

    def _replica_tensors(self, params: list[Tensor]) -> list[Tensor]:
        """What must agree across ranks: the parameters and any fp32 master copies."""
        masters = [self.state[p]["master_param"] for p in params if "master_param" in self.state[p]]
        return params + masters

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """Turn a failed collective (a dead or stuck peer) into a clear error."""
        try:
            yield
        except ReplicaMismatchError:
            raise
        except RuntimeError as error:
            if self.world_size == 1:
                raise
            raise CommunicationError(
                f"{type(self).__name__}: a collective failed at step {self.step_count + 1} "
                f"({self.stage} stage) on rank {dist.get_rank()}: another rank has probably "
                "died or stopped responding (collectives give up after the timeout passed to "
                f"init_process_group). Cause: {error}"
            ) from error

    # torch.amp.GradScaler calls step() on every rank with `grad_scale` set instead of
    # unscaling and skipping the step itself on the ranks that saw an Inf: a local skip would
    # leave the other ranks waiting in a collective. The step unscales, and its own check of
    # non-finite gradients agrees across ranks.
    _step_supports_amp_scaling = True

    def _unscale_for_grad_scaler(self, params: list[Tensor]) -> None:
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is None:
            return
        inverse = 1.0 / float(grad_scale)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, inverse)

    def _skip(self, reason: str) -> bool:
        message = f"non-finite gradients at step {self.step_count + 1} ({reason})"
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message + "; raising on every rank (on_nonfinite='raise')")
        self._counters["skipped_steps"] += 1
        warnings.warn(
            f"{message}: step skipped on every rank, state unchanged "
            f"({self.skipped_steps} skipped so far)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False

    def _averaged_warmup_grads(self, params: list[Tensor]) -> list[Tensor | None] | None:
        """Gradients averaged over ranks, ``None`` for a parameter no rank has a gradient
        for; ``None`` as a whole if any gradient is not finite (the same answer on every rank).
        """
        if self.gradients_averaged_by_ddp or self.world_size == 1:
            grads = [_common.dense_grad(p, _common.state_dtype(p)) for p in params]
            return grads if _common.all_finite(g for g in grads if g is not None) else None
        # One dense allreduce of every gradient, plus one flag per parameter that says
        # whether the rank had a gradient for it.
        total = sum(p.numel() for p in params)
        if self._flat_grads is None or self._flat_grads.numel() != total + len(params):
            dtype = self._buffer_dtype(params)
            self._flat_grads = torch.empty(
                total + len(params), dtype=dtype, device=params[0].device
            )
        flat = self._flat_grads
        flags = flat[total:]
        views, offset = [], 0
        for index, param in enumerate(params):
            view = flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            grad = _common.dense_grad(param, flat.dtype)
            if grad is None:
                view.zero_()
                flags[index] = 0
            else:
                view.copy_(grad)
                flags[index] = 1
            views.append(view)
        with self._collective():
            allreduce_mean_(flat, self.process_group, traffic=self._traffic)
        if not _common.all_finite([flat]):
            return None
        present = (flags > 0).tolist()
        return [view if has_grad else None for view, has_grad in zip(views, present, strict=True)]

    def _warmup_step(self, params: list[Tensor]) -> bool:
        grads = self._averaged_warmup_grads(params)
        if grads is None:
            return self._skip("warm-up gradients")
        grad_of = {id(p): g for p, g in zip(params, grads, strict=True)}
        for group in self.param_groups:
            for param in group["params"]:
                grad = grad_of.get(id(param))
                if grad is None:
                    continue
                state = self.state[param]
                if not state:
                    _common.init_param_state(param, state)
                    self._init_state(state)
                self._warmup_update(group, param, state, grad.to(state["exp_avg"].dtype))
                _common.sync_param_from_master(param, state)
        return True

    def _compression_step(self) -> bool:
        layout = self._fused_layout()
        buffer = layout.buffer
        for group, param, offset, _ in layout.entries:
            state = self.state[param]
            exp_avg = state["exp_avg"]
            local = buffer[offset : offset + exp_avg.numel()].view_as(exp_avg)
            # s_p * m_local with m_local = b1 m + (1 - b1) g_local, straight into the buffer
            # (two passes: s_p is folded into both coefficients).
            beta1, scaling = group["betas"][0], state["scaling_coeff"]
            torch.mul(exp_avg, beta1 * scaling, out=local)
            grad = _common.dense_grad(param, exp_avg.dtype)
            if grad is not None:
                local.add_(grad, alpha=(1 - beta1) * scaling)
        buffer[layout.numel :].zero_()
        try:
            with self._collective():
                compressed_allreduce(
                    buffer,
                    self._worker_error,
                    self._server_error,
                    self.process_group,
                    out=buffer,
                    workspace=self._workspace,
                    traffic=self._traffic,
                )
        except NonFiniteError:
            return self._skip("a rank's local momentum")
        for group, param, offset, mask in layout.entries:
            state = self.state[param]
            exp_avg = state["exp_avg"]
            exchanged = buffer[offset : offset + exp_avg.numel()].view_as(exp_avg)
            exchanged.div_(state["scaling_coeff"])
            if mask is not None:
                exchanged.mul_(mask)
            self._compressed_update(group, param, state, exchanged)
            _common.sync_param_from_master(param, state)
        return True

    # ----------------------------------------------------------------- the switch
    @staticmethod
    def _buffer_dtype(params: Iterable[Tensor]) -> torch.dtype:
        dtypes = {_common.state_dtype(p) for p in params}
        return torch.float64 if dtypes == {torch.float64} else torch.float32

    def _fused_layout(self) -> _FusedLayout:
        """Build (once) the fused momentum buffer; at the first compression step, also the
        scaling coefficients ``s_p`` and the subclass's compression-stage state."""
        if self._layout is not None:
            return self._layout
        entries, offset, skipped = [], 0, 0
        for group in self.param_groups:
            masks = self._masks_of(group) if "exp_avg_mask" in group else None
            for index, param in enumerate(group["params"]):
                if "exp_avg" not in self.state[param]:
                    skipped += param.requires_grad
                    continue
                mask = None
                if masks is not None:
                    mask = masks[index].to(self.state[param]["exp_avg"])
                entries.append((group, param, offset, mask))
                offset += param.numel()
        if not entries:
            raise RuntimeError(
                "no parameter received a gradient during the warm-up stage; nothing to compress"
            )
        if skipped:
            logger.warning(
                "%d trainable parameter tensor(s) had no gradient during warm-up; they are "
                "left out of the compression stage and no longer updated",
                skipped,
            )
        params = [param for _, param, _, _ in entries]
        n = self.world_size
        size = padded_size(offset, n)
        dtype = self._buffer_dtype(params)
        device = params[0].device
        if self._worker_error is None or self._worker_error.numel() != size:
            self._worker_error = torch.zeros(size, dtype=dtype, device=device)
            self._server_error = torch.zeros(size // n, dtype=dtype, device=device)
        if any("scaling_coeff" not in self.state[p] for p in params):
            self._start_compression(params)
        self._layout = _FusedLayout(entries, offset, torch.zeros(size, dtype=dtype, device=device))
        self._flat_grads = None  # the warm-up's gradient buffer is not needed any more
        return self._layout

    def _start_compression(self, params: list[Tensor]) -> None:
        """At the first compression step: ``s_p = mean_q rms(m_q) / rms(m_p)`` (1 if 0)."""
        rms = [self.state[p]["exp_avg"].norm().item() / math.sqrt(p.numel()) for p in params]
        mean_rms = sum(rms) / len(rms)
        for param, value in zip(params, rms, strict=True):
            self.state[param]["scaling_coeff"] = mean_rms / value if value > 0 else 1.0
        if self._is_logging_rank():
            logger.info(
                "%s: switching to 1-bit compressed momentum at step %d (%d tensors, %d "
                "elements, %d ranks)",
                type(self).__name__,
                self.step_count + 1,
                len(params),
                sum(p.numel() for p in params),
                self.world_size,
            )

    def _is_logging_rank(self) -> bool:
        return not dist.is_initialized() or dist.get_rank(self.process_group) == 0

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"onebit"``: the step, this rank's error-feedback
        buffers, the world size they belong to, and the traffic counters."""
        state = super().state_dict()
        state["onebit"] = {
            "optimizer": type(self).__name__,
            "step": self._counters["step"],
            "skipped_steps": self._counters["skipped_steps"],
            "bytes_sent": dict(self._counters["bytes_sent"]),
            "world_size": self.world_size,
            "worker_error": self._worker_error,
            "server_error": self._server_error,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint; with another world size the error buffers restart from zero."""
        extra = state_dict.get("onebit")
        if not isinstance(extra, dict) or extra.get("optimizer") != type(self).__name__:
            found = extra.get("optimizer") if isinstance(extra, dict) else "a non-onebit optimizer"
            raise ValueError(f"checkpoint was saved by {found}, not by {type(self).__name__}")
        _common.validate_checkpoint(self, state_dict)
        super().load_state_dict({k: state_dict[k] for k in ("state", "param_groups")})
        _common.restore_state_precision(self, state_dict)
        self._counters = {
            "step": int(extra["step"]),
            "skipped_steps": int(extra["skipped_steps"]),
            "bytes_sent": dict(extra["bytes_sent"]),
        }
        self._layout = None
        self._flat_grads = None
        self._replicas_verified = False
        worker_error, server_error = extra["worker_error"], extra["server_error"]
        if worker_error is not None and extra["world_size"] != self.world_size:
            warnings.warn(
                f"checkpoint was saved with world size {extra['world_size']}, now "
                f"{self.world_size}: the error-feedback buffers are reset to zero",
                UserWarning,
                stacklevel=2,
            )
            worker_error = server_error = None
        device = next(iter(_common.params_in_order(self.param_groups))).device
        self._worker_error = None if worker_error is None else worker_error.to(device, copy=True)
        self._server_error = None if server_error is None else server_error.to(device, copy=True)

    # ----------------------------------------------------------------- subclass hooks
    def _init_state(self, state: dict[str, Any]) -> None:
        """Extra per-parameter state, created with the moments."""

    def _warmup_update(
        self, group: dict[str, Any], param: Tensor, state: dict[str, Any], grad: Tensor
    ) -> None:
        raise NotImplementedError

    def _compressed_update(
        self, group: dict[str, Any], param: Tensor, state: dict[str, Any], exp_avg: Tensor
    ) -> None:
        """Apply the update with the exchanged momentum ``exp_avg`` (state still holds the
        previous momentum; the subclass stores the new one)."""
        raise NotImplementedError
