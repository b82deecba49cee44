"""The ``onebit`` command: ``train``, ``simulate``, ``compare``, ``finetune``, ``probe``,
``study``, ``estimate`` and ``bench ...`` (``onebit --help`` lists each with one line).

Each sub-command lives in its own module, which exposes ``register(subparsers)`` adding its
parser(s) with ``set_defaults(handler=...)``; the handler takes the parsed arguments and
returns an exit code. Modules import their heavy dependencies inside the handler, so
``onebit --help`` stays fast.

The options of a settings dataclass are written once, as its fields: :func:`option` declares
a field with its help text (and choices, parser, ...), :func:`add_options` turns every such
field into ``--field-name``, and :func:`given_options` reads back the ones given.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

TOP_LEVEL_MODULES = ("onebit.train.cli", "onebit.train.study.cli", "onebit.estimate.cli")
BENCH_MODULES = ("onebit.bench.cli", "onebit.bench.micro")


def option(
    default: Any,
    *,
    help: str,
    group: str | None = None,
    choices: Collection[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | tuple[str, ...] | None = None,
    default_help: str | None = None,
) -> Any:
    """A dataclass field with ``default`` that is also the command-line option ``--name``.

    Args:
        help: what the option sets; ``(default: ...)`` is appended.
        group: the title of the help section the option is listed in.
        choices: the values allowed.
        parse: turns the option's text into the value (default: from the field's type).
        metavar: the value's name in the help.
        default_help: how the default is shown, where the value itself says too little
            (e.g. ``"20% of --steps"`` for a ``None`` resolved later).
    """
    metadata = {
        "help": help,
        "group": group,
        "choices": choices,
        "parse": parse,
        "metavar": metavar,
        "default_help": default_help,
    }
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def checked_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ``ValueError`` shown by argparse as the option's error message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return convert


def _value_kwargs(hint: Any, parse: Callable[[str], Any] | None) -> dict[str, Any]:
    """``type``/``nargs``/``action`` of an option whose field has the type ``hint``."""
    if parse is not None:
        return {"type": checked_type(parse)}
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return {"type": args[0], "nargs": "+"}
    if origin is tuple:
        return {"type": args[0], "nargs": len(args)}
    return {"type": hint}


def _default_of(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _shown(flag: str, value: Any) -> str:
    """How the default ``value`` of the option ``flag`` is shown in its help."""
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return "none" if value is None else str(value)


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    exclude: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add ``--field-name`` for every field of the dataclass ``cls`` made by :func:`option`.

    An option that is not given is absent from the parsed namespace, unless ``defaults``
    gives it a value here (which its help then shows); :func:`given_options` collects them.
    Fields named in ``exclude`` get no option.
    """
    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    groups: dict[str | None, Any] = {None: parser}
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if "help" not in meta or field.name in exclude:
            continue
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        flag = "--" + field.name.replace("_", "-")
        default = defaults.get(field.name, argparse.SUPPRESS)
        value = _default_of(field) if default is argparse.SUPPRESS else default
        shown = meta["default_help"] or _shown(flag, value)
        kwargs = _value_kwargs(hints[field.name], meta["parse"])
        for key in ("choices", "metavar"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
        groups[meta["group"]].add_argument(
            flag,
            default=default,
            help=f"{meta['help']} (default: {shown})".replace("%", "%%"),
            **kwargs,
        )


def given_options(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` that ``args`` holds (given, or with a default)."""
    hints = typing.get_type_hints(cls)
    given = {}
    for field in dataclasses.fields(cls):
        if hasattr(args, field.name):
            value = getattr(args, field.name)
            is_tuple = typing.get_origin(hints[field.name]) is tuple
            given[field.name] = tuple(value) if is_tuple and isinstance(value, list) else value
    return given


def options_argv(settings: Any, *, exclude: Collection[str] = ()) -> list[str]:
    """The command-line options that give the dataclass instance ``settings`` again (the
    inverse of :func:`add_options` and :func:`given_options`): ``--field-name value`` for
    every option field whose value differs from its default, in field order."""
    argv: list[str] = []
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if "help" not in field.metadata or field.name in exclude:
            continue
        if value is None or value == _default_of(field):
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onebit",
        description="1-bit LAMB, 1-bit Adam and 0/1 Adam for PyTorch: the main job, its simulation "
        "of many workers, optimizer comparisons, downstream checks, the convergence study, "
        "the cost model and the benchmarks.",
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
        "bench", help="micro-benchmarks and the emulated-cluster comparison"
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


def flag_name(name: str) -> str:
    """The option ``--name`` of a field ``name``."""
    return name.replace("_", "-")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming ``--name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"--{flag_name(name)} must be one of {list(choices)}, got {value!r}")


def check_positive_int_option(name: str, value: int) -> None:
    """Raise ``ValueError`` naming ``--name`` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{flag_name(name)} must be a positive integer, got {value!r}")


def int_or_auto(text: str) -> int | str:
    """An option's value: ``auto`` or a positive integer."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected 'auto' or a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"expected 'auto' or a positive integer, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
