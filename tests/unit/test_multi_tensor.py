"""The flat, multi-tensor step: host synchronisations, backends against each other, layout."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import onebit
from onebit import kernels
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE

BACKENDS = [name for name in kernels.available() if name != "triton"]
SYNCING = ("item", "tolist", "__float__", "__bool__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_syncs():
    """Count calls of the Tensor methods that read a value back to the host."""
    counts = {"syncs": 0}
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def counting(original):
        def wrapper(self, *args, **kwargs):
            counts["syncs"] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _make(kind: str, tensors: int, freeze_step: int = 2):
    gen = torch.Generator().manual_seed(tensors)
    params = [torch.nn.Parameter(torch.randn(7, 3, generator=gen)) for _ in range(tensors)]
    hyper = dict(lr=0.01, weight_decay=0.01)
    if kind == "lamb":
        return params, onebit.Lamb(params, **hyper)
    if kind == "onebit-lamb":
        return params, onebit.OneBitLamb(params, freeze_step=freeze_step, **hyper)
    return params, onebit.OneBitAdam(params, freeze_step=freeze_step, **hyper)


def _syncs_per_step(kind: str, tensors: int, steps: int = 5) -> list[int]:
    params, optimizer = _make(kind, tensors)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        with count_host_syncs() as counter:
            optimizer.step()
        counts.append(counter["syncs"])
    return counts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lamb", "onebit-lamb", "onebit-adam"])
def test_host_syncs_per_step_do_not_grow_with_the_number_of_tensors(backend, kind, monkeypatch):
    monkeypatch.setenv("ONEBIT_KERNELS", backend)
    few, many = _syncs_per_step(kind, 3), _syncs_per_step(kind, 60)
    assert few == many, f"host syncs per step: {few} with 3 tensors, {many} with 60"
    assert max(many) <= 4  # the flags, the finite check and the exchange's two scale checks


def _trajectory(kind: str, backend: str, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setenv("ONEBIT_KERNELS", backend)
    gen = torch.Generator().manual_seed(5)
    shapes = [(40, 30), (30,), (17, 5), (3,)]
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes
    ]
    groups = [
        {"params": params[:2], "lr": 0.02, "weight_decay": 0.01},
        {"params": params[2:], "lr": 0.01, "betas": (0.8, 0.99)},
    ]
    optimizer = {
        "lamb": lambda: onebit.Lamb(groups, max_coeff=0.3),
        "onebit-lamb": lambda: onebit.OneBitLamb(groups, freeze_step=4, max_coeff=0.3),
        "onebit-lamb-bounded": lambda: onebit.OneBitLamb(
            groups, freeze_step=4, max_coeff=0.3, trust_bound=1.0
        ),
        "onebit-lamb-momentum-bound": lambda: onebit.OneBitLamb(
            groups, freeze_step=4, max_coeff=0.3, momentum_bound=True
        ),
        "onebit-adam": lambda: onebit.OneBitAdam(groups, freeze_step=4),
        # every kind of step within 12: variance updates 1, 2, 4, 6; 1-bit gradients 3, 5;
        # after the freeze at 6, synchronisations 7, 8, 10, 12 and local steps 9, 11
        "zero-one-adam": lambda: onebit.ZeroOneAdam(
            groups,
            var_update_scaler=2,
            local_step_scaler=2,
            **(DEEPSPEED_SCHEDULE | {"var_freeze_step": 6}),
        ),
    }[kind]()
    history = []
    for step in range(12):
        for index, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if kind.endswith("-momentum-bound") and index == 0:
                p.grad[:, ::2] *= 1e-4  # elements far below their tensor's scale: it binds
            if index == 3 and step < 2:
                p.grad = None  # a parameter that starts late
        optimizer.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for p in params]))
    return history


@pytest.mark.skipif(len(BACKENDS) < 2, reason="needs the numba backend")
@pytest.mark.parametrize(
    "kind",
    [
        "lamb",
        "onebit-lamb",
        "onebit-lamb-bounded",
        "onebit-lamb-momentum-bound",
        "onebit-adam",
        "zero-one-adam",
    ],
)
def test_fused_backend_follows_the_torch_reference(kind, monkeypatch):
    """float64: the backends differ only in summation order (~1e-16), so 1e-10 would catch
    any difference in the maths, which shows at >= 1e-4."""
    reference = _trajectory(kind, "torch", monkeypatch)
    for backend in BACKENDS[1:]:
        for step, (got, want) in enumerate(
            zip(_trajectory(kind, backend, monkeypatch), reference, strict=True)
        ):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"step {step + 1}")


def test_parameters_and_state_are_views_of_the_flat_buffers():
    params, optimizer = _make("onebit-lamb", 3)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    flat = optimizer.flat_state
    for index, p in enumerate(params):
        assert p.data.data_ptr() == flat.view(flat.weights, index).data_ptr()
        state = optimizer.state[p]
        assert state["exp_avg"].data_ptr() == flat.view(flat.exp_avg, index).data_ptr()
    with torch.no_grad():
        params[0].add_(1.0)  # what a model.load_state_dict would do
    assert torch.equal(flat.view(flat.weights, 0), params[0].detach())


def test_wrong_size_error_buffers_in_a_checkpoint_are_rejected_by_name():
    params, optimizer = _make("onebit-lamb", 2, freeze_step=1)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    saved = optimizer.state_dict()
    saved["onebit"]["worker_error"] = torch.zeros(7)
    _, fresh = _make("onebit-lamb", 2, freeze_step=1)
    with pytest.raises(ValueError, match="worker_error has 7 elements.*need 48"):
        fresh.load_state_dict(saved)
    assert fresh.state_dict()["state"] == {}  # nothing was loaded


def test_an_unknown_backend_is_rejected_at_construction():
    with pytest.raises(ValueError, match="Invalid kernels='fast'"):
        onebit.OneBitLamb([torch.nn.Parameter(torch.zeros(3))], kernels="fast")


@pytest.mark.skipif(len(BACKENDS) < 2, reason="needs the numba backend")
def test_the_kernels_argument_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("ONEBIT_KERNELS", "numba")
    params, _ = _make("lamb", 1)
    optimizer = onebit.Lamb(params, kernels="torch")
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()
    assert optimizer.backend.name == "torch"


def test_checkpoints_with_python_float_scalars_load_and_continue_identically():
    """Per-parameter scalars (``lamb_coeff_freeze``, ``last_factor``...) were Python floats
    in checkpoints of earlier versions; they load into the device vectors."""
    params, optimizer = _make("onebit-lamb", 3, freeze_step=2)
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(6)]
    for step in range(4):
        for p, g in zip(params, grads[step], strict=True):
            p.grad = g
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    weights = [p.detach().clone() for p in params]
    as_floats = copy.deepcopy(saved)
    for state in as_floats["state"].values():
        for name, value in state.items():
            if torch.is_tensor(value) and value.dim() == 0:
                state[name] = float(value)
    results = []
    for checkpoint in (saved, as_floats):
        fresh_params, fresh = _make("onebit-lamb", 3, freeze_step=2)
        with torch.no_grad():
            for p, w in zip(fresh_params, weights, strict=True):
                p.copy_(w)
        fresh.load_state_dict(checkpoint)
        for step in range(4, 6):
            for p, g in zip(fresh_params, grads[step], strict=True):
                p.grad = g
            fresh.step()
        results.append([p.detach().clone() for p in fresh_params])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
