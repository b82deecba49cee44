"""What code written for ``torch.optim`` expects of every optimizer (the generic expectations of
PyTorch's own optimizer tests), held by all four onebit optimizers at world size 1, through a
two-step warm-up into the 1-bit steps: closures, hooks, schedulers, tensor learning rates,
dtypes, exact resume, load hooks, copies, and clear refusals of what they do not take."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

import onebit

SHAPES = [(5, 3), (3,), (2, 2)]


def build(name: str, params, **options):
    """Each optimizer with a warm-up of two steps (0/1 Adam: variance frozen after step 2,
    so steps 3.. are its local and synchronisation steps)."""
    if name == "Lamb":
        return onebit.Lamb(params, **{"lr": 1e-2, **options})
    if name == "ZeroOneAdam":
        options = {"var_freeze_step": 2, "var_warmup_steps": 2, "local_step_clipper": 2, **options}
        return onebit.ZeroOneAdam(params, **{"lr": 1e-2, **options})
    kind = {"OneBitLamb": onebit.OneBitLamb, "OneBitAdam": onebit.OneBitAdam}[name]
    return kind(params, **{"lr": 1e-2, "freeze_step": 2, **options})


OPTIMIZERS = ["Lamb", "OneBitLamb", "OneBitAdam", "ZeroOneAdam"]
ONEBIT = OPTIMIZERS[1:]


def make_params(dtype=torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype))
        for shape in SHAPES
    ]


def set_gradients(params, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


def run(optimizer, params, steps: range) -> None:
    for step in steps:
        set_gradients(params, step)
        optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_closure_is_evaluated_with_gradients_and_its_loss_returned(name):
    params = make_params()
    optimizer = build(name, params)
    target = torch.ones(5, 3)

    def closure():
        optimizer.zero_grad()
        loss = ((params[0] - target) ** 2).sum() + params[1].sum() + params[2].sum()
        loss.backward()
        return loss

    losses = [float(optimizer.step(closure).detach()) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert optimizer.step() is None


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero_grad_sets_gradients_to_none(name):
    params = make_params()
    optimizer = build(name, params)
    run(optimizer, params, range(3))
    optimizer.zero_grad()
    assert all(param.grad is None for param in params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_step_hooks_run_before_and_after_every_step(name):
    params = make_params()
    optimizer = build(name, params)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    run(optimizer, params, range(4))
    assert calls == ["pre", "post"] * 4


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_parameter_group_with_learning_rate_zero_stays_put(name):
    params = make_params()
    optimizer = build(name, [{"params": params[:2]}, {"params": params[2:], "lr": 0.0}])
    before = [param.detach().clone() for param in params]
    run(optimizer, params, range(5))
    assert not torch.equal(params[0], before[0])
    assert torch.equal(params[2].detach(), before[2])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_schedulers_drive_the_learning_rate_and_cycled_betas_across_the_freeze(name):
    params = make_params()
    optimizer = build(name, params)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.05, total_steps=6, cycle_momentum=True
    )
    seen = []
    for step in range(5):
        set_gradients(params, step)
        optimizer.step()
        scheduler.step()
        seen.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"][0]))
    assert len({lr for lr, _ in seen}) > 1 and len({beta for _, beta in seen}) > 1
    assert all(torch.isfinite(param).all() for param in params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_one_element_tensor_learning_rate_steps_as_the_number_does(name):
    by_number, by_tensor = make_params(), make_params()
    run(build(name, by_number, lr=1e-2), by_number, range(5))
    run(build(name, by_tensor, lr=torch.tensor(1e-2)), by_tensor, range(5))
    for a, b in zip(by_number, by_tensor, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_learning_rate_tensor_of_several_elements_is_refused_naming_lr(name):
    with pytest.raises(ValueError, match="lr"):
        build(name, make_params(), lr=torch.tensor([1e-3, 1e-3]))


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_float64_and_bfloat16_parameters_step_in_their_dtype(name, dtype):
    params = make_params(dtype)
    optimizer = build(name, params)
    before = [param.detach().clone() for param in params]
    run(optimizer, params, range(5))
    for param, old in zip(params, before, strict=True):
        assert param.dtype == dtype and torch.isfinite(param).all()
        assert not torch.equal(param.detach(), old)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("split", [1, 3])
def test_a_resumed_run_follows_the_uninterrupted_one_bit_for_bit(name, split):
    """Saved before the freeze (1) or after it (3), through torch.save with weights_only."""
    straight = make_params()
    run(build(name, straight), straight, range(7))
    first = make_params()
    optimizer = build(name, first)
    run(optimizer, first, range(split))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    weights = [param.detach().clone() for param in first]
    resumed = [torch.nn.Parameter(w) for w in weights]
    buffer.seek(0)
    again = build(name, resumed)
    again.load_state_dict(torch.load(buffer, weights_only=True))
    run(again, resumed, range(split, 7))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_sparse_gradient_is_refused_clearly(name):
    params = make_params()
    optimizer = build(name, params)
    set_gradients(params, 0)
    params[0].grad = params[0].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optimizer.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_complex_parameters_are_refused_before_anything_changes(name):
    real = make_params()
    with pytest.raises(ValueError, match="complex"):
        build(name, [*real, torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    optimizer = build(name, real)
    with pytest.raises(ValueError, match="complex"):
        optimizer.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.cfloat))]}
        )
    assert len(optimizer.param_groups) == 1


#: A bad value of each hyper-parameter every optimizer takes, and what its error names.
BAD_HYPERPARAMETERS = [
    ({"lr": -1.0}, "lr=-1.0"),
    ({"lr": "0.1"}, "lr='0.1': it must be a number"),
    ({"betas": (0.9, 1.0)}, r"betas\[1\]=1.0"),
    ({"betas": 0.9}, "betas=0.9: expected a pair"),
    ({"eps": 0.0}, "eps=0.0"),
    ({"weight_decay": -0.1}, "weight_decay=-0.1"),
    ({"weight_decay": True}, "weight_decay=True: it must be a number"),
]

#: Each optimizer's own: a bad value, and what its error names.
OWN_BAD_HYPERPARAMETERS = {
    "Lamb": [({"min_coeff": 0.5, "max_coeff": 0.1}, "min_coeff=0.5 > max_coeff=0.1")],
    "OneBitLamb": [
        ({"max_coeff": 0.001}, "min_coeff=0.01 > max_coeff=0.001"),
        ({"coeff_beta": 1.0}, "coeff_beta=1.0"),
        ({"factor_min": 0.0}, "factor_min=0.0"),
        ({"factor_threshold": -1.0}, "factor_threshold=-1.0"),
        ({"trust_bound": 0.0}, "trust_bound=0.0"),
        ({"momentum_bound": 1}, "momentum_bound must be True or False"),
    ],
    "OneBitAdam": [],
    "ZeroOneAdam": [],
}


def bad_groups():
    return [
        (name, *case)
        for name in OPTIMIZERS
        for case in BAD_HYPERPARAMETERS + OWN_BAD_HYPERPARAMETERS[name]
    ]


@pytest.mark.parametrize(("name", "values", "message"), bad_groups())
def test_a_bad_hyper_parameter_is_refused_by_name_in_the_constructor_and_in_a_group(
    name, values, message
):
    with pytest.raises(ValueError, match=message):
        build(name, make_params(), **values)
    with pytest.raises(ValueError, match=message):
        build(name, [{"params": make_params(), **values}])
    optimizer = build(name, make_params())
    with pytest.raises(ValueError, match=message):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], **values})
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_group_setting_an_argument_of_the_whole_optimizer_is_refused_by_name(name):
    optimizer = build(name, make_params())
    with pytest.raises(ValueError, match=f"kernels is an argument of {name} as a whole"):
        optimizer.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(2))], "kernels": "torch"}
        )
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize(
    ("name", "option", "value"),
    [
        ("Lamb", "exp_avg_mask", None),
        ("OneBitAdam", "trust_bound", 2.0),
        ("ZeroOneAdam", "max_coeff", 1.0),
    ],
)
def test_a_group_setting_another_optimizers_option_is_refused_by_name(name, option, value):
    optimizer = build(name, make_params())
    extra = {"params": [torch.nn.Parameter(torch.zeros(2))], option: value}
    with pytest.raises(ValueError, match=f"{name}'s parameter groups do not take {option}"):
        optimizer.add_param_group(extra)
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_group_may_carry_keys_of_its_own_as_with_torch(name):
    optimizer = build(name, make_params())
    optimizer.add_param_group(
        {"params": [torch.nn.Parameter(torch.zeros(2))], "name": "decoder", "lr": 0.5}
    )
    assert optimizer.param_groups[1]["name"] == "decoder"
    assert optimizer.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_group_given_as_a_generator_is_taken_whole(name):
    params = make_params()
    optimizer = build(name, [{"params": (p for p in params)}])
    assert optimizer.param_groups[0]["params"] == params


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_load_hooks_keep_their_effect(name):
    """A pre-hook's returned dict is what loads; a post-hook's change to the state stays, and
    the next step starts from it as from a checkpoint that held those values."""
    params = make_params()
    source = build(name, params)
    run(source, params, range(3))
    saved = copy.deepcopy(source.state_dict())
    weights = [param.detach().clone() for param in params]

    def pre_hook(optimizer, state_dict):
        changed = copy.deepcopy(state_dict)
        changed["state"][0]["exp_avg"].fill_(7.0)
        return changed

    hooked_params = [torch.nn.Parameter(w.clone()) for w in weights]
    hooked = build(name, hooked_params)
    hooked.register_load_state_dict_pre_hook(pre_hook)
    hooked.register_load_state_dict_post_hook(
        lambda optimizer: optimizer.state[hooked_params[1]]["exp_avg"].fill_(3.0)
    )
    hooked.load_state_dict(saved)
    assert hooked.state[hooked_params[0]]["exp_avg"].unique().tolist() == [7.0]
    assert hooked.state[hooked_params[1]]["exp_avg"].unique().tolist() == [3.0]

    edited = copy.deepcopy(saved)
    edited["state"][0]["exp_avg"].fill_(7.0)
    edited["state"][1]["exp_avg"].fill_(3.0)
    twin_params = [torch.nn.Parameter(w.clone()) for w in weights]
    twin = build(name, twin_params)
    twin.load_state_dict(edited)
    run(hooked, hooked_params, range(3, 5))
    run(twin, twin_params, range(3, 5))
    for a, b in zip(hooked_params, twin_params, strict=True):
        assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_parameter_group_is_refused_after_the_first_step(name):
    params = make_params()
    optimizer = build(name, params)
    run(optimizer, params, range(1))
    with pytest.raises(RuntimeError, match="after the first step"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


@pytest.mark.parametrize("name", ONEBIT)
def test_a_parameter_group_is_refused_after_a_checkpoint_load(name):
    """The loaded error feedback is laid out for the checkpoint's parameters."""
    params = make_params()
    source = build(name, params)
    run(source, params, range(4))
    target = build(name, make_params())
    target.load_state_dict(source.state_dict())
    with pytest.raises(RuntimeError, match="after load_state_dict"):
        target.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert len(target.param_groups) == 1


