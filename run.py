#!/usr/bin/env python3
"""Bootstrap and run onebit on a fresh machine that has nothing but Python.

    python3 run.py train [ARGS...]   # the main job (`onebit train`), default settings
    python3 run.py test  [ARGS...]   # the test suite (pytest): without ARGS the default
                                     # suite, then the end-to-end group (-m slow)
    python3 run.py onebit ARGS...    # any `onebit` sub-command
    python3 run.py docs              # the documentation site (mkdocs, warnings are errors)
                                     # into site/

The first call creates a virtual environment in `.venv` next to this file and installs
onebit into it with its training and test extras; torch is pinned to a CPU build here, the
packages the results are measured with to constraints.txt.
Later calls reuse it (it is rebuilt when pyproject.toml changes).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH_PIN = "torch==2.13.0"
#: The versions of the packages the results under docs/ are measured with.
CONSTRAINTS = ROOT / "constraints.txt"
STAMP = VENV / ".onebit-installed"


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _wanted_stamp() -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(CONSTRAINTS.read_bytes())
    digest.update(TORCH_PIN.encode())
    return digest.hexdigest()


def ensure_environment() -> Path:
    python = _venv_python()
    if STAMP.exists() and STAMP.read_text() == _wanted_stamp() and python.exists():
        return python
    if not python.exists():
        print(f"[run.py] creating virtual environment in {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    print(f"[run.py] installing {TORCH_PIN} and onebit[train,dev]", flush=True)
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, "-c", str(CONSTRAINTS), "-e", f"{ROOT}[train,dev]"], check=True)
    STAMP.write_text(_wanted_stamp())
    return python


def run_suite(python: str) -> int:
    """The default suite (``-m "not slow"``), then, if it passed, the end-to-end group
    (``-m slow``: runs of the job, the study and the cluster benchmark); each one's time."""
    times = []
    for group in ("not slow", "slow"):
        start = time.monotonic()
        code = subprocess.call([python, "-m", "pytest", "-m", group], cwd=ROOT)
        times.append(f"-m {group!r}: {time.monotonic() - start:.0f} s")
        if code not in (0, 5):  # 5: no test selected
            break
    print(f"[run.py] test suite: {', '.join(times)}", flush=True)
    return 0 if code in (0, 5) else code


def build_docs(python: str, rest: list[str]) -> int:
    """``mkdocs build --strict`` of mkdocs.yml into ``site/`` (ARGS go to mkdocs)."""
    args = [python, "-m", "mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice on every build
    code = subprocess.call([*args, *rest], cwd=ROOT, env=env)
    if code == 0:
        print(f"[run.py] documentation site: {ROOT / 'site' / 'index.html'}", flush=True)
    return code


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"train", "test", "onebit", "docs"}:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    python = str(ensure_environment())
    command, rest = argv[0], argv[1:]
    if command == "test" and not rest:
        return run_suite(python)
    if command == "docs":
        return build_docs(python, rest)
    if command == "test":
        args = [python, "-m", "pytest", *rest]
    elif command == "train":
        args = [python, "-m", "onebit", "train", *rest]
    else:
        args = [python, "-m", "onebit", *rest]
    return subprocess.call(args, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
