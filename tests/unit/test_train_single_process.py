"""``onebit train`` without a run: its options and their errors, the run folder's checks, the
defaults and schedules, atomic writes, checkpoint rotation and fallback, subnormals, a legacy
run folder's options."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from onebit.atomic import atomic_path, write_json_atomic
from onebit.cli import build_parser, given_options
from onebit.cli import main as onebit_main
from onebit.train import checkpoint
from onebit.train.config import SIMULATION_OPTIONS, TrainConfig
from onebit.train.job_data import lr_factor, step_seed, tensors_digest
from onebit.train.run_dir import prepare_run_dir


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fsdp"], "--fsdp shards over the workers of a node: give --node-size L > 1"),
        (["--fsdp", "--optimizer", "adam"], "--fsdp trains lamb, onebit-lamb, onebit-adam"),
        (
            ["--fsdp", "--node-size", "2", "--overlap-backward", "--grad-clip", "0"],
            "--overlap-backward is not offered with --fsdp",
        ),
        (["--steps", "0"], "--steps must be a positive integer"),
        (["--steps", "10", "--freeze-step", "11"], "--freeze-step must be in [1, --steps=10]"),
        (["--hidden", "30", "--heads", "4"], "--hidden 30 must be divisible by --heads 4"),
        (["--lr", "-1"], "Invalid --lr=-1.0: it must be > 0"),
        (["--eps", "0"], "Invalid --eps=0.0: it must be > 0"),
        (["--min-coeff", "0.5"], "min_coeff=0.5 > max_coeff=0.3"),
        (["--factor-min", "5"], "factor_min=5.0 > factor_max=4.0"),
        (["--coeff-beta", "1"], "Invalid --coeff-beta=1.0: it must be in [0, 1)"),
        (["--trust-bound", "0"], "Invalid --trust-bound=0.0: it must be > 0"),
        (
            ["--trust-bound", "1", "--optimizer", "onebit-adam"],
            "--trust-bound bounds onebit-lamb's compression steps, not onebit-adam's",
        ),
        (
            ["--momentum-bound", "--optimizer", "lamb"],
            "--momentum-bound bounds onebit-lamb's exchanged momentum, not lamb's",
        ),
        (
            ["--momentum-bound", "--betas", "0.9", "0.8"],
            "momentum_bound needs betas with beta1**2 < beta2",
        ),
        # the bound is onebit-lamb's default
        (["--betas", "0.9", "0.8"], "pass momentum_bound=False"),
        (["--betas", "0.9", "1.0"], "Invalid betas[1]=1.0: it must be in [0, 1)"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda"),
        (["--batch-size", "10", "--workers", "4"], "--batch-size 10 (global) is not divisible"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--workers", "4", "--node-size", "3"], "--node-size 3 does not divide --workers 4"),
        (["--node-size", "0"], "--node-size must be a positive integer"),
        (["--no-launch"], "needs torchrun's environment variables; ['RANK'"),
        (
            ["--bucket-cap-mb", "0"],
            "Invalid --bucket-cap-mb=0.0: it must be a finite number of MiB > 0",
        ),
        (
            ["--optimizer", "lamb", "--bucket-cap-mb", "1"],
            "--bucket-cap-mb buckets the flat exchange of onebit-lamb and onebit-adam",
        ),
        (["--overlap-backward"], "add --grad-clip 0"),
        (
            ["--overlap-backward", "--grad-clip", "0", "--workers", "4", "--node-size", "2"],
            "--overlap-backward buckets the flat exchange",
        ),
        (["--optimizer", "lamb", "--delayed-exchange"], "not of lamb"),
        (
            ["--delayed-exchange", "--overlap-backward", "--grad-clip", "0"],
            "--delayed-exchange is not offered with --overlap-backward",
        ),
        (
            ["--corpus", "/nonexistent/corpus.txt"],
            "--corpus /nonexistent/corpus.txt does not exist",
        ),
        (
            ["--steps", "50", "--lr-warmup-steps", "50"],
            "--lr-warmup-steps must be in [0, --steps=50)",
        ),
        (["--sync-every", "10"], "--optimizer lamb or adam, not onebit-lamb"),
        (["--optimizer", "adam", "--sync-every", "0"], "--sync-every must be a positive integer"),
        (
            ["--optimizer", "lamb", "--sync-every", "10", "--powersgd-rank", "2"],
            "--sync-every (DiLoCo) is not offered with --powersgd-rank",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-lr", "0"],
            "Invalid --outer-lr=0.0: it must be > 0",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-momentum", "1"],
            "Invalid --outer-momentum=1.0: it must be in [0, 1)",
        ),
        (["--optimizer", "adam", "--fragments", "2"], "--fragments is an option of DiLoCo"),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--fragments", "2"],
            "--sync-every 5 must be a multiple of --fragments 2",
        ),
        (
            [
                "--optimizer",
                "adam",
                "--sync-every",
                "6",
                "--fragments",
                "2",
                "--fragment-delay",
                "3",
            ],
            "--fragment-delay must be in [0, 3)",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "6", "--local-share", "1.5"],
            "Invalid --local-share=1.5: it must be in [0, 1]",
        ),
        (
            ["--optimizer", "adam", "--outer-implementation", "torchft"],
            "--outer-implementation is an option of DiLoCo: give --sync-every too",
        ),
        (
            ["--optimizer", "adam", "--worker-residual", "local"],
            "--worker-residual is an option of DiLoCo: give --sync-every too",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-exchange", "dense"]
            + ["--worker-residual", "local"],
            "--worker-residual local places the 1-bit exchange's residual: give --outer-exchange",
        ),
        (
            ["--optimizer", "adam", "--outer-block-size", "128"],
            "--outer-block-size is an option of DiLoCo: give --sync-every too",
        ),
        (
            ["--optimizer", "adam", "--deliver-errors"],
            "--deliver-errors is an option of DiLoCo: give --sync-every too",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-exchange", "dense"]
            + ["--deliver-errors"],
            "--deliver-errors delivers what the 1-bit outer exchange has not: give",
        ),
        (
            ["--optimizer", "adam", "--outer-reference-share", "0.5"],
            "--outer-reference-share is an option of DiLoCo: give --sync-every too",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-reference-share", "1.5"],
            "Invalid --outer-reference-share=1.5: it must be in [0, 1]",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-exchange", "dense"]
            + ["--outer-reference-share", "0.5"],
            "--outer-reference-share takes the last round's average out of the 1-bit outer",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-block-size", "100"],
            "--outer-block-size sets the blocks of the 1-bit outer exchange: a multiple of 8",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-exchange", "dense"]
            + ["--outer-block-size", "128"],
            "got 128 with --outer-exchange dense",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "5", "--outer-implementation", "torchft"],
            "it takes --outer-exchange dense and not --outer-exchange 1bit",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "6", "--outer-exchange", "dense"]
            + ["--fragments", "2", "--outer-implementation", "torchft"],
            "it takes --outer-exchange dense and not --fragments",
        ),
        (
            ["--optimizer", "adam", "--sync-every", "7", "--outer-exchange", "dense"]
            + ["--steps", "20", "--outer-implementation", "torchft"],
            "--steps 20 must be a multiple of --sync-every 7",
        ),
    ],
)
def test_bad_options_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert onebit_main(["train", "--out", str(tmp_path / "run"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_momentum_bound_is_on_with_onebit_lamb_unless_given() -> None:
    def bound(*args: str) -> bool:
        parsed = build_parser().parse_args(["train", *args])
        return TrainConfig(**given_options(TrainConfig, parsed)).resolved().momentum_bound

    assert bound() is True
    assert bound("--no-momentum-bound") is False
    assert bound("--no-momentum-bound", "--betas", "0.9", "0.8") is False
    for optimizer in ("lamb", "onebit-adam", "zero-one-adam", "adam"):
        assert bound("--optimizer", optimizer) is False


def test_torchft_missing_is_named_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "torchft" else find_spec(name)
    )
    args = ["--optimizer", "adam", "--sync-every", "5", "--outer-exchange", "dense"]
    out = str(tmp_path / "run")
    assert onebit_main(["train", "--out", out, *args, "--outer-implementation", "torchft"]) == 2
    assert "--outer-implementation torchft: torchft is not installed" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_simulations_prediction_oracle_is_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--delayed-prediction`` is an option of ``onebit simulate --delayed-exchange`` only."""
    out = str(tmp_path / "run")
    assert onebit_main(["simulate", "--out", out, "--delayed-prediction", "mean"]) == 2
    assert "--delayed-prediction mean chooses the predictions of --delayed-exchange: add it" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        onebit_main(["train", "--out", out, "--delayed-prediction", "mean"])
    assert "unrecognized arguments: --delayed-prediction" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_run_folder_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert onebit_main(["train", "--no-launch"]) == 2
    assert "--no-launch needs --out" in capsys.readouterr().err
    assert onebit_main(["train", "--resume", str(tmp_path)]) == 2
    assert "is not a run folder: config.json is missing" in capsys.readouterr().err
    prepare_run_dir(tmp_path / "run", TrainConfig().resolved(), {})
    assert onebit_main(["train", "--resume", str(tmp_path / "run"), "--lr", "1"]) == 2
    assert "drop ['--lr']" in capsys.readouterr().err
    assert onebit_main(["train", "--out", str(tmp_path / "run"), "--steps", "50"]) == 2
    assert "holds a run with another configuration" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert onebit_main(["train", "--out", str(tmp_path / "other")]) == 2
    assert "exists and is not a run folder" in capsys.readouterr().err


