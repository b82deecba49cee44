"""Every fused backend against the pure-torch reference, stage by stage and end to end.

The triton backend runs on CUDA where there is a GPU, else in Triton's interpreter on CPU
(see tests/conftest.py); tests marked ``cuda`` need a GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers.oracle import oracle_compressed_allreduce

import onebit
from onebit import kernels
from onebit.testing import backend_device

CUDA = torch.cuda.is_available()
FUSED = [name for name in kernels.available() if name != "torch"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SIZES = [8, 64, 1000 * 8, (1 << 16) + 8 * 37]  # one byte, several blocks, a ragged last block
needs_cuda_triton = pytest.mark.skipif(
    not (CUDA and "triton" in FUSED), reason="needs CUDA and triton"
)


def _with_dtypes(dtypes) -> list:
    """``(backend, dtype)`` for every fused backend and each of ``dtypes`` it supports here."""
    return [
        pytest.param(name, dtype, id=f"{name}-{str(dtype).removeprefix('torch.')}")
        for name in FUSED
        for dtype in dtypes
        if kernels._load(name).supports(torch.empty(0, dtype=dtype, device=backend_device(name)))
    ]


def _inputs(numel: int, dtype: torch.dtype, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(numel, generator=gen, dtype=torch.float64)
    b = torch.randn(numel, generator=gen, dtype=torch.float64) * 0.1
    a[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30], dtype=torch.float64)  # sign(+-0) = +1
    b[:4] = 0.0
    return a.to(dtype).to(device), b.to(dtype).to(device)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (so -0.0 and 0.0 differ)."""
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def _assert_scale(scale: torch.Tensor, ref_scale: torch.Tensor, values: torch.Tensor) -> None:
    """A fused scale is ``||values|| / sqrt(N)`` summed in float64, then rounded: within an
    ulp of the exact value. The reference's (summed in float32 for float32 and half-precision
    buffers) agrees to that sum's error."""
    assert scale.dtype == ref_scale.dtype and scale.device == ref_scale.device
    exact = torch.linalg.vector_norm(values.double()) / values.numel() ** 0.5
    ulp = max(torch.finfo(scale.dtype).eps, 1e-12)
    torch.testing.assert_close(scale.double(), exact, rtol=ulp, atol=0)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-5, atol=0)


def _backends(name: str, dtype: torch.dtype):
    """The fused backend ``name`` for ``dtype`` on its test device, and the reference."""
    fused = kernels.select(torch.empty(0, dtype=dtype, device=backend_device(name)), name)
    return fused.compression, kernels._load("torch").compression


