"""Checks of the job's options that choose how gradients and momenta travel: the bucketed,
overlapped and delayed 1-bit exchange, FSDP2, DiLoCo (and torchft's as its peer), and PowerSGD
for the dense baselines."""

from __future__ import annotations

from typing import Any

from onebit.cli import check_positive_int_option
from onebit.optim.checks import check_bucket_cap_mb, check_positive, check_unit_interval
from onebit.train.torchft_diloco import torchft_missing

#: A :class:`onebit.train.config.TrainConfig` (which calls these checks).
TrainConfig = Any

#: The dense optimizers PowerSGD's comm hook may average the gradients of.
POWERSGD_OPTIMIZERS = ("lamb", "adam")


def check_exchange_options(config: TrainConfig) -> None:
    """Raise ``ValueError`` naming the option that does not fit the others."""
    _check_fsdp(config)
    _check_buckets(config)
    _check_delay(config)
    _check_powersgd(config)
    _check_diloco(config)


#: The optimizers of the job that take FSDP2-sharded parameters.
FSDP_OPTIMIZERS = ("lamb", "onebit-lamb", "onebit-adam")


def _check_fsdp(config: TrainConfig) -> None:
    """``--fsdp``: sharded within a node of more than one worker, without DDP's options."""
    if not config.fsdp:
        return
    if config.optimizer not in FSDP_OPTIMIZERS:
        raise ValueError(f"--fsdp trains {', '.join(FSDP_OPTIMIZERS)}, not {config.optimizer}")
    if config.node_size < 2:
        raise ValueError(
            "--fsdp shards over the workers of a node: give --node-size L > 1 (L = --workers: "
            "one node, no replicas)"
        )
    for flag, value in (
        ("--bucket-cap-mb", config.bucket_cap_mb is not None),
        ("--overlap-backward", config.overlap_backward),
        ("--powersgd-rank", config.powersgd_rank > 0),
    ):
        if value:
            raise ValueError(f"{flag} is not offered with --fsdp")


def _check_buckets(config: TrainConfig) -> None:
    """``--bucket-cap-mb`` and ``--overlap-backward``: the flat exchange only."""
    if config.bucket_cap_mb is None and not config.overlap_backward:
        return
    flag = "--overlap-backward" if config.overlap_backward else "--bucket-cap-mb"
    check_bucket_cap_mb("--bucket-cap-mb", config.bucket_cap_mb)
    if config.optimizer not in ("onebit-lamb", "onebit-adam") or config.node_size > 1:
        raise ValueError(
            f"{flag} buckets the flat exchange of onebit-lamb and onebit-adam (--node-size 1)"
        )
    if config.overlap_backward and config.grad_clip > 0:
        raise ValueError(
            "--overlap-backward sends each bucket during backward, before the gradient "
            "norm that --grad-clip clips by is known: add --grad-clip 0"
        )


def _check_delay(config: TrainConfig) -> None:
    """``--delayed-exchange``: 1-bit LAMB and 1-bit Adam over one flat group."""
    if not config.delayed_exchange:
        if config.delayed_prediction != "own":
            raise ValueError(
                f"--delayed-prediction {config.delayed_prediction} chooses the predictions "
                "of --delayed-exchange: add it"
            )
        return
    if config.optimizer not in ("onebit-lamb", "onebit-adam"):
        raise ValueError(
            f"--delayed-exchange delays the 1-bit exchange of onebit-lamb and onebit-adam, not "
            f"of {config.optimizer}"
        )
    for flag, value in (
        ("--overlap-backward", config.overlap_backward),
        ("--node-size > 1", config.node_size > 1),
        ("--fsdp", config.fsdp),
    ):
        if value:
            raise ValueError(f"--delayed-exchange is not offered with {flag}")


def _check_powersgd(config: TrainConfig) -> None:
    """``--powersgd-rank``: a DDP comm hook, for the dense optimizers."""
    if config.powersgd_rank == 0:
        return
    check_positive_int_option("powersgd_rank", config.powersgd_rank)
    if config.optimizer not in POWERSGD_OPTIMIZERS or not config.ddp:
        raise ValueError(
            f"--powersgd-rank averages the gradients of {' and '.join(POWERSGD_OPTIMIZERS)} "
            f"under DDP (it is a DDP comm hook), not of {config.optimizer}"
            + ("" if config.ddp else " with --no-ddp")
        )


#: The inner optimizers of DiLoCo in the job: those that take local steps without exchanging.
DILOCO_INNER = ("lamb", "adam")


