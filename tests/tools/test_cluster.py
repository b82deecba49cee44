"""Tests of the emulated cluster: namespaces, bridge, tc shaping, rendezvous and teardown."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
from helpers.emulated_cluster import needs_cluster

from onebit.bench.cluster import EmulatedCluster
from onebit.bench.cluster_tools import run_allreduce, tcp_transfer
from onebit.bench.netns import cleanup_stale
from onebit.units import parse_bandwidth, parse_latency


def _namespaces() -> list[str]:
    listing = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    return [line.split()[0] for line in listing.splitlines() if line]


def _owned_by(run_id: str) -> list[str]:
    return [ns for ns in _namespaces() if ns.startswith(run_id)]


def test_parsing_and_validation() -> None:
    assert parse_bandwidth("100mbit") == 1e8
    assert parse_bandwidth("1gbit") == 1e9
    assert parse_bandwidth("2.5GBIT") == 2.5e9
    assert parse_latency("0.1ms") == pytest.approx(1e-4)
    assert parse_latency("250us") == pytest.approx(2.5e-4)
    for bad in ("fast", "1gibit", "100mbps", "0mbit", "-1gbit", ""):
        with pytest.raises(ValueError, match="bandwidth"):
            EmulatedCluster(2, bandwidth=bad)
    with pytest.raises(ValueError, match="latency"):
        EmulatedCluster(2, latency="1 sec")
    for hosts in (0, -1, 251):
        with pytest.raises(ValueError, match="num_hosts"):
            EmulatedCluster(hosts)
    for prefix in ("OB", "toolong", "1ob", "o-b"):
        with pytest.raises(ValueError, match="name_prefix"):
            EmulatedCluster(2, name_prefix=prefix)
    with pytest.raises(ValueError, match="burst"):
        EmulatedCluster(2, bandwidth=None, burst=100_000)


def test_names_fit_interface_limits() -> None:
    cluster = EmulatedCluster(250, name_prefix="abcde")
    assert len({cluster.namespace(i) for i in range(250)}) == 250
    assert max(len(cluster.interface(i)) for i in range(250)) <= 15
    assert cluster.host_address(0) == "198.18.0.1"  # the benchmarking range, 198.18.0.0/15
    assert cluster.host_address(249) == "198.18.0.250"
    with pytest.raises(IndexError):
        cluster.interface(250)


def test_ranks_of_several_per_host_get_torchrun_environment() -> None:
    cluster = EmulatedCluster(2)
    env = cluster.torchrun_like_env(3, 4, cluster.host_address(0), 29500, ranks_per_host=2)
    assert (env["RANK"], env["GROUP_RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "3", "1", "1", "2"
    )  # fmt: skip
    assert env["GLOO_SOCKET_IFNAME"] == cluster.interface(1)
    with pytest.raises(ValueError, match="world_size must be in"):
        cluster.torchrun_like_env(0, 5, cluster.host_address(0), 29500, ranks_per_host=2)
    with pytest.raises(ValueError, match="ranks_per_host"):
        cluster.torchrun_like_env(0, 2, cluster.host_address(0), 29500, ranks_per_host=0)


@needs_cluster
def test_rank0_record_is_what_rank_0_printed_last_and_a_failed_rank_is_named() -> None:
    """Every host runs a rank; rank 0's last line of output is the record, and a rank that
    exits with an error fails the run, by its rank."""
    prints = (
        "import json, os; print('warming up'); print(json.dumps({'rank': int(os.environ['RANK'])}))"
    )
    fails = "import os, sys; sys.exit(int(os.environ['RANK']))"
    with EmulatedCluster(2, bandwidth=None) as cluster:
        assert cluster.rank0_record([sys.executable, "-c", prints], timeout=60) == {"rank": 0}
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\]"):
            cluster.rank0_record([sys.executable, "-c", fails], timeout=60)


@needs_cluster
def test_traffic_inside_a_host_bypasses_its_link() -> None:
    """Two processes of one host, talking to its own address, go over its loopback: the
    stream is not limited to the link's rate and does not show on the link's counters."""
    nbytes = 20 << 20
    with EmulatedCluster(2, bandwidth="10mbit") as cluster:
        tx, rx = cluster.interface_bytes(0)
        transfer = tcp_transfer(cluster, 0, 0, nbytes=nbytes, seconds=10.0)
        after_tx, after_rx = cluster.interface_bytes(0)
    assert transfer.nbytes == nbytes
    assert transfer.bits_per_second > 10 * 10e6
    assert after_tx - tx < 10_000 and after_rx - rx < 10_000


@needs_cluster
def test_shaped_two_host_cluster_end_to_end() -> None:
    rate = 100e6
    with EmulatedCluster(2, bandwidth="100mbit", latency=None) as cluster:
        run_id = cluster.run_id
        assert len(_owned_by(run_id)) == 3  # switch + two hosts

        env_probe = cluster.popen(
            1, ["sh", "-c", "echo $GLOO_SOCKET_IFNAME"], stdout=subprocess.PIPE
        )
        assert env_probe.communicate(timeout=10)[0].strip() == cluster.interface(1)
        env = cluster.torchrun_like_env(1, 2, cluster.host_address(0), 29500)
        assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
        assert env["GLOO_SOCKET_IFNAME"] == cluster.interface(1)

        tx0, rx0 = cluster.interface_bytes(0)
        tx1, rx1 = cluster.interface_bytes(1)
        transfer = tcp_transfer(cluster, 0, 1, seconds=2.0)
        # Within 15% of the configured rate, and not above it: the shaping holds.
        assert 0.85 * rate <= transfer.bits_per_second <= 1.02 * rate, transfer
        assert transfer.nbytes >= 0.85 * rate / 8 * 2.0
        after_tx0, _ = cluster.interface_bytes(0)
        _, after_rx1 = cluster.interface_bytes(1)
        assert after_tx0 - tx0 >= transfer.nbytes
        assert after_rx1 - rx1 >= transfer.nbytes

        numel = 1_000_000
        reports = run_allreduce(cluster, numel, iters=1, timeout=90.0)
        assert [report.rank for report in reports] == [0, 1]
        assert all(report.correct for report in reports)
        # Two ranks each send at least the whole tensor per all_reduce (warm-up + 1 timed).
        sent = 2 * numel * 4
        assert cluster.interface_bytes(0)[0] - after_tx0 >= sent
        assert cluster.interface_bytes(1)[0] - tx1 >= sent
        # gloo's traffic is shaped too: no faster than the wire allows (one tensor each way).
        assert reports[0].seconds[0] >= 0.9 * numel * 4 * 8 / rate
    assert _owned_by(run_id) == []


class _Boom(Exception):
    pass


@needs_cluster
def test_exception_inside_with_block_tears_down() -> None:
    cluster = EmulatedCluster(2, bandwidth="1gbit")
    with pytest.raises(_Boom), cluster:
        sleeper = cluster.popen(0, ["sleep", "60"])
        assert len(_owned_by(cluster.run_id)) == 3
        raise _Boom
    assert _owned_by(cluster.run_id) == []
    assert sleeper.poll() is not None
    with pytest.raises(RuntimeError, match="not running"):
        cluster.popen(0, ["true"])


@needs_cluster
def test_sigterm_tears_down() -> None:
    prefix = "s" + secrets.token_hex(2)
    script = (
        "import time\n"
        "from onebit.bench.cluster import EmulatedCluster\n"
        f"with EmulatedCluster(2, name_prefix={prefix!r}) as cluster:\n"
        "    cluster.popen(1, ['sleep', '60'])\n"
        "    time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not [ns for ns in _namespaces() if ns.startswith(prefix)]:
            assert process.poll() is None, "the cluster process exited early"
            assert time.monotonic() < deadline, "the cluster never came up"
            time.sleep(0.1)
        time.sleep(0.3)  # let the sleeper start
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    assert [ns for ns in _namespaces() if ns.startswith(prefix)] == []


@needs_cluster
def test_cleanup_stale_removes_only_dead_owners() -> None:
    prefix = "c" + secrets.token_hex(2)
    reaped = subprocess.Popen(["true"])  # its pid names an owner that no longer exists
    reaped.wait(timeout=10)
    dead = f"{prefix}{secrets.token_hex(3)}-{reaped.pid}-h0"
    live = f"{prefix}{secrets.token_hex(3)}-{os.getpid()}-sw"
    unrelated = f"{prefix}x-{reaped.pid}-h0"
    created = []
    try:
        for name in (dead, live, unrelated):
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
            created.append(name)
        assert cleanup_stale(prefix) == [dead]
        assert cleanup_stale(prefix, include_live=True) == [live]
        assert unrelated in _namespaces()
    finally:
        for name in set(created) & set(_namespaces()):
            subprocess.run(["ip", "netns", "del", name], check=False, timeout=10)
