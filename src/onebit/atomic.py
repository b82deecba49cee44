"""Atomic file writes: a temporary file next to the target, fsync, rename, fsync of the folder.

A reader, or a run restarted after a crash, sees the old file or the complete new one, never
a partly written one.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` for the block to write.

    When the block succeeds, the file is fsynced, renamed onto ``path`` and the folder
    fsynced; when it fails, the temporary file is removed and ``path`` is left as it was.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(payload)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically."""
    write_bytes_atomic(path, (json.dumps(data, indent=2) + "\n").encode())