def test_copies_of_lamb_and_the_original_end_alike():
    params = make_params()
    optimizer = build("Lamb", params)
    run(optimizer, params, range(3))
    copied = copy.deepcopy(optimizer)
    pickled = pickle.loads(pickle.dumps(optimizer))
    for other in (copied, pickled):
        run(other, other.param_groups[0]["params"], range(3, 6))
    run(optimizer, params, range(3, 6))
    for other in (copied, pickled):
        for a, b in zip(params, other.param_groups[0]["params"], strict=True):
            assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("name", ONEBIT)
def test_copying_a_one_bit_optimizer_is_refused_with_what_to_do(name):
    optimizer = build(name, make_params())
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="state_dict"):
            attempt(optimizer)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_optimizer_prints(name):
    optimizer = build(name, make_params())
    assert repr(optimizer).startswith(type(optimizer).__name__)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("kernels", ["torch", "numba"])
def test_a_parameter_unfrozen_before_the_freeze_joins_as_if_it_had_had_no_gradient(name, kernels):
    """ALGORITHM.md, "Parameters that join late": frozen when the state was laid out and
    unfrozen before the freeze, it joins; every tensor's trajectory and final state are those
    of a run where it was trainable throughout without a gradient until then (0/1 Adam: after
    a synchronisation, so its per-tensor error feedback moves over too)."""
    joins = 4 if name == "ZeroOneAdam" else 2  # the step it is unfrozen at
    options = {"var_freeze_step": 6} if name == "ZeroOneAdam" else {}
    runs = []
    for late in (True, False):
        params = make_params()
        params[2].requires_grad_(not late)
        optimizer = build(name, params, kernels=kernels, **options)
        trajectory = []
        for step in range(1, 10):
            params[2].requires_grad_(params[2].requires_grad or step == joins)
            set_gradients(params, step)
            if step < joins:
                params[2].grad = None
            optimizer.step()
            trajectory.append([param.detach().clone() for param in params])
        state = optimizer.state_dict()
        runs.append((trajectory, state["state"], state.get("onebit", {})))
    (late, late_state, late_extra), (throughout, state, extra) = runs
    for step, (a, b) in enumerate(zip(late, throughout, strict=True)):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"step {step + 1} parameter {index}"
    assert late_state.keys() == state.keys()
    for key, values in state.items():
        for name_, value in values.items():
            assert torch.equal(torch.as_tensor(late_state[key][name_]), torch.as_tensor(value))
    for error in ("worker_error", "server_error"):
        if extra.get(error) is not None:
            assert torch.equal(late_extra[error], extra[error]), error


