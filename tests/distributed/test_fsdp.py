"""onebit's optimizers on FSDP2-sharded parameters (gloo, real processes): the sharded maths
against the replicated optimizer, and HSDP with 1-bit between replicas (ALGORITHM.md,
"Sharded parameters (FSDP2 and HSDP)")."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import onebit
from onebit.collectives import ring_allreduce_bytes
from onebit.exchange import node_groups
from onebit.exchange.protocol import Layout, exchange_bytes, padded_size
from onebit.testing import spawn_workers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BATCH = 8


def _model(hidden: int = 7, out: int = 5) -> torch.nn.Module:
    """By default uneven shapes: slices of 4 and 3 rows (and 3 and 2) on two ranks."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, out)
    )


def _batch(step: int, rank: int, out: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, out, generator=gen)


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


OPTIMIZERS = {
    "lamb": lambda params, **kw: onebit.Lamb(params, lr=0.05, weight_decay=0.01, **kw),
    "lamb-clipped": lambda params, **kw: onebit.Lamb(params, lr=0.05, max_grad_norm=0.1, **kw),
    "onebit-lamb": lambda params, **kw: onebit.OneBitLamb(
        params, lr=0.05, freeze_step=4, compression="fused", weight_decay=0.01, **kw
    ),
    "onebit-adam": lambda params, **kw: onebit.OneBitAdam(
        params, lr=0.01, freeze_step=4, max_grad_norm=0.5, **kw
    ),
}


def _one_dimensional(rank: int, world: int, names: list[str]):
    """FSDP over both ranks against the replicated optimizer given the gradient of the whole
    batch, for each optimizer named: the largest difference after each step, and the state
    bytes of both."""
    mesh = init_device_mesh("cpu", (world,))
    single, _ = dist.new_subgroups(group_size=1)
    steps = {name: 6 if name.startswith("lamb") else 4 for name in names}  # 1-bit: the warm-up
    results = {
        name: _compare_one_dimensional(rank, world, name, steps[name], mesh, single)
        for name in names
    }
    # FSDP's own HSDP (a 2-D mesh: Replicate(), Shard(0)), which Lamb takes: one replica here.
    hsdp = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    results["lamb-fsdp-hsdp"] = _compare_one_dimensional(rank, world, "lamb", 6, hsdp, single)
    return results


def _compare_one_dimensional(rank, world, name, steps, mesh, single):
    reference = _model()
    model = _shard(copy.deepcopy(reference), mesh)
    kwargs = {} if name.startswith("lamb") else {"process_group": single}
    sharded_opt = OPTIMIZERS[name](model.parameters())
    reference_opt = OPTIMIZERS[name](reference.parameters(), kernels="torch", **kwargs)
    differences = []
    for step in range(steps):
        x, y = _batch(step, rank)
        _loss(model, x, y).backward()
        batches = [_batch(step, r) for r in range(world)]
        _loss(
            reference, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        ).backward()
        sharded_opt.step()
        reference_opt.step()
        for opt in (sharded_opt, reference_opt):
            opt.zero_grad()
        full = [p.full_tensor() for p in model.parameters()]
        differences.append(
            max(
                (a - b).abs().max().item()
                for a, b in zip(full, reference.parameters(), strict=True)
            )
        )
    memory = sharded_opt.memory_bytes()["state"], reference_opt.memory_bytes()["state"]
    return differences, memory


def test_one_dimensional_mesh_equals_the_replicated_optimizer():
    outputs = spawn_workers(_one_dimensional, 2, args=(list(OPTIMIZERS),), timeout_s=240)
    for rank, by_name in enumerate(outputs):
        for name, (differences, (sharded, replicated)) in by_name.items():
            assert max(differences) < 2e-6, f"{name}, rank {rank}: {differences}"
            assert sharded < replicated, f"{name}, rank {rank}: state {sharded} vs {replicated}"


