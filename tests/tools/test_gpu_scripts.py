"""The GPU check's step benchmark (scripts/gpu_step_benchmark.py), prepared on CPU: it runs
every kind of step at small widths, and without CUDA it says so and stops."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from helpers.paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu_step_benchmark.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("gpu_step_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_the_step_benchmark_stops_with_a_message_without_cuda(capsys):
    assert _benchmark().main([]) == 77
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_the_step_benchmark_times_every_kind_of_step_on_cpu(tmp_path, capsys):
    module = _benchmark()
    out = tmp_path / "steps.json"
    args = ["--device", "cpu", "--scale", "0.02", "--repeats", "2", "--models", "base"]
    assert module.main([*args, "--out", str(out)]) == 0
    steps = json.loads(out.read_text())["results"]["base"]["steps"]
    expected = {step for _, step, _, _ in module.TARGETS} | {"AdamW(foreach=True)"}
    assert expected <= set(steps), expected - set(steps)
    for name, row in steps.items():
        assert row["ms"] > 0 and row["copies"] > 0, name
    assert steps["AdamW(fused=True)"]["vs_adamw_fused"] == 1.0
    printed = capsys.readouterr().out
    assert "BERT-base" in printed and "Lamb / AdamW(fused) <= 1.3" in printed


def test_a_method_that_never_reaches_its_counted_kind_is_named_not_waited_for():
    module = _benchmark()
    params = [torch.nn.Parameter(torch.zeros(8))]
    never = module.Method("never counted", params, torch.optim.SGD(params, lr=0.1), lambda: False)
    with pytest.raises(RuntimeError, match=r"\['never counted'\] took fewer than 2 steps"):
        module.time_group([never], [torch.ones(8)], repeats=2, device="cpu")
