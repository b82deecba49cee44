"""The settings of the downstream checks of a pre-trained model: fine-tuning
(:class:`FinetuneConfig`, ``onebit finetune``) and linear probing (:class:`ProbeConfig`,
``onebit probe``)."""

from __future__ import annotations

from dataclasses import dataclass

from onebit.cli import check_choice, check_positive_int_option, option
from onebit.optim.checks import check_non_negative, check_positive

#: The tasks of `onebit finetune` and `onebit probe`.
FINETUNE_TASKS = ("sentiment", "spelling", "replaced-letter")
#: The tasks labelled per token (the others: per sequence).
TOKEN_TASKS = ("replaced-letter",)
#: Training windows of the spelling task when ``max_train`` is not given.
SPELLING_TRAIN_WINDOWS = 10_000
#: AdamW's peak learning rate when fine-tuning, when ``lr`` is not given.
DEFAULT_FINETUNE_LR = 3e-4


@dataclass(frozen=True)
class FinetuneConfig:
    """Fine-tuning settings (the same for every pre-trained model that is compared); each
    field is also an option of ``onebit finetune``.

    The defaults come from the grid the BERT authors suggest for their small models (lr
    1e-4 to 3e-4, batch 8 to 128, a few epochs); they were not tuned on this task.
    """

    task: str = option(
        "sentiment",
        choices=FINETUNE_TASKS,
        help="sentiment: movie-review snippets, positive or negative; spelling: has one letter "
        "of a text window from the run's corpus been replaced (test windows from the documents "
        "held out of pre-training); replaced-letter: the same windows, each with one letter "
        "replaced, every token labelled replaced or not, scored by how often the token "
        "predicted most likely replaced is the replaced one",
    )
    epochs: int = option(3, help="epochs")
    lr: float = option(DEFAULT_FINETUNE_LR, help="AdamW peak learning rate")
    batch_size: int = option(32, help="batch size")
    dropout: float = option(0.1, help="dropout while fine-tuning")
    weight_decay: float = option(0.01, help="AdamW weight decay")
    seed: int = option(0, help="seed of the split, the classifier head and the order")
    max_train: int | None = option(
        None,
        help="use at most this many training examples",
        default_help=f"all for sentiment, {SPELLING_TRAIN_WINDOWS} for the others",
    )
    max_test: int | None = option(
        None, help="use at most this many test sentences", default_help="all"
    )
    from_scratch: bool = option(
        False,
        help="ignore the pre-trained weights (the no-pre-training baseline); writes "
        "finetune-scratch*.json",
    )

    @property
    def result_file(self) -> str:
        """``finetune[-scratch][-<task>][-lr<lr>][-seed<seed>].json``: the task named unless it
        is sentiment, the learning rate unless it is the default, the seed unless it is 0."""
        parts = ["finetune"]
        if self.from_scratch:
            parts.append("scratch")
        if self.task != "sentiment":
            parts.append(self.task)
        if self.lr != DEFAULT_FINETUNE_LR:
            parts.append(f"lr{self.lr:g}")
        if self.seed != 0:
            parts.append(f"seed{self.seed}")
        return "-".join(parts) + ".json"

    def __post_init__(self) -> None:
        check_choice("task", self.task, FINETUNE_TASKS)
        for name in ("epochs", "batch_size"):
            check_positive_int_option(name, getattr(self, name))
        for name in ("max_train", "max_test"):
            if getattr(self, name) is not None:
                check_positive_int_option(name, getattr(self, name))
        check_positive("--lr", self.lr)
        check_non_negative("--weight-decay", self.weight_decay)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")


#: The L2 penalty of a linear probe when ``l2`` is not given (on standardised features).
DEFAULT_PROBE_L2 = 1e-4
#: Versions of every test window (each with its own replaced letter) a probe scores.
DEFAULT_TEST_VARIANTS = 8


@dataclass
class ProbeConfig:
    """Linear-probe settings (the same for every model that is compared); each field is also
    an option of ``onebit probe``."""

    task: str = option(
        "replaced-letter",
        choices=FINETUNE_TASKS,
        help="the task of onebit finetune to probe: sentiment, spelling or replaced-letter",
    )
    seed: int = option(0, help="seed of the training sample and of the replaced letters")
    max_train: int | None = option(
        None,
        help="use at most this many training examples",
        default_help=f"all for sentiment, {SPELLING_TRAIN_WINDOWS} for the others",
    )
    test_variants: int | None = option(
        None,
        help="spelling tasks: score every test window this many times, each with its own "
        "replaced letter (standard errors treat the variants of a window as one cluster)",
        default_help=f"{DEFAULT_TEST_VARIANTS} for the spelling tasks, 1 for sentiment",
    )
    l2: float = option(DEFAULT_PROBE_L2, help="L2 penalty of the probe's weights")
    max_iter: int = option(200, help="L-BFGS iterations of the probe's fit")

    @property
    def result_file(self) -> str:
        """``probe-<task>[-seed<seed>].json``."""
        return f"probe-{self.task}" + (f"-seed{self.seed}" if self.seed else "") + ".json"

    def __post_init__(self) -> None:
        check_choice("task", self.task, FINETUNE_TASKS)
        check_positive_int_option("max_iter", self.max_iter)
        for name in ("max_train", "test_variants"):
            if getattr(self, name) is not None:
                check_positive_int_option(name, getattr(self, name))
        check_non_negative("--l2", self.l2)
        if self.task == "sentiment":
            if self.test_variants not in (None, 1):
                raise ValueError(
                    "--test-variants applies to the spelling tasks: sentiment's test set has "
                    f"one version of each text, got {self.test_variants}"
                )
            self.test_variants = 1
        elif self.test_variants is None:
            self.test_variants = DEFAULT_TEST_VARIANTS
