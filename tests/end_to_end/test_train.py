"""End-to-end tests of ``onebit train``: run folder, loss, traffic, checkpoints, resumption.

A tiny BERT on a tiny generated corpus (helpers/jobs.py), 2 gloo workers started by the real
elastic launcher. What needs no run (options, the run folder's checks, checkpoint files) is in
unit/test_train_single_process.py.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.jobs import FREEZE, STEPS, TINY, final_model, write_corpus

from onebit.cli import main as onebit_main
from onebit.train import checkpoint, report


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temporary folder holding the corpus, with the data cache pointed into it."""
    root = tmp_path_factory.mktemp("train")
    write_corpus(root / "corpus.txt")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONEBIT_CACHE", str(root / "cache"))
        yield root


def train(*args: str) -> int:
    return onebit_main(["train", *args])


def tiny(workspace: Path, out: Path, *extra: str) -> list[str]:
    return [*TINY, "--corpus", str(workspace / "corpus.txt"), "--out", str(out), *extra]


@pytest.fixture(scope="module")
def reference_run(workspace: Path) -> Path:
    """An uninterrupted tiny run through the switch to compression."""
    out = workspace / "reference"
    assert train(*tiny(workspace, out)) == 0
    return out


def assert_same_trajectory(run_dir: Path, reference: Path) -> None:
    expected, actual = final_model(reference), final_model(run_dir)
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), f"{name} differs from the uninterrupted run"
    ours, theirs = report.read_metrics(run_dir), report.read_metrics(reference)
    assert [r["step"] for r in ours.train] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in ours.train] == [r["loss"] for r in theirs.train]
    assert [r["loss"] for r in ours.validation] == [r["loss"] for r in theirs.validation]


