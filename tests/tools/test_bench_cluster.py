"""Tests of the emulated-cluster comparison (``onebit bench cluster``) without a cluster: the
arithmetic of its analysis and report, how its worker counts the interface bytes, its settings
and options, the commands' checks before they run (the runs on an emulated cluster:
end_to_end/test_bench_cluster_runs.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from helpers.emulated_cluster import UNAVAILABLE

from onebit.bench import _worker, analysis, bert, cli, comparison, report
from onebit.bench.settings import (
    METHODS,
    ComparisonSettings,
    untimed_before_compression,
    zero_one_adam_arm,
)
from onebit.bert_shapes import PRESETS
from onebit.cli import main as onebit_main
from onebit.optim.zero_one_adam import STEP_KINDS


def test_ideal_figures() -> None:
    # The figures: 5.7x at w = 15 %, 4.4x at w = 20 %, 3.1x at s = 70 %.
    assert analysis.ideal_traffic_reduction(0.15) == pytest.approx(5.66, abs=0.01)
    assert analysis.ideal_traffic_reduction(0.20) == pytest.approx(4.44, abs=0.01)
    assert analysis.ideal_speedup(0.7) == pytest.approx(3.10, abs=0.01)
    assert analysis.ideal_speedup(0.0) == 1.0
    assert analysis.ideal_speedup(0.7, w=1.0) == 1.0


def test_the_delayed_exchanges_first_step_of_the_stage_is_untimed_besides_skip_steps() -> None:
    # Its first step of the stage applies nothing; its first that does pays the first exchange's
    # setup, as every other method's first step of the stage does (skip_steps).
    assert untimed_before_compression("onebit-lamb-delayed", 1) == 2
    assert untimed_before_compression("onebit-lamb-delayed", 0) == 1
    for method in ("onebit-lamb", "onebit-lamb-overlap-per-tensor", "onebit-adam"):
        assert untimed_before_compression(method, 1) == 1


def _block(stage: str, seconds: float, tx: int, library: int, steps: int = 2) -> dict:
    return {
        "stage": stage,
        "steps": steps,
        "seconds": seconds * steps,
        "rank0_step_seconds": [seconds] * steps,
        "library_bytes_by_rank": [library * steps] * 2,
        "last_loss": 7.0,
        "interface_tx_bytes_by_host": [tx * steps] * 2,
        "interface_rx_bytes_by_host": [tx * steps] * 2,
    }


def _run(method: str, blocks: list[dict], round_: int = 0) -> dict:
    return {"method": method, "label": method, "round": round_, "ok": True, "blocks": blocks}


def _raw(methods: dict[str, list[list[dict]]], **settings: Any) -> dict:
    """A comparison's raw result with each method's rounds of blocks, on 2 workers at
    100 Mbit/s unless ``settings`` say otherwise."""
    return {
        "settings": {
            "workers": 2,
            "batch_size": 1,
            "freeze_fraction": 0.2,
            "run_steps": 1000,
            "bandwidth": "100mbit",
            "model": "tiny",
            "seq_len": 16,
            "skip_steps": 1,
            "methods": list(methods),
            **settings,
        },
        "info": {"parameters": 1000},
        "errors": [],
        "methods": {
            name: {
                "label": "",
                "ok": True,
                "runs": [_run(name, blocks, round_) for round_, blocks in enumerate(rounds)],
            }
            for name, rounds in methods.items()
        },
    }


def test_analyze_derives_shares_speedups_and_targets(tmp_path: Path, capsys) -> None:
    dense, onebit = 3200, 100
    raw = _raw(
        {
            "lamb": [
                [_block("steady", 4.0, dense, 0)],
                [_block("steady", 5.0, dense, 0)],  # a slower round: ignored
            ],
            "lamb-compute": [[_block("steady", 1.0, 10, 0)]],
            "onebit-lamb": [
                [_block("warmup", 4.0, dense, dense), _block("compression", 1.25, onebit, onebit)]
            ],
            "fp16": [[_block("steady", 2.5, dense // 2, 0)]],
        }
    )
    result = analysis.analyze(raw)
    summary, derived = result["summary"], result["derived"]
    assert summary["lamb"]["t_comp"] == 4.0  # the fastest round
    assert derived["comm_share"] == pytest.approx(0.75)
    item = summary["onebit-lamb"]
    assert item["compression_stage_speedup"] == pytest.approx(3.2)
    # T = S (w t_warm + (1 - w) t_comp), computed from the per-stage step times.
    assert item["end_to_end_seconds"] == pytest.approx(1000 * (0.2 * 4.0 + 0.8 * 1.25))
    assert item["end_to_end_speedup"] == pytest.approx(4000 / 1800)
    assert item["compression_stage_bytes_reduction"] == pytest.approx(32.0)
    assert item["whole_run_traffic_reduction"]["0.20"] == pytest.approx(
        analysis.ideal_traffic_reduction(0.2)
    )
    targets = result["targets"]
    assert targets["compression_bytes_30x"]["met"] is True
    assert targets["whole_run_traffic_w15"]["met"] is True
    assert targets["speedup_where_comm_70"]["met"] is True  # 3.2x >= 2.8x, faster than fp16
    assert "onebit-lamb" in report.format_report(result)

    path = tmp_path / "cluster-tiny-2w-100mbit.json"
    report.write_json(result, path)
    assert onebit_main(["bench", "report", "--full", str(path)]) == 0
    out = capsys.readouterr().out
    assert "### 2 workers, 100mbit, model tiny" in out  # the full report
    row = out.splitlines()[-1]  # the sweep table's row: 1-bit LAMB plain, fp16, not run
    assert row.startswith("| 2 | 100mbit |") and "| 3.20x / 2.22x |" in row
    assert "| 1.60x |" in row and row.count("not run") == 10


def test_the_delayed_exchange_is_held_to_the_longer_of_compute_and_wire() -> None:
    """At 100 Mbit/s 100,000 bytes a step are 8 ms on the wire; the compute-only step is 1 s,
    so the delayed step (1.1 s) is within 1.15x of the longer, and faster than undelayed."""
    warm = _block("warmup", 4.0, 3200, 3200)
    raw = _raw(
        {
            "lamb": [[_block("steady", 4.0, 3200, 0)]],
            "lamb-compute": [[_block("steady", 1.0, 10, 0)]],
            "onebit-lamb": [[warm, _block("compression", 1.25, 100_000, 100_000)]],
            "onebit-lamb-delayed": [[warm, _block("compression", 1.1, 100_000, 100_000)]],
        }
    )
    targets = analysis.analyze(raw)["targets"]
    within = targets["delayed_within_1.15x_of_max_compute_wire"]
    assert within["met"] is True and "= 1.10" in within["detail"]
    assert targets["delayed_not_slower_than_undelayed"]["met"] is True
    slow = analysis.analyze(raw | {"settings": {**raw["settings"], "bandwidth": "100kbit"}})
    within = slow["targets"]["delayed_within_1.15x_of_max_compute_wire"]
    assert within["met"] is True and "wire time 8.000 s" in within["detail"]


def test_zero_one_adam_arm_holds_every_kind_of_step() -> None:
    # ALGORITHM.md, "0/1 Adam", with kappa = 2: variance updates at 1, 2 (interval 1), 4, 6
    # (interval 2), 8, 12 (interval 4), ...; after the freeze T with S = 1 and H = 4 the
    # interval is 1 at T+1, 2 at T+2, 4 from T+3 on.
    freeze, kinds = zero_one_adam_arm(3)
    v, g, s, local = "variance_update", "gradient_1bit", "sync", "local"
    assert freeze == 7
    assert kinds == [v, v, g, v, g, v, g, s, local, local, local, s, local, local, local, s]
    freeze, kinds = zero_one_adam_arm(2)
    assert freeze == 5 and kinds == [v, v, g, v, g, s, local, s, local]


def test_zero_one_adam_schedule_of_the_main_job() -> None:
    # docs/ZERO-ONE-ADAM.md: `onebit train --optimizer zero-one-adam` (400 steps, freeze 80)
    # takes 40 variance updates, 40 1-bit gradient steps, 85 synchronisations, 235 local steps.
    schedule = analysis.zero_one_adam_run_schedule(400, 0.2)
    assert schedule["steps_by_kind"] == {
        "variance_update": 40,
        "gradient_1bit": 40,
        "local": 235,
        "sync": 85,
    }
    assert (schedule["var_freeze_step"], schedule["local_step_scaler"]) == (80, 40)


def test_zero_one_adam_whole_run_is_weighted_by_kind(tmp_path: Path, capsys) -> None:
    dense, onebit = 3200, 100
    seconds = {"variance_update": 4.0, "gradient_1bit": 1.0, "local": 0.5, "sync": 1.0}
    wire = {"variance_update": dense, "gradient_1bit": onebit, "local": 10, "sync": onebit}
    raw = _raw(
        {
            "lamb": [[_block("steady", 4.0, dense, 0)]],
            "onebit-adam": [
                [_block("warmup", 4.0, dense, dense), _block("compression", 1.0, onebit, onebit)]
            ],
            "zero-one-adam": [
                [_block(kind, seconds[kind], wire[kind], wire[kind]) for kind in STEP_KINDS],
                # a slower round: its step times are not used
                [_block(kind, 2 * seconds[kind], wire[kind], wire[kind]) for kind in STEP_KINDS],
            ],
        },
        run_steps=400,
    )
    item = analysis.analyze(raw)["summary"]["zero-one-adam"]
    # 40 variance updates, 40 1-bit gradient steps, 235 local steps, 85 synchronisations.
    time = 40 * 4.0 + 40 * 1.0 + 235 * 0.5 + 85 * 1.0
    sent = 40 * dense + 40 * onebit + 235 * 10 + 85 * onebit
    assert item["end_to_end_seconds"] == pytest.approx(time)
    assert item["whole_run_wire_bytes"] == pytest.approx(sent)
    assert item["stages"]["local"]["speedup_over_lamb_step"] == pytest.approx(8.0)
    assert item["vs"]["lamb"]["end_to_end_speedup"] == pytest.approx(400 * 4.0 / time)
    assert item["vs"]["lamb"]["whole_run_bytes_reduction"] == pytest.approx(400 * dense / sent)
    onebit_adam_time = 80 * 4.0 + 320 * 1.0
    assert item["vs"]["onebit-adam"]["end_to_end_speedup"] == pytest.approx(onebit_adam_time / time)
    assert item["vs"]["onebit-adam"]["whole_run_bytes_reduction"] == pytest.approx(
        (80 * dense + 320 * onebit) / sent
    )
    result = analysis.analyze(raw)
    text = report.format_report(result)
    assert "| local | 235 | 0.50 s | 8.00x |" in text
    assert f"| zero-one-adam | {time:.0f} s |" in text
    path = tmp_path / "cluster-tiny-2w-100mbit.json"
    report.write_json(result, path)
    assert onebit_main(["bench", "report", str(path)]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert f"| {400 * 4.0 / time:.2f}x |" in row  # the whole run, in the sweep table
    # The same measurements for a run of 10000 steps (freeze 2000): 112 variance updates.
    assert onebit_main(["bench", "report", "--full", "--run-steps", "10000", str(path)]) == 0
    assert "| variance_update | 112 | 4.00 s |" in capsys.readouterr().out


def test_blocks_of_one_kind_are_joined() -> None:
    first, second = _block("sync", 1.0, 100, 40, steps=1), _block("sync", 3.0, 300, 40, steps=1)
    joined = _worker._joined([first, second])
    assert (joined["stage"], joined["steps"], joined["seconds"]) == ("sync", 2, 4.0)
    assert joined["rank0_step_seconds"] == [1.0, 3.0]
    assert joined["library_bytes_by_rank"] == [80, 80]
    assert joined["interface_tx_bytes_by_host"] == [400, 400]


class _SendingBetweenReadings:
    """A method whose every step sends 1000 bytes, and a link on which 10 more bytes go out
    before every reading of the counters: an exchange a step left in flight."""

    name = "diloco-dense-k2-d1"
    optimizer = None
    last_loss = 0.0

    def __init__(self) -> None:
        self.sent = 0
        self.readings: list[int] = []

    def step(self, batch: dict) -> tuple[float, float]:
        self.sent += 1000
        return 0.0, 0.0

    def library_bytes(self) -> int:
        return 0

    def counters(self) -> list[list[int]]:
        self.sent += 10
        self.readings.append(self.sent)
        return [[self.sent, self.sent]]


def test_steps_timed_one_by_one_count_every_byte_between_their_readings(monkeypatch) -> None:
    method = _SendingBetweenReadings()
    monkeypatch.setattr(_worker, "_interface_counters", method.counters)
    monkeypatch.setattr(_worker.dist, "barrier", lambda: None)
    runner = _worker._Runner.__new__(_worker._Runner)  # one rank, no process group
    runner.cfg, runner.rank, runner.world = {"skip_steps": 1, "steps": 2}, 0, 1
    runner.batches, runner.cursor = [{}], 0
    blocks = runner.run_each_kind(method, ["inner", "outer"] * 4)
    counted = sum(block["interface_tx_bytes_by_host"][0] for block in blocks)
    # the 2nd and 3rd turns are timed: from the reading after the 1st turn to the last timed one
    first, last = method.readings[2], method.readings[6]
    assert [block["steps"] for block in blocks] == [2, 2]
    assert counted == last - first == 4 * 1010


def test_hierarchical_figures_and_targets() -> None:
    flat, hier = 1000, 520
    raw = _raw(
        {
            name: [[_block("warmup", 3.0, 9000, 9000), _block("compression", t, tx, tx)]]
            for name, t, tx in (("onebit-lamb-ddp", 2.0, flat), ("onebit-lamb-hier", 1.0, hier))
        },
        workers=4,
        nodes=2,
        workers_per_node=2,
        run_steps=100,
    )
    result = analysis.analyze(raw)
    vs_flat = result["summary"]["onebit-lamb-hier"]["vs_flat"]
    assert vs_flat["method"] == "onebit-lamb-ddp"
    assert vs_flat["compression_stage_speedup"] == pytest.approx(2.0)
    assert vs_flat["wire_bytes_ratio"] == pytest.approx(0.52)
    targets = result["targets"]
    assert targets["hierarchical_inter_node_bytes"]["met"] is True  # 0.52 <= 1.05 / 2
    assert targets["hierarchical_compression_stage_1.5x"]["met"] is True
    assert "### 2 nodes x 2 workers, 100mbit" in report.format_report(result)
    assert "wire MB/step/node" in report.format_report(result)


def test_hsdp_figures_and_targets() -> None:
    raw = _raw(
        {
            "hsdp-lamb": [[_block("steady", 2.0, 3200, 3200)]],
            "hsdp-onebit-lamb": [
                [_block("warmup", 2.0, 3200, 3200), _block("compression", 1.0, 100, 100)]
            ],
        },
        workers=4,
        nodes=2,
        workers_per_node=2,
        run_steps=100,
    )
    result = analysis.analyze(raw)
    versus = result["summary"]["hsdp-onebit-lamb"]["vs_hsdp"]
    assert versus == {"compression_stage_speedup": 2.0, "wire_bytes_reduction": 32.0}
    assert result["targets"]["hsdp_inter_node_bytes_30x"]["met"] is True
    with pytest.raises(ValueError, match="hsdp-lamb shard the model over the workers of a node"):
        ComparisonSettings(workers=4, methods=("hsdp-lamb",)).resolved()


def test_exchange_command_checks_before_it_runs(monkeypatch, capsys, tmp_path: Path) -> None:
    from onebit.bench import netns

    with pytest.raises(SystemExit) as exit_info:
        onebit_main(["bench", "exchange", "--bucket-cap-mb", "0"])
    assert exit_info.value.code == 2
    assert "--bucket-cap-mb=0.0: it must be a finite number of MiB > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        onebit_main(["bench", "exchange", "--hosts", "1"])
    assert exit_info.value.code == 2
    assert "--hosts: must be from 2 to 250, got 1" in capsys.readouterr().err
    missing = str(tmp_path / "no" / "rows.json")
    if UNAVAILABLE is None:
        assert onebit_main(["bench", "exchange", "--output", missing]) == 2
        assert "no folder for --output" in capsys.readouterr().err
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "not root (test)")
    assert onebit_main(["bench", "exchange"]) == 2
    assert "onebit bench exchange: the emulated cluster needs root" in capsys.readouterr().err


def test_cluster_command_says_why_it_cannot_run(monkeypatch, capsys) -> None:
    monkeypatch.setattr(comparison, "unavailable_reason", lambda: "not root (test)")
    assert onebit_main(["bench", "cluster", "--workers", "2", "--model", "tiny"]) == 2
    assert "not root (test)" in capsys.readouterr().err
    assert onebit_main(["bench", "cluster", "--workers", "1", "--model", "tiny"]) == 2
    assert "--workers must be at least 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (dict(workers=6, workers_per_node=4), "--workers-per-node 4 does not divide --workers 6"),
        (dict(workers=6, nodes=2, workers_per_node=2), "--workers 6 disagrees with --nodes 2"),
        (dict(nodes=1, workers_per_node=4), "--nodes must be at least 2"),
        (dict(nodes=2, workers_per_node=0), "--workers-per-node must be at least 1"),
    ],
)
def test_cluster_shape_is_checked(given: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ComparisonSettings(**given).resolved()


def test_cluster_shape_from_nodes_or_workers() -> None:
    default = ComparisonSettings().resolved()
    assert (default.workers, default.nodes, default.workers_per_node) == (4, 4, 1)
    for given in (dict(nodes=2, workers_per_node=2), dict(workers=4, workers_per_node=2)):
        settings = ComparisonSettings(**given, threads=1).resolved()
        assert (settings.workers, settings.nodes) == (4, 2)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_options_are_the_settings_fields(capsys) -> None:
    assert cli._settings(_parse("cluster")) == ComparisonSettings()
    settings = cli._settings(
        _parse(
            "cluster", "--workers", "3", "--bandwidth", "none", "--methods", "lamb,fp16",
            "--no-memory-check", "--seq-len", "16", "--latency", "0.1ms",
        )
    )  # fmt: skip
    assert settings == ComparisonSettings(
        workers=3,
        bandwidth=None,
        methods=("lamb", "fp16"),
        memory_check=False,
        seq_len=16,
        latency="0.1ms",
    )
    assert cli._settings(_parse("cluster", "--methods", "all")).methods == tuple(METHODS)
    nodes = cli._settings(_parse("cluster", "--nodes", "2", "--workers-per-node", "2"))
    assert nodes == ComparisonSettings(nodes=2, workers_per_node=2)
    sweep = _parse("sweep", "--bandwidths", "100mbit,none", "--worker-counts", "")
    assert cli._settings(sweep) == ComparisonSettings(model="small")
    assert (sweep.bandwidths, sweep.worker_counts) == (["100mbit", None], [])
    for bad in (["--bandwidth", "fast"], ["--methods", "lamb,sgd"], ["--model", "huge"]):
        with pytest.raises(SystemExit):
            _parse("cluster", *bad)
    err = capsys.readouterr().err
    assert "bandwidth must be a positive rate" in err and "unknown method(s) ['sgd']" in err


def test_presets_count_their_parameters() -> None:
    model = bert.build_model("tiny", seed=0)
    assert sum(p.numel() for p in model.parameters()) == PRESETS["tiny"].parameter_count()
    embeddings = sum(p.numel() for name, p in model.named_parameters() if ".embeddings." in name)
    assert embeddings == PRESETS["tiny"].embedding_count()