@pytest.mark.parametrize("name", ONEBIT)
def test_a_parameter_unfrozen_after_the_freeze_is_refused_before_the_step(name):
    """It has no variance for the 1-bit steps: refused, naming it, with nothing changed."""
    params = make_params()
    params[2].requires_grad_(False)
    optimizer = build(name, params)
    run(optimizer, params[:2], range(3))
    params[2].requires_grad_(True)
    set_gradients(params, 3)
    before = [param.detach().clone() for param in params]
    with pytest.raises(RuntimeError, match="parameter 2 of group 0 .* after the variance froze"):
        optimizer.step()
    assert all(torch.equal(a.detach(), b) for a, b in zip(params, before, strict=True))


@pytest.mark.parametrize("name", ONEBIT)
@pytest.mark.parametrize("kernels", ["torch", "numba"])
def test_a_parameter_without_a_gradient_in_the_one_bit_steps_keeps_weights_and_state(name, kernels):
    """Trainable, but no gradient (no rank has one): skipped as torch's optimizers skip it,
    its weights and state bit for bit (but 0/1 Adam's ``lr_sum``, the interval's sum of
    learning rates, which every parameter counts alike); with a gradient again, it moves."""
    params = make_params()
    optimizer = build(name, params, kernels=kernels)
    run(optimizer, params, range(3))

    def held():
        state = optimizer.state[params[2]]
        return {k: v.clone() for k, v in state.items() if torch.is_tensor(v) and k != "lr_sum"}

    kept, weights = held(), params[2].detach().clone()
    for step in range(3, 9):
        set_gradients(params, step)
        params[2].grad = None
        optimizer.step()
    assert torch.equal(params[2].detach(), weights)
    assert all(torch.equal(held()[k], v) for k, v in kept.items())
    run(optimizer, params, range(9, 13))
    assert not torch.equal(params[2].detach(), weights)


