"""The documentation site builds with warnings as errors (``mkdocs build --strict``, what
``python3 run.py docs`` runs): every page in the nav, every link and anchor between pages,
every cross-reference to the API, every docstring the API reference renders and the CLI
reference generated from the parsers. A second build shows that the site's settings turn a
broken link and a broken cross-reference in a docstring into a failed build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from helpers.paths import ROOT

CONFIG = ROOT / "mkdocs.yml"


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    built = _mkdocs_build(CONFIG, site)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-8000:]
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("onebit.OneBitLamb", "onebit.ZeroOneAdam", "onebit.dcp.save", "onebit.DiLoCo"):
        assert f'id="{name}"' in api, f"{name} is missing from the API reference"
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("onebit train", "onebit simulate", "onebit bench cluster"):
        assert command in cli, f"{command} is missing from the CLI reference"
    assert "<!-- onebit-cli -->" not in cli


def _config_for(pages: Path, source: Path) -> dict:
    """mkdocs.yml's settings (theme, validation, extensions, the API handler and its
    docstring extension) over other pages and another source folder."""
    config = yaml.safe_load(CONFIG.read_text())
    config.pop("nav", None)
    config.pop("not_in_nav", None)
    config.pop("hooks", None)
    config["docs_dir"] = str(pages)
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            python = plugin["mkdocstrings"]["handlers"]["python"]
            python["paths"] = [str(source)]
            python["options"]["extensions"] = [
                str(ROOT / extension) for extension in python["options"]["extensions"]
            ]
    return config


def test_a_broken_link_or_docstring_reference_fails_the_build(tmp_path):
    source, pages = tmp_path / "src", tmp_path / "docs"
    (source / "sample").mkdir(parents=True)
    (source / "sample" / "__init__.py").write_text(
        'def documented() -> None:\n    """Works like [`missing`][sample.missing]."""\n'
    )
    pages.mkdir()
    (pages / "index.md").write_text("# Home\n\nSee [the guide](guide/missing.md).\n")
    (pages / "api.md").write_text("# API\n\n::: sample.documented\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump(_config_for(pages, source)))

    built = _mkdocs_build(config, tmp_path / "site")
    output = built.stdout + built.stderr
    assert built.returncode != 0, output[-4000:]
    assert "guide/missing.md" in output, output[-4000:]
    assert "sample.missing" in output, output[-4000:]
