"""The measurement tools of benchmarks/: each explains itself with ``--help``, is listed in
benchmarks/README.md, and runs at tiny sizes with output of the expected shape (no figure is
checked: the timings of a shared machine vary). The GPU tools, prepared on CPU, say that
there is no CUDA device and stop."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from types import ModuleType

import pytest
import torch
from helpers.emulated_cluster import needs_cluster
from helpers.jobs import TINY, write_corpus
from helpers.paths import BENCHMARKS, ROOT

#: The tools benchmarks/README.md lists, one table row each.
TOOLS = re.findall(
    r"^\| `(\w+)\.py` \|", (BENCHMARKS / "README.md").read_text(), flags=re.MULTILINE
)


def _tool(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The tool ``name`` imported by its name from benchmarks/ (so that the ranks it spawns,
    and its dataclasses, find their module)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


def _run(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run the tool as its users do, from the repository root; its standard output."""
    command = [sys.executable, str(BENCHMARKS / f"{name}.py"), *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_every_tool_the_readme_lists_is_there():
    assert len(TOOLS) >= 8, TOOLS
    assert all((BENCHMARKS / f"{name}.py").is_file() for name in TOOLS), TOOLS


def test_the_gpu_check_calls_tools_that_exist():
    check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    called = re.findall(r"\b(benchmarks/\w+\.py)", check)
    assert {"benchmarks/optimizer_steps.py", "benchmarks/gpu_optimizer_check.py"} <= set(called)
    assert all((ROOT / path).is_file() for path in called), called
    assert "scripts/gpu_step_benchmark.py" not in check


@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_says_what_it_measures_and_its_options(name, monkeypatch, capsys):
    tool = _tool(name, monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--help"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage:") and "options:" in printed
    first_line = " ".join(tool.__doc__.split("\n\n")[0].split())
    assert first_line[:40] in " ".join(printed.split())
    assert f"benchmarks/{name}.py" in tool.__doc__  # its command, with its path


# ------------------------------------------------------------------ optimizer_steps


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_the_step_benchmark_stops_with_a_message_without_cuda(monkeypatch, capsys):
    assert _tool("optimizer_steps", monkeypatch).main([]) == 77
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_the_step_benchmark_times_every_kind_of_step_on_cpu(tmp_path, monkeypatch, capsys):
    tool = _tool("optimizer_steps", monkeypatch)
    out = tmp_path / "steps.json"
    args = ["--device", "cpu", "--scale", "0.02", "--repeats", "2", "--models", "base"]
    assert tool.main([*args, "--out", str(out)]) == 0
    steps = json.loads(out.read_text())["results"]["base"]["steps"]
    expected = {step for _, step, _, _ in tool.TARGETS} | {"AdamW(foreach=True)"}
    assert expected <= set(steps), expected - set(steps)
    for name, row in steps.items():
        assert row["ms"] > 0 and row["copies"] > 0, name
    assert steps["AdamW(fused=True)"]["vs_adamw_fused"] == 1.0
    printed = capsys.readouterr().out
    assert "BERT-base" in printed and "Lamb / AdamW(fused) <= 1.3" in printed


def test_a_method_that_never_reaches_its_counted_kind_is_named_not_waited_for(monkeypatch):
    tool = _tool("optimizer_steps", monkeypatch)
    params = [torch.nn.Parameter(torch.zeros(8))]
    never = tool.Method("never counted", params, torch.optim.SGD(params, lr=0.1), lambda: False)
    with pytest.raises(RuntimeError, match=r"\['never counted'\] took fewer than 2 steps"):
        tool.time_group([never], [torch.ones(8)], repeats=2, device="cpu")


# -------------------------------------------------------------- gpu_optimizer_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_the_gpu_optimizer_check_says_nothing_could_run_without_cuda(monkeypatch, capsys):
    assert _tool("gpu_optimizer_check", monkeypatch).main([]) == 77
    assert "no CUDA device" in capsys.readouterr().err


# ------------------------------------------------------------------------- step_cpu


@pytest.mark.slow
def test_step_cpu_breaks_each_methods_step_down(tmp_path):
    out = tmp_path / "step-cpu.json"
    methods = "lamb,onebit-lamb"
    printed = _run(
        "step_cpu", "--workers", "2", "--model", "tiny", "--methods", methods, "--steps", "2",
        "--json", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert list(result["methods"]) == ["lamb", "onebit-lamb"]
    assert result["methods"]["onebit-lamb"]["stage"] == "compression"
    for figures in result["methods"].values():
        assert len(figures["steps"]) == 2
        assert set(figures["steps"][0]) == {"forward_backward", "optimizer_step"}
        assert set(figures["steps"][0]["optimizer_step"]) == {"wall", "user", "sys", "faults"}
    rows = [line for line in printed.splitlines() if line.startswith("| lamb")]
    assert len(rows) == 1 and "| onebit-lamb | compression |" in printed


# ---------------------------------------------------------------------- step_phases


def test_step_phases_gives_backwards_share_of_the_step(tmp_path, monkeypatch, capsys):
    out = tmp_path / "phases.json"
    tool = _tool("step_phases", monkeypatch)
    assert tool.main(["--model", "tiny", "--steps", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"forward", "backward", "update"}
    assert 0 < result["backward_share"] < 1
    assert "b = backward / step" in capsys.readouterr().out


# --------------------------------------------------------------- compression_stages


def test_compression_stages_times_each_stage_beside_a_copy(tmp_path, monkeypatch, capsys):
    out = tmp_path / "stages.json"
    tool = _tool("compression_stages", monkeypatch)
    args = ["--ranks", "2", "--log2", "10", "--repeats", "2", "--kernels", "torch"]
    assert tool.main([*args, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    stages = {row["stage"] for row in rows}
    assert {"worker compression", "server compression", "copy of the chunk"} <= stages
    assert all(row["backend"] == "torch" and row["ranks"] == 2 for row in rows)
    assert all(row["ms"] > 0 and row["copies"] > 0 for row in rows)
    assert capsys.readouterr().out.count("| torch | 2 |") == len(rows)


# ------------------------------------------------------------------ simulation_cost


@pytest.mark.slow
def test_simulation_cost_measures_each_worker_count(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "cost.json"
    job = [
        "--steps", "3", "--freeze-step", "1", "--batch-size", "8", "--seq-len", "16",
        "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab-size", "120",
        "--eval-every", "3", "--checkpoint-every", "3", "--eval-seqs", "0",
        "--corpus", str(corpus),
    ]  # fmt: skip
    env = {**os.environ, "ONEBIT_CACHE": str(tmp_path / "cache")}
    printed = _run("simulation_cost", "--workers", "1", "2", "--out", str(out), "--", *job, env=env)
    runs = json.loads(out.read_text())["runs"]
    assert [run["workers"] for run in runs] == [1, 2]
    for run in runs:
        assert set(run["step_time_s"]) == {"warmup", "compression"}
        assert run["peak_rss_bytes"] > 0 and run["simulation_bytes"]["worker_errors"] > 0
    assert printed.splitlines()[0].startswith("| workers | warmup s (x first)")


# ---------------------------------------------------------------- diloco_vs_torchft


@pytest.mark.slow
@pytest.mark.parametrize(
    ("streaming", "turns"),
    [([], 2), (["--fragments", "2", "--delay", "1", "--local-share", "0.5"], 4)],
    ids=["rounds", "streaming"],
)
def test_diloco_matches_torchft_round_by_round(streaming, turns):
    pytest.importorskip("torchft")
    printed = _run("diloco_vs_torchft", "--rounds", "2", "--sync-every", "4", *streaming)
    rounds = [line.split() for line in printed.splitlines() if re.match(r"\s+\d+ ", line)]
    assert [row[0] for row in rounds] == [str(t + 1) for t in range(turns)]
    assert all(row[3] == "yes" for row in rounds)  # bit for bit at 2 workers
    assert printed.rstrip().splitlines()[-1].startswith("PASS")


# ---------------------------------------------------------------- optimizer_anatomy


def test_the_anatomy_names_the_path_from_step_to_the_first_collective(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "anatomy.json"
    assert _tool("optimizer_anatomy", monkeypatch).main(["--json", str(out)]) == 0
    counts = json.loads(out.read_text())
    assert set(counts["classes"]["OneBitLamb"]) == {"OneBitLamb", "OneBitOptimizer"}
    path = counts["step"]["path"]
    assert path[0][1] == "step" and path[-1][0] == "exchange/transport.py"
    assert counts["step"]["functions"] > len(path)
    assert "frames in" in capsys.readouterr().out


# ------------------------------------------------------------------ variance_guard


@pytest.mark.slow  # trains every arm of the guard study
def test_the_guard_study_runs_each_arm_and_summarizes_them(tmp_path):
    """A tiny study on simulated workers: the dense counterpart and the 1-bit optimizer at both
    freeze points with the guard off and on, one JSON line each, and the summary of them;
    --report summarizes the lines again without running anything."""
    runs, summary = tmp_path / "runs.jsonl", tmp_path / "summary.json"
    common = ["--tasks", "attention", "--optimizers", "onebit-adam", "--seeds", "0"]
    _run(
        "variance_guard", *common, "--workers", "2", "--simulate", "--steps", "30",
        "--out", str(runs), "--summary", str(summary),
    )  # fmt: skip
    rows = [json.loads(line) for line in runs.read_text().splitlines()]
    assert [(r["optimizer"], r["freeze_step"], r["variance_guard"]) for r in rows] == [
        ("adam", None, None),
        ("onebit-adam", 40, "off"),
        ("onebit-adam", 40, "refresh"),
        ("onebit-adam", 300, "off"),
        ("onebit-adam", 300, "refresh"),
    ]
    written = json.loads(summary.read_text())
    assert written["command"].startswith(
        ".venv/bin/python benchmarks/variance_guard.py --workers 2"
    )
    assert [(e["freeze_step"], e["runs"]) for e in written["rows"]] == [(40, 1), (300, 1)]
    again = tmp_path / "again.json"
    _run("variance_guard", "--report", str(runs), "--summary", str(again))
    assert json.loads(again.read_text()) == written


@pytest.mark.slow  # five runs on spawned ranks: the end-to-end group
def test_the_guard_study_runs_zero_one_adam_on_real_ranks_only(tmp_path):
    """0/1 Adam, whose local steps the simulation does not model, on 2 gloo ranks; with
    --simulate it is refused by name."""
    runs = tmp_path / "runs.jsonl"
    common = ["--tasks", "deep-narrow", "--optimizers", "zero-one-adam", "--seeds", "0"]
    _run("variance_guard", *common, "--workers", "2", "--steps", "30", "--out", str(runs))
    rows = [json.loads(line) for line in runs.read_text().splitlines()]
    assert [(r["optimizer"], r["freeze_step"], r["variance_guard"]) for r in rows] == [
        ("adam", None, None),
        ("zero-one-adam", 40, "off"),
        ("zero-one-adam", 40, "refresh"),
        ("zero-one-adam", 300, "off"),
        ("zero-one-adam", 300, "refresh"),
    ]
    command = [sys.executable, str(BENCHMARKS / "variance_guard.py"), *common, "--simulate"]
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "not ['zero-one-adam']" in refused.stderr


# ------------------------------------------------------------ the readiness tools


@pytest.mark.slow  # jobs on spawned ranks: the end-to-end group
def test_the_seed_study_runs_each_arm_and_records_its_outcome(tmp_path):
    """Two arms, one seed, on the tiny job (its options after --, which replace the study's):
    the dense baseline and 1-bit LAMB, the paired comparison and the outcome of each run."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    record = tmp_path / "seeds.json"
    env = {**os.environ, "ONEBIT_CACHE": str(tmp_path / "cache")}
    printed = _run(
        "seed_study", "--arms", "lamb", "onebit-lamb", "--seeds", "0", "--out",
        str(tmp_path / "runs"), "--record", str(record), "--", *TINY, "--corpus", str(corpus),
        env=env,
    )  # fmt: skip
    written = json.loads(record.read_text())
    assert written["command"].startswith(
        ".venv/bin/python benchmarks/seed_study.py --arms lamb onebit-lamb --seeds 0 -- "
    )
    assert written["baselines"] == {"lamb": None, "onebit-lamb": "lamb"}
    outcome = written["arms"]["onebit-lamb"]["0"]
    assert outcome["freeze"] == 4 and outcome["refresh_steps"] == 0
    assert not outcome["diverged"] and outcome["final"] > 0
    assert "| onebit-lamb | 1 |" in printed


@pytest.mark.slow  # jobs on spawned ranks: the end-to-end group
def test_variance_readiness_records_every_arm(tmp_path):
    record = tmp_path / "plateau.json"
    _run("variance_readiness", "--steps", "30", "--early", "10", "--record", str(record))
    written = json.loads(record.read_text())
    assert written["command"].endswith("variance_readiness.py --steps 30 --early 10")
    runs = written["runs"]
    assert len(runs) == 11 and runs["adam"]["froze_after"] is None
    assert runs["onebit-lamb early"]["froze_after"] == 10
    assert runs["zero-one-adam never"]["froze_after"] == 30


@pytest.mark.slow  # trains until the freeze
def test_the_readiness_trajectory_records_each_check_until_the_freeze(tmp_path):
    record = tmp_path / "trajectory.json"
    printed = _run("readiness_trajectory", "plateau", "--record", str(record))
    written = json.loads(record.read_text())
    checks = written["checks"]
    assert [c["step"] for c in checks] == list(range(10, 10 * len(checks) + 1, 10))
    assert written["froze_after"] == checks[-1]["step"]  # "auto" freezes after a check
    assert f"froze after step {written['froze_after']}" in printed


def _fake_run(root, name, train, stages, validation):
    """A run folder of ``onebit train`` with these steps' kinds and validation losses."""
    folder = root / name
    folder.mkdir()
    config = {"train": {"optimizer": "adam", **train}, "launch": {"world_size": 4}}
    (folder / "config.json").write_text(json.dumps(config))
    rows = [
        {"kind": "train", "step": i + 1, "stage": s, "bytes": 8, "step_time": 0.5}
        for i, s in enumerate(stages)
    ]
    rows += [{"kind": "validation", "step": step, "loss": loss} for step, loss in validation]
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    summary = {"parameters": 1024, "final_validation_loss": validation[-1][1]}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_link_choice_times_each_step_by_its_kind(tmp_path, monkeypatch):
    from onebit.estimate.model import (
        Cluster,
        Machine,
        dense_allreduce,
        flat_exchange,
        local_compression_seconds,
        turn_seconds,
    )

    tool = _tool("link_choice", monkeypatch)
    dense = _fake_run(tmp_path, "dense", {}, ["dense"] * 6, [(3, 2.0), (6, 1.5)])
    rounds = ["inner", "inner", "outer"] * 2
    diloco = {"sync_every": 3, "outer_exchange": "1bit"}
    local = _fake_run(tmp_path, "diloco", diloco, rounds, [(3, 1.7), (6, 1.6)])
    machine = Machine(compression_throughput=2e4, host_throughput=1e4, latency=0.01)
    runs = [tool.read_run(dense), tool.read_run(local)]
    result = tool.choose(runs, 1.8, 2.0, ["8kbit"], machine)  # 1000 bytes/s
    cluster = Cluster(parameters=1024, compute_seconds=2.0, bandwidth=1000.0, nodes=4)
    dense_step = 2.0 + dense_allreduce(cluster, machine, 4).seconds
    outer_step = 2.0 + local_compression_seconds(cluster, machine)
    outer_step += flat_exchange(cluster, machine).seconds
    assert result["runs"]["dense"]["steps"] == 6
    assert result["runs"]["dense"]["seconds"]["8kbit"] == pytest.approx(6 * dense_step)
    assert result["runs"]["diloco"]["steps"] == 3
    assert result["runs"]["diloco"]["seconds"]["8kbit"] == pytest.approx(4.0 + outer_step)
    assert result["runs"]["diloco"]["bytes"] == 24
    fastest = result["fastest"]["8kbit"]
    assert (fastest["runs"], fastest["next"]) == (["diloco"], "dense")
    assert fastest["lead"] == pytest.approx(6 * dense_step / (4.0 + outer_step))
    kinds = ["variance_update", "gradient_1bit", "local", "sync", "refresh", "local"]
    zero_one = _fake_run(tmp_path, "zero-one", {"optimizer": "zero-one-adam"}, kinds, [(6, 1.7)])
    timed = tool.choose([tool.read_run(zero_one)], 1.8, 2.0, ["8kbit"], machine)
    onebit_step = 2.0 + local_compression_seconds(cluster, machine)
    onebit_step += flat_exchange(cluster, machine).seconds
    expected = 2 * dense_step + 2 * onebit_step + 2 * 2.0
    assert timed["runs"]["zero-one"]["seconds"]["8kbit"] == pytest.approx(expected)
    # streaming, 2 fragments, delay 1: a turn of 3 steps adds T_stream over its last two
    streaming = {"sync_every": 6, "outer_exchange": "1bit", "fragments": 2, "fragment_delay": 1}
    turns = ["inner", "outer", "outer"] * 2
    stream = _fake_run(tmp_path, "stream", streaming, turns, [(6, 1.7)])
    streamed = tool.choose([tool.read_run(stream)], 1.8, 2.0, ["8kbit"], machine)
    added, _ = turn_seconds(cluster, machine, "1bit", 2, 1)
    assert 0 < added < outer_step - 2.0  # part of the exchange hides behind a step
    assert streamed["runs"]["stream"]["seconds"]["8kbit"] == pytest.approx(6 * 2.0 + 2 * added)
    never = tool.choose(runs, 1.0, 2.0, ["8kbit"], machine)
    assert never["runs"]["dense"]["steps"] is None and never["fastest"] == {}
    twin = _fake_run(tmp_path, "twin", {}, ["dense"] * 6, [(3, 2.0), (6, 1.5)])
    tied = tool.choose([runs[0], tool.read_run(twin)], 1.8, 2.0, ["8kbit"], machine)
    assert tied["fastest"]["8kbit"] == {
        "runs": ["dense", "twin"],
        "seconds": pytest.approx(6 * dense_step),
    }


def test_link_choice_leaves_powersgd_untimed_and_names_what_it_cannot_time(
    tmp_path, monkeypatch, capsys
):
    from_powersgd = _fake_run(tmp_path, "psgd", {"powersgd_rank": 4}, ["dense"], [(1, 2.0)])
    dense = _fake_run(tmp_path, "dense", {}, ["dense"], [(1, 2.0)])
    tool = _tool("link_choice", monkeypatch)
    record = tmp_path / "choice.json"
    arguments = [str(from_powersgd), str(dense), "--compute", "2", "--record", str(record)]
    assert tool.main(arguments) == 0
    assert "psgd: 1 steps; not timed by the cost model" in capsys.readouterr().out
    written = json.loads(record.read_text())
    psgd, dense_entry = written["runs"]["psgd"], written["runs"]["dense"]
    assert (psgd["timed"], psgd["seconds"], psgd["bytes"]) == (False, {}, 8)
    assert dense_entry["timed"] and set(dense_entry["seconds"]) == {"100mbit", "1gbit", "10gbit"}
    assert written["fastest"]["1gbit"]["runs"] == ["dense"]
    strange = _fake_run(tmp_path, "strange", {}, ["dense", "inner"], [(2, 2.0)])
    with pytest.raises(SystemExit):
        tool.main([str(strange)])
    assert "does not time its steps of kind ['inner']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main([str(dense), "--model", "bert-base"])
    assert "--model needs --compute" in capsys.readouterr().err
    metrics = dense / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"bytes": 8', '"bytes": 0'))
    plot = tmp_path / "plot.png"
    with pytest.raises(SystemExit):
        tool.main([str(dense), "--compute", "2", "--plot", str(plot)])
    assert "['dense'] sent none" in capsys.readouterr().err and not plot.exists()


def test_link_choice_on_the_main_jobs_diloco_runs(tmp_path):
    runs = [f"docs/main-job/diloco/{run}" for run in ("adam", "h25-dense", "h25-1bit")]
    outputs = ["--record", str(tmp_path / "choice.json"), "--plot", str(tmp_path / "plot.png")]
    out = _run("link_choice", *runs, *outputs)
    assert "100mbit:" in out and "first" in out
    record = json.loads((tmp_path / "choice.json").read_text())
    assert set(record["runs"]) == {"adam", "h25-dense", "h25-1bit"}
    assert record["target"] == max(r["final"] for r in record["runs"].values())
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bert = _run("link_choice", *runs, "--model", "bert-base", "--compute", "1.2")
    assert bert != out  # another model's step times


# ---------------------------------------------------------------------------- errors_ahead


@needs_cluster
def test_errors_ahead_times_both_places_of_the_updates_side_by_side(tmp_path):
    record = tmp_path / "ahead.json"
    printed = _run(
        "errors_ahead",
        *("--model", "tiny", "--bandwidths", "none", "--calls", "3", "--bucket-cap-mb", "0.01"),
        *("--record", str(record)),
    )
    (row,) = json.loads(record.read_text())["rows"]
    assert row["bandwidth"] == "none"
    for place in ("ahead", "after"):
        assert len(row[f"{place}_seconds"]) == 2  # the first call of each not timed
        assert 0 < row[f"{place}_fastest"] <= row[f"{place}_median"]
    assert row["after_over_ahead"] == row["after_median"] / row["ahead_median"]
    assert f"after / ahead {row['after_over_ahead']:.2f}x" in printed


def test_errors_ahead_refuses_bad_options_by_name(monkeypatch, capsys):
    tool = _tool("errors_ahead", monkeypatch)
    for args, message in (
        (["--calls", "1"], "--calls must be at least 2"),
        (["--bucket-cap-mb", "-1"], "--bucket-cap-mb must be 0"),
    ):
        with pytest.raises(SystemExit):
            tool.main(args)
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------- overlap_tail


@pytest.mark.slow
@needs_cluster
def test_overlap_tail_times_both_compressions_step_after_step(tmp_path):
    record = tmp_path / "tail.json"
    printed = _run(
        "overlap_tail",
        *("--model", "tiny", "--bandwidths", "none", "--steps", "2", "--record", str(record)),
    )
    (row,) = json.loads(record.read_text())["rows"]
    assert row["bandwidth"] == "none" and row["model"] == "tiny"
    for compression in ("fused", "per_tensor"):
        timed = row["seconds"][compression]
        assert all(len(values) == 2 for values in timed.values())  # the untimed steps left out
        for step in range(2):  # the tail is part of step(), which is part of the step
            assert 0 < timed["tail"][step] <= timed["step"][step] <= timed["total"][step]
    ratio = row["per_tensor_tail_median"] / row["fused_tail_median"]
    assert row["tail_per_tensor_over_fused"] == ratio
    assert f"tail {ratio:.2f}x" in printed


def test_overlap_tail_refuses_bad_options_by_name(monkeypatch, capsys):
    tool = _tool("overlap_tail", monkeypatch)
    for args, message in (
        (["--steps", "0"], "--steps must be at least 1"),
        (["--model", "huge"], "invalid choice: 'huge'"),
    ):
        with pytest.raises(SystemExit):
            tool.main(args)
        assert message in capsys.readouterr().err
