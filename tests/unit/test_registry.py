"""The optimizer registry: every entry builds what it names, with the arguments it lists, and
the tools that build optimizers (the job, from_deepspeed_config) go through it; the optimizers'
public memory figures against the tensors they hold."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import onebit
from onebit.optim.registry import (
    OPTIMIZERS,
    PAPER_BERT_SETTINGS,
    by_deepspeed_type,
    optimizer_spec,
)
from onebit.train.config import TrainConfig
from onebit.train.gradients import build_optimizer


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_listed_argument_is_an_argument_of_the_class(name: str) -> None:
    spec = OPTIMIZERS[name]
    accepted = inspect.signature(spec.cls).parameters
    missing = [key for key in (*spec.hyperparameters, *spec.options) if key not in accepted]
    assert not missing, f"{spec.cls.__name__} takes no {missing}"
    assert spec.baseline in OPTIMIZERS and not OPTIMIZERS[spec.baseline].compresses
    assert spec.compresses == issubclass(spec.cls, onebit.OneBitOptimizer)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_job_builds_each_optimizer_with_its_config(name: str) -> None:
    config = TrainConfig(optimizer=name, steps=10, max_coeff=0.25, freeze_step=3).resolved()
    optimizer = build_optimizer(config, params(), max_grad_norm=0.5)
    spec = OPTIMIZERS[name]
    assert type(optimizer) is spec.cls
    group = optimizer.param_groups[0]
    assert group["lr"] == config.lr == spec.default_lr
    assert group["weight_decay"] == PAPER_BERT_SETTINGS["weight_decay"]
    if "max_coeff" in spec.hyperparameters:
        assert group["max_coeff"] == 0.25
    if "freeze_step" in spec.hyperparameters:
        assert optimizer.freeze_step == 3
    if "max_grad_norm" in spec.options:
        assert optimizer.max_grad_norm == 0.5


def test_arguments_leave_out_what_the_optimizer_does_not_take() -> None:
    values = {"lr": 0.1, "max_coeff": 0.3, "freeze_step": 4, "var_update_scaler": 8, "x": 1}
    assert optimizer_spec("onebit-adam").arguments(values) == {"lr": 0.1, "freeze_step": 4}
    assert optimizer_spec("lamb").arguments(values) == {"lr": 0.1, "max_coeff": 0.3}
    assert optimizer_spec("zero-one-adam").arguments(values) == {"lr": 0.1, "var_update_scaler": 8}


def test_default_reads_the_optimizers_signature() -> None:
    assert optimizer_spec("onebit-lamb").default("momentum_bound") is True
    assert optimizer_spec("onebit-lamb").default("freeze_step") == 100000
    assert optimizer_spec("lamb").default("momentum_bound") is None  # no such argument
    assert optimizer_spec("onebit-lamb").default("params") is None  # required


def test_names_and_deepspeed_types() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgd'; choose one of \['onebit-lamb'"):
        optimizer_spec("sgd")
    assert by_deepspeed_type("OneBitLamb") is OPTIMIZERS["onebit-lamb"]
    assert by_deepspeed_type("ZEROONEADAM") is OPTIMIZERS["zero-one-adam"]
    assert by_deepspeed_type("Adam") is None  # DeepSpeed's Adam has no onebit counterpart


def test_config_defaults_are_the_registry_settings() -> None:
    defaults = TrainConfig()
    for key, value in PAPER_BERT_SETTINGS.items():
        assert getattr(defaults, key) == value
    assert {f.name for f in dataclasses.fields(TrainConfig)} >= set(PAPER_BERT_SETTINGS)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def step(optimizer: torch.optim.Optimizer, parameters: list[torch.nn.Parameter]) -> None:
    for p in parameters:
        p.grad = torch.ones_like(p)
    optimizer.step()


def test_memory_bytes_counts_the_tensors_the_optimizer_holds() -> None:
    parameters = params()
    lamb = onebit.Lamb(parameters, lr=0.01)
    assert lamb.memory_bytes() == {"state": 0, "scratch": 0}
    step(lamb, parameters)
    state_tensors = [v for s in lamb.state.values() for v in s.values() if torch.is_tensor(v)]
    # moments of every element plus one trust ratio per tensor, all float32
    assert lamb.memory_bytes()["state"] == nbytes(state_tensors) == 4 * (2 * 22 + 2)

    parameters = params()
    optimizer = onebit.OneBitLamb(parameters, lr=0.01, freeze_step=1, momentum_bound=False)
    step(optimizer, parameters)
    assert optimizer.memory_bytes()["error_feedback"] == 0  # nothing exchanged yet
    step(optimizer, parameters)
    memory = optimizer.memory_bytes()
    worker_error, server_error = optimizer.error_feedback
    assert memory["error_feedback"] == nbytes([worker_error, server_error]) > 0
    buffer = optimizer.local_momentum()
    assert memory["scratch"] >= nbytes([buffer]) + optimizer.exchange.nbytes()

    bounded_parameters = params()
    bounded = onebit.OneBitLamb(bounded_parameters, lr=0.01, freeze_step=1)  # momentum_bound
    for _ in range(2):
        step(bounded, bounded_parameters)
    # the limits of the decoded momentum: one float32 per element
    assert bounded.memory_bytes()["scratch"] == memory["scratch"] + 4 * 22


def test_the_per_tensor_exchange_copies_nothing_it_can_use_in_place() -> None:
    # Tensors that need no padding (multiples of 8 elements at n = 1) are compressed where
    # they are, the intermediates and the worker's error updates in the spent buffer: with
    # the fused kernels (no stage scratch) the exchange's own scratch, besides the server's
    # error updates computed ahead (as large as the server error, here the worker's), is the
    # packed signs, the messages and the scales, well under a word per element.
    pytest.importorskip("numba")
    aligned = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(256))]
    optimizer = onebit.OneBitLamb(aligned, lr=0.01, freeze_step=1, kernels="numba")
    for _ in range(2):
        step(optimizer, aligned)
    server_error = optimizer.exchange.server_error
    assert server_error.numel() == 2304
    assert optimizer.exchange.nbytes() - 4 * 2304 < 4 * 2304 / 2
