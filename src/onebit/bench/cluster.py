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
and at interpreter exit. Namespace names carry the owner's pid, so :func:`cleanup_stale` can
remove what a killed run left behind without touching a live run.

Run ``python -m onebit.bench.cluster --hosts 4 --bandwidth 1gbit`` for a self-check report.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType, TracebackType

__all__ = [
    "DEFAULT_PREFIX",
    "MAX_HOSTS",
    "AllreduceReport",
    "ClusterUnavailable",
    "EmulatedCluster",
    "TcpTransfer",
    "cleanup_stale",
    "parse_bandwidth",
    "parse_latency",
    "run_allreduce",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "ob"
"""Default first characters of every namespace and interface name a cluster creates."""

MAX_HOSTS = 250
"""Most hosts in one cluster (one /24 subnet, three-digit indices in interface names)."""

_SUBNET = "198.18.0"
_FIRST_MASTER_PORT = 29500
_MASTER_PORTS = 1000

_MODULE = "onebit.bench.cluster"
# The small helpers run this file as a script in isolated mode: standard library only, so they
# start in ~0.1 s instead of paying for the package's torch import.
_HELPER_ARGV = (sys.executable, "-I", os.path.abspath(__file__))
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?bit)")
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_TIME_RE = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s)")
_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,4}")
_TOKEN_HEX = 6
_MIN_BURST = 64 * 1024
_TBF_QUEUE = "50ms"
_NETEM_LIMIT = 100_000
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_COMMAND_TIMEOUT = 30.0
_STOP_GRACE = 3.0
_CHUNK = 1 << 20


_SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be built here; the message says why."""


@dataclasses.dataclass(frozen=True)
class TcpTransfer:
    """Outcome of one TCP stream between two hosts, as seen by the receiver."""

    nbytes: int
    """Bytes received."""
    seconds: float
    """Time from the first to the last received chunk."""
    bits_per_second: float
    """Receive rate over that time (the first chunk, which starts the clock, excluded)."""


def parse_bandwidth(bandwidth: str) -> float:
    """Return the rate in bits/s of a ``tc`` rate string such as ``'100mbit'`` or ``'1gbit'``.

    Units are decimal, as in ``tc``: ``kbit`` = 1e3, ``mbit`` = 1e6, ``gbit`` = 1e9 bits/s.
    """
    match = _RATE_RE.fullmatch(bandwidth.strip().lower()) if isinstance(bandwidth, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"bandwidth must be a positive rate such as '100mbit', '1gbit' or '10gbit' "
            f"(units: {', '.join(_RATE_UNITS)}), or None for unshaped links; got {bandwidth!r}"
        )
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def parse_latency(latency: str) -> float:
    """Return the delay in seconds of a string such as ``'100us'``, ``'0.1ms'`` or ``'1s'``."""
    match = _TIME_RE.fullmatch(latency.strip().lower()) if isinstance(latency, str) else None
    if match is None:
        raise ValueError(
            f"latency must be a delay such as '100us', '0.1ms' or '2ms' "
            f"(units: {', '.join(_TIME_UNITS)}), or None for no added delay; got {latency!r}"
        )
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def _effective_capabilities() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def unavailable_reason() -> str | None:
    """Say why an :class:`EmulatedCluster` cannot be built here, or return None if it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not on PATH (install iproute2)"
    if os.geteuid() != 0:
        caps = _effective_capabilities()
        needed = {"CAP_NET_ADMIN": _CAP_NET_ADMIN, "CAP_SYS_ADMIN": _CAP_SYS_ADMIN}
        lacking = [name for name, bit in needed.items() if not caps >> bit & 1]
        if lacking:
            return f"not root and lacking {', '.join(lacking)} (needed for ip netns)"
    return None


