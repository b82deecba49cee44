"""The optimizers by name: one table that the main job, the benchmarks, the study, the cost
model and :func:`onebit.from_deepspeed_config` build optimizers from.

Each entry says which class a name builds, which of its arguments are hyper-parameters of the
update rule (the names DeepSpeed's config uses too) and which are onebit's own options that the
tools set, the dense optimizer the entry is measured against, DeepSpeed's type name, and the
peak learning rate the main job starts from.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from onebit.optim._onebit import OneBitOptimizer
from onebit.optim.lamb import Lamb
from onebit.optim.onebit_adam import OneBitAdam
from onebit.optim.onebit_lamb import OneBitLamb
from onebit.optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "OPTIMIZERS",
    "PAPER_BERT_SETTINGS",
    "OptimizerSpec",
    "by_deepspeed_type",
    "optimizer_spec",
]

#: Hyper-parameters of Adam's update, shared by every entry.
ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
#: ... and LAMB's: the bounds of its trust ratio.
LAMB_HYPERPARAMETERS = (*ADAM_HYPERPARAMETERS, "max_coeff", "min_coeff")
#: The 1-bit LAMB paper's BERT settings that differ from the classes' (DeepSpeed's) defaults;
#: the main job's defaults and the benchmarks' optimizers.
PAPER_BERT_SETTINGS: dict[str, float] = {"weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01}


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer by name.

    ``hyperparameters`` are the arguments of the update rule (named as in DeepSpeed's config),
    ``options`` onebit's own arguments that the tools set (the exchange's layout, clipping,
    the backend);
    ``rule`` is the dense update the optimizer takes before it compresses (``"lamb"`` or
    ``"adam"``), which names its ``baseline``: the dense optimizer it is compared with.
    """

    name: str
    cls: type[torch.optim.Optimizer]
    rule: str
    hyperparameters: tuple[str, ...]
    options: tuple[str, ...] = ()
    deepspeed_type: str | None = None
    default_lr: float = 0.001

    @property
    def compresses(self) -> bool:
        """Whether the optimizer exchanges at 1 bit (and so owns its gradient averaging)."""
        return issubclass(self.cls, OneBitOptimizer)

    @property
    def baseline(self) -> str:
        """The name of the dense optimizer this one is measured against."""
        return self.rule

    def default(self, argument: str) -> Any:
        """The default of ``argument`` in the optimizer's signature (``None`` where it takes
        no such argument, or requires it)."""
        parameter = inspect.signature(self.cls).parameters.get(argument)
        if parameter is None or parameter.default is inspect.Parameter.empty:
            return None
        return parameter.default

    def arguments(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``values`` this optimizer takes, hyper-parameters and options; the
        others (settings of another optimizer) are left out."""
        return {key: values[key] for key in (*self.hyperparameters, *self.options) if key in values}

    def build(
        self, params: Iterable[Tensor] | Iterable[dict[str, Any]], values: Mapping[str, Any]
    ) -> torch.optim.Optimizer:
        """``cls(params, **arguments(values))``."""
        return self.cls(params, **self.arguments(values))


_CLIPPING = ("max_grad_norm", "kernels")
_FLAT_EXCHANGE = ("process_group", "node_groups", "bucket_cap_mb", "overlap_backward", *_CLIPPING)
_AUTO_FREEZE = ("max_freeze_step",)

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            "onebit-lamb",
            OneBitLamb,
            "lamb",
            (
                *LAMB_HYPERPARAMETERS,
                "freeze_step",
                "coeff_beta",
                "factor_max",
                "factor_min",
                "factor_threshold",
            ),
            (
                *_FLAT_EXCHANGE,
                "compression",
                "delayed_exchange",
                "variance_guard",
                "trust_bound",
                "momentum_bound",
                *_AUTO_FREEZE,
            ),
            deepspeed_type="onebitlamb",
            default_lr=0.016,
        ),
        OptimizerSpec("lamb", Lamb, "lamb", LAMB_HYPERPARAMETERS, _CLIPPING, "lamb", 0.016),
        OptimizerSpec(
            "onebit-adam",
            OneBitAdam,
            "adam",
            (*ADAM_HYPERPARAMETERS, "freeze_step"),
            (*_FLAT_EXCHANGE, "compression", "delayed_exchange", "variance_guard", *_AUTO_FREEZE),
            deepspeed_type="onebitadam",
        ),
        OptimizerSpec("adam", torch.optim.AdamW, "adam", ADAM_HYPERPARAMETERS),
        OptimizerSpec(
            "zero-one-adam",
            ZeroOneAdam,
            "adam",
            (
                *ADAM_HYPERPARAMETERS,
                "var_freeze_step",
                "var_update_scaler",
                "local_step_scaler",
                "local_step_clipper",
            ),
            (
                "pre_freeze_exchange",
                "var_warmup_steps",
                "max_var_freeze_step",
                "variance_guard",
                *_CLIPPING,
            ),
            deepspeed_type="zerooneadam",
        ),
    )
}


def optimizer_spec(name: str) -> OptimizerSpec:
    """The entry of ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {list(OPTIMIZERS)}") from None


def by_deepspeed_type(type_name: str) -> OptimizerSpec | None:
    """The entry whose DeepSpeed type is ``type_name`` (any case, as DeepSpeed compares)."""
    wanted = type_name.lower()
    return next((s for s in OPTIMIZERS.values() if s.deepspeed_type == wanted), None)
