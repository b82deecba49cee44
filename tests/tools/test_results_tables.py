"""The results tables of README.md and docs/ are what the result files under docs/ give
(benchmarks/results_tables.py), and each names its data, a commit, a date and a command."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from helpers.paths import ROOT

_SPEC = importlib.util.spec_from_file_location(
    "results_tables", ROOT / "benchmarks" / "results_tables.py"
)
tables = importlib.util.module_from_spec(_SPEC)
sys.modules["results_tables"] = tables
_SPEC.loader.exec_module(tables)


@pytest.fixture(scope="module")
def built():
    return {name: build() for name, build in tables.TABLES.items()}


@pytest.mark.parametrize("page", tables.PAGES)
def test_the_committed_page_is_what_the_data_give(page, built):
    text = (ROOT / page).read_text()
    assert tables.render(text, built) == text, (
        f"{page}: a table differs from its data; run .venv/bin/python benchmarks/results_tables.py"
    )


def test_every_table_is_on_a_page_and_every_marker_names_a_table(built):
    used = [name for page in tables.PAGES for name in tables.tables_in((ROOT / page).read_text())]
    assert set(used) == set(tables.TABLES)
    assert len(used) == len(set(used)), "a table appears on two pages"


def test_every_stamp_names_a_commit_a_date_and_a_command(built):
    for name, table in built.items():
        assert table.commits and all(re.fullmatch(r"[0-9a-f]{7}", c) for c in table.commits), name
        assert table.dates and all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", d) for d in table.dates), name
        assert table.commands and all(
            c.startswith(("python3 run.py", ".venv/bin/python")) for c in table.commands
        ), name
        assert table.rows and all(
            len(r) == len(table.header) == len(table.align) for r in table.rows
        )
        for source in table.sources:
            pattern = source.replace("<run>", "*")
            assert list(ROOT.glob(pattern)), f"{name}: no file matches {source}"
        stamp = table.markdown().splitlines()[-1]
        assert all(c in stamp for c in table.commits) and "Reproduce:" in stamp, name
        # each command pastes into a shell: a note in parentheses stays out of its code span
        spans = re.findall(r"`([^`]+)`", stamp.split("Reproduce:")[1])
        assert spans and not any(span.endswith(")") for span in spans), name


def test_render_refuses_an_unknown_table():
    with pytest.raises(KeyError, match="unknown table"):
        tables.render("<!-- table: no-such-table -->\n<!-- /table -->\n")


def test_the_tool_checks_and_rewrites_in_place(tmp_path, monkeypatch, built, capsys):
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- table: main-job -->\nstale\n<!-- /table -->\nafter\n")
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    monkeypatch.setattr(tables, "PAGES", ("page.md",))
    monkeypatch.setattr(tables, "TABLES", {"main-job": lambda: built["main-job"]})
    assert tables.main(["--check"]) == 1
    assert "page.md" in capsys.readouterr().err
    assert tables.main([]) == 0
    assert page.read_text() == tables.render(page.read_text(), built)
    assert "stale" not in page.read_text()
    assert tables.main(["--check"]) == 0


def test_runs_compared_in_a_table_must_share_their_inputs(tmp_path, monkeypatch):
    """The first training loss (before any update) and the recorded input digests tell runs
    on other samples or from other weights."""
    monkeypatch.setattr(tables, "ROOT", tmp_path)

    def run(name, first_loss, inputs=None):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(f'{{"kind": "train", "loss": {first_loss}}}\n')
        summary = {} if inputs is None else {"inputs": inputs}
        (folder / "summary.json").write_text(json.dumps(summary))
        return name

    a, b = run("a", 6.365576758924708), run("b", 6.365576603848019)  # other reduction order
    tables._first_losses_agree([a, b])
    other = run("c", 6.375825695098817)
    with pytest.raises(ValueError, match=r"\['c'\] did not train on the inputs of a"):
        tables._first_losses_agree([a, other])
    d = run("d", 6.365576758924708, {"sequences": "0123"})
    e = run("e", 6.365576758924708, {"sequences": "4567"})
    with pytest.raises(ValueError, match=r"\['e'\]"):
        tables._first_losses_agree([a, d, e])
