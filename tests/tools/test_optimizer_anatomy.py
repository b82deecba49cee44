"""scripts/optimizer_anatomy.py counts the optimizers' classes and traces one compression
step to its first collective on 2 gloo ranks."""

from __future__ import annotations

import json

from helpers.paths import ROOT


def test_the_anatomy_names_the_path_from_step_to_the_first_collective(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import optimizer_anatomy

    out = tmp_path / "anatomy.json"
    assert optimizer_anatomy.main(["--json", str(out)]) == 0
    counts = json.loads(out.read_text())
    assert set(counts["classes"]["OneBitLamb"]) == {"OneBitLamb", "OneBitOptimizer"}
    path = counts["step"]["path"]
    assert path[0][1] == "step" and path[-1][0] == "exchange/transport.py"
    assert counts["step"]["functions"] > len(path)
    assert "frames in" in capsys.readouterr().out
