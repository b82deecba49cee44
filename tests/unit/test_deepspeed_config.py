"""onebit.from_deepspeed_config on the configs of DeepSpeed's 1-bit tutorials, and its errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers.paths import FIXTURES

import onebit

# The configs of DeepSpeed's 1-bit tutorials, as the tutorials document them:
# - BERT pre-training, 1-bit LAMB, sequence length 128: the 1-bit LAMB tutorial
#   (deepspeed.ai/tutorials/onebit-lamb, "Configuration for BERT Pre-training"), i.e.
#   DeepSpeedExamples bing_bert/1-bit_lamb/deepspeed_bsz64k_onebitlamb_config_seq128_nccl.json.
# - BERT pre-training, 1-bit Adam, sequence length 128: the JSON shown in section 3.2 of the
#   1-bit Adam tutorial (deepspeed.ai/tutorials/onebit-adam).
# - SQuAD fine-tuning, 1-bit Adam: Table 1 of the same tutorial (batch 96, micro-batch 3,
#   lr 3e-5, weight decay 0, freeze_step 400, nccl), i.e. DeepSpeedExamples
#   BingBertSquad/deepspeed_onebitadam_bsz96_config.json (type spelled "OnebitAdam").
# - 0/1 Adam: the example of section 1.4 of the 0/1 Adam tutorial
#   (deepspeed.ai/tutorials/zero-one-adam, "Configuration of 0/1 Adam").
TUTORIALS = {
    "deepspeed_bert_pretraining_onebitlamb_seq128.json": onebit.OneBitLamb,
    "deepspeed_bert_pretraining_onebitadam_seq128.json": onebit.OneBitAdam,
    "deepspeed_squad_finetuning_onebitadam.json": onebit.OneBitAdam,
    "deepspeed_zerooneadam.json": onebit.ZeroOneAdam,
}
HYPER_PARAMETERS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "max_coeff",
    "min_coeff",
    "coeff_beta",
    "factor_max",
    "factor_min",
    "factor_threshold",
)


def params():
    return [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.zeros(2))]


def config(type_="OneBitLamb", **extra_params):
    return {"optimizer": {"type": type_, "params": {"lr": 1e-2, **extra_params}}}


@pytest.mark.parametrize("name", sorted(TUTORIALS))
def test_tutorial_configs_round_trip(name, caplog):
    path = FIXTURES / name
    given = json.loads(path.read_text())["optimizer"]["params"]
    with caplog.at_level(logging.INFO, logger="onebit"):
        optimizer = onebit.from_deepspeed_config(path, params())
    assert type(optimizer) is TUTORIALS[name]
    assert optimizer.freeze_step == given.get("freeze_step", given.get("var_freeze_step"))
    for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
        if key in given:
            assert getattr(optimizer, key) == given[key], key
    for key in HYPER_PARAMETERS:
        if key in given:
            assert optimizer.defaults[key] == given[key], key
            assert optimizer.param_groups[0][key] == given[key], key
    # What the config asked of the engine is listed, each with what replaces it.
    report = caplog.text
    for key in ("comm_backend_name", "bias_correction", "gradient_clipping", "fp16"):
        assert key in report
    assert "max_grad_norm" in report and "GradScaler" in report
    assert "register_comm_hook" in report
    clip = json.loads(path.read_text()).get("gradient_clipping", 0.0)
    assert optimizer.max_grad_norm == clip


def test_gradient_clipping_becomes_max_grad_norm_unless_given():
    config = {"gradient_clipping": 0.5, "optimizer": {"type": "OneBitAdam", "params": {}}}
    assert onebit.from_deepspeed_config(config, params()).max_grad_norm == 0.5
    assert onebit.from_deepspeed_config(config, params(), max_grad_norm=2.0).max_grad_norm == 2.0
    fused_lamb = {"optimizer": {"type": "Lamb", "params": {"max_grad_norm": 3.0}}}
    fused_lamb["optimizer"]["params"].update(bias_correction=False, eps_inside_sqrt=False)
    assert onebit.from_deepspeed_config(fused_lamb, params()).max_grad_norm == 3.0


def test_keys_left_out_take_deepspeeds_defaults():
    optimizer = onebit.from_deepspeed_config({"optimizer": {"type": "onebitlamb"}}, params())
    # DeepSpeed's OnebitLamb defaults.
    expected = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_coeff=10.0)
    expected.update(min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5)
    assert {key: optimizer.defaults[key] for key in expected} == expected
    assert optimizer.freeze_step == 100000


def test_onebit_lamb_takes_deepspeeds_exchange_unless_options_choose_onebits():
    deepspeeds = onebit.from_deepspeed_config(config(), params())
    assert deepspeeds.compression == "fused"
    assert deepspeeds.defaults["momentum_bound"] is False
    onebits = onebit.from_deepspeed_config(
        config(), params(), compression="per_tensor", momentum_bound=True
    )
    assert onebits.compression == "per_tensor"
    assert onebits.defaults["momentum_bound"] is True
    assert onebit.OneBitLamb(params()).defaults["momentum_bound"] is True


def test_types_are_case_insensitive_and_options_pass_through():
    lamb = onebit.from_deepspeed_config(
        config("LAMB", betas=[0.8, 0.99], max_coeff=0.3, bias_correction=False), params()
    )
    assert type(lamb) is onebit.Lamb
    assert lamb.defaults["betas"] == (0.8, 0.99) and lamb.defaults["max_coeff"] == 0.3
    adam = onebit.from_deepspeed_config(
        config("oneBITadam", freeze_step=7), params(), on_nonfinite="raise", verify_every=5
    )
    assert type(adam) is onebit.OneBitAdam
    assert (adam.freeze_step, adam.on_nonfinite, adam.verify_every) == (7, "raise", 5)


@pytest.mark.parametrize(
    "cfg, message",
    [
        (config(factor_maxx=4.0, warmup=3), r"\['factor_maxx', 'warmup'\]"),
        (config("OneBitAdam", max_coeff=0.3), r"\['max_coeff'\]"),
        (config("Lamb", freeze_step=10, bias_correction=False), r"\['freeze_step'\]"),
        (config("Adagrad"), "'Adagrad' has no onebit counterpart"),
        (config("ZeroOneAdam", freeze_step=10), r"\['freeze_step'\]"),
        ({"train_batch_size": 8}, "no optimizer section"),
        (config(lr="auto", weight_decay="auto"), r"\['lr', 'weight_decay'\] are 'auto'"),
        (config(amsgrad=True), "amsgrad"),
        (config("Lamb"), "bias_correction"),
        (config("Lamb", bias_correction=False, eps_inside_sqrt=True), "eps_inside_sqrt"),
        (config(freeze_step=0), "freeze_step"),
    ],
)
def test_bad_configs_name_the_problem(cfg, message):
    with pytest.raises(ValueError, match=message):
        onebit.from_deepspeed_config(cfg, params())


def test_path_must_hold_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a DeepSpeed config"):
        onebit.from_deepspeed_config(str(path), params())
