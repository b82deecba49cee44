"""Build a onebit optimizer from a DeepSpeed JSON config: the migration path off the engine.

:func:`from_deepspeed_config` reads the ``"optimizer"`` section of a DeepSpeed config whose
type is one of DeepSpeed's ``OneBitLamb``, ``OneBitAdam``, ``ZeroOneAdam`` or ``Lamb`` (any
case, as DeepSpeed reads it) and returns :class:`onebit.OneBitLamb`, :class:`onebit.OneBitAdam`,
:class:`onebit.ZeroOneAdam` or :class:`onebit.Lamb` with the same hyper-parameters; keys it
leaves out take the same defaults in both. The rest of the config configured DeepSpeed's
engine, not the optimizer: what it asked for (gradient clipping, loss scaling, batch sizes,
the scheduler...) is the training loop's job now, and is listed in one log message.
docs/MIGRATION.md is the guide.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor

from onebit.optim import Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam
from onebit.optim.registry import by_deepspeed_type
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE

__all__ = ["from_deepspeed_config"]

logger = logging.getLogger("onebit")

# Keys DeepSpeed accepts that change nothing in onebit, and why.
_IGNORED = {
    "cuda_aware": "a setting of DeepSpeed's MPI backend; onebit runs on torch.distributed",
    "comm_backend_name": (
        "DeepSpeed's choice of communication backend; onebit uses the backend of the process "
        "group (nccl on GPU, gloo on CPU)"
    ),
    "max_grad_norm": (
        "DeepSpeed's 1-bit optimizers store it but never read it; the top-level "
        "gradient_clipping sets onebit's max_grad_norm"
    ),
}
# Keys DeepSpeed's 1-bit optimizers store but never read. DeepSpeed's Lamb (FusedLamb) reads
# them, with these defaults; onebit.Lamb computes as if both were false.
_LAMB_VARIANTS = {"bias_correction": True, "eps_inside_sqrt": False}
# A variant DeepSpeed itself rejects: accepted only when false.
_AMSGRAD = "amsgrad"

# Top-level sections the engine acted on, and what replaces each.
_ENGINE_SECTIONS = {
    "gradient_clipping": (
        "mapped onto the optimizer's max_grad_norm: step() clips the averaged gradients at "
        "it in dense steps and each rank's own at value·√W in the others"
    ),
    "fp16": "torch.autocast(dtype=torch.float16) and torch.amp.GradScaler (scaler.step(optimizer))",
    "bf16": "torch.autocast(dtype=torch.bfloat16); no loss scaling needed",
    "amp": "torch.autocast and torch.amp.GradScaler",
    "train_batch_size": "your DataLoader's batch size times the world size",
    "train_micro_batch_size_per_gpu": "your DataLoader's batch size",
    "gradient_accumulation_steps": (
        "accumulate in your loop (DistributedDataParallel.no_sync for the steps between)"
    ),
    "scheduler": "a torch.optim.lr_scheduler on the onebit optimizer",
    "prescale_gradients": "averaging: onebit.ddp.register_comm_hook, or the plain loop",
    "gradient_predivide_factor": "averaging: onebit.ddp.register_comm_hook, or the plain loop",
    "zero_optimization": "not supported by 1-bit optimizers (DeepSpeed's neither): drop it",
}


#: Where onebit's defaults differ from DeepSpeed's, what a DeepSpeed config builds instead: the
#: arguments, and onebit's defaults with the reason for them.
_DEEPSPEED_CHOICES: dict[type, tuple[dict[str, Any], str]] = {
    ZeroOneAdam: (
        DEEPSPEED_SCHEDULE,
        "ZeroOneAdam's defaults (var_freeze_step='auto', var_warmup_steps='auto', "
        "pre_freeze_exchange='momentum', which keep learning where DeepSpeed's schedule "
        "stalled and freeze once the variance has caught up: docs/ZERO-ONE-ADAM.md; "
        "variance_guard='refresh', which refreshes a variance that falls behind after the "
        "freeze: docs/VARIANCE-READINESS.md)",
    ),
    OneBitLamb: (
        {"compression": "fused", "momentum_bound": False},
        "OneBitLamb's defaults (compression='per_tensor', which did not diverge where "
        "DeepSpeed's fused exchange did; momentum_bound=True, which keeps each element's "
        "exchanged momentum within Adam's reach of its variance: docs/VARIANCE-READINESS.md)",
    ),
}


def from_deepspeed_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    params: Iterable[Tensor] | Iterable[dict[str, Any]],
    **options: Any,
) -> OneBitLamb | OneBitAdam | ZeroOneAdam | Lamb:
    """The onebit optimizer a DeepSpeed config describes, with the same hyper-parameters.

    Args:
        config: a DeepSpeed config as a dict, or the path of its JSON file. Its
            ``optimizer.type`` must be ``OneBitLamb``, ``OneBitAdam``, ``ZeroOneAdam`` or
            ``Lamb`` (any case).
        params: parameters or parameter groups, as for any torch optimizer.
        **options: onebit's own arguments (``process_group``, ``on_nonfinite``,
            ``verify_every``, ``kernels``...), passed to the optimizer.

    Mapped from ``optimizer.params``: ``lr``, ``betas``, ``eps``, ``weight_decay``, and by
    type ``freeze_step``, ``max_coeff``, ``min_coeff``, ``coeff_beta``, ``factor_max``,
    ``factor_min``, ``factor_threshold``, ``var_freeze_step``, ``var_update_scaler``,
    ``local_step_scaler``, ``local_step_clipper``. ``freeze_step`` keeps its value:
    compression starts at the same ``step()`` call as in DeepSpeed, whose first call makes no
    update (so its warm-up has one update fewer); 0/1 Adam's schedules are counted in updates
    (ALGORITHM.md, "0/1 Adam", difference 1). Accepted with an info message: ``cuda_aware``,
    ``comm_backend_name``, ``max_grad_norm``, and the 1-bit types' ``bias_correction`` and
    ``eps_inside_sqrt`` (which DeepSpeed's 1-bit optimizers never read). The top-level
    ``gradient_clipping`` becomes ``max_grad_norm`` (as does ``optimizer.params.max_grad_norm``
    of ``Lamb``, which DeepSpeed's FusedLamb reads), unless ``options`` give one. Other
    top-level sections (``fp16``, ``train_batch_size``, ``scheduler``...) are listed, with
    what replaces each, in one info message (rank 0).

    Raises:
        ValueError: naming the problem, for a config without an ``optimizer`` section, another
            optimizer type, unknown ``params`` keys, ``"auto"`` values, ``amsgrad: true``, or a
            ``Lamb`` with bias correction or ``eps_inside_sqrt`` (onebit.Lamb has neither;
            DeepSpeed's Lamb corrects bias unless ``"bias_correction": false``).
    """
    config = _load(config)
    section = config.get("optimizer")
    if not isinstance(section, Mapping) or "type" not in section:
        raise ValueError(
            "the DeepSpeed config has no optimizer section with a type "
            '(expected {"optimizer": {"type": "OneBitLamb", "params": {...}}})'
        )
    name = str(section["type"])
    spec = by_deepspeed_type(name)
    if spec is None:
        raise ValueError(
            f"optimizer type {name!r} has no onebit counterpart; onebit builds OneBitLamb, "
            "OneBitAdam, ZeroOneAdam and Lamb (any case)"
        )
    cls, mapped = spec.cls, spec.hyperparameters
    given = dict(section.get("params") or {})
    unknown = sorted(set(given) - {*mapped, *_IGNORED, *_LAMB_VARIANTS, _AMSGRAD})
    if unknown:
        raise ValueError(
            f"optimizer.params of {name} has keys onebit does not know: {unknown}; "
            f"{cls.__name__} takes {sorted(mapped)}"
        )
    auto = sorted(key for key, value in given.items() if value == "auto")
    if auto:
        raise ValueError(
            f"optimizer.params {auto} are 'auto' (filled in by the HF DeepSpeed integration): "
            "give numbers"
        )
    if given.get(_AMSGRAD):
        raise ValueError("amsgrad: true is not supported (DeepSpeed's optimizers reject it too)")
    ignored = [
        key for key in _IGNORED if key in given and not (cls is Lamb and key == "max_grad_norm")
    ]
    if cls is Lamb:
        enabled = {k: True for k, default in _LAMB_VARIANTS.items() if given.get(k, default)}
        if enabled:
            raise ValueError(
                f"DeepSpeed's Lamb with {enabled} (bias_correction is on when absent) computes "
                "another update than onebit.Lamb, which has no bias correction and adds eps "
                'outside the square root; set "bias_correction": false and '
                '"eps_inside_sqrt": false to accept onebit\'s update'
            )
    else:
        ignored += [key for key in _LAMB_VARIANTS if key in given]
    kwargs = {key: given[key] for key in mapped if key in given}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if cls is Lamb and "max_grad_norm" in given:
        kwargs["max_grad_norm"] = float(given["max_grad_norm"])
    if config.get("gradient_clipping"):
        kwargs["max_grad_norm"] = float(config["gradient_clipping"])
    if "max_grad_norm" in options:
        kwargs.pop("max_grad_norm", None)
    deepspeeds, _ = _DEEPSPEED_CHOICES.get(cls, ({}, ""))
    schedule = {k: v for k, v in deepspeeds.items() if k not in options and k not in kwargs}
    optimizer = cls(params, **kwargs, **schedule, **options)
    _report(name, cls, ignored, given, config, schedule)
    return optimizer


def _load(config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    with open(config, encoding="utf-8") as file:
        loaded = json.load(file)
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{config} holds a JSON {type(loaded).__name__}, not a DeepSpeed config")
    return loaded


def _report(
    name: str,
    cls: type,
    ignored: list[str],
    given: dict[str, Any],
    config: Mapping[str, Any],
    schedule: dict[str, Any],
) -> None:
    """One info message (rank 0): what the config asked of DeepSpeed and not of onebit."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    lines = [f"from_deepspeed_config: DeepSpeed {name} -> onebit.{cls.__name__}"]
    if schedule:
        built = ", ".join(f"{key}={value!r}" for key, value in schedule.items())
        lines.append(
            f"  DeepSpeed's choice ({built}), not {_DEEPSPEED_CHOICES[cls][1]}; pass them as "
            "options to choose onebit's"
        )
    for key in ignored:
        why = _IGNORED.get(key, "DeepSpeed's 1-bit optimizers store it but never read it")
        lines.append(f"  optimizer.params.{key}={given[key]!r} ignored: {why}")
    for key in config:
        if key != "optimizer":
            todo = _ENGINE_SECTIONS.get(key, "configured DeepSpeed's engine; onebit ignores it")
            lines.append(f"  {key}: now yours: {todo}")
    lines.append(
        "  gradient averaging: onebit.ddp.register_comm_hook(model, optimizer) on a "
        "DistributedDataParallel model, or step() on local gradients (docs/MIGRATION.md)"
    )
    logger.info("\n".join(lines))
