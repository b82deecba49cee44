"""Checkpoints through torch.distributed.checkpoint (onebit.dcp): exact resume on the same
layout (error feedback included), resharded moments and restarted error buffers, with a
warning, on another one; named errors for what it cannot save."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import onebit
from onebit import dcp
from onebit.testing import spawn_workers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> torch.nn.Module:
    """Uneven shapes: FSDP slices of 4 and 3 rows (and 3 and 2) on two ranks."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, optimizer, steps: range, rank: int = 0) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _local(tensors) -> list[torch.Tensor]:
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def _assert_same_run(first, second) -> None:
    """Two (model, optimizer) pairs hold bit-identical weights and error buffers."""
    (model_a, opt_a), (model_b, opt_b) = first, second
    for a, b in zip(_local(model_a.parameters()), _local(model_b.parameters()), strict=True):
        assert torch.equal(a, b), "the resumed run's weights differ"
    if isinstance(opt_a, onebit.OneBitOptimizer):
        for a, b in zip(opt_a.error_feedback, opt_b.error_feedback, strict=True):
            assert torch.equal(a, b), "the resumed run's error buffers differ"


@contextlib.contextmanager
def _no_restart() -> Iterator[None]:
    """The block warns of no error buffers restarting."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if "error-feedback" in str(w.message)]


OPTIMIZERS = {
    "lamb": lambda params, **kw: onebit.Lamb(params, lr=0.05, weight_decay=0.01, **kw),
    "onebit-lamb": lambda params, **kw: onebit.OneBitLamb(
        params, lr=0.05, freeze_step=3, weight_decay=0.01, **kw
    ),
    "onebit-lamb-fused": lambda params, **kw: onebit.OneBitLamb(
        params, lr=0.05, freeze_step=3, compression="fused", **kw
    ),
    "onebit-adam-bucketed": lambda params, **kw: onebit.OneBitAdam(
        params, lr=0.01, freeze_step=3, bucket_cap_mb=0.0001, **kw
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_run_resumed_from_a_checkpoint_continues_bit_for_bit(tmp_path, name):
    model = _model()
    optimizer = OPTIMIZERS[name](model.parameters())
    _train(model, optimizer, range(5))  # through the switch to compression
    dcp.save({"model": model, "optimizer": optimizer, "step": 5}, checkpoint_id=tmp_path)
    _train(model, optimizer, range(5, 8))
    resumed = _model()
    resumed_optimizer = OPTIMIZERS[name](resumed.parameters())
    state = {"model": resumed, "optimizer": resumed_optimizer, "step": 0}
    with _no_restart():
        dcp.load(state, checkpoint_id=tmp_path)
    assert state["step"] == 5
    _train(resumed, resumed_optimizer, range(5, 8))
    _assert_same_run((model, optimizer), (resumed, resumed_optimizer))


def test_what_it_cannot_save_or_load_is_a_named_error(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="ZeroOneAdam"):
        dcp.save({"optimizer": onebit.ZeroOneAdam(model.parameters())}, tmp_path / "a")
    with pytest.raises(ValueError, match="not a onebit optimizer.*get_optimizer_state_dict"):
        dcp.save({"optimizer": torch.optim.Adam(model.parameters())}, tmp_path / "b")
    optimizer = onebit.Lamb(model.parameters(), lr=0.1)
    _train(model, optimizer, range(1))
    dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=tmp_path / "c")
    with pytest.raises(ValueError, match="no onebit optimizer under 'optim'"):
        dcp.load({"optim": onebit.Lamb(model.parameters())}, checkpoint_id=tmp_path / "c")
    other = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5))
    other_optimizer = onebit.Lamb(other.parameters())
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(ValueError, match=r"shape \(7, 6\); parameter 0 has shape \(9, 6\)"):
        dcp.load({"optimizer": other_optimizer}, checkpoint_id=tmp_path / "c")
    assert not other_optimizer.state and all(
        torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True)
    )
    with pytest.raises(ValueError, match="checkpoint_id or storage_reader"):
        dcp.load({"optimizer": optimizer})
    fresh = _model()
    before = [p.clone() for p in fresh.parameters()]
    with pytest.raises(ValueError, match="'optimizer' was saved from Lamb, not from OneBitLamb"):
        state = {"model": fresh, "optimizer": onebit.OneBitLamb(fresh.parameters())}
        dcp.load(state, checkpoint_id=tmp_path / "c")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))


def _gathered_momentum(optimizer) -> list[torch.Tensor]:
    """Every parameter's whole exp_avg (gathered from the FSDP slices where sharded)."""
    momenta = []
    for param in (p for g in optimizer.param_groups for p in g["params"]):
        value = optimizer.state[param]["exp_avg"]
        if hasattr(param, "device_mesh"):
            pieces = [None] * dist.get_world_size(param.device_mesh.get_group())
            dist.all_gather_object(pieces, value.clone(), group=param.device_mesh.get_group())
            value = torch.cat(pieces)
        momenta.append(value.clone())
    return momenta


