"""MkDocs hook: the command-line reference, generated from the ``onebit`` command's parsers.

``reference/cli.md`` holds the marker ``<!-- onebit-cli -->``; at build time it is replaced by
one section per command and sub-command (``onebit``, ``onebit train``, ``onebit bench
cluster``, ...), each with the command's one-line summary and its ``--help`` text as argparse
prints it, so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

MARKER = "<!-- onebit-cli -->"
PAGE = "reference/cli.md"
#: The width argparse wraps the help text at (it reads ``$COLUMNS``).
WIDTH = "96"


@contextmanager
def _columns(width: str) -> Iterator[None]:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, parser)`` of each sub-command of ``parser``, in its order."""
    found = []
    for action in parser._actions:  # argparse has no public way to list sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def _sections(
    parser: argparse.ArgumentParser, words: list[str], summary: str, level: int
) -> Iterator[str]:
    heading = "#" * min(level, 6)
    yield f"{heading} `{' '.join(words)}`\n"
    if summary:
        yield f"{summary[0].upper()}{summary[1:]}.\n"
    yield f"```text\n{parser.format_help().rstrip()}\n```\n"
    for name, help_text, sub in _subcommands(parser):
        yield from _sections(sub, [*words, name], help_text, level + 1)


def cli_reference() -> str:
    """The Markdown of every command's section."""
    from onebit.cli import build_parser

    with _columns(WIDTH):
        parser = build_parser()
        return "\n".join(_sections(parser, ["onebit"], "", 2))


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs API)
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER!r}: the CLI reference has no place")
    return markdown.replace(MARKER, cli_reference())
