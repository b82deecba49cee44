"""Every update backend against the torch reference in float32, for all four optimizers
through every kind of step (float64 hides rounding).

The fused numba kernels cannot reproduce the reference to the bit: torch's vectorised
``add(alpha=)`` and ``addcmul`` round ``a + alpha b`` once (a fused multiply-add), numba's
passes round every product. What they must reproduce is every constant the reference
derives from the hyper-parameters (``1 - beta``, ``lr c``, ...), rounded as it rounds them:
then each buffer stays within the reference's own float32 error (its distance from a
float64 run), far below what one mis-rounded constant does (``1 - beta2`` rounded in float32
leaves the variance 1.3e-5 off from the first step)."""

from __future__ import annotations

import pytest
import torch

import onebit
from onebit import kernels
from onebit.optim.zero_one_adam import DEEPSPEED_SCHEDULE
from onebit.testing import backend_device

# Triton runs on CUDA where there is a GPU, else in its interpreter on CPU.
FUSED = [name for name in kernels.available() if name != "torch"]
SHAPES = [(40, 30), (30,), (17, 5), (3,), (6, 2)]
STEPS = 24
KINDS = {
    "lamb": {"lamb"},
    "onebit-lamb": {"warmup", "compression"},  # each tensor compressed alone (the default)
    "onebit-lamb-fused": {"warmup", "compression"},
    "onebit-lamb-bounded": {"warmup", "compression"},  # with trust_bound
    "onebit-lamb-momentum-bound": {"warmup", "compression"},  # with momentum_bound
    "onebit-adam": {"warmup", "compression"},
    "onebit-adam-fused": {"warmup", "compression"},
    "zero-one-adam": {"variance_update", "gradient_1bit", "local", "sync"},
}


def _build(kind: str, backend: str, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(5)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype))
        for s in SHAPES
    ]
    masks = [torch.ones(17, 5), torch.ones(3), torch.tensor([[1.0, 0.0]] * 6)]
    masks = [mask.to(device) for mask in masks]
    groups = [
        {"params": params[:2], "lr": 0.01, "weight_decay": 0.01},
        {"params": params[2:], "lr": 0.02, "weight_decay": 0.0, "exp_avg_mask": masks},
    ]
    if kind == "lamb":
        groups[1].pop("exp_avg_mask")
        return params, onebit.Lamb(groups, kernels=backend)
    compression = "fused" if kind.endswith("-fused") else "per_tensor"
    if kind.startswith("onebit-lamb"):
        bound = {
            "onebit-lamb-bounded": {"trust_bound": 1.0},
            "onebit-lamb-momentum-bound": {"momentum_bound": True},
        }.get(kind, {})
        optimizer = onebit.OneBitLamb(
            groups,
            freeze_step=8,
            max_coeff=0.3,
            compression=compression,
            kernels=backend,
            **bound,
        )
        return params, optimizer
    if kind.startswith("onebit-adam"):
        optimizer = onebit.OneBitAdam(
            groups, freeze_step=8, compression=compression, kernels=backend
        )
        return params, optimizer
    schedule = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=4)
    return params, onebit.ZeroOneAdam(
        groups, **(DEEPSPEED_SCHEDULE | schedule), local_step_clipper=4, kernels=backend
    )


def _run(
    kind: str,
    backend: str,
    dtype: torch.dtype,
    device: torch.device | None = None,
    steps: int = STEPS,
):
    """Each step's kind and the optimizer's flat buffers after it (as float64, on the CPU);
    ``device`` defaults to the backend's."""
    device = backend_device(backend) if device is None else device
    params, optimizer = _build(kind, backend, dtype, device)
    gen = torch.Generator().manual_seed(7)
    history = []
    for t in range(steps):
        step_kind = getattr(optimizer, "stage", "lamb")
        for index, p in enumerate(params):
            grad = torch.randn(p.shape, generator=gen, dtype=torch.float64) * (0.1 + index)
            if kind.endswith("-momentum-bound") and index == 0:
                grad[:, ::2] *= 1e-4  # elements far below their tensor's scale: the bound binds
            p.grad = None if index == 1 and t >= 3 else grad.to(device, dtype)  # one stops
        optimizer.step()
        flat = optimizer.flat_state  # every buffer the step wrote
        buffers = {"p": flat.weights, "m": flat.exp_avg, "v": flat.exp_avg_sq}
        if flat.exp_avg_sq_fresh is not None:
            buffers["v_fresh"] = flat.exp_avg_sq_fresh
        copies = {k: b.to("cpu", torch.float64, copy=True) for k, b in buffers.items()}
        history.append((step_kind, copies))
    return history


