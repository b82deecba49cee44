"""DiLoCo with a dense or a 1-bit outer exchange (ALGORITHM.md, "DiLoCo with a 1-bit outer
exchange").

Each worker takes ``sync_every`` steps of its own inner optimizer; then the workers average
their pseudo-gradients ``Δ_i = θ_r - θ_{r,i}`` (densely, or through onebit's 1-bit exchange
with error feedback that persists from round to round) and an outer optimizer (by default
DiLoCo's Nesterov SGD, with momentum 0.5 instead of 0.9 after the 1-bit exchange) applies the
average to the round's start weights::

    model = ...
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = onebit.DiLoCo(model.parameters(), inner, sync_every=100)
    for batch in data:
        loss(model, batch).backward()
        inner.step()          # every 100th step ends a round: the outer exchange and step
        inner.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from onebit import kernels as backends
from onebit.collectives import allreduce_mean_
from onebit.exchange import (
    Exchange,
    FlatExchange,
    PerTensorExchange,
    TrafficCounter,
    world_size,
)

__all__ = ["DILOCO_OUTER", "DiLoCo", "EXCHANGES", "ONEBIT_OUTER", "OUTER_DEFAULTS", "outer_sgd"]

#: The outer exchanges: a mean allreduce, or the 1-bit exchange with error feedback.
EXCHANGES = ("dense", "1bit")
#: DiLoCo's outer optimizer: SGD with Nesterov momentum (Douillard et al.), the dense
#: exchange's default.
DILOCO_OUTER: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
#: The 1-bit exchange's default outer optimizer: SGD with Nesterov momentum 0.5, not 0.9,
#: since outer momentum multiplies the compression's error by up to 1/(1 - momentum)
#: (ALGORITHM.md, "DiLoCo with a 1-bit outer exchange").
ONEBIT_OUTER: dict[str, Any] = {"lr": 0.7, "momentum": 0.5, "nesterov": True}
#: Each outer exchange's default outer optimizer.
OUTER_DEFAULTS: dict[str, dict[str, Any]] = {"dense": DILOCO_OUTER, "1bit": ONEBIT_OUTER}
_COMPRESSIONS = ("per_tensor", "fused")


def outer_sgd(
    params: Iterable[Tensor],
    lr: float = DILOCO_OUTER["lr"],
    momentum: float = DILOCO_OUTER["momentum"],
) -> torch.optim.SGD:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD at ``momentum=0``)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)


class DiLoCo:
    """DiLoCo over ``process_group`` (``None``: the world) for ``params``, which
    ``inner_optimizer`` trains: every ``sync_every`` inner steps, a round's outer exchange
    (``exchange``: ``"dense"`` or ``"1bit"``, the latter each tensor alone or fused by
    ``compression``, on the backend ``kernels`` selects) and the step of
    ``outer_optimizer`` (built over the same parameters; default: the exchange's
    :data:`OUTER_DEFAULTS`, DiLoCo's Nesterov SGD for the dense exchange, with momentum 0.5
    for the 1-bit one). A step post-hook on the inner optimizer ends the rounds
    (:meth:`close` removes it); :meth:`sync` ends one at once.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        inner_optimizer: Optimizer,
        *,
        sync_every: int,
        exchange: str = "1bit",
        compression: str = "per_tensor",
        outer_optimizer: Optimizer | None = None,
        process_group: dist.ProcessGroup | None = None,
        kernels: str | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo needs parameters that require gradients")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(
                f"sync_every must be an int >= 1 (inner steps per round), got {sync_every!r}"
            )
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be one of {_COMPRESSIONS}, got {compression!r}")
        if not isinstance(inner_optimizer, Optimizer):
            raise TypeError(
                "inner_optimizer must be a torch.optim.Optimizer, got "
                f"{type(inner_optimizer).__name__}"
            )
        _check_covers("inner_optimizer", inner_optimizer, self.params)
        if outer_optimizer is None:
            default = OUTER_DEFAULTS[exchange]
            outer_optimizer = outer_sgd(self.params, default["lr"], default["momentum"])
        _check_covers("outer_optimizer", outer_optimizer, self.params)
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(
                f"all parameters must be on one device, got {sorted(map(str, devices))}"
            )
        self.sync_every = sync_every
        self.exchange_kind = exchange
        self.inner_optimizer, self.outer_optimizer = inner_optimizer, outer_optimizer
        self.process_group = process_group
        self.traffic = TrafficCounter()
        self.local_step = 0  # inner steps of the current round
        self.rounds = 0
        self._round_start = [p.detach().clone() for p in self.params]
        numels = [p.numel() for p in self.params]
        self._exchange: Exchange | None = None
        if exchange == "1bit":
            group_exchange = PerTensorExchange if compression == "per_tensor" else FlatExchange
            self._exchange = group_exchange(process_group)
            device = next(iter(devices))
            backend = _backend_for(device, kernels)
            self._exchange.bind(numels, torch.float32, device, backend, self.traffic)
            size = self._exchange.buffer_size(numels)
        else:
            size = sum(numels)
        self._buffer = torch.zeros(size, dtype=torch.float32, device=next(iter(devices)))
        self._numels = numels
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    # ----------------------------------------------------------------- rounds
    def _after_inner_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.local_step += 1
        if self.local_step >= self.sync_every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """End the round now: the pseudo-gradients through the outer exchange, then the
        outer step from the round's start weights; the next round starts from its result."""
        self.pseudo_gradient(self._buffer)
        if self._exchange is None:
            allreduce_mean_(self._buffer, self.process_group, traffic=self.traffic)
            self.check_finite(self._buffer)
        else:
            self._exchange.exchange(self._buffer).decode(self._buffer)
        self.outer_step(self._buffer)

    @torch.no_grad()
    def pseudo_gradient(self, out: Tensor) -> None:
        """``out`` (:attr:`buffer_size` fp32 elements) = this worker's pseudo-gradient
        ``θ_r - θ``, tensor after tensor, the padding zero."""
        total = sum(self._numels)
        for delta, start, param in zip(
            out[:total].split(self._numels), self._round_start, self.params, strict=True
        ):
            delta.copy_((start - param.detach()).reshape(-1))
        out[total:].zero_()

    def check_finite(self, average: Tensor) -> None:
        """``FloatingPointError`` naming the round if the averaged pseudo-gradient is not
        finite (the 1-bit exchange raises its own ``NonFiniteError``)."""
        if not bool(torch.isfinite(average).all()):
            raise FloatingPointError(
                f"DiLoCo: the averaged pseudo-gradient of round {self.rounds + 1} is not "
                "finite (a worker's inner steps diverged); the weights are left as they are"
            )

    @torch.no_grad()
    def outer_step(self, average: Tensor) -> None:
        """The round's outer step from ``average``, the workers' averaged pseudo-gradient
        (laid out as :meth:`pseudo_gradient`'s): the weights set back to the round's start,
        each parameter's gradient to its part of ``average``, the outer optimizer's step;
        the next round starts from its result, and the inner loop's gradients are put back."""
        pseudo = average[: sum(self._numels)].split(self._numels)
        grads = [param.grad for param in self.params]
        for delta, start, param in zip(pseudo, self._round_start, self.params, strict=True):
            param.copy_(start)
            param.grad = delta.view_as(param).to(param.dtype, copy=True)
        self.outer_optimizer.step()
        for param, grad, start in zip(self.params, grads, self._round_start, strict=True):
            param.grad = grad
            start.copy_(param)
        self.local_step = 0
        self.rounds += 1

    @property
    def buffer_size(self) -> int:
        """Elements of the pseudo-gradient buffer the outer exchange takes."""
        return self._buffer.numel()

    def use_exchange(self, exchange: Exchange) -> None:
        """Average the pseudo-gradients of a 1-bit DiLoCo through ``exchange`` (a simulated
        one, :mod:`onebit.simulate`) instead of over the process group; before the first
        round only."""
        if self._exchange is None:
            raise ValueError("use_exchange replaces the 1-bit exchange; this DiLoCo is dense")
        if self.rounds or self._exchange.worker_error is not None:
            raise ValueError("use_exchange must come before the first round")
        exchange.bind(
            self._numels, torch.float32, self._buffer.device, self._exchange.backend, self.traffic
        )
        self._exchange = exchange
        self._buffer = self._buffer.new_zeros(exchange.buffer_size(self._numels))

    # ----------------------------------------------------------------- what users see
    @contextlib.contextmanager
    def round_start_weights(self) -> Iterator[None]:
        """Inside the block the parameters hold the current round's start weights (the outer
        step's result, the same on every rank: what to evaluate or export in the middle of a
        round); this rank's own weights are put back after it."""
        own = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for param, start in zip(self.params, self._round_start, strict=True):
                param.copy_(start)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, mine in zip(self.params, own, strict=True):
                    param.copy_(mine)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent in the outer exchanges so far."""
        return self.traffic.total()

    @property
    def world_size(self) -> int:
        return world_size(self.process_group)

    def close(self) -> None:
        """Remove the hook on the inner optimizer: its steps no longer end rounds."""
        self._hook.remove()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The inner step within the round, the rounds, the round's start weights, the outer
        optimizer's state, this rank's error buffers and the bytes sent (the model and the
        inner optimizer are saved by the caller)."""
        errors: tuple[Tensor | None, Tensor | None] = (None, None)
        if self._exchange is not None:
            errors = self._exchange.worker_error, self._exchange.server_error
        return {
            "local_step": self.local_step,
            "rounds": self.rounds,
            "sync_every": self.sync_every,
            "exchange": self.exchange_kind,
            "round_start": [start.clone() for start in self._round_start],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "worker_error": None if errors[0] is None else errors[0].clone(),
            "server_error": None if errors[1] is None else errors[1].clone(),
            "bytes_sent": dict(self.traffic.bytes_sent),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; ``ValueError`` naming what does not fit, before
        anything changes."""
        if state.get("exchange") != self.exchange_kind:
            raise ValueError(
                f"checkpoint of a DiLoCo with exchange={state.get('exchange')!r}; this one has "
                f"exchange={self.exchange_kind!r}"
            )
        starts = state["round_start"]
        shapes = [tuple(t.shape) for t in starts]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError(
                f"checkpoint's round start weights have shapes {shapes}; the parameters "
                f"{[tuple(p.shape) for p in self.params]}"
            )
        if not 0 <= int(state["local_step"]) < self.sync_every:
            raise ValueError(
                f"checkpoint is at inner step {state['local_step']} of a round; this DiLoCo has "
                f"sync_every={self.sync_every}"
            )
        if self._exchange is not None and state["worker_error"] is not None:
            sizes = self._exchange.error_sizes(self._numels)
            found = (state["worker_error"].numel(), state["server_error"].numel())
            if found != sizes:
                raise ValueError(
                    f"checkpoint's error buffers hold {found} elements; this exchange over "
                    f"{self.world_size} ranks needs {sizes}"
                )
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for start, saved in zip(self._round_start, starts, strict=True):
            start.copy_(saved)
        self.local_step, self.rounds = int(state["local_step"]), int(state["rounds"])
        self.traffic.reset()
        for kind, nbytes in state["bytes_sent"].items():
            self.traffic.bytes_sent[kind] = int(nbytes)
        if self._exchange is not None and state["worker_error"] is not None:
            self._exchange.carry_errors(
                self._numels,
                state["worker_error"].to(self._buffer.device).clone(),
                state["server_error"].to(self._buffer.device).clone(),
                self._exchange.backend,
                self.traffic,
            )


def _backend_for(device: torch.device, name: str | None) -> backends.Backend:
    """The compression backend for float32 buffers on ``device``."""
    return backends.select(torch.zeros(8, device=device), name)


def _check_covers(name: str, optimizer: Optimizer, params: list[Tensor]) -> None:
    """``optimizer`` must hold every one of ``params``."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [index for index, p in enumerate(params) if id(p) not in held]
    if missing:
        raise ValueError(
            f"{name} does not hold parameters {missing[:5]} of the {len(params)} given to "
            "DiLoCo: build it over the same parameters"
        )