def _sharded_resume(rank: int, world: int, folder: str):
    """FSDP over both ranks, OneBitLamb per tensor: an exact resume on the same mesh, then the
    same checkpoint on replicated parameters (the moments whole, the error buffers reset)."""
    mesh = init_device_mesh("cpu", (world,))
    single, _ = dist.new_subgroups(group_size=1)  # one replica: the exchange over one rank

    def build(sharded: bool, group=single):
        model = _shard(_model(), mesh) if sharded else _model()
        return model, OPTIMIZERS["onebit-lamb"](model.parameters(), process_group=group)

    model, optimizer = build(True)
    _train(model, optimizer, range(5), rank)
    dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=folder)
    momenta = _gathered_momentum(optimizer)
    weights = [p.full_tensor() for p in model.parameters()]
    _train(model, optimizer, range(5, 8), rank)
    resumed = build(True)
    with _no_restart():
        dcp.load({"model": resumed[0], "optimizer": resumed[1]}, checkpoint_id=folder)
    _train(*resumed, range(5, 8), rank)
    _assert_same_run((model, optimizer), resumed)

    replicated = build(False, group=None)  # both ranks one data-parallel group, no FSDP
    with pytest.warns(UserWarning, match="data-parallel world size 1, now 2.*reset to zero"):
        dcp.load({"model": replicated[0], "optimizer": replicated[1]}, checkpoint_id=folder)
    loaded = [replicated[1].state[p]["exp_avg"] for p in replicated[0].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(momenta, loaded, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights, replicated[0].parameters(), strict=True))
    _train(*replicated, range(5, 6), rank)  # it trains on, its error feedback from zero
    return replicated[1].stage


def test_sharded_state_resumes_exactly_and_reshards_onto_replicated_parameters(tmp_path):
    stages = spawn_workers(_sharded_resume, 2, args=(str(tmp_path),), timeout_s=180)
    assert stages == ["compression", "compression"]


def _hsdp_resume(rank: int, world: int, folder: str):
    """HSDP 2 x 2 (FSDP in a node, 1 bit between nodes): exact resume through DCP; loaded onto
    FSDP over all four ranks, the moments are resharded and the error buffers restart."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build():
        model = _shard(_model(), mesh["shard"])
        group = mesh["replicate"].get_group()
        return model, OPTIMIZERS["onebit-lamb-fused"](model.parameters(), process_group=group)

    model, optimizer = build()
    _train(model, optimizer, range(5), rank)
    dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=folder)
    momenta = _gathered_momentum(optimizer)
    weights = [p.full_tensor() for p in model.parameters()]
    _train(model, optimizer, range(5, 8), rank)
    resumed = build()
    with _no_restart():
        dcp.load({"model": resumed[0], "optimizer": resumed[1]}, checkpoint_id=folder)
    _train(*resumed, range(5, 8), rank)
    _assert_same_run((model, optimizer), resumed)

    flat_mesh = init_device_mesh("cpu", (world,))
    single, _ = dist.new_subgroups(group_size=1)
    wide = _shard(_model(), flat_mesh)
    wide_optimizer = OPTIMIZERS["onebit-lamb-fused"](wide.parameters(), process_group=single)
    with pytest.warns(UserWarning, match="data-parallel world size 2, now 1"):
        dcp.load({"model": wide, "optimizer": wide_optimizer}, checkpoint_id=folder)
    wide_weights = [p.full_tensor() for p in wide.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights, wide_weights, strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(momenta, _gathered_momentum(wide_optimizer), strict=True)
    )


@pytest.mark.slow
def test_hsdp_resumes_exactly_through_dcp_and_reshards_onto_another_mesh(tmp_path):
    spawn_workers(_hsdp_resume, 4, args=(str(tmp_path),), timeout_s=240)