def _run(argv: Sequence[str], stdin: str | None = None, timeout: float = _COMMAND_TIMEOUT) -> str:
    """Run a command, return its stdout; raise RuntimeError with its stderr if it fails."""
    try:
        done = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(argv)} did not finish within {timeout:g} s") from exc
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def _list_namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL every process still inside a namespace and wait briefly for them to go."""
    pids = [int(p) for p in _run(["ip", "netns", "pids", namespace]).split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _STOP_GRACE
    while any(_pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _delete_namespaces(namespaces: Sequence[str]) -> None:
    """Kill what runs in the namespaces, then delete them (their veth ends go with them)."""
    for namespace in namespaces:
        _kill_namespace_processes(namespace)
    if namespaces:
        _run(["ip", "-force", "-batch", "-"], "".join(f"netns del {ns}\n" for ns in namespaces))


def _stale_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}[0-9a-f]{{{_TOKEN_HEX}}}-(\d+)-(?:sw|h\d+)")


def cleanup_stale(prefix: str = DEFAULT_PREFIX, *, include_live: bool = False) -> list[str]:
    """Delete namespaces left by clusters created with ``name_prefix=prefix`` whose owner died.

    Namespaces whose owning process is still alive are kept unless ``include_live`` is true.
    Processes still running inside a deleted namespace are killed. Returns the deleted names.
    """
    pattern = _stale_pattern(prefix)
    stale = []
    for name in _list_namespaces():
        match = pattern.fullmatch(name)
        if match and (include_live or not _pid_alive(int(match.group(1)))):
            stale.append(name)
    _delete_namespaces(stale)
    if stale:
        logger.info("removed %d stale namespaces: %s", len(stale), " ".join(stale))
    return stale


def _stop(processes: Sequence[subprocess.Popen[str]]) -> None:
    """Terminate the process groups of still-running children, then kill them after a grace."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold back SIGINT/SIGTERM/SIGHUP so that a teardown runs to its end; deliver them after."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class EmulatedCluster:
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
        token = secrets.token_hex(_TOKEN_HEX // 2)
        self.run_id = prefix + token
        self._owner = os.getpid()
        self._launches = 0
        self._children: list[subprocess.Popen[str]] = []
        self._lock = threading.Lock()
        self._active = False
        self._saved_handlers: dict[signal.Signals, _SignalHandler] = {}

    # ----- names ---------------------------------------------------------------------------

    def _check_host(self, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hosts:
            raise IndexError(f"host index must be in [0, {self.num_hosts}), got {i!r}")

    @property
    def switch_namespace(self) -> str:
        """Name of the namespace holding the bridge."""
        return f"{self.run_id}-{self._owner}-sw"

    def namespace(self, i: int) -> str:
        """Name of host ``i``'s network namespace."""
        self._check_host(i)
        return f"{self.run_id}-{self._owner}-h{i}"

    def interface(self, i: int) -> str:
        """Name of host ``i``'s network interface (the veth end inside its namespace)."""
        self._check_host(i)
        return f"{self.run_id}h{i}"

    def host_address(self, i: int) -> str:
        """IPv4 address of host ``i``: ``198.18.0.<i + 1>``, only inside the cluster."""
        self._check_host(i)
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
                self._saved_handlers[signum] = signal.signal(signum, _raise_system_exit)
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
            _run(["ip", "-batch", "-"], "".join(f"netns add {ns}\n" for ns in self._namespaces()))
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
            _run([*command, "-batch", "-"], "".join(f"{line}\n" for line in lines))
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
        namespaces = [ns for ns in _list_namespaces() if ns.startswith(self.run_id)]
        links = [
            link["ifname"]
            for link in json.loads(_run(["ip", "-j", "link", "show"]) or "[]")
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
            with _signals_blocked():
                try:
                    _stop(self._children)
                finally:
                    existing = set(_list_namespaces())
                    _delete_namespaces([ns for ns in self._namespaces() if ns in existing])
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

    # ----- processes -----------------------------------------------------------------------

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
        self._check_host(i)
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

    # ----- measurements --------------------------------------------------------------------

    def interface_bytes(self, i: int) -> tuple[int, int]:
        """Return ``(tx_bytes, rx_bytes)`` of host ``i``'s interface, from the kernel counters."""
        self._check_host(i)
        out = _run(["ip", "-n", self.namespace(i), "-s", "-j", "link", "show", self.interface(i)])
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def tcp_transfer(
        self, src: int, dst: int, nbytes: int = 1 << 30, seconds: float = 3.0
    ) -> TcpTransfer:
        """Stream zeros over one TCP connection from host ``src`` to host ``dst`` (with
        ``src == dst``, between two processes of one host, over its loopback).

        The sender stops after ``nbytes`` or ``seconds``, whichever comes first; both ends time
        out on their own if the other side stalls.
        """
        self._check_host(src)
        self._check_host(dst)
        if nbytes < 1 or seconds <= 0:
            raise ValueError("nbytes and seconds must be positive")
        idle = seconds + 10.0
        address = self.host_address(dst)
        receiver = self.popen(
            dst,
            [*_HELPER_ARGV, "tcp-recv", "--bind", address, "--timeout", str(idle)],
            stdout=subprocess.PIPE,
        )
        try:
            port = str(_read_port(receiver))
        except BaseException:
            _stop([receiver])
            raise
        sender = self.popen(
            src,
            [
                *_HELPER_ARGV,
                "tcp-send",
                "--host",
                address,
                "--port",
                port,
                "--nbytes",
                str(nbytes),
                "--seconds",
                str(seconds),
                "--timeout",
                str(idle),
            ],
        )
        try:
            sender_rc = sender.wait(timeout=idle + _COMMAND_TIMEOUT)
            out, _ = receiver.communicate(timeout=idle + _COMMAND_TIMEOUT)
        finally:
            _stop([sender, receiver])
        if sender_rc != 0 or receiver.returncode != 0:
            raise RuntimeError(
                f"TCP transfer {src}->{dst} failed (sender exit {sender_rc}, "
                f"receiver exit {receiver.returncode})"
            )
        result = json.loads(out)
        return TcpTransfer(
            nbytes=result["bytes"],
            seconds=result["seconds"],
            bits_per_second=result["bits_per_second"],
        )

    def measure_tcp_throughput(
        self, src: int, dst: int, nbytes: int = 1 << 30, seconds: float = 3.0
    ) -> float:
        """Return the rate in bits/s of a TCP stream from host ``src`` to host ``dst``.

        See :meth:`tcp_transfer` for the bounds.
        """
        return self.tcp_transfer(src, dst, nbytes=nbytes, seconds=seconds).bits_per_second


# ----- helper commands run inside the namespaces (python -m onebit.bench.cluster CMD) ---------


def _emit(record: Mapping[str, object]) -> None:
    """Write one JSON line on stdout: the answer a helper command gives its parent."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _read_port(receiver: subprocess.Popen[str]) -> int:
    """The port a ``tcp-recv`` helper bound, from the first line it writes."""
    assert receiver.stdout is not None
    ready, _, _ = select.select([receiver.stdout], [], [], _COMMAND_TIMEOUT)
    line = receiver.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"the TCP receiver did not report its port (exit {receiver.poll()})")
    return int(json.loads(line)["port"])


def _tcp_recv_command(args: argparse.Namespace) -> None:
    """Bind a free port (reported as the first output line), receive one stream, report it."""
    with socket.create_server((args.bind, 0)) as server:
        _emit({"port": server.getsockname()[1]})
        server.settimeout(args.timeout)
        conn, _ = server.accept()
    deadline = time.monotonic() + args.timeout
    buffer = memoryview(bytearray(_CHUNK))
    total = timed = 0
    first = last = 0.0
    with conn:
        conn.settimeout(args.timeout)
        while time.monotonic() < deadline:
            n = conn.recv_into(buffer)
            if n == 0:
                break
            last = time.perf_counter()
            if total == 0:
                first = last
            else:
                timed += n
            total += n
    elapsed = last - first
    _emit(
        {
            "bytes": total,
            "seconds": elapsed,
            "bits_per_second": timed * 8 / elapsed if elapsed > 0 else 0.0,
        }
    )


def _tcp_send_command(args: argparse.Namespace) -> None:
    payload = memoryview(bytes(_CHUNK))
    sent = 0
    give_up = time.monotonic() + args.timeout
    while True:  # the receiver may not be listening yet
        try:
            sock = socket.create_connection((args.host, args.port), timeout=args.timeout)
            break
        except ConnectionRefusedError:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.01)
    with sock:
        stop = time.perf_counter() + args.seconds
        while sent < args.nbytes and time.perf_counter() < stop:
            sent += sock.send(payload[: min(_CHUNK, args.nbytes - sent)])
        sock.shutdown(socket.SHUT_WR)


def _worker_command(args: argparse.Namespace) -> None:
    """One rank of the all_reduce check; reads the torchrun-style environment."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        tensor = torch.empty(args.numel, dtype=torch.float32)
        expected = world * (world + 1) / 2
        times = []
        for step in range(args.warmup + args.iters):
            tensor.fill_(rank + 1)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        correct = bool(torch.all(tensor == expected))
    finally:
        dist.destroy_process_group()
    _emit(
        {
            "rank": rank,
            "world_size": world,
            "numel": args.numel,
            "seconds": times,
            "correct": correct,
        }
    )


def _optional(kind: str) -> Callable[[str], str | None]:
    def parse(text: str) -> str | None:
        if text.lower() == "none":
            return None
        try:
            (parse_bandwidth if kind == "bandwidth" else parse_latency)(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        return text

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}",
        description="Build an emulated cluster, measure a TCP stream and a gloo all_reduce, "
        "report against the configured link rate, tear it down.",
    )
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument(
        "--bandwidth",
        type=_optional("bandwidth"),
        default="1gbit",
        help="per-link rate such as 1gbit, or 'none' (default: 1gbit)",
    )
    parser.add_argument(
        "--latency",
        type=_optional("latency"),
        default=None,
        help="added one-way delay such as 0.1ms (needs netem; default: none)",
    )
    parser.add_argument(
        "--numel",
        type=int,
        default=25_000_000,
        help="float32 elements in the all_reduce (default: 25M)",
    )
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--tcp-seconds", type=float, default=3.0)
    sub = parser.add_subparsers(dest="command", metavar="{worker}")
    worker = sub.add_parser("worker", help="one all_reduce rank (started by the check)")
    worker.add_argument("--numel", type=int, required=True)
    worker.add_argument("--iters", type=int, default=3)
    worker.add_argument("--warmup", type=int, default=1)
    worker.add_argument("--threads", type=int, default=1)
    worker.add_argument("--timeout", type=float, default=300.0)
    worker.set_defaults(handler=_worker_command)
    recv = sub.add_parser("tcp-recv")
    recv.add_argument("--bind", required=True)
    recv.add_argument("--timeout", type=float, required=True)
    recv.set_defaults(handler=_tcp_recv_command)
    send = sub.add_parser("tcp-send")
    send.add_argument("--host", required=True)
    send.add_argument("--port", type=int, required=True)
    send.add_argument("--nbytes", type=int, required=True)
    send.add_argument("--seconds", type=float, required=True)
    send.add_argument("--timeout", type=float, required=True)
    send.set_defaults(handler=_tcp_send_command)
    return parser


@dataclasses.dataclass(frozen=True)
class AllreduceReport:
    """What one rank of :func:`run_allreduce` measured."""

    rank: int
    seconds: list[float]
    """Wall time of each timed ``all_reduce`` (after one untimed warm-up)."""
    correct: bool
    """Whether the reduced tensor held the expected sum everywhere."""


def run_allreduce(
    cluster: EmulatedCluster, numel: int, iters: int = 3, timeout: float = 300.0
) -> list[AllreduceReport]:
    """Run a gloo ``all_reduce`` of ``numel`` float32 on every host, one rank per host.

    Ranks are started with :meth:`EmulatedCluster.launch_ranks`, one thread each. Returns the
    reports in rank order.
    """
    argv = [
        sys.executable,
        "-m",
        _MODULE,
        "worker",
        "--numel",
        str(numel),
        "--iters",
        str(iters),
        "--timeout",
        str(timeout),
    ]
    processes = cluster.launch_ranks(argv, env={"OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    reports = []
    try:
        for rank, process in enumerate(processes):
            out, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RuntimeError(f"all_reduce rank {rank} failed (exit {process.returncode})")
            record = json.loads(out.strip().splitlines()[-1])
            reports.append(
                AllreduceReport(record["rank"], list(record["seconds"]), record["correct"])
            )
    finally:
        _stop(processes)
    return reports


def _check(args: argparse.Namespace) -> None:
    with EmulatedCluster(args.hosts, bandwidth=args.bandwidth, latency=args.latency) as cluster:
        rate = cluster.rate_bits_per_second
        logger.info(
            "hosts %d, bandwidth %s, latency %s",
            args.hosts,
            args.bandwidth or "unshaped",
            args.latency or "none added",
        )
        measured = None
        if args.hosts > 1:
            measured = cluster.measure_tcp_throughput(0, 1, seconds=args.tcp_seconds)
            ratio = f", {measured / rate:.3f} of configured" if rate else ""
            logger.info("TCP host0 -> host1: %.1f Mbit/s%s", measured / 1e6, ratio)
        reports = run_allreduce(cluster, args.numel, iters=args.iters)
    nbytes = args.numel * 4
    rank0 = reports[0].seconds
    best = min(rank0)
    logger.info(
        "all_reduce of %d float32 (%.1f MB) over %d ranks: rank 0 best %.3f s, all %s",
        args.numel,
        nbytes / 1e6,
        args.hosts,
        best,
        " ".join(f"{t:.3f}" for t in rank0),
    )
    ring_bits = 2 * (args.hosts - 1) / args.hosts * nbytes * 8
    if rate and args.hosts > 1:
        logger.info(
            "ideal ring time 2(n-1)/n*bytes/rate = %.3f s; measured/ideal = %.3f",
            ring_bits / rate,
            best * rate / ring_bits,
        )
    if measured:
        logger.info(
            "ring time at the measured TCP rate (headers included) = %.3f s; measured/that = %.3f",
            ring_bits / measured,
            best * measured / ring_bits,
        )
    if not all(report.correct for report in reports):
        raise SystemExit("all_reduce result is WRONG on some rank")
    logger.info("all_reduce results correct on all ranks")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m onebit.bench.cluster``."""
    args = _parser().parse_args(argv)
    if args.command is not None:
        args.handler(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        _check(args)
    except ClusterUnavailable as exc:
        raise SystemExit(f"emulated cluster unavailable: {exc}") from exc


if __name__ == "__main__":
    main()
