"""``onebit estimate``: the cost model's formulas against hand-computed cases, its input checks,
the command line, and the validation against the shipped emulated-cluster results."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers.paths import ROOT

from onebit.cli import main
from onebit.collectives import compressed_allreduce_per_tensor_bytes
from onebit.estimate.model import (
    COMPRESSION_THROUGHPUT,
    COPY_THROUGHPUT,
    HOST_THROUGHPUT,
    Cluster,
    Machine,
    delayed_exchange,
    dense_allreduce,
    estimate,
    flat_exchange,
    hierarchical_exchange,
    local_compression_seconds,
    overlapped_exchange,
    turn_seconds,
)
from onebit.estimate.models import model_parameters, model_tail_share
from onebit.estimate.validate import (
    EMULATED_BURST_EFFICIENCY,
    EMULATED_LATENCY,
    emulated_machine,
    fit_emulation,
    load_results,
    validate,
)

BENCH = ROOT / "docs" / "bench"

# alpha 10 ms, line rate 1000 B/s used at full payload, host 10 kB/s, compression 20 kB/s
MACHINE = Machine(
    compression_throughput=2e4,
    host_throughput=1e4,
    latency=0.01,
    link_efficiency=1.0,
    burst_efficiency=0.5,
)


def job(nodes: int, per_node: int, parameters: int = 1024, **kwargs) -> Cluster:
    return Cluster(
        parameters=parameters,
        compute_seconds=2.0,
        bandwidth=1000.0,
        nodes=nodes,
        ranks_per_node=per_node,
        **kwargs,
    )


def test_dense_ring_allreduce_by_hand():
    # W = 4 nodes of one rank, N = 1000 fp32: each rank sends 2*3/4*4000 = 6000 bytes, all
    # of them through its node link; 6 message steps; the host moves 6000 bytes.
    fp32 = dense_allreduce(job(4, 1, parameters=1000), MACHINE, 4)
    assert fp32.rank_bytes == fp32.node_link_bytes == 6000
    assert fp32.seconds == pytest.approx(6 * 0.01 + 6000 / 1000 + 6000 / 1e4)
    # fp16 halves the wire bytes; the host costs what fp32 costs (per element)
    fp16 = dense_allreduce(job(4, 1, parameters=1000), MACHINE, 2)
    assert fp16.node_link_bytes == 3000
    assert fp16.seconds == pytest.approx(6 * 0.01 + 3000 / 1000 + 6000 / 1e4)
    # one node of 4 ranks: nothing leaves it; the hops inside run at the intra-node rate
    inside = dense_allreduce(job(1, 4, parameters=1000, intra_bandwidth=500.0), MACHINE, 4)
    assert inside.node_link_bytes == 0
    assert inside.seconds == pytest.approx(6 * 0.01 + 6000 / 500 + 6000 / 1e4)


def test_flat_exchange_by_hand():
    # W = 4, N = 1024: per phase 3 chunks of 256/8 = 32 bytes of signs; three 4-byte scalars
    # to each of 3 peers: 2*96 + 36 = 228 bytes per rank, all of them off the node.
    flat = flat_exchange(job(4, 1), MACHINE)
    assert flat.rank_bytes == flat.node_link_bytes == 228
    assert flat.seconds == pytest.approx(4 * 3 * 0.01 + 228 / (1000 * 0.5) + 228 / 1e4)
    # 2 nodes of 2: the all-to-all sends 2 of 3 chunks of each of the 2 ranks off the node,
    # the ring all-gather leaves it once: 114 * (2*2/3 + 1) bytes
    two_by_two = flat_exchange(job(2, 2), MACHINE)
    assert two_by_two.node_link_bytes == pytest.approx(114 * 7 / 3)
    assert flat_exchange(job(1, 1), MACHINE).seconds == 0


def test_overlapped_exchange_by_hand():
    # One bucket (25 MiB hold the 1024 elements) starts when backward ends: the flat exchange.
    flat = flat_exchange(job(4, 1), MACHINE)
    one = overlapped_exchange(job(4, 1), MACHINE)
    assert job(4, 1).buckets == 1
    assert one.seconds == pytest.approx(flat.seconds)
    assert (one.rank_bytes, one.node_link_bytes) == (flat.rank_bytes, flat.node_link_bytes)
    # Buckets of 32 elements (128 bytes): 32 of them. The core: t_c 2 s, local work
    # 4096 / 2e4, host 228 / 1e4, 32 buckets of 12 message steps of 10 ms; the link: forward
    # and update 0.4 * 2 s, 12 message steps, 228 / (1000 * 0.5) s of bytes. The tail, the
    # last bucket's bytes after the core's work, is the longest: the exchange adds the host
    # time, the latency and 1/32 of the bytes' time.
    wire = 228 / (1000 * 0.5)
    small = job(4, 1, bucket_cap_mb=128 / 2**20)
    assert small.buckets == 32
    expected = 228 / 1e4 + 32 * 0.12 + wire / 32
    assert overlapped_exchange(small, MACHINE).seconds == pytest.approx(expected)
    # half the parameters' gradients complete at the end of backward: half the bytes after
    late = dataclasses.replace(small, tail_share=0.5)
    expected = 228 / 1e4 + 32 * 0.12 + wire / 2
    assert overlapped_exchange(late, MACHINE).seconds == pytest.approx(expected)
    # a slow link (100 B/s) with a short backward (b = 0.05): the link sets the step,
    # 0.95 * 2 + 0.12 + 228 / (100 * 0.5) s, of which t_c and the local work are not the exchange's
    slow = dataclasses.replace(small, backward_share=0.05, bandwidth=100.0)
    expected = 0.95 * 2 + 0.12 + 228 / 50 - 2 - 4096 / 2e4
    assert overlapped_exchange(slow, MACHINE).seconds == pytest.approx(expected)
    assert overlapped_exchange(job(1, 1), MACHINE).seconds == 0


def test_delayed_exchange_by_hand():
    # One pass over the weights: 4096 / 4e4 s. The core: t_c 2 s, local work 4096 / 2e4 s,
    # two passes, host 228 / 1e4 s; the chain: the update 0.17 * 2 s, two passes, the local
    # work and the flat exchange (12 message steps of 10 ms, 228 / (1000 * 0.5) s of bytes, the
    # host), shorter: the exchange adds the two passes and the host.
    machine = dataclasses.replace(MACHINE, copy_throughput=4e4)
    weights_pass = 4096 / 4e4
    delayed = delayed_exchange(job(4, 1), machine)
    assert delayed.seconds == pytest.approx(2 * weights_pass + 228 / 1e4)
    assert delayed.rank_bytes == flat_exchange(job(4, 1), machine).rank_bytes
    # a link of 100 B/s and an update of half the step: the chain sets the step, of which
    # t_c and the local work are not the exchange's
    slow = dataclasses.replace(job(4, 1), bandwidth=100.0, update_share=0.5)
    flat = 0.12 + 228 / 50 + 228 / 1e4
    expected = 0.5 * 2 + 2 * weights_pass + flat - 2
    assert delayed_exchange(slow, machine).seconds == pytest.approx(expected)
    # the delay hides forward and backward, (1 - u_p) t_c, and no more
    assert flat - delayed_exchange(slow, machine).seconds <= 0.5 * 2
    assert delayed_exchange(job(1, 1), machine).seconds == 0


def test_tail_shares_are_the_embeddings_of_named_models(capsys):
    # BERT-base: (30522 + 512 + 2) * 768 + 2 * 768 embedding parameters of 109514298
    assert model_tail_share("bert-base") == pytest.approx(23_837_184 / 109_514_298)
    assert model_tail_share("small") == pytest.approx(((30522 + 512 + 2) * 512 + 1024) / 28_795_194)
    assert model_tail_share("340M") == 0
    # the command line takes the named model's share unless --tail-share gives one
    argv = ["estimate", "--compute", "1", "--model", "small", "--nodes", "2", "--json"]
    for extra, share in [([], model_tail_share("small")), (["--tail-share", "0.1"], 0.1)]:
        assert main([*argv, *extra]) == 0
        assert json.loads(capsys.readouterr().out)["cluster"]["tail_share"] == pytest.approx(share)
    with pytest.raises(SystemExit):
        main([*argv, "--tail-share", "1.5"])
    assert "a share must be in [0, 1], got '1.5'" in capsys.readouterr().err


def test_buckets_are_cut_as_the_optimizer_cuts_them():
    # BERT-base on 2 ranks: 109514298 parameters padded to a multiple of 16, 109514304;
    # 25 MiB of fp32 are 6553600 elements (a multiple of 16): 17 buckets, the last one short
    base = Cluster(parameters=109514298, compute_seconds=1.0, bandwidth=1e8, nodes=2)
    assert base.buckets == math.ceil(109514304 / 6553600) == 17
    # buckets smaller than 8 W elements are rounded up to 8 W (16 here)
    assert dataclasses.replace(base, bucket_cap_mb=1e-9).buckets == 109514304 // 16


def test_hierarchical_exchange_by_hand():
    # M = 2 nodes of L = 2, N = 1024: inside the node each rank sends its other shard in fp32
    # (512 * 4) and its compressed chunk to the other rank (512/8 signs + 2 scales of 4 B);
    # between nodes the flat exchange of 512 elements over 2 ranks: 2 * 256/8 + 3 * 4.
    cluster = job(2, 2, intra_bandwidth=4000.0)
    hier = hierarchical_exchange(cluster, MACHINE)
    intra, inter = 512 * 4 + 64 + 8, 2 * 32 + 12
    assert hier.rank_bytes == intra + inter
    assert hier.node_link_bytes == 2 * inter
    expected = (3 + 4) * 0.01 + 2 * inter / (1000 * 0.5) + intra / 4000 + (intra + inter) / 1e4
    assert hier.seconds == pytest.approx(expected)
    # nodes of one rank: the flat exchange's bytes
    single = hierarchical_exchange(job(4, 1), MACHINE)
    assert single.node_link_bytes == flat_exchange(job(4, 1), MACHINE).node_link_bytes


def test_step_times_speedup_and_traffic_by_hand():
    cluster = job(4, 1, warmup_fraction=0.25)
    shared = dataclasses.replace(MACHINE, cpu_sharing=2.0)
    rows = {row.method: row for row in estimate(cluster, shared)}
    # one rank per node: no hierarchical row
    assert set(rows) == {"lamb", "fp16", "onebit", "onebit-overlap", "onebit-delayed"}
    lamb_step = 2.0 + 6 * 0.01 + 4096 * 1.5 / 1000 + 2 * 4096 * 1.5 / 1e4
    local = 2 * 4 * 1024 / 2e4
    comp_step = 2.0 + local + 12 * 0.01 + 228 / 500 + 2 * 228 / 1e4
    onebit = rows["onebit"]
    assert rows["lamb"].compression_step == pytest.approx(lamb_step)
    assert onebit.warmup_step == pytest.approx(lamb_step)
    assert onebit.compression_step == pytest.approx(comp_step)
    assert onebit.mean_step == pytest.approx(0.25 * lamb_step + 0.75 * comp_step)
    assert onebit.speedup == pytest.approx(lamb_step / (0.25 * lamb_step + 0.75 * comp_step))
    assert onebit.compression_speedup == pytest.approx(lamb_step / comp_step)
    assert onebit.traffic_reduction == pytest.approx(6144 / (0.25 * 6144 + 0.75 * 228))
    assert local_compression_seconds(cluster, shared) == local


def test_diloco_rounds_by_hand():
    # W = 4 nodes of one rank, N = 1024, H = 8: seven inner steps of t_c = 2 s, the eighth
    # adds the outer exchange of fp32 pseudo-gradients (dense: 6144 bytes a rank; 1-bit:
    # 228, after the local work).
    rows = {row.method: row for row in estimate(job(4, 1, sync_every=(8,)), MACHINE)}
    dense_outer = 6 * 0.01 + 6144 / 1000 + 6144 / 1e4
    onebit_outer = 4 * 1024 / 2e4 + 12 * 0.01 + 228 / 500 + 228 / 1e4
    lamb_step = 2.0 + dense_outer
    for name, outer, sent in (("dense", dense_outer, 6144), ("1bit", onebit_outer, 228)):
        row = rows[f"diloco-{name}-h8"]
        assert (row.warmup_step, row.compression_step) == pytest.approx((2.0, 2.0 + outer))
        assert row.mean_step == pytest.approx(2.0 + outer / 8)
        assert row.speedup == pytest.approx(lamb_step / (2.0 + outer / 8))
        assert row.rank_bytes == row.node_link_bytes == pytest.approx(sent / 8)
        assert row.traffic_reduction == pytest.approx(8 * 6144 / sent)
    # mixed precision halves LAMB's allreduce, not the fp32 pseudo-gradients'
    half = {
        r.method: r for r in estimate(job(4, 1, sync_every=(8,), mixed_precision=True), MACHINE)
    }
    assert half["diloco-dense-h8"].traffic_reduction == pytest.approx(4)
    assert [r.method for r in estimate(job(4, 1, sync_every=(2, 8)), MACHINE)][-4:] == [
        "diloco-dense-h2",
        "diloco-1bit-h2",
        "diloco-dense-h8",
        "diloco-1bit-h8",
    ]


def test_the_1bit_outer_exchange_in_blocks_by_hand():
    # W = 4, N = 1024, H = 8, blocks of b = 64 per rank: 4 blocks of 256 elements, each with
    # its worker scale and 4 server scales: the same 192 bytes of signs, and per peer 2·4
    # scales and the backend code (108 bytes of scalars, against 36 for one scale).
    rows = {
        row.method: row
        for row in estimate(job(4, 1, sync_every=(8,), outer_block_size=64), MACHINE)
    }
    sent = 192 + (2 * 4 + 1) * 4 * 3
    outer = 4 * 1024 / 2e4 + 12 * 0.01 + sent / 500 + sent / 1e4
    row = rows["diloco-1bit-h8"]
    assert row.label.endswith("blocks of 64")
    assert row.compression_step == pytest.approx(2.0 + outer)
    assert row.rank_bytes == row.node_link_bytes == pytest.approx(sent / 8)
    assert rows["diloco-dense-h8"].rank_bytes == pytest.approx(6144 / 8)  # dense unchanged
    assert sent == compressed_allreduce_per_tensor_bytes([256] * 4, 4, torch.float32)
    # N = 1200, padded to 1216: four blocks of 256 and a short one of 192
    short = estimate(job(4, 1, 1200, sync_every=(8,), outer_block_size=64), MACHINE)
    expected = compressed_allreduce_per_tensor_bytes([256] * 4 + [192], 4, torch.float32)
    assert {r.method: r for r in short}["diloco-1bit-h8"].rank_bytes == expected / 8


def test_streaming_diloco_turns_by_hand():
    # W = 4 nodes of one rank, N = 1024 in K = 2 fragments of 512, H = 8: a turn of 4 steps
    # of t_c = 2 s exchanges one fragment (dense: 3072 bytes a rank; 1-bit: 96 of signs and
    # 36 of scalars, after 0.1024 s of local work). Started a step (τ = 1) before the turn's
    # end, the core runs that step and the exchange's host work while the link carries the
    # rest: max(τ t_c + core, link) - τ t_c.
    dense_core, dense_link = 3072 / 1e4, 6 * 0.01 + 3072 / 1000
    onebit_core, onebit_link = 4 * 512 / 2e4 + 132 / 1e4, 12 * 0.01 + 132 / 500
    expected = {
        "dense": (max(2 + dense_core, dense_link) - 2, dense_core + dense_link, 3072),
        "1bit": (max(2 + onebit_core, onebit_link) - 2, onebit_core + onebit_link, 132),
    }
    streaming = job(4, 1, sync_every=(8,), fragments=2, fragment_delay=1)
    rows = {row.method: row for row in estimate(streaming, MACHINE)}
    plain = {row.method: row for row in estimate(job(4, 1, sync_every=(8,)), MACHINE)}
    for name, (added, outer, sent) in expected.items():
        row = rows[f"diloco-{name}-h8-k2-d1"]
        assert row.label.startswith("Streaming DiLoCo")
        assert (row.warmup_step, row.compression_step) == pytest.approx((2.0, 2.0 + added))
        assert row.mean_step == pytest.approx(2.0 + added / 4)
        assert row.rank_bytes == row.node_link_bytes == pytest.approx(sent / 4)
        assert rows[f"diloco-{name}-h8"] == plain[f"diloco-{name}-h8"]  # beside it
        assert turn_seconds(streaming, MACHINE, name, 2, 0)[0] == pytest.approx(outer)
    assert expected["1bit"][0] == pytest.approx(onebit_core)  # the wire hides behind t_c
    assert expected["dense"][0] == pytest.approx(dense_link - 2)  # 1.132 s of 3.132 exposed


def test_free_local_work_and_latency_give_the_32x_byte_ratio():
    # With nothing but the links costing time, the compression stage is 32x faster than a
    # dense fp32 step (less the scalars), the whole run 1 / (w + (1-w)/32) on traffic.
    free = Machine(math.inf, math.inf, latency=0.0, link_efficiency=1.0)
    cluster = Cluster(parameters=2**24, compute_seconds=1e-12, bandwidth=1e9, nodes=8)
    rows = {row.method: row for row in estimate(cluster, free)}
    assert rows["onebit"].compression_speedup == pytest.approx(32, rel=1e-3)
    assert rows["onebit"].traffic_reduction == pytest.approx(1 / (0.2 + 0.8 / 32), rel=1e-3)
    assert rows["fp16"].speedup == pytest.approx(2, rel=1e-9)


def test_one_node_sends_nothing_over_links_and_mixed_precision_drops_the_fp16_row():
    rows = estimate(job(1, 4, mixed_precision=True), MACHINE)
    assert [row.method for row in rows] == [
        "lamb",
        "onebit",
        "onebit-overlap",
        "onebit-delayed",
        "onebit-hier",
    ]
    assert all(row.traffic_reduction is None for row in rows)
    lamb = dense_allreduce(job(1, 4), MACHINE, 2)
    assert rows[0].compression_step == pytest.approx(2.0 + lamb.seconds)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"parameters": 0}, "parameters must be an integer >= 1"),
        ({"nodes": 1.5}, "nodes must be an integer >= 1"),
        ({"compute_seconds": -1.0}, "compute_seconds must be a positive number"),
        ({"bandwidth": math.inf}, "bandwidth must be finite"),
        ({"warmup_fraction": 1.5}, r"warmup_fraction must be in \[0, 1\]"),
        ({"backward_share": -0.1}, r"backward_share must be in \[0, 1\]"),
        ({"tail_share": 1.5}, r"tail_share must be in \[0, 1\]"),
        ({"update_share": -0.2}, r"update_share must be in \[0, 1\]"),
        ({"bucket_cap_mb": 0.0}, "bucket_cap_mb must be a positive number"),
        ({"sync_every": (10, 0)}, "sync_every must hold integers >= 1, got 0"),
        ({"fragments": 0}, "fragments must be an integer >= 1, got 0"),
        ({"sync_every": (10,), "fragments": 3}, "sync_every 10 must be a multiple of fragments"),
        (
            {"sync_every": (10,), "fragments": 2, "fragment_delay": 5},
            "fragment_delay 5 less than their quotient",
        ),
        ({"sync_every": (10,), "outer_block_size": 12}, "outer_block_size must be a multiple"),
        ({"outer_block_size": 128}, "outer_block_size prices DiLoCo's 1-bit outer exchange"),
    ],
)
def test_cluster_rejects_bad_input(kwargs, message):
    base = {"parameters": 10, "compute_seconds": 1.0, "bandwidth": 1e9}
    with pytest.raises(ValueError, match=message):
        Cluster(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compression_throughput": 0.0}, "compression_throughput must be a positive number"),
        ({"copy_throughput": -1.0}, "copy_throughput must be a positive number"),
        ({"latency": -1e-6}, "latency must be finite seconds >= 0"),
        ({"burst_efficiency": 1.5}, r"burst_efficiency must be in \(0, 1\]"),
        ({"cpu_sharing": 0.5}, "cpu_sharing must be a number >= 1"),
    ],
)
def test_machine_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Machine(**kwargs)


def test_model_names_and_counts():
    # BertForMaskedLM's counts: bert-base as measured by the benchmark (docs/bench), bert-large
    # as transformers reports it for bert-large-uncased
    assert model_parameters("bert-base") == 109_514_298
    assert model_parameters("BERT-Large") == 335_174_458
    assert model_parameters("340M") == 340_000_000
    assert model_parameters("1.5e9") == 1_500_000_000
    with pytest.raises(ValueError, match="model must be one of"):
        model_parameters("gpt-7")


def test_command_prints_a_table_and_json(capsys):
    assert main(["estimate", "--compute", "0.5", "--nodes", "2", "--gpus-per-node", "2"]) == 0
    table = capsys.readouterr().out
    assert (
        "1-bit LAMB / 1-bit Adam, hierarchical" in table and "| LAMB (dense allreduce) |" in table
    )
    argv = ["estimate", "--compute", "0.5", "--model", "mini", "--bandwidth", "1gbit", "--json"]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["cluster"]["parameters"] == 11_201_594
    assert document["cluster"]["bandwidth"] == 1e9 / 8
    assert [row["method"] for row in document["methods"]] == [
        "lamb",
        "fp16",
        "onebit",
        "onebit-overlap",
        "onebit-delayed",
    ]
    assert main([*argv, "--sync-every", "50"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["cluster"]["sync_every"] == [50]
    assert [row["method"] for row in document["methods"]][-2:] == [
        "diloco-dense-h50",
        "diloco-1bit-h50",
    ]
    assert main([*argv, "--sync-every", "50", "--fragments", "5", "--fragment-delay", "2"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [row["method"] for row in document["methods"]][-2:] == [
        "diloco-dense-h50-k5-d2",
        "diloco-1bit-h50-k5-d2",
    ]
    assert main([*argv, "--sync-every", "50", "--fragments", "3"]) == 2
    assert "sync_every 50 must be a multiple of fragments 3" in capsys.readouterr().err


def test_command_rejects_bad_input_with_clear_errors(capsys):
    assert main(["estimate"]) == 2
    assert "--compute SECONDS is required" in capsys.readouterr().err
    assert main(["estimate", "--compute", "1", "--nodes", "0"]) == 2
    assert "nodes must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["estimate", "--compute", "1", "--fit"]) == 2
    assert "give --validate DIR" in capsys.readouterr().err
    for option, value, message in [
        ("--model", "gpt-7", "model must be one of"),
        ("--bandwidth", "fast", "bandwidth must be a positive rate"),
        ("--host-throughput", "-3", "a throughput must be a positive number"),
        ("--copy-throughput", "0", "a throughput must be a positive number"),
        ("--update-share", "1.5", "a share must be in [0, 1]"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["estimate", "--compute", "1", option, value])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert main(["estimate", "--validate", str(BENCH / "micro-optimizer.json")]) == 2
    assert "no onebit bench cluster results" in capsys.readouterr().err


def test_validation_on_the_shipped_results(capsys):
    assert main(["estimate", "--validate", str(BENCH), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    predictions = document["predictions"]
    results = load_results([BENCH])
    measured = sum(
        1
        for _, result in results
        for method, summary in result["summary"].items()
        if method not in ("lamb-compute", "powersgd-1", "powersgd-4")
        for _ in summary["stages"]
    )
    assert len(predictions) == measured
    current = {name for name, result in results if "code" in result}
    ratios = [p["ratio"] for p in predictions if p["run"] in current]
    within = sum(abs(r - 1) <= 0.2 for r in ratios)
    assert within >= 0.9 * len(ratios), ratios
    assert all(0.5 < r < 2 for r in ratios)


def test_the_pipelined_overlap_runs_are_predicted_within_tolerance():
    # docs/ESTIMATE.md: every step time of docs/bench/pipelined within 20 %, the overlapped
    # `small` steps at 100 Mbit/s (its embeddings over half the bytes) through the tail bound
    predictions = validate(load_results([BENCH / "pipelined"]), emulated_machine(Machine()))
    assert len(predictions) == 42
    assert all(p.within_tolerance for p in predictions), [
        (p.run, p.method, round(p.ratio, 2)) for p in predictions if not p.within_tolerance
    ]


def _predicted_by_run(folder: str):
    """For each result file of docs/bench/``folder``: its predicted step time of each
    (method, stage) and its compute-only step."""
    results = load_results([BENCH / folder])
    predictions = validate(results, emulated_machine(Machine()))
    for name, result in results:
        predicted = {(p.method, p.stage): p.predicted for p in predictions if p.run == name}
        yield predicted, result["summary"]["lamb-compute"]["stages"]["steady"]["step_seconds"]


def test_zero_one_adams_steps_are_timed_by_their_exchange():
    # a variance update is LAMB's dense step, a 1-bit gradient step and a synchronisation the
    # 1-bit exchange's step (1-bit Adam's compression step), a local step the compute alone
    for predicted, compute in _predicted_by_run("zero-one-adam"):
        assert predicted[("zero-one-adam", "variance_update")] == predicted[("lamb", "steady")]
        onebit_step = predicted[("onebit-adam", "compression")]
        assert predicted[("zero-one-adam", "gradient_1bit")] == onebit_step
        assert predicted[("zero-one-adam", "sync")] == onebit_step
        assert predicted[("zero-one-adam", "local")] == pytest.approx(compute)


def test_dilocos_steps_are_the_compute_and_the_rounds_outer_exchange():
    # an inner step is the compute alone; the last of a round adds the dense allreduce of the
    # fp32 pseudo-gradients (LAMB's step) or the 1-bit exchange with its local work;
    # streaming, the last of a turn adds less than half of that: half the model, behind a step
    methods = {"diloco-dense": "diloco-dense-k2-d1", "diloco-1bit": "diloco-1bit-k2-d1"}
    seen = set()
    for predicted, compute in _predicted_by_run("diloco"):
        lamb = predicted[("lamb", "steady")]
        for whole, streaming in methods.items():
            method = whole if (whole, "outer") in predicted else streaming
            seen.add(method)
            assert predicted[(method, "inner")] == pytest.approx(compute)
            added = predicted[(method, "outer")] - compute
            assert 0 < added <= lamb - compute
            if method == "diloco-dense":
                assert predicted[(method, "outer")] == lamb
            if method == streaming:
                assert added < (lamb - compute) / 2
    assert seen == {*methods, *methods.values()}


def test_a_runs_delayed_step_takes_the_update_share_of_its_own_step_without_communication():
    # u_p: rank 0's seconds in step() over its seconds of whole steps, every timed step of
    # lamb-compute; without those records, the default
    (name, result), *_ = load_results([BENCH / "delayed-prediction"])
    blocks = [b for run in result["methods"]["lamb-compute"]["runs"] for b in run["blocks"]]
    update = sum(sum(b["rank0_optimizer_step_seconds"]) for b in blocks)
    share = update / sum(sum(b["rank0_step_seconds"]) for b in blocks)
    assert 0.05 < share < 0.5

    def delayed_step(result) -> float:
        predictions = validate([(name, result)], emulated_machine(Machine()))
        (delayed,) = [
            p.predicted
            for p in predictions
            if (p.method, p.stage) == ("onebit-lamb-delayed", "compression")
        ]
        return delayed

    unrecorded = json.loads(json.dumps(result))
    for run in unrecorded["methods"]["lamb-compute"]["runs"]:
        for block in run["blocks"]:
            del block["rank0_optimizer_step_seconds"]
    compute = result["summary"]["lamb-compute"]["stages"]["steady"]["step_seconds"]
    # the chain sets BERT-base's delayed step at 100 Mbit/s: it moves with u_p t_c
    assert name == "cluster-base-2w-100mbit"
    assert delayed_step(result) - delayed_step(unrecorded) == pytest.approx(
        (share - 0.17) * compute
    )


def test_the_stated_emulation_constants_are_the_fit():
    results = load_results([BENCH])
    machine = emulated_machine(Machine())
    fitted, misses, rms = fit_emulation(
        results, machine, latencies=(1e-3, 2e-3, 3e-3), burst_efficiencies=(0.6, 0.65, 0.7)
    )
    assert (fitted.latency, fitted.burst_efficiency) == (
        EMULATED_LATENCY,
        EMULATED_BURST_EFFICIENCY,
    )
    current = [(n, r) for n, r in results if "code" in r]
    assert misses == sum(not p.within_tolerance for p in validate(current, fitted))
    assert 0 < rms < 0.2


def test_calibration_measures_positive_throughputs_with_the_library_kernels():
    from onebit.bert_shapes import bert_shapes
    from onebit.estimate.calibration import calibrate

    shapes = bert_shapes(0.05)
    measured = calibrate(scale=0.05, repeats=3)
    assert measured["parameters"] == sum(math.prod(shape) for shape in shapes)
    assert measured["world_size"] == 2
    for key in ("compression_throughput", "host_throughput", "copy_throughput"):
        assert 0 < measured[key] < math.inf


@pytest.mark.parametrize(
    ("scale", "message"),
    [("0", "scale 0.0 leaves base's hidden width 768 below 1"), ("nan", "must be a finite")],
)
def test_a_width_scale_that_leaves_no_model_is_refused(scale, message, capsys):
    from onebit.bert_shapes import bert_shapes

    assert len(bert_shapes(0.5)) == len(bert_shapes(2.0))  # widths change, tensors do not
    assert bert_shapes(2.0)[0] == (30522, 1536)  # above 1 the widths grow
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "optimizer", "--scale", scale])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_step_times_on_one_device_without_a_process_group():
    from onebit.bert_shapes import bert_shapes
    from onebit.timing import optimizer_step_times

    measured = optimizer_step_times(bert_shapes(0.05), 2, device="cpu")
    assert measured["world_size"] == 1 and measured["dense_allreduce_s"] == 0.0
    assert measured["onebit_compression_step_s"] > measured["lamb_step_s"] > 0
    assert measured["onebit_delayed_compression_step_s"] > 0  # its exchange runs at once
    assert measured["onebit_compression_state_bytes"] > measured["lamb_state_bytes"] > 0


def test_a_saved_calibration_is_what_later_estimates_use(tmp_path, monkeypatch, capsys):
    from onebit.estimate import calibration

    monkeypatch.setenv("ONEBIT_CACHE", str(tmp_path))
    defaults = {
        "compression_throughput": COMPRESSION_THROUGHPUT,
        "host_throughput": HOST_THROUGHPUT,
        "copy_throughput": COPY_THROUGHPUT,
    }
    assert calibration.machine_constants() == (defaults, calibration.FALLBACK_SOURCE)
    args = ["estimate", "--model", "bert-base", "--nodes", "4", "--compute", "0.8"]
    assert main(args) == 0
    assert "measured on a 2-core CPU" in capsys.readouterr().out
    measured = {
        "device": "cuda",
        "measured_on": "cuda (triton kernels)",
        "measured_at": "2026-12-01 12:00:00",
        "compression_throughput": 2.3e10,
        "host_throughput": math.inf,
    }
    path = calibration.save_calibration(measured)
    assert path == tmp_path / "calibration-cuda.json"
    assert calibration.load_calibration("cuda") == measured  # inf survives JSON
    throughputs, source = calibration.machine_constants("cuda")
    # saved before the copy throughput was measured: the default, and the source says so
    assert throughputs == {
        **defaults,
        "compression_throughput": 2.3e10,
        "host_throughput": math.inf,
    }
    assert "2026-12-01 12:00:00" in source and "copy throughput: onebit's default" in source
    calibration.save_calibration({**measured, "copy_throughput": 9e11})
    assert calibration.machine_constants("cuda")[0]["copy_throughput"] == 9e11
    calibration.save_calibration(measured)
    assert main([*args, "--device", "cuda", "--json"]) == 0
    machine = json.loads(capsys.readouterr().out)["machine"]
    assert machine["compression_throughput"] == 2.3e10
    assert main([*args, "--device", "cuda", "--compression-throughput", "1e9"]) == 0
    assert "compression throughput 1 GB/s" in capsys.readouterr().out  # the option wins
    path.write_text("{not json")
    assert calibration.load_calibration("cuda") is None  # unreadable: the fallback
