"""The hierarchical exchange on real gloo processes against its single-process simulation."""

from __future__ import annotations

import pytest
import torch
from helpers.oracle import oracle_compressed_allreduce, oracle_hierarchical_compressed_allreduce

import onebit
from onebit.collectives import NonFiniteError, TrafficCounter, padded_size
from onebit.exchange.hierarchical import hierarchical_bytes, node_groups
from onebit.testing import spawn_workers

CALLS = 4


def _inputs(world: int, numel: int, call: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * world + call)
    return torch.randn(world, numel, generator=gen) * torch.linspace(0.5, 2.0, world)[:, None]


def _exchange(rank: int, world: int, local: int, numel: int):
    intra, inter = node_groups(local)
    worker_error = torch.zeros(numel // local)
    server_error = torch.zeros(numel // world)
    sim = (torch.zeros(world, numel // local), torch.zeros(world, numel // world))
    flat_sim = (torch.zeros(world, numel), torch.zeros(world, numel // world))
    traffic = TrafficCounter()
    workspace = onebit.HierarchicalWorkspace()
    for call in range(CALLS):
        inputs = _inputs(world, numel, call)
        result = onebit.hierarchical_compressed_allreduce(
            inputs[rank].clone(),
            worker_error,
            server_error,
            intra,
            inter,
            workspace=workspace,
            traffic=traffic,
        )
        expected, *sim = oracle_hierarchical_compressed_allreduce(inputs, *sim, local)
        assert torch.equal(result, expected), f"call {call}: result differs from the simulation"
        assert torch.equal(worker_error, sim[0][rank]), f"call {call}: worker_error differs"
        assert torch.equal(server_error, sim[1][rank]), f"call {call}: server_error differs"
        if local == 1:  # the flat exchange, bit for bit
            flat, *flat_sim = oracle_compressed_allreduce(inputs, *flat_sim)
            assert torch.equal(result, flat)
    return result, dict(traffic.bytes_sent)


@pytest.mark.parametrize(
    ("nodes", "local"),
    [
        (2, 2),
        pytest.param(3, 1, marks=pytest.mark.slow),
        pytest.param(1, 3, marks=pytest.mark.slow),
    ],
)
def test_matches_the_simulation_bit_for_bit_and_ranks_agree(nodes, local):
    world = nodes * local
    numel = padded_size(1000, world)
    outputs = spawn_workers(_exchange, world, args=(local, numel), timeout_s=120)
    expected_bytes = hierarchical_bytes(numel, local, nodes, torch.float32)
    for rank, (result, sent) in enumerate(outputs):
        assert torch.equal(result, outputs[0][0]), f"rank {rank} got a different result"
        counted = {kind: nbytes for kind, nbytes in expected_bytes.items() if nbytes}
        assert sent == {kind: CALLS * nbytes for kind, nbytes in counted.items()}


def _non_finite(rank: int, world: int):
    intra, inter = node_groups(2)
    buffer = torch.randn(64, generator=torch.Generator().manual_seed(rank))
    if rank == 3:
        buffer[5] = float("nan")  # shard 0 of node 1: only local index 0 sees it directly
    worker_error, server_error = torch.full((32,), 0.5), torch.full((16,), 0.25)
    try:
        onebit.hierarchical_compressed_allreduce(buffer, worker_error, server_error, intra, inter)
    except NonFiniteError:
        return bool((worker_error == 0.5).all() and (server_error == 0.25).all())
    return None


@pytest.mark.slow
def test_non_finite_input_anywhere_raises_on_every_rank_without_touching_state():
    assert spawn_workers(_non_finite, 4, timeout_s=60) == [True] * 4


# ------------------------------------------------------------------ the optimizers on 2 x 2
def _optimizer_run(rank: int, world: int, directory: str, use_ddp: bool, stop: int, resume: bool):
    """OneBitLamb with node groups of 2 on 4 ranks: parameters after every step, and a
    checkpoint saved after step 6 (or resumed from it)."""
    import os

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = onebit.OneBitLamb(
        model.parameters(), lr=0.01, freeze_step=3, weight_decay=0.01, node_groups=node_groups(2)
    )
    forward = model
    if use_ddp:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        onebit.ddp.register_comm_hook(forward, opt)
    path = os.path.join(directory, f"rank{rank}.pt")
    start = 0
    if resume:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = opt.step_count
    gen = torch.Generator().manual_seed(100 + rank)
    history = []
    for step in range(stop):
        x = torch.randn(8, 6, generator=gen)  # the data of every step, also when resuming
        if step < start:
            continue
        opt.zero_grad()
        torch.nn.functional.mse_loss(forward(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        if step + 1 == 6 and not (resume or use_ddp):
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return history, opt.bytes_sent


def _plain_ddp_and_resumed(rank: int, world: int, directory: str):
    """The plain loop (saving its checkpoint), the DDP path and the resumed plain loop, one
    after another in the same processes."""
    return [
        _optimizer_run(rank, world, directory, use_ddp, 10, resume)
        for use_ddp, resume in ((False, False), (True, False), (False, True))
    ]


@pytest.mark.slow  # four processes, three runs
def test_optimizer_on_two_nodes_of_two_ranks_plain_ddp_and_resume_agree(tmp_path):
    runs = spawn_workers(_plain_ddp_and_resumed, 4, args=(str(tmp_path),), timeout_s=240)
    plain, ddp, resumed = ([runs[rank][kind] for rank in range(4)] for kind in range(3))
    for step in range(10):
        for rank in range(1, 4):
            assert torch.equal(plain[rank][0][step], plain[0][0][step]), (rank, step + 1)
    for rank in range(4):
        resumed_steps = zip(plain[rank][0][6:], resumed[rank][0], strict=True)
        assert all(torch.equal(a, b) for a, b in resumed_steps), f"rank {rank}: resume differs"
        # gloo may sum 4 ranks' warm-up gradients in another order in DDP's buckets than in
        # the optimizer's flat buffer, so the two paths agree to rounding, not to the bit.
        for step, (a, b) in enumerate(zip(plain[rank][0], ddp[rank][0], strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step + 1}")
        assert ddp[rank][1]["compression"] == plain[rank][1]["compression"] > 0


def _two_data_parallel_groups(rank: int, world: int):
    """4 ranks as 2 data-parallel x 2 model-parallel: ranks {0, 2} and {1, 3} each train
    their own replica (another model per model-parallel rank) at the same time."""
    groups = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
    group = groups[rank % 2]
    torch.manual_seed(rank % 2)  # the two model-parallel ranks hold different parameters
    model = torch.nn.Linear(5, 3)
    opt = onebit.OneBitLamb(model.parameters(), lr=0.01, freeze_step=2, process_group=group)
    forward = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    onebit.ddp.register_comm_hook(forward, opt)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x = torch.randn(4, 5, generator=gen)
        opt.zero_grad()
        forward(x).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.slow
def test_optimizers_run_inside_data_parallel_subgroups_at_the_same_time():
    results = spawn_workers(_two_data_parallel_groups, 4, timeout_s=120)
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[3])
    assert not torch.equal(results[0], results[1])
