"""Griffe extension: read onebit's docstrings the way they are written.

onebit's docstrings are Google-style with two habits that the Google parser does not know:

* parameters that share a description are listed together (``max_coeff, min_coeff: ...``);
  each name becomes an entry of its own with that description, so that every entry is a real
  parameter (an unknown name still fails the strict build);
* cross-references are Sphinx roles (``:class:`~onebit.exchange.Exchange```); they are shown
  as inline code of the name Sphinx would show (the last part after ``~``).

Only the text the API reference renders changes; the source is not touched.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

SECTIONS = {"Args:", "Arguments:", "Parameters:", "Params:", "Keyword Args:", "Other Parameters:"}
SHARED_ENTRY = re.compile(r"^(\s*)(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)+):(\s.*|)$")
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`([^`]+)`")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_shared_parameters(text: str) -> str:
    """Each ``a, b: description`` entry of a parameters section as ``a: ...`` and ``b: ...``."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if line.strip() not in SECTIONS:
            continue
        section = _indent(line)
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > section):
            match = SHARED_ENTRY.match(lines[i])
            entry = _indent(lines[i])
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() and _indent(lines[i]) > entry:
                body.append(lines[i])
                i += 1
            if match is None:
                out += [lines[i - 1 - len(body)], *body]
                continue
            lead, names, rest = match.groups()
            for name in (n.strip() for n in names.split(",")):
                out += [f"{lead}{name}:{rest}", *body]
    return "\n".join(out)


def _role_text(match: re.Match[str]) -> str:
    target = re.sub(r"\s+", "", match.group(1))
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


def plain_roles(text: str) -> str:
    """Sphinx roles as inline code."""
    return ROLE.sub(_role_text, text)


class OnebitDocstrings(griffe.Extension):
    """Rewrites each docstring's text before mkdocstrings parses it."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_shared_parameters(plain_roles(obj.docstring.value))