def _check_diloco(config: TrainConfig) -> None:
    """``--sync-every``: DiLoCo over a dense inner optimizer, between workers or nodes,
    optionally streaming (``--fragments``, ``--fragment-delay``, ``--local-share``)."""
    if config.sync_every is None:
        given = {
            "--fragments": config.fragments != 1,
            "--fragment-delay": config.fragment_delay != 0,
            "--local-share": config.local_share != 0.0,
            "--worker-residual": config.worker_residual is not None,
            "--outer-block-size": config.outer_block_size is not None,
            "--outer-reference-share": config.outer_reference_share != 0.0,
            "--deliver-errors": config.deliver_errors,
        }
        for flag, is_given in given.items():
            if is_given:
                raise ValueError(f"{flag} is an option of DiLoCo: give --sync-every too")
        if config.outer_implementation != "onebit":
            raise ValueError("--outer-implementation is an option of DiLoCo: give --sync-every too")
        return
    check_positive_int_option("sync_every", config.sync_every)
    check_positive_int_option("fragments", config.fragments)
    if config.sync_every % config.fragments:
        raise ValueError(
            f"--sync-every {config.sync_every} must be a multiple of --fragments "
            f"{config.fragments} (each fragment's turn is --sync-every/--fragments steps)"
        )
    turn = config.sync_every // config.fragments
    if not 0 <= config.fragment_delay < turn:
        raise ValueError(
            f"--fragment-delay must be in [0, {turn}) (less than --sync-every/--fragments), "
            f"got {config.fragment_delay}"
        )
    if not 0.0 <= config.local_share <= 1.0:
        raise ValueError(f"Invalid --local-share={config.local_share}: it must be in [0, 1]")
    if config.optimizer not in DILOCO_INNER:
        raise ValueError(
            f"--sync-every runs DiLoCo over an inner optimizer that steps on each worker's own "
            f"gradients: --optimizer {' or '.join(DILOCO_INNER)}, not {config.optimizer} "
            "(it exchanges every step itself)"
        )
    for flag, value in (
        ("--powersgd-rank", config.powersgd_rank > 0),
        ("--fsdp", config.fsdp),
    ):
        if value:
            raise ValueError(f"--sync-every (DiLoCo) is not offered with {flag}")
    if config.worker_residual == "local" and config.outer_exchange != "1bit":
        raise ValueError(
            f"--worker-residual {config.worker_residual} places the 1-bit exchange's residual: "
            "give --outer-exchange 1bit"
        )
    if not 0.0 <= config.outer_reference_share <= 1.0:
        raise ValueError(
            f"Invalid --outer-reference-share={config.outer_reference_share}: it must be in [0, 1]"
        )
    if config.outer_reference_share and config.outer_exchange != "1bit":
        raise ValueError(
            "--outer-reference-share takes the last round's average out of the 1-bit outer "
            "exchange's messages: give --outer-exchange 1bit"
        )
    if config.deliver_errors and config.outer_exchange != "1bit":
        raise ValueError(
            "--deliver-errors delivers what the 1-bit outer exchange has not: give "
            "--outer-exchange 1bit"
        )
    if config.outer_block_size is not None:
        check_positive_int_option("outer_block_size", config.outer_block_size)
        if config.outer_block_size % 8 or config.outer_exchange != "1bit":
            raise ValueError(
                "--outer-block-size sets the blocks of the 1-bit outer exchange: a multiple of "
                f"8 with --outer-exchange 1bit, got {config.outer_block_size} with "
                f"--outer-exchange {config.outer_exchange}"
            )
    _check_outer_implementation(config)
    if config.outer_lr is not None:  # None: the outer exchange's default
        check_positive("--outer-lr", config.outer_lr)
    if config.outer_momentum is not None:
        check_unit_interval("--outer-momentum", config.outer_momentum)


def _check_outer_implementation(config: TrainConfig) -> None:
    """``--outer-implementation torchft``: torchft's dense DiLoCo over single workers, in
    whole rounds, installed."""
    if config.outer_implementation != "torchft":
        return
    given = {
        "--outer-exchange 1bit": config.outer_exchange != "dense",
        "--fragments": config.fragments != 1,
        "--fragment-delay": config.fragment_delay != 0,
        "--node-size": config.node_size != 1,
    }
    for flag, is_given in given.items():
        if is_given:
            raise ValueError(
                f"--outer-implementation torchft runs torchft's dense DiLoCo between single "
                f"workers: it takes --outer-exchange dense and not {flag}"
            )
    if config.steps % config.sync_every:
        raise ValueError(
            f"--outer-implementation torchft ends rounds at every --sync-every-th step only: "
            f"--steps {config.steps} must be a multiple of --sync-every {config.sync_every}"
        )
    missing = torchft_missing()
    if missing is not None:
        raise ValueError(f"--outer-implementation torchft: {missing}")
