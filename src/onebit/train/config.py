"""One training job's configuration (:class:`TrainConfig`: every option of ``onebit train``),
its defaults and its validation; its run folder: :mod:`onebit.train.run_dir`; fine-tuning's
and probing's: :mod:`onebit.train.downstream_config`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from onebit.cli import check_choice, check_positive_int_option, int_or_auto, option
from onebit.diloco import EXCHANGES as DILOCO_EXCHANGES
from onebit.diloco import OUTER_DEFAULTS, RESIDUAL_DEFAULTS, WORKER_RESIDUALS
from onebit.optim import AUTO, COMPRESSIONS, registry
from onebit.optim.checks import (
    check_betas,
    check_coeff_bounds,
    check_factor_bounds,
    check_momentum_bound,
    check_non_negative,
    check_positive,
    check_unit_interval,
)
from onebit.optim.zero_one_adam import PRE_FREEZE_EXCHANGES
from onebit.simulate import PREDICTIONS
from onebit.train.exchange_options import check_exchange_options
from onebit.train.torchft_diloco import IMPLEMENTATIONS as DILOCO_IMPLEMENTATIONS

#: The encoder architectures of :mod:`onebit.train.model` (kept here, where the options are
#: declared, so that ``onebit --help`` imports no ``transformers``).
ARCHITECTURES = ("bert", "roformer")
#: The optimizers of the job (:data:`onebit.optim.registry.OPTIMIZERS`), and those of them
#: that exchange at 1 bit.
OPTIMIZERS = tuple(registry.OPTIMIZERS)
ONEBIT_OPTIMIZERS = tuple(name for name, spec in registry.OPTIMIZERS.items() if spec.compresses)
ZERO_ONE_ADAM = "zero-one-adam"
BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")

#: Options that choose how worker processes communicate (``onebit simulate`` has none).
REAL_WORKER_OPTIONS = (
    "ddp",
    "backend",
    "timeout",
    "powersgd_rank",
    "fsdp",
    "outer_implementation",
)

#: 1-bit LAMB's optional bounds (off: ``None`` or ``False``) and what each bounds; another
#: optimizer refuses them by name.
_ONEBIT_LAMB_BOUNDS = {"trust_bound": "compression steps", "momentum_bound": "exchanged momentum"}

#: Options of the simulated workers alone (``onebit train`` has none).
SIMULATION_OPTIONS = ("delayed_prediction",)

#: Peak learning rates when ``lr`` is not given (each optimizer's ``default_lr``).
DEFAULT_LAMB_LR = registry.OPTIMIZERS["lamb"].default_lr
DEFAULT_ADAM_LR = registry.OPTIMIZERS["adam"].default_lr
#: Fraction of the steps spent in the warm-up stage when ``freeze_step`` is not given: 20 %,
#: the paper's share, at which the main job's 1000 steps of 64 sequences end 0.75 % below
#: LAMB with 4.44x fewer bytes (CONVERGENCE.md, "The main job"; VARIANCE-READINESS.md, "A
#: longer compression stage": in 250 steps of 256 the attention's variance still grew after
#: a freeze at 20 %).
DEFAULT_FREEZE_FRACTION = 0.2
#: 0/1 Adam's local interval doubles this many times over the steps after the variance freeze
#: when ``local_step_scaler`` is not given (DeepSpeed's 32678 suits runs of 10^5 steps).
DEFAULT_LOCAL_INTERVAL_DOUBLINGS = 8
#: Fraction of the steps with a linearly rising learning rate when ``lr_warmup_steps`` is not given.
DEFAULT_LR_WARMUP_FRACTION = 0.1
#: Number of validation points and checkpoints of a run when their interval is not given.
DEFAULT_EVALS = 10
DEFAULT_CHECKPOINTS = 4


_JOB = "job"
_MODEL = "model"
_HYPER = "optimizer hyper-parameters (defaults: the 1-bit LAMB paper's BERT settings)"
_SYSTEM = "system"


def _outer_default(setting: str) -> str:
    """The help's default of an outer SGD ``setting``: each outer exchange's own."""
    dense, one_bit = (OUTER_DEFAULTS[x][setting] for x in ("dense", "1bit"))
    return f"{dense:g} with --outer-exchange dense (DiLoCo's), {one_bit:g} with 1bit"


@dataclass
class TrainConfig:
    """Everything that determines a training run's trajectory (and so must match on resume).

    Each field is also an option of ``onebit train`` (``--field-name``). ``lr`` (per optimizer
    family), ``freeze_step``, ``lr_warmup_steps``, ``eval_every`` and ``checkpoint_every``
    (from ``steps``), ``outer_lr`` and ``outer_momentum`` (from ``outer_exchange``) may be
    left ``None``; :meth:`resolved` fills them in.
    """

    optimizer: str = option(
        "onebit-lamb",
        group=_JOB,
        choices=OPTIMIZERS,
        help="onebit-lamb and onebit-adam compress after --freeze-step; zero-one-adam (0/1 "
        "Adam) averages gradients densely on a few steps, at 1 bit on the others up to "
        "--var-freeze-step, then takes local steps; lamb and adam (AdamW) average gradients "
        "with a dense allreduce",
    )
    steps: int = option(1000, group=_JOB, help="optimizer steps")
    batch_size: int = option(
        64, group=_JOB, help="global batch in sequences, split evenly over the workers"
    )
    lr: float | None = option(
        None,
        group=_JOB,
        help="peak learning rate",
        default_help=f"{DEFAULT_LAMB_LR} for lamb and onebit-lamb, {DEFAULT_ADAM_LR} for adam, "
        "onebit-adam and zero-one-adam",
    )
    freeze_step: int | str | None = option(
        None,
        group=_JOB,
        parse=int_or_auto,
        help="warm-up (uncompressed) steps of the 1-bit optimizers; onebit-lamb and onebit-adam: "
        "auto, until the variance has caught up with the gradients (at most --steps)",
        default_help=f"{DEFAULT_FREEZE_FRACTION:.0%} of --steps",
    )
    variance_guard: str = option(
        "refresh",
        group=_JOB,
        choices=("refresh", "warn", "off"),
        help="onebit-lamb, onebit-adam and zero-one-adam: what a growth of the momentum "
        "against the frozen variance does after the freeze: dense steps until it has caught "
        "up (refresh), a warning, or nothing",
    )
    lr_warmup_steps: int | None = option(
        None,
        group=_JOB,
        help="steps of linear LR warm-up, followed by linear decay to 0 at --steps, the same "
        "for every optimizer",
        default_help=f"{DEFAULT_LR_WARMUP_FRACTION:.0%} of --steps",
    )
    seq_len: int = option(64, group=_MODEL, help="tokens per sequence")
    layers: int = option(2, group=_MODEL, help="BERT layers")
    hidden: int = option(128, group=_MODEL, help="hidden size")
    heads: int = option(4, group=_MODEL, help="attention heads")
    vocab_size: int = option(512, group=_MODEL, help="WordPiece vocabulary")
    dropout: float = option(0.0, group=_MODEL, help="dropout")
    architecture: str = option(
        "roformer",
        group=_MODEL,
        choices=ARCHITECTURES,
        help="bert: learned absolute position embeddings; roformer: the same encoder with "
        "rotary position embeddings (learns to attend to neighbouring tokens far sooner)",
    )
    seed: int = option(0, group=_JOB, help="seed of weights, data order, masking")
    corpus: list[str] | None = option(
        None,
        group=_JOB,
        metavar="PATH",
        help="your own .txt files or folders of them instead of the built-in corpus",
        default_help="the Wikipedia sample and Shakespeare",
    )
    betas: tuple[float, float] = option(
        (0.9, 0.999), group=_HYPER, metavar=("B1", "B2"), help="Adam betas"
    )
    eps: float = option(1e-8, group=_HYPER, help="Adam epsilon")
    weight_decay: float = option(
        registry.PAPER_BERT_SETTINGS["weight_decay"], group=_HYPER, help="decoupled weight decay"
    )
    max_coeff: float = option(
        registry.PAPER_BERT_SETTINGS["max_coeff"], group=_HYPER, help="LAMB trust-ratio upper bound"
    )
    min_coeff: float = option(
        registry.PAPER_BERT_SETTINGS["min_coeff"], group=_HYPER, help="LAMB trust-ratio lower bound"
    )
    coeff_beta: float = option(
        0.9, group=_HYPER, help="1-bit LAMB: EMA factor of the frozen trust ratio"
    )
    factor_max: float = option(
        4.0, group=_HYPER, help="1-bit LAMB: upper bound of the compression-stage factor"
    )
    factor_min: float = option(
        0.5, group=_HYPER, help="1-bit LAMB: lower bound of the compression-stage factor"
    )
    factor_threshold: float = option(
        0.1, group=_HYPER, help="1-bit LAMB: largest relative change of the factor per step"
    )
    trust_bound: float | None = option(
        None,
        group=_HYPER,
        help="1-bit LAMB: let a compression step grow at most this many times against the "
        "weights over the stage (ALGORITHM.md, 'A bound on the frozen coefficient')",
        default_help="none, the paper's",
    )
    momentum_bound: bool | None = option(
        None,
        group=_HYPER,
        help="1-bit LAMB: clamp each element's exchanged momentum to Adam's largest "
        "|m| / sqrt(v) (ALGORITHM.md, 'A bound on each element's momentum'); "
        "--no-momentum-bound: the paper's unbounded exchange",
        default_help="on with onebit-lamb",
    )
    compression: str | None = option(
        None,
        group=_HYPER,
        choices=COMPRESSIONS,
        help="1-bit LAMB and 1-bit Adam: how the momentum is exchanged: per_tensor (each tensor "
        "compressed alone) or fused (DeepSpeed's 1-bit LAMB: one buffer of all tensors, scaled "
        "per tensor)",
        default_help="per_tensor",
    )
    var_freeze_step: int | str | None = option(
        None,
        group=_HYPER,
        parse=int_or_auto,
        help="0/1 Adam: the last step that may update the variance, or auto (once the variance "
        "has caught up with the gradients, at most --steps)",
        default_help="--freeze-step",
    )
    var_update_scaler: int = option(
        16, group=_HYPER, help="0/1 Adam: variance updates at each interval before it doubles"
    )
    local_step_scaler: int | None = option(
        None,
        group=_HYPER,
        help="0/1 Adam: steps after the variance freeze at each local interval before it doubles",
        default_help=f"the steps after --var-freeze-step / {DEFAULT_LOCAL_INTERVAL_DOUBLINGS} "
        "(--steps / 8 with --var-freeze-step auto)",
    )
    local_step_clipper: int = option(16, group=_HYPER, help="0/1 Adam: the longest local interval")
    pre_freeze_exchange: str = option(
        "momentum",
        group=_HYPER,
        choices=PRE_FREEZE_EXCHANGES,
        help="0/1 Adam: what the 1-bit steps before the variance freeze exchange: momentum "
        "(the paper's: each worker's own momentum step, synchronised at 1 bit as after the "
        "freeze) or gradient (DeepSpeed's)",
    )
    var_warmup_steps: int | str = option(
        AUTO,
        group=_HYPER,
        parse=int_or_auto,
        help="0/1 Adam: the first steps, each a variance update, before the schedule spaces "
        "them: auto (until the variance has caught up) or a number (DeepSpeed's: 16)",
    )
    grad_clip: float = option(
        1.0,
        group=_HYPER,
        help="clip the gradient norm before each step, 0 = off: the averaged gradient in "
        "uncompressed steps, each worker's own at this times sqrt(workers) in the others",
    )
    ddp: bool = option(
        True,
        group=_SYSTEM,
        help="wrap the model in DistributedDataParallel (the 1-bit optimizers register onebit's "
        "comm hook; with --sync-every, DDP inside each node of --node-size workers); "
        "--no-ddp: the job averages the gradients of dense steps itself, in one allreduce",
    )
    node_size: int = option(
        1,
        group=_SYSTEM,
        help="workers per node (consecutive ranks) for the hierarchical 1-bit exchange: "
        "dense averaging inside a node, 1-bit only between nodes; with --sync-every, DiLoCo's "
        "workers are the nodes; must divide the number of workers; 1 = the flat exchange "
        "(the dense optimizers ignore it)",
    )
    fsdp: bool = option(
        False,
        group=_SYSTEM,
        help="shard parameters, gradients and optimizer state with FSDP2 (fully_shard) over "
        "the --node-size workers of each node, replicated across nodes (HSDP), in place of "
        "DDP: onebit-lamb and onebit-adam exchange each slice's momentum between nodes at 1 "
        "bit; lamb runs FSDP's own HSDP (a dense allreduce between nodes); checkpoints "
        "through torch.distributed.checkpoint",
    )
    bucket_cap_mb: float | None = option(
        None,
        group=_SYSTEM,
        help="1-bit LAMB / 1-bit Adam (flat exchange): exchange the momentum in buckets "
        "of this many MiB, each compressed alone, their phases pipelined",
        default_help="the whole buffer at once (25 with --overlap-backward)",
    )
    overlap_backward: bool = option(
        False,
        group=_SYSTEM,
        help="1-bit LAMB / 1-bit Adam (flat exchange): start each bucket's exchange "
        "during backward, as soon as its gradients are in (needs --grad-clip 0)",
    )
    delayed_exchange: bool = option(
        False,
        group=_SYSTEM,
        help="1-bit LAMB / 1-bit Adam: run each compression step's exchange behind the next "
        "step's forward and backward and apply its update there, one step late (not with "
        "--overlap-backward, --node-size > 1 or --fsdp)",
    )
    delayed_prediction: str = option(
        "own",
        group=_SYSTEM,
        choices=PREDICTIONS,
        help="onebit simulate --delayed-exchange: the momentum each worker's prediction is "
        "made from: its own (what real workers do), or the mean of the workers' (an oracle no "
        "real worker has, to measure what their differences cost)",
    )
    powersgd_rank: int = option(
        0,
        group=_SYSTEM,
        help="lamb and adam under DDP: average the gradients with torch's PowerSGD comm hook "
        "of this rank (error feedback, warm start, dense for the first 2 steps; one bucket) "
        "instead of the dense allreduce; 0 = off",
    )
    sync_every: int | None = option(
        None,
        group=_SYSTEM,
        help="DiLoCo (onebit.DiLoCo) over --optimizer lamb or adam as the inner optimizer: "
        "each worker (with --node-size L > 1: each node of L workers, DDP inside it) takes "
        "this many steps on its own gradients (nothing sent between nodes), then the workers "
        "(nodes) average how far they moved (the pseudo-gradient) through --outer-exchange "
        "and an outer SGD (--outer-lr, --outer-momentum) steps from the round's start; "
        "validation reads the last round's weights",
        default_help="off",
    )
    outer_exchange: str = option(
        "1bit",
        group=_SYSTEM,
        choices=DILOCO_EXCHANGES,
        help="with --sync-every: the pseudo-gradients' exchange, 1-bit per tensor with error "
        "feedback kept from round to round, or a dense mean allreduce",
    )
    outer_implementation: str = option(
        "onebit",
        group=_SYSTEM,
        choices=DILOCO_IMPLEMENTATIONS,
        help="with --sync-every: who runs DiLoCo's rounds, onebit.DiLoCo or, as its peer, "
        "torchft's DiLoCo (dense exchange, whole rounds, no resume; needs torchft)",
    )
    outer_lr: float | None = option(
        None,
        group=_SYSTEM,
        help="with --sync-every: the outer SGD's learning rate",
        default_help=_outer_default("lr"),
    )
    outer_momentum: float | None = option(
        None,
        group=_SYSTEM,
        help="with --sync-every: the outer SGD's Nesterov momentum (0: plain SGD)",
        default_help=_outer_default("momentum"),
    )
    fragments: int = option(
        1,
        group=_SYSTEM,
        help="with --sync-every: Streaming DiLoCo's fragments, runs of consecutive parameters "
        "of about equal size that take turns, one exchanged every --sync-every/--fragments "
        "steps",
    )
    fragment_delay: int = option(
        0,
        group=_SYSTEM,
        help="with --sync-every: inner steps each fragment's outer exchange runs behind, "
        "started that many steps before its outer step (less than --sync-every/--fragments)",
    )
    local_share: float = option(
        0.0,
        group=_SYSTEM,
        help="with --fragment-delay: the share of its own move during the delay each worker "
        "keeps at the fragment's outer step (0: the outer step's result alone)",
    )
    worker_residual: str | None = option(
        None,
        group=_SYSTEM,
        choices=WORKER_RESIDUALS,
        help="with --sync-every and --outer-exchange 1bit: where each worker's residual of the "
        "compression goes: carried into its next round's message (error feedback), or local, "
        "also into its own weights at once, as far as the outer step would move them",
        default_help="local with --outer-exchange 1bit, carried with dense (no residual)",
    )
    outer_block_size: int | None = option(
        None,
        group=_SYSTEM,
        help="with --sync-every and --outer-exchange 1bit: elements to each server scale of "
        "the 1-bit exchange, each tensor compressed in blocks of this many times the workers, "
        "every block with its own scales (a multiple of 8; the bytes grow by 32/this times "
        "the signs')",
        default_help="one scale per tensor",
    )
    outer_reference_share: float = option(
        0.0,
        group=_SYSTEM,
        help="with --sync-every and --outer-exchange 1bit: the share of the last round's "
        "averaged pseudo-gradient each worker takes out of its message, added back to the "
        "exchange's result (in [0, 1]; 0: the pseudo-gradient sent whole)",
    )
    deliver_errors: bool = option(
        False,
        group=_SYSTEM,
        help="with --sync-every and --outer-exchange 1bit: at the end of training, deliver "
        "what the 1-bit exchange has not yet (its errors) in one dense exchange, the weights "
        "moved as the outer step would (an outer SGD)",
    )
    backend: str = option("gloo", group=_SYSTEM, choices=BACKENDS, help="collective backend")
    device: str = option("cpu", group=_SYSTEM, choices=DEVICES, help="device of each worker")
    eval_every: int | None = option(
        None,
        group=_SYSTEM,
        help="validation interval in steps",
        default_help=f"--steps/{DEFAULT_EVALS}",
    )
    eval_seqs: int = option(
        512,
        group=_SYSTEM,
        help="validation sequences evaluated (a fixed random subset, fixed masks; 0: all)",
    )
    checkpoint_every: int | None = option(
        None,
        group=_SYSTEM,
        help="checkpoint interval in steps",
        default_help=f"--steps/{DEFAULT_CHECKPOINTS}",
    )
    keep_checkpoints: int = option(2, group=_SYSTEM, help="complete checkpoints kept")
    timeout: float = option(
        600.0,
        group=_SYSTEM,
        help="seconds a collective may wait for a lost worker before failing",
    )

    def resolved(self) -> TrainConfig:
        """A validated copy with every ``None`` filled in."""
        config = dataclasses.replace(self, betas=tuple(self.betas))
        config.validate_basic()
        if config.lr is None:
            config.lr = registry.OPTIMIZERS[config.optimizer].default_lr
        if config.freeze_step is None:
            config.freeze_step = max(1, round(DEFAULT_FREEZE_FRACTION * config.steps))
        config.momentum_bound = config.resolved_momentum_bound()
        if config.optimizer == ZERO_ONE_ADAM:
            if config.var_freeze_step is None:
                config.var_freeze_step = config.freeze_step
            if config.local_step_scaler is None:
                frozen = 0 if config.var_freeze_step == AUTO else config.var_freeze_step
                local_steps = config.steps - frozen
                config.local_step_scaler = max(1, local_steps // DEFAULT_LOCAL_INTERVAL_DOUBLINGS)
        if config.lr_warmup_steps is None:
            config.lr_warmup_steps = round(DEFAULT_LR_WARMUP_FRACTION * config.steps)
        outer = OUTER_DEFAULTS[config.outer_exchange]
        if config.outer_lr is None:
            config.outer_lr = outer["lr"]
        if config.outer_momentum is None:
            config.outer_momentum = outer["momentum"]
        if config.worker_residual is None and config.diloco:
            config.worker_residual = RESIDUAL_DEFAULTS[config.outer_exchange]
        if config.eval_every is None:
            config.eval_every = max(1, config.steps // DEFAULT_EVALS)
        if config.checkpoint_every is None:
            config.checkpoint_every = max(1, config.steps // DEFAULT_CHECKPOINTS)
        config.validate_intervals()
        return config

    def resolved_momentum_bound(self) -> bool:
        """``momentum_bound``, where ``None``: the optimizer's own default (on with
        onebit-lamb), off with the optimizers that have no such bound."""
        if self.momentum_bound is None:
            return bool(registry.OPTIMIZERS[self.optimizer].default("momentum_bound"))
        return self.momentum_bound

    def validate_basic(self) -> None:
        """Raise ``ValueError`` naming the first option that is out of range."""
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("architecture", self.architecture, ARCHITECTURES)
        check_choice("backend", self.backend, BACKENDS)
        check_choice("device", self.device, DEVICES)
        if self.compression is not None:
            check_choice("compression", self.compression, COMPRESSIONS)
        check_choice("pre_freeze_exchange", self.pre_freeze_exchange, PRE_FREEZE_EXCHANGES)
        check_choice("outer_exchange", self.outer_exchange, DILOCO_EXCHANGES)
        check_choice("outer_implementation", self.outer_implementation, DILOCO_IMPLEMENTATIONS)
        if self.worker_residual is not None:
            check_choice("worker_residual", self.worker_residual, WORKER_RESIDUALS)
        for name in ("freeze_step", "var_freeze_step", "var_warmup_steps"):
            if getattr(self, name) not in (None, AUTO):
                check_positive_int_option(name, getattr(self, name))
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("--backend nccl needs --device cuda (NCCL moves CUDA tensors only)")
        for name in ("steps", "batch_size", "layers", "hidden", "heads", "keep_checkpoints"):
            check_positive_int_option(name, getattr(self, name))
        check_positive_int_option("node_size", self.node_size)
        if self.optimizer == ZERO_ONE_ADAM and self.node_size > 1:
            raise ValueError(
                "--node-size > 1 (the hierarchical exchange) is not offered for 0/1 Adam"
            )
        for name in (
            "var_update_scaler",
            "local_step_clipper",
            "local_step_scaler",
        ):
            if getattr(self, name) is not None:
                check_positive_int_option(name, getattr(self, name))
        if self.eval_seqs < 0:
            raise ValueError(f"--eval-seqs must be >= 0 (0: all), got {self.eval_seqs}")
        if self.seq_len < 8:
            raise ValueError(f"--seq-len must be at least 8, got {self.seq_len}")
        if self.vocab_size < 64:
            raise ValueError(f"--vocab-size must be at least 64, got {self.vocab_size}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        check_positive("--timeout", self.timeout)
        check_non_negative("--grad-clip", self.grad_clip)
        check_exchange_options(self)
        self._validate_hyperparameters()

    def _validate_hyperparameters(self) -> None:
        """The optimizers' own checks (:mod:`onebit.optim._common`), made before any worker
        starts."""
        if self.lr is not None:
            check_positive("--lr", self.lr)
        check_betas(self.betas)
        check_positive("--eps", self.eps)
        check_non_negative("--weight-decay", self.weight_decay)
        check_coeff_bounds(self.min_coeff, self.max_coeff)
        check_non_negative("--factor-threshold", self.factor_threshold)
        if self.trust_bound is not None:
            check_positive("--trust-bound", self.trust_bound)
        check_momentum_bound(self.resolved_momentum_bound(), self.betas)
        for name, bounded in _ONEBIT_LAMB_BOUNDS.items():
            if getattr(self, name) not in (None, False) and self.optimizer != "onebit-lamb":
                raise ValueError(
                    f"--{name.replace('_', '-')} bounds onebit-lamb's {bounded}, not "
                    f"{self.optimizer}'s"
                )
        check_unit_interval("--coeff-beta", self.coeff_beta)
        check_factor_bounds(self.factor_min, self.factor_max)

    def validate_intervals(self) -> None:
        """Check the step-count options against ``steps``."""
        auto = self.freeze_step == AUTO
        if (
            self.optimizer in ONEBIT_OPTIMIZERS
            and not auto
            and not 1 <= self.freeze_step <= self.steps
        ):
            raise ValueError(
                f"--freeze-step must be in [1, --steps={self.steps}], got {self.freeze_step}"
            )
        if (
            self.optimizer == ZERO_ONE_ADAM
            and self.var_freeze_step != AUTO
            and self.var_freeze_step > self.steps
        ):
            raise ValueError(
                f"--var-freeze-step must be in [1, --steps={self.steps}], got "
                f"{self.var_freeze_step}"
            )
        if not 0 <= self.lr_warmup_steps < self.steps:
            raise ValueError(
                f"--lr-warmup-steps must be in [0, --steps={self.steps}), got "
                f"{self.lr_warmup_steps}"
            )
        check_positive_int_option("eval_every", self.eval_every)
        check_positive_int_option("checkpoint_every", self.checkpoint_every)

    @property
    def uses_onebit(self) -> bool:
        return self.optimizer in ONEBIT_OPTIMIZERS

    def diloco_options(self) -> dict[str, Any]:
        """``onebit.DiLoCo``'s (and ``SimulatedDiLoCo``'s) keyword arguments that these
        options set, beside the outer optimizer (:func:`onebit.diloco.outer_sgd`)."""
        return {
            "sync_every": self.sync_every,
            "exchange": self.outer_exchange,
            "fragments": self.fragments,
            "delay": self.fragment_delay,
            "local_share": self.local_share,
            "worker_residual": self.worker_residual,
            "block_size": self.outer_block_size,
            "reference_share": self.outer_reference_share,
        }

    @property
    def diloco(self) -> bool:
        """Whether DiLoCo's rounds train (``--sync-every``)."""
        return self.sync_every is not None

    @property
    def diloco_nodes(self) -> bool:
        """Whether DiLoCo's workers are nodes of ``node_size`` workers, which average their
        gradients at every inner step (DDP inside the node)."""
        return self.diloco and self.node_size > 1

    @property
    def counts_links(self) -> bool:
        """Whether each step's bytes are also counted by link, inside a node and between
        nodes (the hierarchical exchange, DiLoCo over nodes)."""
        return self.hierarchical or self.diloco_nodes

    @property
    def hierarchical(self) -> bool:
        """Whether the hierarchical 1-bit exchange runs between nodes of ``node_size``
        workers (with ``fsdp``, FSDP takes the node's part)."""
        return self.uses_onebit and self.node_size > 1 and not self.fsdp

    def check_world_size(self, workers: int) -> None:
        """Raise ``ValueError`` if ``workers`` does not suit the batch and the node size."""
        if self.batch_size % workers:
            raise ValueError(
                f"--batch-size {self.batch_size} (global) is not divisible by --workers {workers}"
            )
        if workers % self.node_size:
            raise ValueError(
                f"--node-size {self.node_size} does not divide --workers {workers}: nodes "
                "must hold the same number of workers"
            )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training options in the config: {unknown}")
        return cls(**data).resolved()
