"""``onebit study run|report|finetune|diff``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from onebit.train.study.report import (
    trajectory_difference,
    write_study_report,
)
from onebit.train.study.runner import (
    run_downstream,
    run_study,
)
from onebit.train.study.schema import (
    DEFAULT_OUT,
    DEFAULT_SPEC,
    FINISHED,
    UNAVAILABLE,
    Study,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``onebit study run|report|finetune|diff``."""
    from onebit.train import study as package

    study = subparsers.add_parser(
        "study",
        help="the convergence study, resumable, and its report",
        description=package.__doc__.split("\n\n")[0],
    )
    commands = study.add_subparsers(dest="study_command", required=True, metavar="STUDY")
    for name, handler, help_text in (
        ("run", _run, "run the arms one after another (finished ones are skipped, interrupted "
         "ones continue), then write the report"),
        ("report", _report, "write the report of the arms run so far"),
        ("finetune", _finetune, "the downstream check: fine-tune every finished arm's model and "
         "one without pre-training with each of the study's seeds (results already written are "
         "kept), then write the report"),
    ):  # fmt: skip
        parser = commands.add_parser(name, help=help_text, description=help_text)
        parser.add_argument(
            "--spec",
            type=Path,
            default=DEFAULT_SPEC,
            help=f"the study file (default: {DEFAULT_SPEC})",
        )
        parser.add_argument(
            "--out",
            type=Path,
            default=DEFAULT_OUT,
            help=f"the arms' run folders (default: {DEFAULT_OUT})",
        )
        parser.add_argument(
            "--report-dir",
            type=Path,
            help="where the report and copies of the arms' metrics go (default: --out)",
        )
        parser.set_defaults(handler=handler)
        if name == "run":
            parser.add_argument(
                "--arms", nargs="+", metavar="NAME", help="only these arms (default: all)"
            )
            parser.add_argument(
                "--max-restarts",
                type=int,
                default=0,
                help="restarts of a failed real-process arm (default: 0)",
            )
    diff = commands.add_parser(
        "diff",
        help="largest relative difference of two runs' train and validation losses",
        description="Compare two runs' per-step train losses and validation losses (e.g. LAMB "
        "at 1 and at 4 workers, whose update does not depend on the number of workers).",
    )
    diff.add_argument("run_a", type=Path)
    diff.add_argument("run_b", type=Path)
    diff.set_defaults(handler=_diff)


def _report_of(args: argparse.Namespace, study: Study) -> int:
    path = write_study_report(study, args.out, args.report_dir)
    print(path.read_text())
    return 0


def _run(args: argparse.Namespace) -> int:
    try:
        study = Study.read(args.spec)
        states = run_study(study, args.out, arms=args.arms, max_restarts=args.max_restarts)
    except (ValueError, FileNotFoundError) as exc:
        print(f"onebit study run: error: {exc}", file=sys.stderr)
        return 2
    _report_of(args, study)
    return 0 if all(state in (FINISHED, UNAVAILABLE) for state in states.values()) else 1


def _report(args: argparse.Namespace) -> int:
    try:
        return _report_of(args, Study.read(args.spec))
    except (ValueError, FileNotFoundError) as exc:
        print(f"onebit study report: error: {exc}", file=sys.stderr)
        return 2


def _finetune(args: argparse.Namespace) -> int:
    try:
        study = Study.read(args.spec)
        run_downstream(study, args.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"onebit study finetune: error: {exc}", file=sys.stderr)
        return 2
    return _report_of(args, study)


def _diff(args: argparse.Namespace) -> int:
    try:
        result = trajectory_difference(args.run_a, args.run_b)
    except (ValueError, FileNotFoundError) as exc:
        print(f"onebit study diff: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0
