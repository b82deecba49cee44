"""Processes on an emulated cluster's hosts (:class:`~onebit.bench.cluster.EmulatedCluster`
inherits them): a command inside a host's namespace, the environment ``torchrun`` gives a
rank, and every rank of a multi-host job."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["HostProcesses"]

_FIRST_MASTER_PORT = 29500
_MASTER_PORTS = 1000


class HostProcesses:
    """The processes of a cluster of ``num_hosts`` hosts; the cluster gives ``check_host``,
    ``namespace``, ``interface``, ``host_address`` and whether it is ``_active``, and stops
    ``_children`` when it closes."""

    num_hosts: int
    _active: bool
    _lock: threading.Lock
    _children: list[subprocess.Popen[str]]
    _launches: int

    def popen(
        self,
        i: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[str]:
        """Start ``argv`` inside host ``i``'s namespace and return its ``Popen``.

        The child gets this process's environment updated with ``env``, plus
        ``GLOO_SOCKET_IFNAME`` set to host ``i``'s interface. It runs in a new session (its own
        process group), which is terminated, then killed, when the cluster closes. Pipes are
        in text mode; other ``kwargs`` go to :class:`subprocess.Popen`.
        """
        self.check_host(i)
        if not self._active:
            raise RuntimeError("the cluster is not running; use it inside a with block")
        child_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.interface(i)}
        process: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.namespace(i), *argv],
            env=child_env,
            start_new_session=True,
            text=True,
            **kwargs,
        )
        with self._lock:
            self._children = [p for p in self._children if p.poll() is None]
            self._children.append(process)
        return process

    def torchrun_like_env(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        ranks_per_host: int = 1,
    ) -> dict[str, str]:
        """Environment ``torchrun`` gives rank ``rank`` of a job of ``ranks_per_host`` ranks per
        node, on host ``rank // ranks_per_host``.

        ``torch.distributed.init_process_group(init_method="env://")`` then rendezvouses over
        the emulated network at ``master_addr:master_port``.
        """
        if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int):
            raise ValueError(f"ranks_per_host must be an int, got {ranks_per_host!r}")
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be at least 1, got {ranks_per_host}")
        ranks = self.num_hosts * ranks_per_host
        if not 1 <= world_size <= ranks:
            raise ValueError(
                f"world_size must be in [1, {ranks}] ({self.num_hosts} hosts of "
                f"{ranks_per_host} ranks), got {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        host, local_rank = divmod(rank, ranks_per_host)
        return {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "GROUP_RANK": str(host),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(ranks_per_host),
            "GLOO_SOCKET_IFNAME": self.interface(host),
        }

    def launch_ranks(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        rank_kwargs: Callable[[int], Mapping[str, object]] | None = None,
        *,
        ranks_per_host: int = 1,
        **kwargs: object,
    ) -> list[subprocess.Popen[str]]:
        """Start ``argv`` ``ranks_per_host`` times per host, as ranks ``i * ranks_per_host``
        to ``(i + 1) * ranks_per_host - 1`` on host ``i``; master on host 0.

        Each process gets :meth:`torchrun_like_env` on top of ``env``; ``kwargs``, and
        ``rank_kwargs(rank)`` for what differs between ranks (such as each rank's own log
        file), go to :meth:`popen`. Returns the processes in rank order.

        The master port is not probed (a port found free can be taken before rank 0 binds
        it): host 0's namespace belongs to this cluster and nothing in it binds below the
        ephemeral port range, so each launch takes the next port from 29500.
        """
        with self._lock:
            port = _FIRST_MASTER_PORT + self._launches % _MASTER_PORTS
            self._launches += 1
        master = self.host_address(0)
        world = self.num_hosts * ranks_per_host
        processes = []
        for rank in range(world):
            rank_env = {
                **(env or {}),
                **self.torchrun_like_env(rank, world, master, port, ranks_per_host),
            }
            extra = rank_kwargs(rank) if rank_kwargs is not None else {}
            host = rank // ranks_per_host
            processes.append(self.popen(host, argv, env=rank_env, **kwargs, **extra))
        return processes

    def rank0_record(self, argv: Sequence[str], timeout: float) -> Any:
        """Run ``argv`` as one rank per host (:meth:`launch_ranks`), wait up to ``timeout``
        seconds for every rank, and return the JSON value rank 0 printed on its last line of
        standard output; raises ``RuntimeError`` where a rank failed."""
        processes = self.launch_ranks(argv, stdout=subprocess.PIPE)
        outputs = [p.communicate(timeout=timeout)[0] for p in processes]
        failed = [rank for rank, p in enumerate(processes) if p.returncode]
        if failed:
            raise RuntimeError(f"rank(s) {failed} of {' '.join(argv)} failed")
        return json.loads(outputs[0].strip().splitlines()[-1])
