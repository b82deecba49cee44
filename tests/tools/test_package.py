"""The package as a user installs it: the public API passes the type checker (mypy, as
configured in pyproject.toml); a wheel and an sdist built from a copy of the checkout pass
``twine check``, and the wheel installed into a clean virtual environment with torch and
numpy alone (no extras: no numba) imports, is typed, and steps 1-bit LAMB through its
warm-up into the compression stage on the torch reference kernels."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SMOKE = """
import importlib.resources, torch, onebit
from onebit import kernels
assert "numba" not in kernels.available(), kernels.available()
assert importlib.resources.files("onebit").joinpath("py.typed").is_file()
params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
optimizer = onebit.OneBitLamb(params, lr=1e-2, freeze_step=2)
for step in range(4):
    for param in params:
        param.grad = torch.randn(param.shape)
    optimizer.step()
assert optimizer.stage == "compression" and optimizer.backend.name == "torch"
print("stepped", optimizer.step_count)
"""


def _run(*command, cwd: Path | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(map(str, command))}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_public_api_passes_the_type_checker():
    assert "Success" in _run(sys.executable, "-m", "mypy", cwd=ROOT)


@pytest.mark.slow  # builds the package and installs torch into a new environment
def test_the_built_package_passes_twine_and_steps_without_extras(tmp_path):
    source = tmp_path / "source"
    ignored = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "*.egg-info")
    shutil.copytree(ROOT, source, ignore=ignored)
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), cwd=source)
    built = sorted(path.name for path in dist.iterdir())
    assert sorted(name.rsplit(".", 1)[-1] for name in built) == ["gz", "whl"], built
    _run(sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir()))
    environment = tmp_path / "clean"
    venv.EnvBuilder(with_pip=True).create(environment)
    python = environment / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run(*pip, f"torch=={torch.__version__.split('+')[0]}")
    _run(*pip, str(next(dist.glob("*.whl"))))
    assert "stepped 4" in _run(str(python), "-c", SMOKE)