def _slices(rank: int, world: int, steps: int):
    """OneBitAdam (per-tensor compression) on FSDP slices against a plain single-process
    OneBitAdam whose parameters are this rank's slices: bit for bit, through the
    compression stage (its maths is element-wise and per tensor)."""
    mesh = init_device_mesh("cpu", (world,))
    model = _shard(_model(), mesh)
    slices = [torch.nn.Parameter(p.to_local().detach().clone()) for p in model.parameters()]
    single, _ = dist.new_subgroups(group_size=1)
    kwargs = dict(lr=0.01, freeze_step=3, compression="per_tensor", kernels="torch")
    sharded_opt = onebit.OneBitAdam(model.parameters(), **kwargs)
    plain_opt = onebit.OneBitAdam(slices, process_group=single, **kwargs)
    for step in range(steps):
        x, y = _batch(step, rank)
        _loss(model, x, y).backward()
        for plain, param in zip(slices, model.parameters(), strict=True):
            plain.grad = param.grad.to_local().clone()
        sharded_opt.step()
        plain_opt.step()
        sharded_opt.zero_grad()
        for plain, param in zip(slices, model.parameters(), strict=True):
            assert torch.equal(plain, param.to_local()), f"step {step + 1}: a slice differs"
    for ours, theirs in zip(sharded_opt.error_feedback, plain_opt.error_feedback, strict=True):
        assert torch.equal(ours, theirs)
    # Exact resume from this rank's state_dict (its slices' state and error buffers).
    saved = copy.deepcopy((model.state_dict(), sharded_opt.state_dict()))
    resumed = _shard(_model(), mesh)
    resumed.load_state_dict(saved[0])
    resumed_opt = onebit.OneBitAdam(resumed.parameters(), **kwargs)
    resumed_opt.load_state_dict(saved[1])
    for step in range(steps, steps + 2):
        for m, opt in ((model, sharded_opt), (resumed, resumed_opt)):
            _loss(m, *_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    for ours, theirs in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(ours.to_local(), theirs.to_local()), "the resumed run differs"
    return sharded_opt.bytes_sent


def test_sharded_onebit_adam_is_the_optimizer_of_its_slices_bit_for_bit_and_resumes_exactly():
    spawn_workers(_slices, 2, args=(6,), timeout_s=180)


def _hsdp(rank: int, world: int, warmup: int, steps: int, hidden: int, out: int):
    """2 x 2: FSDP within a "node", 1-bit OneBitLamb across, against the replicated
    OneBitLamb with the hierarchical exchange over nodes of 2."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference = _model(hidden, out)
    model = _shard(copy.deepcopy(reference), mesh["shard"])
    kwargs = dict(lr=0.05, freeze_step=warmup, compression="fused", weight_decay=0.01)
    sharded_opt = onebit.OneBitLamb(
        model.parameters(), process_group=mesh["replicate"].get_group(), **kwargs
    )
    reference_opt = onebit.OneBitLamb(
        reference.parameters(), node_groups=node_groups(2), kernels="torch", **kwargs
    )
    differences, sent = [], []
    for step in range(steps):
        x, y = _batch(step, rank, out)
        for m in (model, reference):
            _loss(m, x, y).backward()
        before = sharded_opt.bytes_sent["compression"]
        sharded_opt.step()
        reference_opt.step()
        sent.append(sharded_opt.bytes_sent["compression"] - before)
        for opt in (sharded_opt, reference_opt):
            opt.zero_grad()
        full = [p.full_tensor() for p in model.parameters()]
        differences.append(  # relative to the reference, of all weights together
            (_flat(full) - _flat(reference.parameters())).norm().item()
            / _flat(reference.parameters()).norm().item()
        )
    local = torch.cat([p.to_local().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(replicas, local, group=mesh["replicate"].get_group())
    slice_numel = local.numel()
    memory = sharded_opt.memory_bytes(), reference_opt.memory_bytes()
    return differences, sent, torch.equal(*replicas), slice_numel, memory


@pytest.mark.slow
@pytest.mark.parametrize(("hidden", "out"), [(7, 5), (64, 8)])
def test_hsdp_two_by_two_follows_the_hierarchical_optimizer(hidden, out):
    warmup, steps = 3, 8
    outputs = spawn_workers(_hsdp, 4, args=(warmup, steps, hidden, out), timeout_s=240)
    for rank, (differences, sent, replicas_agree, slice_numel, memory) in enumerate(outputs):
        assert max(differences[:warmup]) < 1e-6, f"rank {rank}: warm-up {differences}"
        # The compression stage compresses other groups of elements (the FSDP slices instead
        # of contiguous chunks): the trajectories part by compression noise, not by rounding.
        assert 0 < max(differences[warmup:]) < 0.05, f"rank {rank}: {differences}"
        assert replicas_agree, f"rank {rank}: the replicas of its slices differ"
        layout = Layout.flat(padded_size(slice_numel, 2), 2)
        check = 8  # the first compression step's gradient check: one int64 per other replica
        per_step = exchange_bytes(layout, torch.float32)
        # and a byte per tensor to the other replica: whether a rank had its gradient
        per_step += ring_allreduce_bytes(len(list(_model(hidden, out).parameters())), 2)
        assert sent[warmup:] == [per_step + check] + [per_step] * (steps - warmup - 1)
        sharded, replicated = memory
        if hidden % 2 == 0 and out % 2 == 0:  # even slices: half of every tensor's state
            assert sharded["state"] <= 0.55 * replicated["state"], f"rank {rank}: {memory}"


def _rejected(rank: int, world: int):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    errors = {}
    for name, build in {
        "2-D mesh": lambda: onebit.OneBitLamb(_shard(_model(), mesh).parameters()),
        "no process_group": lambda: onebit.OneBitLamb(_shard(_model(), mesh["shard"]).parameters()),
        "zero-one-adam": lambda: onebit.ZeroOneAdam(
            _shard(_model(), mesh["shard"]).parameters(),
            process_group=mesh["replicate"].get_group(),
        ),
        "overlap": lambda: onebit.OneBitLamb(
            _shard(_model(), mesh["shard"]).parameters(),
            process_group=mesh["replicate"].get_group(),
            overlap_backward=True,
        ),
    }.items():
        with pytest.raises(ValueError) as caught:
            build()
        errors[name] = str(caught.value)
    return errors


@pytest.mark.slow
def test_what_does_not_fit_is_a_named_error():
    errors = spawn_workers(_rejected, 4, timeout_s=180)[0]
    assert "mesh['shard']" in errors["2-D mesh"]
    assert "process_group" in errors["no process_group"]
    assert "ZeroOneAdam" in errors["zero-one-adam"]
    assert "overlap_backward" in errors["overlap"]


def _guarded(rank: int, world: int, steps: int):
    """OneBitAdam with the guard after the freeze on FSDP slices, and the replicated optimizer
    on the whole batch, the loss scaled up from step 15 to 35 so that the momentum outgrows
    the frozen variance: the refreshes of both. (Their weights part in the compression stage:
    the sharded exchange compresses each slice alone.)"""
    mesh = init_device_mesh("cpu", (world,))
    single, _ = dist.new_subgroups(group_size=1)
    reference = _model()
    model = _shard(copy.deepcopy(reference), mesh)
    kwargs = dict(lr=0.01, freeze_step=4, compression="per_tensor")
    sharded_opt = onebit.OneBitAdam(model.parameters(), **kwargs)
    reference_opt = onebit.OneBitAdam(
        reference.parameters(), kernels="torch", process_group=single, **kwargs
    )
    for step in range(1, steps + 1):
        scale = 1.3 ** (min(max(step, 15), 35) - 15)
        x, y = _batch(step, rank)
        (scale * _loss(model, x, y)).backward()
        batches = [_batch(step, r) for r in range(world)]
        whole = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        (scale * _loss(reference, *whole)).backward()
        for opt in (sharded_opt, reference_opt):
            opt.step()
            opt.zero_grad()
    return sharded_opt.refreshes, reference_opt.refreshes


@pytest.mark.slow
def test_the_guard_after_the_freeze_decides_alike_on_every_shard():
    """Each shard observes its slices, the energies summed over the shard group at a check:
    both ranks take the decision the whole tensors give."""
    (sharded, replicated), (other, _) = spawn_workers(_guarded, 2, args=(60,), timeout_s=240)
    assert sharded and sharded == other == replicated, (sharded, other, replicated)


def _trust_bounded(rank: int, world: int, steps: int):
    """1-bit LAMB with ``trust_bound`` on FSDP slices: after each step, each tensor's ρ_0,
    coefficient and unbounded coefficient c_frz f on this rank."""
    mesh = init_device_mesh("cpu", (world,))
    model = _shard(_model(), mesh)
    opt = onebit.OneBitLamb(
        model.parameters(), lr=0.05, freeze_step=4, weight_decay=0.01, trust_bound=1.0
    )
    history = []
    for step in range(steps):
        _loss(model, *_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        states = [opt.state[p] for p in model.parameters()]
        history.append(
            [
                (
                    float(s["trust_base"]),
                    float(s["lamb_coeff"]),
                    float(s["lamb_coeff_freeze"] * s["last_factor"]),
                )
                for s in states
            ]
        )
    return history


@pytest.mark.slow
def test_the_trust_bound_is_the_whole_tensors_on_every_shard():
    """ρ_0 and the bound come from whole-tensor norms (summed over the shard group), so both
    shards hold the same base and take the same coefficient, and the bound binds."""
    steps = 12
    first, second = spawn_workers(_trust_bounded, 2, args=(steps,), timeout_s=240)
    assert first == second
    assert all(base > 0 for base, _, _ in first[-1])
    assert any(c < unbounded for step in first[4:] for _, c, unbounded in step)
