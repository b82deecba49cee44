"""The exchange alone at 100 Mbit/s with TCP's restart after idle on and off, on 2 emulated
hosts (the test of one hypothesis for its gap to the wire time).

Run as root from the checkout:

    .venv/bin/python scripts/exchange_slow_start.py

Twice ``onebit bench exchange``'s per-rank timing of 2^25 float32 (25 MiB buckets, fastest of
the last 3 of 4 calls), with ``net.ipv4.tcp_slow_start_after_idle`` set to 1 (the Linux
default), then 0, in both hosts' namespaces."""

import subprocess

from onebit.bench.cluster import EmulatedCluster
from onebit.bench.exchange_wire import bucket_elements_of, time_exchanges

for setting in ("1", "0"):
    with EmulatedCluster(2, bandwidth="100mbit") as cluster:
        for host in range(2):
            sysctl = f"net.ipv4.tcp_slow_start_after_idle={setting}"
            namespace = cluster.namespace(host)
            subprocess.run(
                ["ip", "netns", "exec", namespace, "sysctl", "-q", "-w", sysctl], check=True
            )
        row = time_exchanges(cluster, 25, bucket_elements_of(25), calls=4)
    print(f"tcp_slow_start_after_idle={setting}:", row, flush=True)