def test_every_config_field_is_an_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert given_options(TrainConfig, parser.parse_args(["train"])) == {}
    argv = [
        "train", "--optimizer", "lamb", "--steps", "7", "--betas", "0.8", "0.9", "--no-ddp",
        "--corpus", "a.txt", "b.txt", "--lr", "0.5",
    ]  # fmt: skip
    assert given_options(TrainConfig, parser.parse_args(argv)) == {
        "optimizer": "lamb",
        "steps": 7,
        "betas": (0.8, 0.9),
        "ddp": False,
        "corpus": ["a.txt", "b.txt"],
        "lr": 0.5,
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(TrainConfig):  # but the simulated workers' own
        if field.name not in SIMULATION_OPTIONS:
            assert f"--{field.name.replace('_', '-')} " in help_text
    assert "(default: 20% of --steps)" in help_text and "(default: --ddp)" in help_text


def test_defaults_resolve_from_steps() -> None:
    config = TrainConfig(steps=1000).resolved()
    assert (config.freeze_step, config.lr_warmup_steps) == (200, 100)
    assert (config.eval_every, config.checkpoint_every) == (100, 250)
    assert TrainConfig(optimizer="lamb", steps=3).resolved().freeze_step == 1


def test_lr_schedule_and_seeds() -> None:
    factors = [lr_factor(i, 4, 12) for i in range(12)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4:] == sorted(factors[4:], reverse=True) and 0 < factors[-1] < 0.2
    assert lr_factor(0, 0, 10) == 1.0
    assert step_seed(0, 1) != step_seed(0, 2) != step_seed(1, 1)
    assert step_seed(0, 1, 0) != step_seed(0, 1, 1) and step_seed(3, 4) == step_seed(3, 4)


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    path = tmp_path / "run" / "config.json"
    write_json_atomic(path, {"steps": 1})
    with pytest.raises(OSError), atomic_path(path) as tmp:
        tmp.write_text('{"ste')
        raise OSError("disk full")
    assert json.loads(path.read_text()) == {"steps": 1}
    assert [p.name for p in path.parent.iterdir()] == ["config.json"]  # no temporary file left


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    # Port 0: the store binds a free port itself (nothing else needs to find it).
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_checkpoint_rotation_and_fallback(
    tmp_path: Path, single_rank_group: None, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        state = {"w": torch.full((4,), float(step))}
        checkpoint.save(root, step, {"model": state}, {"opt": state}, keep=2)
    assert checkpoint.complete_steps(root) == [3, 2]
    assert not (root / "step-00000001").exists()
    (root / "step-00000004").mkdir()  # an incomplete checkpoint (no manifest) is ignored
    (root / "step-00000004" / "model.pt").write_bytes(b"partial")
    assert checkpoint.load_latest(root).step == 3

    model = root / "step-00000003" / "model.pt"
    payload = bytearray(model.read_bytes())
    payload[len(payload) // 2] ^= 0xFF  # a flipped bit, same length
    model.write_bytes(bytes(payload))
    loaded = checkpoint.load_latest(root)
    assert loaded.step == 2 and torch.equal(loaded.model["model"]["w"], torch.full((4,), 2.0))
    assert "model.pt is truncated or corrupt" in caplog.text
    assert "trying the previous one" in caplog.text
    assert checkpoint.latest_model_state(root)[0] == 2

    for step_dir in root.iterdir():
        (step_dir / "model.pt").unlink(missing_ok=True)
    assert checkpoint.load_latest(root) is None
    with pytest.raises(FileNotFoundError, match="no usable checkpoint"):
        checkpoint.latest_model_state(root)


def test_training_on_the_cpu_flushes_subnormals_and_restores_them_after():
    from onebit.train.trainer import _subnormals_flushed

    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormal floats")
    torch.set_flush_denormal(False)
    tiny = torch.tensor([1e-30], dtype=torch.float32)
    assert (tiny * 1e-10).item() > 0  # a subnormal result
    with _subnormals_flushed(torch.device("cpu")):
        assert (tiny * 1e-10).item() == 0
    assert (tiny * 1e-10).item() > 0


def test_legacy_compression_option_of_a_run_folder_reads_as_what_it_ran(tmp_path: Path):
    from onebit.train.run_dir import read_config

    for optimizer, saved, now in (("onebit-lamb", None, "fused"), ("onebit-adam", None, None)):
        train = {**TrainConfig(optimizer=optimizer).to_json(), "onebit_adam_compression": saved}
        del train["compression"]
        write_json_atomic(tmp_path / "config.json", {"train": train, "launch": {}})
        assert read_config(tmp_path).compression == now


def test_a_run_folder_from_before_the_momentum_bound_continues_without_it(tmp_path: Path):
    from onebit.train.run_dir import read_config

    train = TrainConfig().resolved().to_json()
    assert train["momentum_bound"] is True
    write_json_atomic(tmp_path / "config.json", {"train": train, "launch": {}})
    assert read_config(tmp_path).momentum_bound is True
    del train["momentum_bound"]
    write_json_atomic(tmp_path / "config.json", {"train": train, "launch": {}})
    assert read_config(tmp_path).resolved().momentum_bound is False


def test_a_diloco_run_folder_from_before_the_local_default_continues_carried(tmp_path: Path):
    from onebit.train.run_dir import read_config

    def saved(**train) -> TrainConfig:
        write_json_atomic(tmp_path / "config.json", {"train": train, "launch": {}})
        return read_config(tmp_path).resolved()

    diloco = TrainConfig(optimizer="adam", sync_every=5).resolved().to_json()
    assert diloco["worker_residual"] == "local"
    assert saved(**diloco).worker_residual == "local"
    del diloco["worker_residual"]  # saved before the option existed: carried
    assert saved(**diloco).worker_residual == "carried"
    plain = TrainConfig(optimizer="adam").resolved().to_json() | {"worker_residual": "carried"}
    assert saved(**plain).worker_residual is None  # recorded by every run while the default


def test_tensors_digest_is_sha256_of_the_values_in_order() -> None:
    a = torch.tensor([1.0, -2.5], dtype=torch.float32)
    b = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()  # not contiguous
    expected = hashlib.sha256(a.numpy().tobytes() + b.contiguous().numpy().tobytes())
    assert tensors_digest([a, b]) == expected.hexdigest()[:16]
    assert tensors_digest([b, a]) != tensors_digest([a, b])
    nudged = a.clone()
    nudged[1] = torch.nextafter(a[1], torch.tensor(0.0))
    assert tensors_digest([nudged, b]) != tensors_digest([a, b])
