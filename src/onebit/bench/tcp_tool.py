"""The TCP throughput tool of the emulated cluster: a receiver and a sender, each run inside a
host's namespace as ``python -I tcp_tool.py tcp-recv|tcp-send ...`` by
:func:`onebit.bench.cluster_tools.tcp_transfer`.

Standard library only, run as a file in isolated mode: each starts in ~0.1 s instead of paying
for the package's torch import. Each answers its parent with JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Mapping, Sequence

CHUNK = 1 << 20
"""Bytes per send and receive call."""


def emit(record: Mapping[str, object]) -> None:
    """Write one JSON line on stdout: the answer a helper command gives its parent."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _tcp_recv_command(args: argparse.Namespace) -> None:
    """Bind a free port (reported as the first output line), receive one stream, report it."""
    with socket.create_server((args.bind, 0)) as server:
        emit({"port": server.getsockname()[1]})
        server.settimeout(args.timeout)
        conn, _ = server.accept()
    deadline = time.monotonic() + args.timeout
    buffer = memoryview(bytearray(CHUNK))
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
    emit(
        {
            "bytes": total,
            "seconds": elapsed,
            "bits_per_second": timed * 8 / elapsed if elapsed > 0 else 0.0,
        }
    )


def _tcp_send_command(args: argparse.Namespace) -> None:
    payload = memoryview(bytes(CHUNK))
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
            sent += sock.send(payload[: min(CHUNK, args.nbytes - sent)])
        sock.shutdown(socket.SHUT_WR)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one end of a timed TCP stream")
    sub = parser.add_subparsers(dest="command", required=True)
    recv = sub.add_parser("tcp-recv", help="bind a free port, receive one stream, report it")
    recv.add_argument("--bind", required=True)
    recv.add_argument("--timeout", type=float, required=True)
    recv.set_defaults(handler=_tcp_recv_command)
    send = sub.add_parser("tcp-send", help="send up to --nbytes for up to --seconds")
    send.add_argument("--host", required=True)
    send.add_argument("--port", type=int, required=True)
    send.add_argument("--nbytes", type=int, required=True)
    send.add_argument("--seconds", type=float, required=True)
    send.add_argument("--timeout", type=float, required=True)
    send.set_defaults(handler=_tcp_send_command)
    args = parser.parse_args(argv)
    args.handler(args)


if __name__ == "__main__":
    main()
