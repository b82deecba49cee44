"""torchft's DiLoCo as the job's peer (``--outer-implementation torchft``).

The job's DiLoCo rounds run through torchft 0.2.0's ``torchft.local_sgd.DiLoCo`` instead of
:class:`onebit.DiLoCo`, on the same model, data and schedule, so the study can set the two side
by side. Each rank is a replica group of one rank with its own ``Manager`` (gloo, synchronous
quorum, no healing at the start: every rank builds the same weights from one seed) under a
``LighthouseServer`` that rank 0 runs in its process. torchft averages each parameter's
pseudo-gradient with its own allreduce; the bytes are counted as those ring allreduces.

torchft's DiLoCo keeps the round's start weights and its step counts inside itself, so such a run
does not resume from a checkpoint, and a round ends at every ``sync_every``-th step only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from onebit.collectives import allreduce_bytes
from onebit.exchange import TrafficCounter
from onebit.optim import holding_weights

__all__ = [
    "IMPLEMENTATIONS",
    "TorchftDiLoCo",
    "quiet_torchft_logs",
    "replica_manager",
    "torchft_missing",
]

#: Who runs DiLoCo's rounds in the job: onebit, or torchft (dense exchange only).
IMPLEMENTATIONS = ("onebit", "torchft")


def torchft_missing() -> str | None:
    """Why torchft's DiLoCo cannot run here (None if it can)."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install torchft==0.2.0)"
    return None


class TorchftDiLoCo:
    """torchft's dense DiLoCo over ``model``: the job's view of it (the inner step within the
    round, the bytes sent) and its lifetime (the manager, and rank 0's lighthouse).

    Enters torchft's DiLoCo at once; :meth:`close` leaves it, shuts the manager down and,
    once every rank is done, the lighthouse. Raises ``RuntimeError`` if a round does not
    commit (torchft would otherwise drop it and go on)."""

    delay = 0

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[Tensor],
        inner: Optimizer,
        outer: Optimizer,
        *,
        sync_every: int,
        timeout: float,
    ) -> None:
        quiet_torchft_logs()
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo

        self.turn_steps = sync_every
        self.local_step = 0
        self.rounds = 0
        self.traffic = TrafficCounter()
        self._params = list(params)
        self._round_start = [p.detach().clone() for p in self._params]
        rank, workers = dist.get_rank(), dist.get_world_size()
        self._round_bytes = sum(allreduce_bytes(p, workers) for p in self._params)
        self._lighthouse = None
        address = [None]
        if rank == 0:
            self._lighthouse = LighthouseServer(
                bind="[::]:0", min_replicas=workers, join_timeout_ms=100
            )
            address = [self._lighthouse.address()]
        dist.broadcast_object_list(address, src=0)
        self._manager, self._store = replica_manager(
            rank, workers, address[0], timeout, _no_healing, dict
        )
        self._diloco = DiLoCo(self._manager, [model], inner, outer, sync_every=sync_every)
        self._diloco.__enter__()  # its hook first: ours reads the round it ended
        self._hook = inner.register_step_post_hook(self._after_inner_step)

    def _after_inner_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.local_step += 1
        if self.local_step < self.turn_steps:
            return
        self.local_step = 0
        self.rounds += 1
        committed = self._manager.current_step()
        if committed != self.rounds:
            raise RuntimeError(
                f"torchft's DiLoCo committed {committed} of {self.rounds} rounds: a round's "
                "allreduce failed"
            )
        self.traffic.record("allreduce", self._round_bytes)
        with torch.no_grad():
            torch._foreach_copy_(self._round_start, [p.detach() for p in self._params])

    @contextlib.contextmanager
    def round_start_weights(self) -> Iterator[None]:
        """Inside the block the parameters hold the current round's start weights (torchft's
        outer step's result, the same on every rank); this rank's own are put back after it."""
        with holding_weights(self._params, self._round_start):
            yield

    @property
    def weights_shared(self) -> bool:
        """Whether the parameters hold the round's start weights, the same on every rank."""
        return self.local_step == 0

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent in the outer exchanges so far."""
        return self.traffic.total()

    def sync(self, deliver_errors: bool = False) -> None:
        """torchft's DiLoCo cannot end a round early (nor has errors to deliver: its exchange
        is dense)."""
        raise RuntimeError(
            f"torchft's DiLoCo ends a round at every {self.turn_steps}-th step only "
            f"(step {self.local_step} of the round)"
        )

    def state_dict(self) -> dict[str, Any]:
        """The inner step within the round and the rounds ended (for the record only)."""
        return {"local_step": self.local_step, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError(
            "a run with --outer-implementation torchft does not resume: torchft's DiLoCo keeps "
            "the round's start weights and its step counts inside itself; start a new run"
        )

    def close(self) -> None:
        """Leave torchft's DiLoCo, shut the manager down and, after every rank has, the
        lighthouse."""
        self._hook.remove()
        self._diloco.__exit__(None, None, None)
        self._manager.shutdown(wait=False)
        dist.barrier()
        if self._lighthouse is not None:
            self._lighthouse.shutdown()


def quiet_torchft_logs() -> None:
    """torchft's Rust side logs every quorum at info: warnings only, unless ``RUST_LOG``
    says otherwise (set before a lighthouse or manager starts)."""
    os.environ.setdefault("RUST_LOG", "warn")


def replica_manager(
    replica: int,
    workers: int,
    lighthouse: str,
    timeout: float,
    load_state_dict: Callable[[dict[str, Any]], None],
    state_dict: Callable[[], dict[str, Any]],
) -> tuple[Any, dist.TCPStore]:
    """torchft's ``Manager`` of replica group ``replica``, of one rank, among ``workers``
    under the lighthouse at ``lighthouse`` (gloo, a synchronous quorum, no healing at the
    start), and the store it meets on, which must live as long as it."""
    quiet_torchft_logs()
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    # torchft warns on CPU that it cannot reset NCCL's flight recorder
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    wait = timedelta(seconds=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=workers,
        use_async_quorum=False,
        init_sync=False,
        replica_id=f"replica_{replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="localhost",
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
    )
    return manager, store


def _no_healing(state: dict[str, Any]) -> None:
    raise RuntimeError(
        "torchft asked to heal this replica from a peer: the ranks should start from the same "
        "weights and stay in step"
    )
