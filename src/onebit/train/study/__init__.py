"""The convergence study: the same pre-training job under several optimizers and worker counts.

A study is a JSON file (docs/convergence/study.json) holding the shared settings of the job
(``train``: :class:`~onebit.train.config.TrainConfig` fields) and its *arms*, each an optimizer
at a number of data-parallel workers, run either as real processes (``runner: "train"``, what
``onebit train`` does) or simulated in one process (``runner: "simulate"``, what
``onebit simulate`` does)::

    {"train": {"steps": 800, "batch_size": 1024, ...},
     "arms": [{"name": "lamb", "optimizer": "lamb", "workers": 4, "runner": "train"},
              {"name": "onebit-lamb-n64", "optimizer": "onebit-lamb", "workers": 64,
               "runner": "simulate"},
              {"name": "onebit-adam-n4", "optimizer": "onebit-adam", "workers": 4,
               "runner": "train", "train": {"lr": 0.002}}]}

Every arm sees the same samples in the same order with the same masks and initial weights (the
data order depends on the step alone, never on the number of workers), at the same global
batch. :func:`run_study` runs the arms one after another in ``OUT/<name>/``: a finished arm is
skipped, an interrupted one continues from its newest checkpoint, and an arm whose optimizer or
runner this installation does not have yet is reported as pending and left for later.
:func:`write_study_report` writes the curves, a table per number of workers and the commands.
"""

from onebit.train.study.report import trajectory_difference, write_study_report
from onebit.train.study.runner import (
    arm_state,
    has_command,
    run_arm,
    run_downstream,
    run_study,
    unavailable_reason,
)
from onebit.train.study.schema import (
    FINISHED,
    NOT_STARTED,
    PARTIAL,
    UNAVAILABLE,
    Arm,
    Downstream,
    Study,
)

__all__ = [
    "FINISHED",
    "NOT_STARTED",
    "PARTIAL",
    "UNAVAILABLE",
    "Arm",
    "Downstream",
    "Study",
    "arm_state",
    "has_command",
    "run_arm",
    "run_downstream",
    "run_study",
    "trajectory_difference",
    "unavailable_reason",
    "write_study_report",
]
