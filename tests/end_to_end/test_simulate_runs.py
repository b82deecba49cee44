"""``onebit simulate`` on the tiny job (helpers/jobs.py): the same run as ``onebit train``
with worker processes, and a resumed simulation the same as an uninterrupted one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.jobs import FREEZE as TINY_FREEZE
from helpers.jobs import STEPS as TINY_STEPS
from helpers.jobs import TINY, final_model, write_corpus

import onebit
from onebit.cli import main as onebit_main


def _train_simulate_and_resume(tmp_path: Path, options: list[str]) -> Path:
    """``onebit train`` (2 processes) into real/, ``onebit simulate`` into sim/, and in
    partial/ the simulation as if stopped after step 8, resumed; returns partial/."""
    assert onebit_main(["train", *options, "--out", str(tmp_path / "real")]) == 0
    # Each worker's pass on the threads a real worker has (bit-identical results need that).
    threads = ["--threads", str(max(1, len(os.sched_getaffinity(0)) // 2))]
    default_threads = torch.get_num_threads()
    partial = tmp_path / "partial"
    try:
        assert onebit_main(["simulate", *options, *threads, "--out", str(tmp_path / "sim")]) == 0
        shutil.copytree(tmp_path / "sim", partial)
        shutil.rmtree(partial / "checkpoints" / f"step-{TINY_STEPS:08d}")
        (partial / "summary.json").unlink()
        assert onebit_main(["simulate", "--resume", str(partial), *threads]) == 0
    finally:
        torch.set_num_threads(default_threads)
    return partial


@pytest.mark.slow
@pytest.mark.parametrize("delay", [[], ["--delayed-exchange"]], ids=["", "delayed"])
def test_cli_simulation_equals_onebit_train_and_resumes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    delay: list[str],
) -> None:
    """``onebit simulate --workers 2`` on the tiny job of helpers/jobs.py: the same parameters as
    ``onebit train`` with 2 worker processes (a mean of two gradients is exact in any order),
    the same run-folder files, and an interrupted simulation that resumes to the same end;
    also with the delayed exchange, each worker's gradients taken at its own prediction."""
    monkeypatch.setenv("ONEBIT_CACHE", str(tmp_path / "cache"))
    corpus = str(write_corpus(tmp_path / "corpus.txt"))
    # --workers 2; the fused exchange, which the simulation runs
    plain = [*TINY, "--corpus", corpus, "--compression", "fused"]
    options = [*plain, *delay]
    partial = _train_simulate_and_resume(tmp_path, options)

    real, simulated = final_model(tmp_path / "real"), final_model(tmp_path / "sim")
    assert real.keys() == simulated.keys()
    for name, tensor in real.items():
        assert torch.equal(tensor, simulated[name]), f"{name}: simulation != onebit train"
    for name, tensor in final_model(partial).items():
        assert torch.equal(tensor, simulated[name]), f"{name}: resumed != uninterrupted"
    rows = {
        kind: [json.loads(line) for line in (tmp_path / kind / "metrics.jsonl").open()]
        for kind in ("real", "sim", "partial")
    }
    for row in (row for kind in rows.values() for row in kind):
        row.pop("step_time", None)
    assert rows["partial"] == rows["sim"]

    train = {kind: [r for r in rows[kind] if r["kind"] == "train"] for kind in rows}
    assert [r["loss"] for r in train["sim"]] == [r["loss"] for r in train["real"]]
    assert [r["stage"] for r in train["sim"]] == [r["stage"] for r in train["real"]]
    assert [r["bytes"] for r in train["sim"][:TINY_FREEZE]] == [
        r["bytes"] for r in train["real"][:TINY_FREEZE]
    ]
    # The real run also sends the one-time gradient check (8 bytes) at the first 1-bit step.
    compressed = [r["bytes"] for r in train["real"][TINY_FREEZE:]]
    compressed[0] -= 8
    assert [r["bytes"] for r in train["sim"][TINY_FREEZE:]] == compressed
    # Validation: the same model, but evaluated in one process rather than split over two
    # ranks, so the batches and the summation of the mean loss differ.
    validation = {
        kind: [r["loss"] for r in rows[kind] if r["kind"] == "validation"] for kind in rows
    }
    assert validation["sim"] == pytest.approx(validation["real"], rel=1e-6)

    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["simulation"]["node_size"] == 1
    memory = summary["simulation"]["memory_bytes"]
    numel = summary["parameters"]
    assert memory["worker_errors"] == 2 * 4 * onebit.padded_size(numel, 2)
    capsys.readouterr()
    assert onebit_main(["train", "--resume", str(tmp_path / "sim")]) == 2
    assert "holds a simulation of 2 workers" in capsys.readouterr().err
    assert onebit_main(["simulate", "--resume", str(tmp_path / "real")]) == 2
    assert "holds a run of worker processes" in capsys.readouterr().err
    assert onebit_main(["simulate", *plain, "--optimizer", "zero-one-adam"]) == 2
    assert "cannot be simulated" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "diloco",
    [
        ["--sync-every", "5"],
        ["--sync-every", "6", "--fragments", "2", "--fragment-delay", "1", "--local-share", "0.5"],
        ["--sync-every", "5", "--worker-residual", "local"],
        ["--sync-every", "5", "--worker-residual", "local", "--deliver-errors"],
        ["--sync-every", "5", "--outer-reference-share", "0.5"],
    ],
    ids=["rounds", "streaming", "local", "delivered", "reference"],
)
def test_simulated_diloco_equals_onebit_train_and_resumes_inside_a_round(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    diloco: list[str],
) -> None:
    """``onebit simulate --sync-every 5`` (DiLoCo over AdamW, the 1-bit outer exchange, 2
    workers): the weights, losses and bytes of ``onebit train`` with 2 worker processes, and
    a simulation resumed from its checkpoint of step 8 (inside the second round, where the
    workers' weights differ) ends where the uninterrupted one does. Likewise streaming, in two
    fragments of 3-step turns with a delay of 1 step, where the checkpoint of step 8 holds
    the exchange that started at step 8, with each worker moved by its residual, with the
    errors delivered at the end, and with half the last round's average taken out of the
    messages."""
    monkeypatch.setenv("ONEBIT_CACHE", str(tmp_path / "cache"))
    corpus = str(write_corpus(tmp_path / "corpus.txt"))
    options = [*TINY, "--corpus", corpus, "--optimizer", "adam", *diloco]
    _train_simulate_and_resume(tmp_path, options)
    simulated = final_model(tmp_path / "sim")
    for run in ("real", "partial"):
        for name, tensor in final_model(tmp_path / run).items():
            assert torch.equal(tensor, simulated[name]), f"{name}: {run} != simulation"
    train = {
        kind: [
            row
            for row in map(json.loads, (tmp_path / kind / "metrics.jsonl").open())
            if row["kind"] == "train"
        ]
        for kind in ("real", "sim", "partial")
    }
    for field in ("loss", "stage", "bytes"):
        assert [r[field] for r in train["sim"]] == [r[field] for r in train["real"]], field
        assert [r[field] for r in train["partial"]] == [r[field] for r in train["sim"]], field
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["simulation"]["memory_bytes"]["worker_weights"] == 2 * 4 * summary["parameters"]
    nodes = ["--workers", "4", "--node-size", "2", "--out", str(tmp_path / "nodes")]
    assert onebit_main(["simulate", *options, *nodes]) == 2
    assert "DiLoCo between nodes) is not simulated" in capsys.readouterr().err
    assert not (tmp_path / "nodes").exists()
