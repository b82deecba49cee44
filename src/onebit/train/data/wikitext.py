"""The Wikipedia sample: MediaWiki XML export to plain-text articles.

The sample is the English Wikipedia excerpt (MediaWiki XML export, bz2) that ships in the
``gensim==4.4.0`` wheel as a test fixture. Its wikitext is parsed with ``mwparserfromhell``
and reduced to the prose a reader sees (:func:`strip_wiki_markup`).
"""

from __future__ import annotations

import bz2
import re
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import mwparserfromhell
from mwparserfromhell.nodes import (
    ExternalLink,
    Heading,
    HTMLEntity,
    Node,
    Tag,
    Template,
    Text,
    Wikilink,
)
from mwparserfromhell.wikicode import Wikicode

from onebit.train.data.fetch import find_member

WIKI_MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)

# Tags whose content is not running text (citations, formulas, galleries, tables, ...).
_DROPPED_TAGS = frozenset(
    "ref references math chem ce gallery timeline imagemap score syntaxhighlight source hiero "
    "graph mapframe templatedata table".split()
)
_DROPPED_NAMESPACES = frozenset({"file", "image", "category", "media"})
_INTERLANGUAGE_RE = re.compile(r"[a-z]{2,3}(?:-[a-z]+)*")
# Trailing sections that hold only references and link lists.
_DROPPED_SECTIONS = frozenset(
    {
        "references",
        "external links",
        "see also",
        "further reading",
        "notes",
        "bibliography",
        "sources",
        "footnotes",
        "citations",
        "notes and references",
    }
)
# Bold and italic quotes. They are removed before parsing: the parser takes an unbalanced
# '' (common in the sample) as the start of a span and keeps whatever follows it as markup.
_BOLD_ITALIC_RE = re.compile(r"'{2,}")
_MAGIC_WORD_RE = re.compile(r"__[A-Z]+__")
_STRAY_MARKERS_RE = re.compile(r"\{\{|\}\}|\[\[|\]\]|\{\||\|\}")
_EMPTY_PARENS_RE = re.compile(r"\(\s*[,;:]?\s*\)")
_PUNCT_AFTER_OPEN_RE = re.compile(r"\(\s*[,;:]\s*")
_SPACE_BEFORE_PUNCT_RE = re.compile(r"[ \t]+([,.;:!?)])")
_SPACE_AFTER_OPEN_RE = re.compile(r"\([ \t]+")
_SPACES_RE = re.compile(r"[ \t\u00a0]+")
_QUALIFIER_RE = re.compile(r"\s*\([^)]*\)$")

_Render = Callable[[list[str], dict[str, str]], str]


def _first(args: list[str], named: dict[str, str]) -> str:
    return args[0] if args else ""


def _last(args: list[str], named: dict[str, str]) -> str:
    return args[-1] if args else ""


def _measure(args: list[str], named: dict[str, str]) -> str:
    """``{{convert|12|km}}`` shows ``12 km``, ``{{convert|5|-|10|km}}`` ``5–10 km``."""
    if len(args) >= 4 and args[1] in ("-", "–", "to", "and", "or", "by", "x"):
        joiner = "–" if args[1] in ("-", "–") else f" {args[1]} "
        return f"{args[0]}{joiner}{args[2]} {args[3]}"
    return " ".join(args[:2])


def _as_of(args: list[str], named: dict[str, str]) -> str:
    return ("as of " if named.get("lc") else "As of ") + " ".join(args[:1])


def _quote(args: list[str], named: dict[str, str]) -> str:
    return named.get("text") or named.get("quote") or _first(args, named)


def _constant(text: str) -> _Render:
    return lambda args, named: text


# Templates whose text is part of a sentence, and the text each one shows; every other
# template (infoboxes, citations, navigation, maintenance tags, ...) is dropped.
_INLINE_TEMPLATES: dict[str, _Render] = {
    "convert": _measure,
    "cvt": _measure,
    "lang": _last,
    "transl": _last,
    "linktext": lambda args, named: "".join(args),
    "nihongo": _first,
    "quote": _quote,
    "as of": _as_of,
    "nowrap": _first,
    "nobr": _first,
    "small": _first,
    "smaller": _first,
    "big": _first,
    "vanchor": _first,
    "nbsp": _constant(" "),
    "ndash": _constant("–"),
    "mdash": _constant("—"),
    "snd": _constant(" – "),
}


def _template_text(template: Template) -> str:
    name = _text(template.name).strip().lower().replace("_", " ")
    render = _INLINE_TEMPLATES.get(name) or (_last if name.startswith("lang-") else None)
    if render is None:
        return ""
    args = [_text(p.value).strip() for p in template.params if not p.showkey]
    named = {str(p.name).strip(): _text(p.value).strip() for p in template.params if p.showkey}
    return render(args, named)


def _link_text(link: Wikilink) -> str:
    """Visible text of an internal link ``[[target|label]]``."""
    target = _text(link.title).strip()
    explicit = target.startswith(":")  # [[:Category:X]] is a plain link to the category page
    target = target.lstrip(":")
    namespace = target.partition(":")[0].strip().lower() if ":" in target else ""
    if not explicit and namespace in _DROPPED_NAMESPACES:
        return ""
    if link.text is None:
        if not explicit and namespace and _INTERLANGUAGE_RE.fullmatch(namespace):
            return ""
        return target
    label = _text(link.text).strip()
    # Pipe trick: [[Page (qualifier)|]] shows "Page".
    return label or _QUALIFIER_RE.sub("", target.rpartition(":")[2]).strip()