@pytest.mark.skipif(not FUSED, reason="needs a fused backend (numba or triton)")
@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_updates_stay_within_the_references_float32_error(kind, backend):
    device = backend_device(backend)  # the reference runs where the backend does
    fused = _run(kind, backend, torch.float32)
    reference = _run(kind, "torch", torch.float32, device)
    exact = _run(kind, "torch", torch.float64, device)
    assert {step_kind for step_kind, _ in reference} == KINDS[kind]
    largest = {"deviation": 0.0, "own_error": 0.0}
    for step, ((step_kind, got), (_, ref), (_, truth)) in enumerate(
        zip(fused, reference, exact, strict=True)
    ):
        for name, value in ref.items():
            scale = float(truth[name].abs().max()) or 1.0
            deviation = float((got[name] - value).abs().max()) / scale
            largest["deviation"] = max(largest["deviation"], deviation)
            largest["own_error"] = max(
                largest["own_error"], float((value - truth[name]).abs().max()) / scale
            )
            where = f"{kind} step {step + 1} ({step_kind}) {name}"
            assert deviation <= 1.5e-6, f"{where}: {deviation:.2e} from the reference"
    # Over the run, within twice the reference's own distance from float64. (Not once: an
    # exchange scale that the backends sum in another order differs by an ulp, and the
    # reconstructed gradient (m_new - b1 m) / (1 - b1) cancels, so v_fresh moves by a few
    # ulps; with per-tensor scales the reference's own error is that small too.)
    assert largest["deviation"] <= 2 * largest["own_error"], largest


def _assert_follows(got: list, want: list, bound: float, what: str) -> None:
    """Every buffer of every step within ``bound`` of ``want``'s, relative to its largest."""
    for step, ((_, a), (step_kind, b)) in enumerate(zip(got, want, strict=True)):
        for name, value in b.items():
            deviation = float((a[name] - value).abs().max()) / (float(value.abs().max()) or 1.0)
            assert deviation <= bound, (
                f"{what} step {step + 1} ({step_kind}) {name}: {deviation:.2e}"
            )


needs_triton = pytest.mark.skipif("triton" not in FUSED, reason="triton is not installed")


@needs_triton
@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("onebit-lamb", torch.float16), ("zero-one-adam", torch.bfloat16)],
    ids=["onebit-lamb-fp16", "zero-one-adam-bf16"],
)
def test_triton_updates_read_half_precision_gradients(kind, dtype):
    """Half-precision parameters with fp32 masters: the kernels widen the gradients exactly,
    so the fp32 state follows the reference's as in float32 (every kind of step that reads a
    gradient: LAMB's and Adam's, the momentum's, 0/1 Adam's local steps)."""
    fused = _run(kind, "triton", dtype, steps=16)
    reference = _run(kind, "torch", dtype, backend_device("triton"), steps=16)
    _assert_follows(fused, reference, 1.5e-6, f"{kind} {dtype}")


@needs_triton
def test_triton_blocks_that_split_a_tensor_reduce_per_tensor(monkeypatch):
    """With blocks of 256 elements the 40 x 30 tensor spans five: its norms (warm-up) and
    its largest ratio (compression stage) reduce over its blocks, and the run follows the
    one with whole-tensor blocks to summation order."""
    from onebit.kernels import _triton_optim

    whole = _run("onebit-lamb", "triton", torch.float32, steps=12)
    monkeypatch.setattr(_triton_optim, "BLOCK", 256)
    _assert_follows(_run("onebit-lamb", "triton", torch.float32, steps=12), whole, 1e-6, "blocks")


@needs_triton
@pytest.mark.parametrize("kind", ["onebit-lamb", "zero-one-adam"])
def test_triton_updates_in_float64_follow_the_reference_to_summation_order(kind):
    """float64 state (float64 loads, square roots and divisions in the kernels): the run
    differs from the reference's only in the order of its sums, far below 1e-12."""
    device = backend_device("triton")
    fused = _run(kind, "triton", torch.float64, steps=12)
    _assert_follows(fused, _run(kind, "torch", torch.float64, device, steps=12), 1e-12, kind)