@pytest.mark.parametrize("name", ONEBIT)
@pytest.mark.parametrize("kernels", ["torch", "numba"])
def test_a_parameter_frozen_in_the_one_bit_steps_keeps_weights_and_state(name, kernels):
    """ALGORITHM.md, "Parameters without gradients": frozen (requires_grad=False, no
    gradient), it keeps everything bit for bit, as torch's optimizers skip it; unfrozen, it
    moves again."""
    params = make_params()
    optimizer = build(name, params, kernels=kernels)
    run(optimizer, params, range(3))  # the warm-up and a first 1-bit step
    params[2].requires_grad_(False)
    kept = {k: v.clone() for k, v in optimizer.state[params[2]].items() if torch.is_tensor(v)}
    weights, others = params[2].detach().clone(), params[0].detach().clone()
    for step in range(3, 8):
        set_gradients(params[:2], step)
        params[2].grad = None
        optimizer.step()
    assert torch.equal(params[2].detach(), weights)
    for key, value in kept.items():
        assert torch.equal(optimizer.state[params[2]][key], value), key
    assert not torch.equal(params[0].detach(), others)
    params[2].requires_grad_(True)
    run(optimizer, params, range(8, 12))
    assert not torch.equal(params[2].detach(), weights)


@pytest.mark.parametrize("name", ONEBIT)
def test_a_first_gradient_after_the_warm_up_is_warned_about_once(name):
    """It has no variance to be frozen: left out, not updated, and said so (once)."""
    params = make_params()
    optimizer = build(name, params)
    for step in range(2):  # the warm-up, without a gradient for parameter 2
        set_gradients(params, step)
        params[2].grad = None
        optimizer.step()
    weights = params[2].detach().clone()
    with pytest.warns(RuntimeWarning, match=r"parameter 2 \(shape \[2, 2\]\) got a first gradient"):
        run(optimizer, params, range(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        run(optimizer, params, range(3, 5))
    assert torch.equal(params[2].detach(), weights)
