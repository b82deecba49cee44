"""Linux network namespaces and the processes in them, for :mod:`onebit.bench.cluster`:
whether this machine can build them, running ``ip``/``tc`` commands, deleting namespaces (and
the stale ones of a killed run), stopping child processes, and holding signals back while a
teardown runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from types import FrameType

__all__ = [
    "DEFAULT_PREFIX",
    "TOKEN_HEX",
    "ClusterUnavailable",
    "cleanup_stale",
    "delete_namespaces",
    "list_namespaces",
    "raise_system_exit",
    "run_command",
    "signals_blocked",
    "stop_processes",
    "unavailable_reason",
]

logger = logging.getLogger("onebit.bench.cluster")

DEFAULT_PREFIX = "ob"
"""Default first characters of every namespace and interface name a cluster creates."""
TOKEN_HEX = 6
"""Hex digits of the random token that makes a cluster's names unique."""
COMMAND_TIMEOUT = 30.0
"""Seconds an ``ip``/``tc`` command (or a helper's answer) may take."""

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_STOP_GRACE = 3.0


class ClusterUnavailable(RuntimeError):
    """The emulated cluster cannot be built here; the message says why."""


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


def run_command(
    argv: Sequence[str], stdin: str | None = None, timeout: float = COMMAND_TIMEOUT
) -> str:
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


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in run_command(["ip", "netns", "list"]).splitlines() if line]


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
    pids = [int(p) for p in run_command(["ip", "netns", "pids", namespace]).split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _STOP_GRACE
    while any(_pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def delete_namespaces(namespaces: Sequence[str]) -> None:
    """Kill what runs in the namespaces, then delete them (their veth ends go with them)."""
    for namespace in namespaces:
        _kill_namespace_processes(namespace)
    if namespaces:
        run_command(
            ["ip", "-force", "-batch", "-"], "".join(f"netns del {ns}\n" for ns in namespaces)
        )


def _stale_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}[0-9a-f]{{{TOKEN_HEX}}}-(\d+)-(?:sw|h\d+)")


def cleanup_stale(prefix: str = DEFAULT_PREFIX, *, include_live: bool = False) -> list[str]:
    """Delete namespaces left by clusters created with ``name_prefix=prefix`` whose owner died.

    Namespaces whose owning process is still alive are kept unless ``include_live`` is true.
    Processes still running inside a deleted namespace are killed. Returns the deleted names.
    """
    pattern = _stale_pattern(prefix)
    stale = []
    for name in list_namespaces():
        match = pattern.fullmatch(name)
        if match and (include_live or not _pid_alive(int(match.group(1)))):
            stale.append(name)
    delete_namespaces(stale)
    if stale:
        logger.info("removed %d stale namespaces: %s", len(stale), " ".join(stale))
    return stale


def stop_processes(processes: Sequence[subprocess.Popen[str]]) -> None:
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


def raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Hold back SIGINT/SIGTERM/SIGHUP so that a teardown runs to its end; deliver them after."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