def _check_worker_stages(backend: str, dtype: torch.dtype, numel: int) -> None:
    """Packed signs are the reference's, the scale is right (see :func:`_assert_scale`)
    and left on the device, and with the reference's scale the error update is its bits."""
    fused, reference = _backends(backend, dtype)
    device = backend_device(backend)
    buffer, error = _inputs(numel, dtype, seed=numel, device=device)
    results = {}
    for impl in (reference, fused):
        err = error.clone()
        packed = torch.empty(numel // 8, dtype=torch.uint8, device=device)
        scratch = impl.scratch(numel, 1, dtype, device)
        x = torch.empty_like(buffer)
        scale = impl.worker_compress(buffer, err, packed, x, scratch)
        results[impl.name] = (packed, scale, err, x, scratch)
    ref_packed, ref_scale, ref_err, ref_x, ref_scratch = results["torch"]
    packed, scale, err, x, scratch = results[backend]
    assert torch.equal(packed, ref_packed), "packed signs differ from the reference's"
    _assert_scale(scale, ref_scale, ref_x)
    fused.worker_error_update(buffer, err, packed, ref_scale, x, scratch)
    reference.worker_error_update(buffer, ref_err, ref_packed, ref_scale, ref_x, ref_scratch)
    assert torch.equal(_bits(err), _bits(ref_err))


def _check_server_stages(backend: str, dtype: torch.dtype, n: int, chunk: int) -> None:
    """As :func:`_check_worker_stages` for the server's stages, then decoding. The scales
    are a column of ``[n, 2]`` rows, as :func:`onebit.compressed_allreduce` passes them."""
    fused, reference = _backends(backend, dtype)
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(n)
    received, gathered = (
        torch.randint(0, 256, (n, chunk // 8), generator=gen, dtype=torch.uint8).to(device)
        for _ in range(2)
    )
    rows = torch.rand(n, 2, generator=gen, dtype=torch.float64) + 0.1
    scales = rows.to(reference.scale_dtype(dtype)).to(device)[:, 0]
    server_error = (torch.randn(chunk, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    outputs = {}
    for impl in (reference, fused):
        error = server_error.clone().to(device)
        packed = torch.empty(chunk // 8, dtype=torch.uint8, device=device)
        scratch = impl.scratch(n * chunk, n, dtype, device)
        scale = impl.server_compress(received, scales, error, packed, scratch)
        outputs[impl.name] = (packed, scale, error, scratch)
    ref_packed, ref_scale, ref_error, ref_scratch = outputs["torch"]
    packed, scale, error, scratch = outputs[backend]
    assert torch.equal(packed, ref_packed), "packed signs differ from the reference's"
    _assert_scale(scale, ref_scale, ref_scratch.y)
    before = error.clone()
    apart = torch.full_like(error, float("nan"))
    fused.server_error_update(received, scales, error, packed, ref_scale, scratch, out=apart)
    assert torch.equal(_bits(error), _bits(before)), "an update into out changed server_error"
    reference.server_error_update(received, scales, ref_error, ref_packed, ref_scale, ref_scratch)
    fused.server_error_update(received, scales, error, packed, ref_scale, scratch)
    assert torch.equal(_bits(error), _bits(ref_error))
    assert torch.equal(_bits(apart), _bits(ref_error)), "the update into out differs"

    out_ref, out_fused = (torch.empty(n * chunk, dtype=dtype, device=device) for _ in range(2))
    reference.decode(gathered, scales, out_ref)
    fused.decode(gathered, scales, out_fused)
    assert torch.equal(_bits(out_fused), _bits(out_ref))


@pytest.mark.parametrize(("backend", "dtype"), _with_dtypes(DTYPES))
@pytest.mark.parametrize("numel", SIZES)
def test_worker_stages_match_the_reference(backend, dtype, numel):
    _check_worker_stages(backend, dtype, numel)


@pytest.mark.parametrize(("backend", "dtype"), _with_dtypes(DTYPES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_server_stages_and_decode_match_the_reference(backend, dtype, n):
    _check_server_stages(backend, dtype, n, chunk=(1 << 16) + 8 * 5)


@pytest.mark.skipif("triton" not in FUSED, reason="triton is not installed")
@pytest.mark.parametrize("block_bytes", [512, 8192])
def test_triton_stages_match_the_reference_with_either_block_size(monkeypatch, block_bytes):
    """The GPU's block size and the interpreter's, each with a ragged last block."""
    from onebit.kernels import _triton

    monkeypatch.setattr(_triton, "BLOCK_BYTES", block_bytes)
    chunk = 3 * 8 * block_bytes + 8 * 37
    _check_worker_stages("triton", torch.float32, 2 * chunk)
    _check_server_stages("triton", torch.float32, n=2, chunk=chunk)


@pytest.mark.cuda
@needs_cuda_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_stages_match_the_reference_bit_for_bit_on_large_cuda_buffers(dtype):
    _check_worker_stages("triton", dtype, 1 << 24)
    _check_server_stages("triton", dtype, n=4, chunk=1 << 22)


def _exchange(buffers, state, name):
    result, worker_errors, server_errors = oracle_compressed_allreduce(
        buffers, *state, kernels=name
    )
    return result, (worker_errors, server_errors)


@pytest.mark.parametrize("backend", FUSED)
def test_exchanges_differ_only_where_the_server_average_is_within_rounding_of_zero(backend):
    """Workers holding permutations of the same values have equal scales in exact
    arithmetic, so a server average such as ``(a0 - a1 + a2 - a3) / 4`` cancels to within
    rounding and its sign follows the rounding of the scales (which a fused backend sums in
    another order; whether any sign flips depends on the device). Every disagreement must be such
    an element."""
    n, numel, device = 4, 8 * 4 * 4000, backend_device(backend)
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(numel, generator=gen)
    buffers = torch.stack([values[torch.randperm(numel, generator=gen)] for _ in range(n)])
    buffers = buffers.to(device)
    zero = (torch.zeros(n, numel, device=device), torch.zeros(n, numel // n, device=device))
    ref, _ = _exchange(buffers, zero, "torch")
    fused, _ = _exchange(buffers, zero, backend)
    scales = buffers.double().norm(dim=1) / numel**0.5
    exact_average = (scales[:, None] / n * torch.where(buffers >= 0, 1.0, -1.0)).sum(0)
    within_rounding = exact_average.abs() <= 1e-4 * scales.max()
    assert within_rounding.sum() > 100, "this input is meant to contain ties"
    differ = torch.sign(ref) != torch.sign(fused)  # none, or some of the ties (device-dependent)
    assert within_rounding[differ].all()


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("n", [1, 4])
def test_successive_exchanges_stay_within_rounding_of_the_reference(backend, n):
    """Workers of distinct magnitudes (no ties) over 8 calls: the fused backend's results,
    scales and error states track the reference's to float32 summation error, and signs
    disagree on at most 1 element in 10^4."""
    numel, calls, device = 8 * n * 4000, 8, backend_device(backend)
    gen = torch.Generator().manual_seed(7)
    magnitudes = torch.linspace(0.5, 2.0, n).unsqueeze(1)
    state = {
        name: (torch.zeros(n, numel, device=device), torch.zeros(n, numel // n, device=device))
        for name in ("torch", backend)
    }
    disagreements = 0
    for _ in range(calls):
        buffers = (torch.randn(n, numel, generator=gen) * magnitudes).to(device)
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


@pytest.mark.cuda
@needs_cuda_triton
def test_compressed_allreduce_picks_triton_on_cuda_and_tracks_the_reference(monkeypatch):
    """World size 1 on a CUDA buffer: ``auto`` takes triton, whose calls equal the
    single-process simulation with triton bit for bit and the reference's to rounding."""
    monkeypatch.delenv("ONEBIT_KERNELS", raising=False)
    device, numel, calls = torch.device("cuda"), 1 << 20, 4
    assert kernels.select(torch.zeros(8, device=device)).name == "triton"
    gen = torch.Generator().manual_seed(11)
    state = {
        name: (torch.zeros(numel, device=device), torch.zeros(numel, device=device))
        for name in ("triton", "torch")
    }
    simulated = (torch.zeros(1, numel, device=device), torch.zeros(1, numel, device=device))
    workspace = onebit.CompressionWorkspace()
    disagreements = 0
    for _ in range(calls):
        buffer = torch.randn(numel, generator=gen).to(device)
        fused = onebit.compressed_allreduce(buffer, *state["triton"], workspace=workspace)
        ref = onebit.compressed_allreduce(buffer, *state["torch"], kernels="torch")
        expected, simulated = _exchange(buffer[None], simulated, "triton")
        assert torch.equal(_bits(fused), _bits(expected))
        assert torch.equal(_bits(state["triton"][0]), _bits(simulated[0][0]))
        assert torch.equal(_bits(state["triton"][1]), _bits(simulated[1][0]))
        same = torch.sign(ref) == torch.sign(fused)
        disagreements += int((~same).sum())
        torch.testing.assert_close(fused[same], ref[same], rtol=1e-4, atol=0)
    assert disagreements <= 1e-4 * calls * numel


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


@pytest.mark.skipif("triton" not in FUSED, reason="triton is not installed")
def test_triton_takes_cpu_tensors_only_in_the_interpreter(monkeypatch):
    from onebit.kernels import _triton

    backend = kernels._load("triton")
    monkeypatch.setattr(_triton, "_INTERPRETED", False)
    assert not backend.supports(torch.zeros(8))
    monkeypatch.setattr(_triton, "_INTERPRETED", True)
    assert backend.supports(torch.zeros(8, dtype=torch.float16))
    assert not backend.supports(torch.zeros(8, dtype=torch.bfloat16))
    assert not backend.supports(torch.zeros(8, dtype=torch.int32))
    monkeypatch.delenv("ONEBIT_KERNELS", raising=False)
    assert kernels.select(torch.zeros(8)).name != "triton"  # CPU's default stays numba


@pytest.mark.skipif("numba" not in FUSED, reason="numba is not installed")
def test_numba_gives_the_same_bits_on_one_thread_and_on_two():
    """Work is split into fixed blocks whatever the thread count: the parallel build (two
    threads) equals the serial one bit for bit, for the exchange and for an update."""

    def run(threads: int):
        default = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            gen = torch.Generator().manual_seed(3)
            numel = 3 * (1 << 16) + 8 * 5  # several blocks of the exchange's kernels
            buffer = torch.randn(numel, generator=gen)
            state = (torch.zeros(numel), torch.zeros(numel))
            out = onebit.compressed_allreduce(buffer.clone(), *state, kernels="numba")
            params = [torch.nn.Parameter(torch.randn(40_000, generator=gen)) for _ in range(2)]
            optimizer = onebit.Lamb(params, lr=0.01, weight_decay=0.01, kernels="numba")
            for _ in range(2):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                optimizer.step()
            return [out, *state, *[p.detach() for p in params]]
        finally:
            torch.set_num_threads(default)

    for serial, parallel in zip(run(1), run(2), strict=True):
        assert torch.equal(serial, parallel)


def test_every_numba_kernel_releases_the_gil():
    """The delayed exchange compresses on a thread of its own: its kernels must let the
    Python of forward and backward run meanwhile (inlined helpers run inside kernels)."""
    numba = pytest.importorskip("numba")
    from onebit.kernels import _numba_compression, _numba_optim

    kernels = {
        f"{module.__name__}.{name}": function.targetoptions
        for module in (_numba_compression, _numba_optim)
        for name, function in vars(module).items()
        if isinstance(function, numba.core.registry.CPUDispatcher)
    }
    from onebit.kernels._numba import _COMPRESSION
    from onebit.kernels._numba_optim import _KERNELS

    for drivers in (_COMPRESSION, _KERNELS):  # the functions the backend calls
        kernels |= {f"driver {n}": drivers(n).targetoptions for n in drivers._names}
    compiled = {name: opts for name, opts in kernels.items() if opts.get("inline") != "always"}
    assert len(compiled) >= 30, sorted(kernels)
    assert [name for name, opts in compiled.items() if not opts.get("nogil")] == []