def test_run_folder_loss_and_traffic(
    reference_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {p.name for p in reference_run.iterdir()}
    assert {
        "config.json", "metrics.jsonl", "loss.png", "summary.json", "tokenizer.json", "checkpoints"
    } <= names  # fmt: skip
    assert (reference_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    versions = json.loads((reference_run / "config.json").read_text())["environment"]
    assert versions["torch"] == torch.__version__ and versions["numpy"] == np.__version__
    inputs = json.loads((reference_run / "summary.json").read_text())["inputs"]
    tokenizer = (reference_run / "tokenizer.json").read_bytes()
    assert inputs["tokenizer"] == hashlib.sha256(tokenizer).hexdigest()[:16]
    assert {len(inputs["sequences"]), len(inputs["initial_weights"])} == {16}
    metrics = report.read_metrics(reference_run)
    assert [r["stage"] for r in metrics.train] == ["warmup"] * FREEZE + ["compression"] * (
        STEPS - FREEZE
    )
    assert [r["step"] for r in metrics.validation] == [4, 8, 12]
    assert [r["samples"] for r in metrics.train] == [8 * s for s in range(1, STEPS + 1)]
    first = sum(r["loss"] for r in metrics.train[:3]) / 3
    last = sum(r["loss"] for r in metrics.train[-3:]) / 3
    assert last < first - 0.3, (first, last)
    assert metrics.validation[-1]["loss"] < metrics.validation[0]["loss"]

    summary = json.loads((reference_run / "summary.json").read_text())
    stages = summary["bytes_sent"]["by_stage"]
    # Warm-up under DDP is LAMB's dense fp32 allreduce; compression sends ~1 bit per element.
    assert stages["warmup"]["bytes"] == stages["warmup"]["lamb_bytes"] > 0
    assert stages["compression"]["bytes"] * 20 < stages["compression"]["lamb_bytes"]
    assert summary["reduction_vs_lamb"] > 1.5
    assert summary["final_validation_loss"] == metrics.validation[-1]["loss"]
    assert summary["samples"] == 8 * STEPS and summary["workers"] == 2

    assert checkpoint.complete_steps(reference_run / "checkpoints") == [12, 8]  # keep 2
    for step_dir in (reference_run / "checkpoints").iterdir():
        for file in step_dir.glob("*.pt"):
            torch.load(file, weights_only=True)

    capsys.readouterr()
    assert train("--resume", str(reference_run)) == 0  # complete: prints the summary again
    assert "compression       8 steps" in capsys.readouterr().out


@pytest.mark.slow
def test_kill_and_automatic_restart_is_bit_identical(workspace: Path, reference_run: Path) -> None:
    """A worker SIGKILLed after step 6; the elastic agent restarts both, which resume at 4.

    The run is without DDP, and still matches the DDP reference bit for bit: the job averages
    the warm-up gradients itself before clipping them, as DDP does."""
    out = workspace / "killed"
    args = tiny(workspace, out, "--no-ddp", "--max-restarts", "1", "--kill-at-step", "6")
    assert train(*args) == 0
    assert_same_trajectory(out, reference_run)


@pytest.mark.slow
def test_resume_skips_a_corrupt_checkpoint(
    workspace: Path, reference_run: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A crash after step 10 with no restarts; the newest checkpoint (8) is then damaged, so
    ``--resume`` reports it, falls back to step 4 and still ends bit-identical."""
    out = workspace / "crashed"
    assert train(*tiny(workspace, out, "--kill-at-step", "10")) == 1
    assert checkpoint.complete_steps(out / "checkpoints") == [8, 4]
    damaged = out / "checkpoints" / "step-00000008" / "rank-00001.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])
    capfd.readouterr()
    assert train("--resume", str(out)) == 0
    err = capfd.readouterr().err
    assert "rank 1: checkpoint at step 8 is unusable" in err and "truncated or corrupt" in err
    assert "Resuming at step 4" in err
    assert_same_trajectory(out, reference_run)


@pytest.mark.slow
def test_dense_optimizer_without_ddp(workspace: Path) -> None:
    """AdamW with the job's own dense gradient averaging: every step sends what LAMB sends,
    and one flag per parameter tensor (whether this rank had its gradient)."""
    out = workspace / "adam"
    assert train(*tiny(workspace, out, "--optimizer", "adam", "--no-ddp", "--lr", "0.01")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bytes_sent"]["by_stage"]["dense"]["steps"] == STEPS
    saved = torch.load(checkpoint.step_dir(out / "checkpoints", STEPS) / checkpoint.rank_file(0))
    tensors = sum(len(group["params"]) for group in saved["optimizer"]["param_groups"])
    flags = report.dense_allreduce_bytes(tensors, 2, STEPS)
    assert summary["bytes_sent"]["total"] == summary["lamb_bytes"] + flags > flags > 0
    metrics = report.read_metrics(out)
    assert metrics.validation[-1]["loss"] < metrics.validation[0]["loss"]


@pytest.mark.slow
def test_onebit_adam_per_tensor_compression(workspace: Path) -> None:
    """1-bit Adam with DeepSpeed's per-tensor compression: it trains, at 1 bit per element."""
    out = workspace / "onebit-adam-per-tensor"
    options = ("--optimizer", "onebit-adam", "--compression", "per_tensor")
    assert train(*tiny(workspace, out, *options, "--lr", "0.01")) == 0
    config = json.loads((out / "config.json").read_text())["train"]
    assert config["compression"] == "per_tensor"
    compression = json.loads((out / "summary.json").read_text())["bytes_sent"]["by_stage"][
        "compression"
    ]
    assert 0 < compression["bytes"] * 16 < compression["lamb_bytes"]
    metrics = report.read_metrics(out)
    assert metrics.validation[-1]["loss"] < metrics.validation[0]["loss"]


def powersgd_floats(shapes: list[torch.Size], rank: int) -> int:
    """Floats PowerSGD allreduces per step: ``r·(n + m)`` for each tensor viewed as an
    ``n x m`` matrix whose compressed size is under half of ``n·m``, ``n·m`` otherwise."""
    total = 0
    for shape in shapes:
        n = shape[0]
        m = math.prod(shape[1:])
        r = min(n, m, rank)
        total += r * (n + m) if 2 * r * (n + m) < n * m else n * m
    return total


@pytest.mark.slow
def test_lamb_with_powersgd_counts_its_bytes_and_resumes_exactly(workspace: Path) -> None:
    """LAMB under DDP with PowerSGD rank 2: dense allreduces for 2 steps, then the floats of
    its low-rank factors; killed after step 6 and restarted from step 4 (its error and
    warm-start matrices in the checkpoint): the same trajectory bit for bit."""
    out = workspace / "powersgd"
    options = ("--optimizer", "lamb", "--powersgd-rank", "2")
    assert train(*tiny(workspace, out, *options)) == 0
    saved = torch.load(checkpoint.step_dir(out / "checkpoints", STEPS) / checkpoint.rank_file(0))
    shapes = [state["exp_avg"].shape for state in saved["optimizer"]["state"].values()]
    rows = report.read_metrics(out).train
    dense = report.dense_allreduce_bytes(sum(math.prod(s) for s in shapes), 2, 1)
    assert dense * STEPS == json.loads((out / "summary.json").read_text())["lamb_bytes"]
    low_rank = report.dense_allreduce_bytes(powersgd_floats(shapes, 2), 2, 1)
    assert [r["bytes"] for r in rows] == [dense, dense] + [low_rank] * (STEPS - 2)
    assert 4 * low_rank < dense
    killed = workspace / "powersgd-killed"
    extra = ("--max-restarts", "1", "--kill-at-step", "6")
    assert train(*tiny(workspace, killed, *options, *extra)) == 0
    assert_same_trajectory(killed, out)


@pytest.mark.slow
def test_delayed_exchange_job_sends_the_same_bytes_and_resumes_exactly(
    workspace: Path, reference_run: Path
) -> None:
    """``--delayed-exchange``: the same bytes in all as the undelayed reference (the last
    update lands at the last step); the checkpoint of step 6 holds that step's update, in
    flight; killed after step 7 and restarted from it: the same trajectory bit for bit, the
    same bytes step by step."""
    out = workspace / "delayed"
    options = ("--delayed-exchange", "--checkpoint-every", "3", "--keep-checkpoints", "4")
    assert train(*tiny(workspace, out, *options)) == 0
    rows, reference_rows = report.read_metrics(out).train, report.read_metrics(reference_run).train
    assert sum(r["bytes"] for r in rows) == sum(r["bytes"] for r in reference_rows)
    saved = torch.load(checkpoint.step_dir(out / "checkpoints", 6) / checkpoint.rank_file(1))
    assert saved["optimizer"]["onebit"]["pending_update"]["step"] == 6
    killed = workspace / "delayed-killed"
    extra = ("--max-restarts", "1", "--kill-at-step", "7")
    assert train(*tiny(workspace, killed, *options, *extra)) == 0
    assert_same_trajectory(killed, out)
    # the bytes of step 6's exchange, saved with it, counted by step 7 after the restart
    assert [r["bytes"] for r in report.read_metrics(killed).train] == [r["bytes"] for r in rows]


ZERO_ONE = [
    "--optimizer", "zero-one-adam", "--lr", "0.01", "--var-freeze-step", "6",
    "--var-update-scaler", "2", "--local-step-scaler", "2", "--local-step-clipper", "4",
    "--var-warmup-steps", "2",
    "--checkpoint-every", "3",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["gradient", "momentum"])
def test_zero_one_adam_job_resumes_inside_a_local_interval(workspace: Path, exchange: str) -> None:
    """0/1 Adam through every kind of step: variance updates 1, 2, 4, 6, 1-bit steps 3, 5
    (gradients, or synchronisations with --pre-freeze-exchange momentum), synchronisations 7,
    8, 10, 12, local steps 9, 11. Under DDP; then without DDP, killed after step 10 and
    restarted from the checkpoint of step 9 (inside a local interval, where the ranks'
    weights differ): the same trajectory bit for bit."""
    out = workspace / f"zero-one-adam-{exchange}"
    options = (*ZERO_ONE, "--pre-freeze-exchange", exchange)
    assert train(*tiny(workspace, out, *options)) == 0
    variance, one_bit = "variance_update", "gradient_1bit" if exchange == "gradient" else "sync"
    assert [r["stage"] for r in report.read_metrics(out).train] == [
        *(variance, variance, one_bit, variance, one_bit, variance),
        *("sync", "sync", "local", "sync", "local", "sync"),
    ]
    stages = json.loads((out / "summary.json").read_text())["bytes_sent"]["by_stage"]
    assert stages["variance_update"]["bytes"] == stages["variance_update"]["lamb_bytes"] > 0
    assert stages["local"]["bytes"] == 0
    for kind in {one_bit, "sync"}:
        assert 0 < stages[kind]["bytes"] * 8 < stages[kind]["lamb_bytes"]
    assert ("gradient_1bit" in stages) == (exchange == "gradient")
    killed = workspace / f"zero-one-adam-{exchange}-killed"
    extra = ("--no-ddp", "--max-restarts", "1", "--kill-at-step", "10")
    assert train(*tiny(workspace, killed, *options, *extra)) == 0
    assert_same_trajectory(killed, out)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["1bit", "dense"])
def test_diloco_job_sends_at_round_ends_only_and_resumes_inside_a_round(
    workspace: Path, exchange: str
) -> None:
    """``--optimizer adam --sync-every 5``: rounds end after steps 5, 10 and 12 (the run's
    end closes the last), nothing is sent in between, the dense exchange sends DDP's bytes
    and the 1-bit one more than 8x fewer; killed after step 8 and restarted from the
    checkpoint of step 6 (inside a round, where the ranks' weights differ, and the
    validation at step 8 reads the round's start weights): the same trajectory bit for bit."""
    out = workspace / f"diloco-{exchange}"
    options = ("--optimizer", "adam", "--sync-every", "5", "--outer-exchange", exchange)
    options += ("--checkpoint-every", "3", "--keep-checkpoints", "4")
    assert train(*tiny(workspace, out, *options)) == 0
    rows = report.read_metrics(out).train
    inner = ["inner"] * 4
    assert [r["stage"] for r in rows] == [*inner, "outer", *inner, "outer", "inner", "outer"]
    assert all(r["bytes"] == 0 for r in rows if r["stage"] == "inner")
    sent = {r["bytes"] for r in rows if r["stage"] == "outer"}
    summary = json.loads((out / "summary.json").read_text())
    dense_step = summary["lamb_bytes"] // STEPS
    (per_round,) = sent
    if exchange == "dense":
        assert per_round == dense_step
    else:
        assert 0 < 8 * per_round < dense_step
    assert summary["bytes_sent"]["total"] == 3 * per_round
    killed = workspace / f"diloco-{exchange}-killed"
    extra = ("--no-ddp", "--max-restarts", "1", "--kill-at-step", "8")
    assert train(*tiny(workspace, killed, *options, *extra)) == 0
    assert_same_trajectory(killed, out)


@pytest.mark.slow
def test_torchfts_diloco_in_the_job_follows_onebits_dense_diloco_bit_for_bit(
    workspace: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``--outer-implementation torchft``: torchft's DiLoCo on the same model, data and
    schedule as onebit's dense DiLoCo (2 workers, so each mean is one addition): the same
    weights, validation losses (read at the round's start weights mid-round) and bytes. A
    restart from a checkpoint is refused by name."""
    pytest.importorskip("torchft")
    options = ("--optimizer", "adam", "--sync-every", "6", "--outer-exchange", "dense")
    ours, theirs = workspace / "diloco-onebit", workspace / "diloco-torchft"
    assert train(*tiny(workspace, ours, *options)) == 0
    assert train(*tiny(workspace, theirs, *options, "--outer-implementation", "torchft")) == 0
    assert_same_trajectory(theirs, ours)
    rows = {run: report.read_metrics(run).train for run in (ours, theirs)}
    assert [r["bytes"] for r in rows[theirs]] == [r["bytes"] for r in rows[ours]]
    assert [r["step"] for r in rows[theirs] if r["bytes"]] == [6, 12]
    killed = workspace / "diloco-torchft-killed"
    extra = ("--no-ddp", "--max-restarts", "1", "--kill-at-step", "8")
    capfd.readouterr()
    assert train(*tiny(workspace, killed, *options, "--outer-implementation", "torchft", *extra))
    assert "--outer-implementation torchft does not resume" in capfd.readouterr().err


@pytest.mark.slow
def test_diloco_between_nodes_averages_inside_them_and_sends_between_them_at_round_ends(
    workspace: Path, reference_run: Path
) -> None:
    """``--workers 4 --node-size 2 --sync-every 5``: DDP inside each node at every step (an
    fp32 allreduce of the gradients over its 2 ranks), the 1-bit outer exchange between the
    nodes at the round ends only. The job's own allreduce in the node (``--no-ddp``),
    killed after step 8 and restarted from the checkpoint of step 6, follows the DDP run
    bit for bit (the mean of two values is the same either way)."""
    options = ("--optimizer", "adam", "--sync-every", "5", "--workers", "4", "--node-size", "2")
    options += ("--checkpoint-every", "3", "--keep-checkpoints", "4")
    out = workspace / "diloco-nodes"
    assert train(*tiny(workspace, out, *options)) == 0
    rows = report.read_metrics(out).train
    summary = json.loads((out / "summary.json").read_text())
    node_allreduce = 4 * summary["parameters"]  # 2 (L - 1) / L · 4N bytes at L = 2
    for row in rows:
        assert row["bytes_intra_node"] == pytest.approx(node_allreduce, rel=1e-3), row
        assert (row["bytes_inter_node"] > 0) == (row["stage"] == "outer"), row
        assert row["bytes"] == row["bytes_intra_node"] + row["bytes_inter_node"]
    assert [r["step"] for r in rows if r["stage"] == "outer"] == [5, 10, STEPS]
    assert summary["node_size"] == 2
    assert 0 < 8 * summary["bytes_sent"]["by_link"]["inter_node"] < 3 * node_allreduce
    # Other optimizer, other workers: the same samples from the same initial weights.
    assert summary["inputs"] == json.loads((reference_run / "summary.json").read_text())["inputs"]
    killed = workspace / "diloco-nodes-killed"
    extra = ("--no-ddp", "--max-restarts", "1", "--kill-at-step", "8")
    assert train(*tiny(workspace, killed, *options, *extra)) == 0
    assert_same_trajectory(killed, out)


@pytest.mark.slow
def test_hierarchical_exchange_on_two_nodes_of_two(
    workspace: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """4 workers as 2 nodes of 2: it trains, and reports intra- and inter-node bytes apart."""
    out = workspace / "nodes"
    assert train(*tiny(workspace, out, "--workers", "4", "--node-size", "2")) == 0
    assert "inter-node" in capfd.readouterr().out  # rank 0's summary
    metrics = report.read_metrics(out)
    assert metrics.validation[-1]["loss"] < metrics.validation[0]["loss"]
    for row in metrics.train:
        compressed = row["stage"] == "compression"
        assert (row["bytes_inter_node"] > 0) == compressed, row
        assert (row["bytes_intra_node"] > row["bytes_inter_node"]) == compressed, row  # fp32
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["workers"], summary["node_size"]) == (4, 2)
    links = summary["bytes_sent"]["by_link"]
    assert links["inter_node"] > 0
    compression = summary["bytes_sent"]["by_stage"]["compression"]["bytes"]
    # The rest of the compression stage's bytes, agreed on over the world: the gradient check
    # and, at each step, a byte per tensor (whether a rank had its gradient), a few percent
    # of this tiny model's 1-bit exchange.
    assert 0 < compression - links["intra_node"] - links["inter_node"] < 0.05 * compression


@pytest.mark.slow
def test_fsdp_on_two_nodes_of_two_trains_and_resumes_exactly(workspace: Path) -> None:
    """``--fsdp``: FSDP2 within nodes of 2, 1-bit LAMB between them. Killed after step 6 and
    restarted, it resumes from its DCP checkpoint at step 4 and ends bit-identical."""
    fsdp = ("--workers", "4", "--node-size", "2", "--fsdp")
    out, killed = workspace / "fsdp", workspace / "fsdp-killed"
    assert train(*tiny(workspace, out, *fsdp)) == 0
    assert train(*tiny(workspace, killed, *fsdp, "--max-restarts", "1", "--kill-at-step", "6")) == 0
    ours, theirs = report.read_metrics(killed), report.read_metrics(out)
    assert [r["loss"] for r in ours.train] == [r["loss"] for r in theirs.train]
    assert [r["loss"] for r in ours.validation] == [r["loss"] for r in theirs.validation]
    assert theirs.validation[-1]["loss"] < theirs.validation[0]["loss"]
    manifest = json.loads(
        (checkpoint.step_dir(out / "checkpoints", STEPS) / "manifest.json").read_text()
    )
    assert any(name.startswith("dcp/") and name.endswith(".distcp") for name in manifest["files"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lamb_baseline"].startswith("HSDP") and summary["fsdp"]["nodes"] == 2
    stages = summary["bytes_sent"]["by_stage"]
    assert 0 < stages["compression"]["bytes"] * 20 < stages["compression"]["lamb_bytes"]


@pytest.mark.parametrize("finished", [True, False])
def test_a_worker_that_aborts_after_the_run_finished_is_no_failure(
    workspace: Path, reference_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    finished: bool,
) -> None:  # fmt: skip
    """torch sometimes aborts a worker as it exits ("terminate called without an active
    exception"): once the summary of the last step is written the job has succeeded, and
    before that it has failed."""
    import shutil

    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from onebit.train.launch import launch_job
    from onebit.train.run_dir import read_config

    out = tmp_path / "run"

    def aborting_launch(launch_config, entrypoint):
        def run(*args):
            if finished:
                shutil.copy(reference_run / "summary.json", out / "summary.json")
            failure = ProcessFailure(local_rank=1, pid=1, exitcode=-6, error_file="")
            raise ChildFailedError("onebit.train.worker", {1: failure})

        return run

    monkeypatch.setattr(launcher, "elastic_launch", aborting_launch)
    status = launch_job(read_config(reference_run), out, workers=2, max_restarts=0)
    assert status == (0 if finished else 1)


@pytest.mark.slow
def test_compare_runs_each_optimizer_from_the_same_start(workspace: Path) -> None:
    """``onebit compare``: one run per optimizer (LAMB's lr for the LAMB family, --adam-lr for
    the Adam family), then the report; a second call reuses the finished runs."""
    out = workspace / "compare"
    args = [*TINY, "--corpus", str(workspace / "corpus.txt"), "--out", str(out)]
    options = ["--optimizers", "lamb", "onebit-adam", "--adam-lr", "0.002"]
    assert onebit_main(["compare", *options, *args]) == 0
    summaries = json.loads((out / "compare.json").read_text())["runs"]
    assert set(summaries) == {"lamb", "onebit-adam"}
    lrs = {
        name: json.loads((out / name / "config.json").read_text())["train"]["lr"]
        for name in summaries
    }
    assert lrs == {"lamb": 0.05, "onebit-adam": 0.002}
    first = {name: report.read_metrics(out / name).train[0]["loss"] for name in summaries}
    assert first["lamb"] == first["onebit-adam"]  # same weights, data and masks at step 1
    assert "| onebit-adam |" in (out / "report.md").read_text()
    assert onebit_main(["compare", *options, *args]) == 0
