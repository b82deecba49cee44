"""Where onebit keeps what it computed once for this machine (the corpus, tokenizers, the
cost model's calibration): ``$ONEBIT_CACHE``, else ``~/.cache/onebit``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV_VAR", "default_cache_dir"]

CACHE_ENV_VAR = "ONEBIT_CACHE"


def default_cache_dir() -> Path:
    """Return the cache directory: ``$ONEBIT_CACHE`` if set, else ``~/.cache/onebit``."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "onebit"
