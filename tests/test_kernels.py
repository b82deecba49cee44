"""Every fused backend against the pure-torch reference, stage by stage and end to end."""

from __future__ import annotations

import pytest
import torch

from onebit import kernels
from onebit.compression import simulate_compressed_allreduce

FUSED = [name for name in kernels.available() if name == "numba"]
SIZES = [8, 64, 1000 * 8, (1 << 16) + 8 * 37]  # one byte, several blocks, a ragged last block


def _device(backend: str) -> torch.device:
    return torch.device("cpu")


def _inputs(numel: int, dtype: torch.dtype, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(numel, generator=gen, dtype=torch.float64)
    b = torch.randn(numel, generator=gen, dtype=torch.float64) * 0.1
    a[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30], dtype=torch.float64)  # sign(+-0) = +1
    b[:4] = 0.0
    return a.to(dtype).to(device), b.to(dtype).to(device)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel", SIZES)
def test_worker_stages_match_the_reference(backend, dtype, numel):
    fused, reference = kernels.select(torch.empty(0, dtype=dtype), backend), kernels._load("torch")
    device = _device(backend)
    buffer, error = _inputs(numel, dtype, seed=numel, device=device)
    results = {}
    for impl in (reference, fused):
        err = error.clone()
        packed = torch.empty(numel // 8, dtype=torch.uint8, device=device)
        scratch = impl.scratch(numel, 1, dtype, device)
        x = torch.empty_like(buffer)
        scale = impl.worker_compress(buffer, err, packed, x, scratch)
        results[impl.name] = (packed.cpu(), scale.cpu(), err, x, scratch)
    ref_packed, ref_scale, *_ = results["torch"]
    packed, scale, err, x, scratch = results[backend]
    assert torch.equal(packed, ref_packed), "packed signs differ from the reference's"
    assert scale.dtype == ref_scale.dtype
    torch.testing.assert_close(scale, ref_scale, rtol=2e-6, atol=0)
    # With the reference's scale, the error update is the reference's to the last bit.
    fused.worker_error_update(buffer, err, packed.to(device), ref_scale.to(device), x, scratch)
    _, _, ref_err, ref_x, ref_scratch = results["torch"]
    reference.worker_error_update(buffer, ref_err, ref_packed, ref_scale, ref_x, ref_scratch)
    assert torch.equal(err.cpu(), ref_err.cpu())


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 3])
def test_server_stages_and_decode_match_the_reference(backend, dtype, n):
    fused, reference = kernels.select(torch.empty(0, dtype=dtype), backend), kernels._load("torch")
    device = _device(backend)
    chunk = (1 << 16) + 8 * 5
    gen = torch.Generator().manual_seed(n)
    received = torch.randint(0, 256, (n, chunk // 8), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, generator=gen, dtype=torch.float64) + 0.1).to(
        reference.scale_dtype(dtype)
    )
    server_error = (torch.randn(chunk, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    outputs = {}
    for impl in (reference, fused):
        error = server_error.clone().to(device)
        packed = torch.empty(chunk // 8, dtype=torch.uint8, device=device)
        scratch = impl.scratch(n * chunk, n, dtype, device)
        args = (received.to(device), scales.to(device), error)
        scale = impl.server_compress(*args, packed, scratch)
        outputs[impl.name] = (packed, scale, error, scratch)
    ref_packed, ref_scale, ref_error, ref_scratch = outputs["torch"]
    packed, scale, error, scratch = outputs[backend]
    assert torch.equal(packed.cpu(), ref_packed.cpu())
    torch.testing.assert_close(scale.cpu(), ref_scale.cpu(), rtol=2e-6, atol=0)
    reference.server_error_update(received, scales, ref_error, ref_packed, ref_scale, ref_scratch)
    fused.server_error_update(
        received.to(device), scales.to(device), error, packed, ref_scale.to(device), scratch
    )
    assert torch.equal(error.cpu(), ref_error.cpu())

    gathered = torch.randint(0, 256, (n, chunk // 8), generator=gen, dtype=torch.uint8)
    out_ref = torch.empty(n * chunk, dtype=dtype)
    out_fused = torch.empty(n * chunk, dtype=dtype, device=device)
    reference.decode(gathered, scales, out_ref)
    fused.decode(gathered.to(device), scales.to(device), out_fused)
    assert torch.equal(out_fused.cpu(), out_ref)


def _exchange(buffers, state, name):
    result, worker_errors, server_errors = simulate_compressed_allreduce(
        buffers, *state, kernels_name=name
    )
    return result, (worker_errors, server_errors)


@pytest.mark.parametrize("backend", FUSED)
def test_exchanges_differ_only_where_the_server_average_is_within_rounding_of_zero(backend):
    """Workers holding permutations of the same values have equal scales in exact
    arithmetic, so a server average such as ``(a0 - a1 + a2 - a3) / 4`` cancels to within
    rounding and its sign follows the rounding of the scales (which a fused backend sums in
    another order). Every disagreement must be such an element."""
    n, numel = 4, 8 * 4 * 4000
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(numel, generator=gen)
    buffers = torch.stack([values[torch.randperm(numel, generator=gen)] for _ in range(n)])
    zero = (torch.zeros(n, numel), torch.zeros(n, numel // n))
    ref, _ = _exchange(buffers, zero, "torch")
    fused, _ = _exchange(buffers, zero, backend)
    scales = buffers.double().norm(dim=1) / numel**0.5
    exact_average = (scales[:, None] / n * torch.where(buffers >= 0, 1.0, -1.0)).sum(0)
    differ = torch.sign(ref) != torch.sign(fused)
    assert differ.any(), "this input is meant to contain ties"
    assert (exact_average[differ].abs() <= 1e-4 * scales.max()).all()


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("n", [1, 4])
def test_successive_exchanges_stay_within_rounding_of_the_reference(backend, n):
    """Workers of distinct magnitudes (no ties) over 8 calls: the fused backend's results,
    scales and error states track the reference's to float32 summation error, and signs
    disagree on at most 1 element in 10^4."""
    numel, calls = 8 * n * 4000, 8
    gen = torch.Generator().manual_seed(7)
    magnitudes = torch.linspace(0.5, 2.0, n).unsqueeze(1)
    state = {
        name: (torch.zeros(n, numel), torch.zeros(n, numel // n)) for name in ("torch", backend)
    }
    disagreements = 0
    for _ in range(calls):
        buffers = torch.randn(n, numel, generator=gen) * magnitudes
        ref, state["torch"] = _exchange(buffers, state["torch"], "torch")
        fused, state[backend] = _exchange(buffers, state[backend], backend)
        same = torch.sign(ref) == torch.sign(fused)
        disagreements += int((~same).sum())
        torch.testing.assert_close(fused[same], ref[same], rtol=1e-4, atol=0)
    assert disagreements <= 1e-4 * calls * numel
    unit = ref.abs().max()  # the magnitude of a decoded element, +-(server scale)
    for ref_state, fused_state in zip(state["torch"], state[backend], strict=True):
        close = (ref_state - fused_state).abs() <= 1e-4 * unit
        assert close.float().mean() >= 1 - 1e-4 * calls


def test_select_names_the_problem():
    with pytest.raises(ValueError, match="unknown kernels 'cuda-magic'"):
        kernels.select(torch.zeros(8), "cuda-magic")
    assert kernels.select(torch.zeros(8, dtype=torch.bfloat16)).name == "torch"


@pytest.mark.skipif("numba" not in FUSED, reason="numba is not installed")
def test_numba_is_the_cpu_default_and_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.delenv("ONEBIT_KERNELS", raising=False)
    assert kernels.select(torch.zeros(8)).name == "numba"
    with pytest.raises(ValueError, match="cannot handle torch.bfloat16"):
        kernels.select(torch.zeros(8, dtype=torch.bfloat16), "numba")
    monkeypatch.setenv("ONEBIT_KERNELS", "torch")
    assert kernels.select(torch.zeros(8)).name == "torch"