def _node_text(node: Node) -> str:
    if isinstance(node, Text):
        return node.value
    if isinstance(node, HTMLEntity):
        return node.normalize()
    if isinstance(node, Template):
        return _template_text(node)
    if isinstance(node, Wikilink):
        return _link_text(node)
    if isinstance(node, ExternalLink):
        return _text(node.title) if node.brackets and node.title else ""
    if isinstance(node, Heading):
        return _text(node.title).strip()
    if isinstance(node, Tag):
        tag = _text(node.tag).strip().lower()
        if tag == "br":
            return "\n"
        if tag in _DROPPED_TAGS or node.contents is None:  # list markers and rules: no contents
            return ""
        return _text(node.contents)
    return ""  # comments and template arguments


def _text(code: Wikicode) -> str:
    return "".join(_node_text(node) for node in code.nodes)


def _without_reference_sections(nodes: Sequence[Node]) -> list[Node]:
    """Drop sections such as "References" or "External links", with their subsections."""
    kept: list[Node] = []
    dropping_level = 0  # heading level of the section being dropped, 0 when keeping
    for node in nodes:
        if isinstance(node, Heading):
            if dropping_level and node.level > dropping_level:
                continue
            title = _text(node.title).strip().lower()
            dropping_level = node.level if title in _DROPPED_SECTIONS else 0
        if not dropping_level:
            kept.append(node)
    return kept


def _clean_line(line: str) -> str:
    line = _SPACES_RE.sub(" ", line)
    line = _EMPTY_PARENS_RE.sub("", line)
    line = _PUNCT_AFTER_OPEN_RE.sub("(", line)
    line = _SPACE_AFTER_OPEN_RE.sub("(", line)
    line = _SPACE_BEFORE_PUNCT_RE.sub(r"\1", line)
    return _SPACES_RE.sub(" ", line).strip()


def strip_wiki_markup(text: str) -> str:
    """Convert MediaWiki markup to plain text.

    Drops comments, ``<ref>`` citations and other non-prose tags with their content, tables,
    file/image/category and interlanguage links, magic words, reference-only sections
    ("References", "External links", ...) and every template except those that show text
    inside a sentence (``{{convert|12|km}}`` -> ``12 km``, ``{{lang|grc|...}}``, ``{{as of|2014}}``,
    ...). ``[[target|label]]`` becomes ``label``, ``[[target]]`` ``target``,
    ``[http://x label]`` ``label`` and ``== Heading ==`` ``Heading``; bold and italic quotes
    and list markers go, other HTML tags keep their content and entities are decoded.
    Paragraphs are separated by one blank line.
    """
    text = _BOLD_ITALIC_RE.sub("", text.replace("\r\n", "\n"))
    code = mwparserfromhell.parse(text)
    plain = "".join(_node_text(node) for node in _without_reference_sections(code.nodes))
    plain = _STRAY_MARKERS_RE.sub("", _MAGIC_WORD_RE.sub("", plain))
    paragraphs: list[str] = []
    current: list[str] = []
    for raw_line in plain.split("\n"):
        line = _clean_line(raw_line)
        if line:
            current.append(line)
        elif current:
            paragraphs.append("\n".join(current))
            current = []
    if current:
        paragraphs.append("\n".join(current))
    return "\n\n".join(paragraphs)


def _local_name(tag: str) -> str:
    return tag.rpartition("}")[2]


def parse_wiki_xml(stream: IO[bytes]) -> Iterator[tuple[str, str]]:
    """Yield ``(title, wikitext)`` of the articles in a MediaWiki XML export.

    Only main-namespace pages (``<ns>0</ns>``) are yielded; redirects (a ``<redirect>``
    element or text starting with ``#REDIRECT``) are skipped.
    """
    for _, elem in ET.iterparse(stream, events=("end",)):
        if _local_name(elem.tag) != "page":
            continue
        title = ""
        namespace = "0"
        text = ""
        redirect = False
        for child in elem.iter():
            name = _local_name(child.tag)
            if name == "title":
                title = child.text or ""
            elif name == "ns":
                namespace = (child.text or "").strip()
            elif name == "redirect":
                redirect = True
            elif name == "text":
                text = child.text or ""
        elem.clear()
        if namespace != "0" or redirect or text.lstrip()[:9].upper() == "#REDIRECT":
            continue
        yield title, text


def extract_wiki_articles(wheel: Path) -> list[str]:
    """Read the Wikipedia sample out of the gensim wheel and return plain-text articles."""
    with zipfile.ZipFile(wheel) as zf:
        member = find_member(zf.namelist(), WIKI_MEMBER, wheel)
        with zf.open(member) as compressed, bz2.open(compressed) as xml_stream:
            articles = [strip_wiki_markup(text) for _, text in parse_wiki_xml(xml_stream)]
    return [a for a in articles if a]
