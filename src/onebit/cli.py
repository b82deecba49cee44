"""The ``onebit`` command: ``train``, ``compare``, ``finetune`` and ``bench ...``.

Each sub-command lives in its own module, which exposes ``register(subparsers)`` adding its
parser(s) with ``set_defaults(handler=...)``; the handler takes the parsed arguments and
returns an exit code. Modules import their heavy dependencies inside the handler, so
``onebit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

TOP_LEVEL_MODULES = ("onebit.train.cli",)
BENCH_MODULES = ("onebit.bench.comparison", "onebit.bench.micro")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onebit",
        description="1-bit LAMB for PyTorch: train, compare optimizers, fine-tune, benchmark.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: INFO)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in TOP_LEVEL_MODULES:
        importlib.import_module(name).register(commands)
    bench = commands.add_parser(
        "bench", help="benchmarks: micro-benchmarks and the emulated-cluster comparison"
    )
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s %(name)s %(message)s"
    )
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
