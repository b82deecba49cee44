"""An emulated multi-host cluster on one Linux machine, for communication benchmarks.

:class:`EmulatedCluster` builds, for the duration of a ``with`` block:

* one network namespace acting as the switch, holding a Linux bridge;
* one network namespace per host, linked to the bridge by a veth pair, with an address in
  ``198.18.0.0/24`` (part of ``198.18.0.0/15``, the range set aside for benchmarking by
  RFC 2544) that exists only inside these namespaces (nothing is created in, or routable from,
  the root namespace);
* optional shaping of every link with ``tc``.

Link semantics
    ``bandwidth`` is the rate of each host's full-duplex link to the switch. A ``tbf`` qdisc
    limits the egress of the host-side veth (host -> switch) and another one limits the egress
    of the switch-side veth (switch -> host), so each direction carries at most ``bandwidth``,
    and several hosts sending to one host share that host's downlink, as on a real switch.
    ``latency`` is an added one-way delay between any two hosts, applied by a ``netem`` qdisc
    on the host-side egress only (a host-to-host path crosses exactly one host-side egress), so
    the round trip grows by ``2 * latency``. ``netem`` is the parent and ``tbf`` its child when
    both are set. Kernels built without ``sch_netem`` cannot emulate a delay: asking for one
    there raises :class:`ClusterUnavailable`.

Processes run inside a host's namespace through :meth:`EmulatedCluster.popen`, which sets
``GLOO_SOCKET_IFNAME`` (inside a namespace the hostname resolves to loopback, so gloo would
otherwise advertise 127.0.0.1 and its peers could not connect).
:meth:`EmulatedCluster.launch_ranks` starts ``ranks_per_host`` ``torch.distributed`` ranks
per host with the environment ``torchrun`` would give a multi-node job (``env://`` rendezvous
over the emulated network; rank ``host * ranks_per_host + local rank``).

Ranks of one host are a node of several GPUs: they all bind the host's address, and a packet
between two of them, addressed to that local address, is routed through the namespace's
loopback ``lo``, never the host's link. So the fast local link is unshaped and its traffic is
not in :meth:`EmulatedCluster.interface_bytes`, which counts exactly what crosses the node's
link (the tests check both with a stream inside one host).

Everything is torn down on exit from the ``with`` block, including after exceptions, SIGTERM,
SIGHUP (turned into ``SystemExit`` while the cluster is up) and SIGINT (``KeyboardInterrupt``),
and at interpreter exit. Namespace names carry the owner's pid, so
:func:`onebit.bench.netns.cleanup_stale` can remove what a killed run left behind without
touching a live run.

Namespaces and processes: :mod:`onebit.bench.netns`; the TCP and ``all_reduce`` tools and
the self-check (``python -m onebit.bench.cluster_tools --hosts 4 --bandwidth 1gbit``):
:mod:`onebit.bench.cluster_tools`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType

from onebit.bench.cluster_processes import HostProcesses
from onebit.bench.netns import (
    DEFAULT_PREFIX,
    TOKEN_HEX,
    ClusterUnavailable,
    delete_namespaces,
    list_namespaces,
    raise_system_exit,
    run_command,
    signals_blocked,
    stop_processes,
    unavailable_reason,
)
from onebit.units import parse_bandwidth, parse_latency

__all__ = ["MAX_HOSTS", "EmulatedCluster"]

logger = logging.getLogger(__name__)

MAX_HOSTS = 250
"""Most hosts in one cluster (one /24 subnet, three-digit indices in interface names)."""

_SUBNET = "198.18.0"

_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,4}")
_MIN_BURST = 64 * 1024
_TBF_QUEUE = "50ms"
_NETEM_LIMIT = 100_000


_SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class EmulatedCluster(HostProcesses):
    """Hosts in network namespaces behind one bridge, each on a shaped full-duplex link.

    Args:
        num_hosts: number of hosts, 1 to :data:`MAX_HOSTS`.
        bandwidth: rate of each host link in each direction, a ``tc`` rate such as
            ``'100mbit'`` or ``'1gbit'``; None leaves the links unshaped.
        latency: added one-way host-to-host delay such as ``'0.1ms'``; None adds none. Needs
            a kernel with ``sch_netem``.
        burst: ``tbf`` bucket size in bytes; None picks the larger of 64 KiB and 1 ms at the
            rate (enough for the 64 KiB segments veth passes along).
        name_prefix: 1 to 5 lowercase letters or digits, starting with a letter, that begin
            every name this cluster creates (default :data:`DEFAULT_PREFIX`); a random suffix
            makes the names unique per run.

    Raises:
        ValueError: an argument is out of range or malformed (at construction).
        ClusterUnavailable: the cluster cannot be built here (on entering the ``with`` block).
    """

    def __init__(
        self,
        num_hosts: int,
        bandwidth: str | None = "1gbit",
        latency: str | None = None,
        burst: int | None = None,
        name_prefix: str | None = None,
    ) -> None:
        if isinstance(num_hosts, bool) or not isinstance(num_hosts, int):
            raise ValueError(f"num_hosts must be an int, got {num_hosts!r}")
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be between 1 and {MAX_HOSTS}, got {num_hosts}")
        self.num_hosts = num_hosts
        self.bandwidth = bandwidth
        self.rate_bits_per_second = None if bandwidth is None else parse_bandwidth(bandwidth)
        self.latency = latency
        self.latency_seconds = None if latency is None else parse_latency(latency)
        if burst is not None and (
            isinstance(burst, bool) or not isinstance(burst, int) or burst < 1500
        ):
            raise ValueError(f"burst must be an int of at least 1500 bytes or None, got {burst!r}")
        if burst is not None and bandwidth is None:
            raise ValueError("burst only applies to shaped links; it needs a bandwidth")
        self.burst = burst
        prefix = DEFAULT_PREFIX if name_prefix is None else name_prefix
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(
                "name_prefix must be 1 to 5 lowercase letters or digits starting with a letter, "
                f"got {name_prefix!r}"
            )
        self.name_prefix = prefix
        token = secrets.token_hex(TOKEN_HEX // 2)
        self.run_id = prefix + token
        self._owner = os.getpid()
        self._launches = 0
        self._children: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        self._active = False
        self._saved_handlers: dict[signal.Signals, _SignalHandler] = {}

    # ----- names ---------------------------------------------------------------------------

    def check_host(self, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hosts:
            raise IndexError(f"host index must be in [0, {self.num_hosts}), got {i!r}")

    @property
    def switch_namespace(self) -> str:
        """Name of the namespace holding the bridge."""
        return f"{self.run_id}-{self._owner}-sw"

    def namespace(self, i: int) -> str:
        """Name of host ``i``'s network namespace."""
        self.check_host(i)
        return f"{self.run_id}-{self._owner}-h{i}"

    def interface(self, i: int) -> str:
        """Name of host ``i``'s network interface (the veth end inside its namespace)."""
        self.check_host(i)
        return f"{self.run_id}h{i}"

    def host_address(self, i: int) -> str:
        """IPv4 address of host ``i``: ``198.18.0.<i + 1>``, only inside the cluster."""
        self.check_host(i)
        return f"{_SUBNET}.{i + 1}"

    def _switch_port(self, i: int) -> str:
        return f"{self.run_id}b{i}"

    @property
    def _bridge(self) -> str:
        return f"{self.run_id}br"

    def _namespaces(self) -> list[str]:
        return [self.namespace(i) for i in range(self.num_hosts)] + [self.switch_namespace]

    # ----- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        if self._active:
            raise RuntimeError("this EmulatedCluster is already running")
        reason = unavailable_reason()
        if reason is not None:
            raise ClusterUnavailable(reason)
        self._active = True
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGHUP):
                self._saved_handlers[signum] = signal.signal(signum, raise_system_exit)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _build(self) -> None:
        started = time.perf_counter()
        try:
            run_command(
                ["ip", "-batch", "-"], "".join(f"netns add {ns}\n" for ns in self._namespaces())
            )
        except RuntimeError as exc:
            raise ClusterUnavailable(f"cannot create network namespaces: {exc}") from exc
        switch = [f"link add {self._bridge} type bridge", "link set lo up"]
        for i in range(self.num_hosts):
            port = self._switch_port(i)
            switch += [
                f"link add {port} type veth peer name {self.interface(i)} "
                f"netns {self.namespace(i)}",
                f"link set {port} master {self._bridge}",
                f"link set {port} up",
            ]
        switch.append(f"link set {self._bridge} up")
        self._batch(["ip", "-n", self.switch_namespace], switch)
        for i in range(self.num_hosts):
            dev = self.interface(i)
            host = [
                "link set lo up",
                f"addr add {self.host_address(i)}/24 dev {dev}",
                f"link set {dev} up",
            ]
            self._batch(["ip", "-n", self.namespace(i)], host)
        self._shape()
        logger.info(
            "emulated cluster %s up: %d hosts on %s.0/24, bandwidth %s, latency %s (%.2f s)",
            self.run_id,
            self.num_hosts,
            _SUBNET,
            self.bandwidth or "unshaped",
            self.latency or "none added",
            time.perf_counter() - started,
        )

    def _batch(self, command: list[str], lines: list[str]) -> None:
        try:
            run_command([*command, "-batch", "-"], "".join(f"{line}\n" for line in lines))
        except RuntimeError as exc:
            if "qdisc kind is unknown" in str(exc) and "netem" in " ".join(lines):
                raise ClusterUnavailable(
                    "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so a link delay "
                    "cannot be emulated; use latency=None"
                ) from exc
            raise ClusterUnavailable(f"setting up the emulated cluster failed: {exc}") from exc

    def _tbf(self, parent: str) -> str:
        assert self.rate_bits_per_second is not None
        burst = self.burst or max(_MIN_BURST, int(self.rate_bits_per_second / 8 / 1000))
        rate = f"{int(self.rate_bits_per_second)}bit"
        return f"{parent} tbf rate {rate} burst {burst} latency {_TBF_QUEUE}"

    def _shape(self) -> None:
        for i in range(self.num_hosts):
            dev = self.interface(i)
            host: list[str] = []
            if self.latency_seconds is not None:
                delay_us = max(1, round(self.latency_seconds * 1e6))
                host.append(
                    f"qdisc add dev {dev} root handle 1: netem delay {delay_us}us "
                    f"limit {_NETEM_LIMIT}"
                )
                if self.rate_bits_per_second is not None:
                    host.append(f"qdisc add dev {dev} {self._tbf('parent 1:1 handle 10:')}")
            elif self.rate_bits_per_second is not None:
                host.append(f"qdisc add dev {dev} {self._tbf('root handle 1:')}")
            if host:
                self._batch(["tc", "-n", self.namespace(i)], host)
        if self.rate_bits_per_second is not None:
            switch = [
                f"qdisc add dev {self._switch_port(i)} {self._tbf('root handle 1:')}"
                for i in range(self.num_hosts)
            ]
            self._batch(["tc", "-n", self.switch_namespace], switch)

    def _leftovers(self) -> list[str]:
        namespaces = [ns for ns in list_namespaces() if ns.startswith(self.run_id)]
        links = [
            link["ifname"]
            for link in json.loads(run_command(["ip", "-j", "link", "show"]) or "[]")
            if link.get("ifname", "").startswith(self.run_id)
        ]
        return namespaces + links

    def close(self) -> None:
        """Stop the children, delete every namespace of this cluster and check none is left.

        Idempotent; called on leaving the ``with`` block and at interpreter exit.

        Raises:
            RuntimeError: something of this cluster could not be removed (names listed).
        """
        with self._lock:
            if not self._active:
                return
            self._active = False
            leftovers: list[str] = []
            with signals_blocked():
                try:
                    stop_processes(self._children)
                finally:
                    existing = set(list_namespaces())
                    delete_namespaces([ns for ns in self._namespaces() if ns in existing])
                    leftovers = self._leftovers()
                    atexit.unregister(self.close)
                    for signum, handler in self._saved_handlers.items():
                        signal.signal(signum, handler)
                    self._saved_handlers.clear()
            if leftovers:
                raise RuntimeError(
                    f"emulated cluster {self.run_id} left behind: {' '.join(leftovers)}"
                )
            logger.info("emulated cluster %s torn down", self.run_id)

    # ----- measurements --------------------------------------------------------------------

    def interface_bytes(self, i: int) -> tuple[int, int]:
        """Return ``(tx_bytes, rx_bytes)`` of host ``i``'s interface, from the kernel counters."""
        self.check_host(i)
        out = run_command(
            ["ip", "-n", self.namespace(i), "-s", "-j", "link", "show", self.interface(i)]
        )
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])
