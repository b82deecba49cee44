"""The delayed exchange (ALGORITHM.md, "Delayed exchange") on gloo ranks.

With gradients that do not depend on the weights, the delayed optimizer's shared weights after
step s + 1 are the undelayed optimizer's after step s, bit for bit, from the freeze on (the
same momenta, error feedback and updates, each applied one step later), and equal after
``finish_exchange()``; a non-finite momentum drops the same update. Between steps the
parameters hold each rank's own prediction, unlike the shared weights. The bytes are the same
(the failed step's gradient flags aside), and the replica check finds the shared weights the
same on every rank. A checkpoint taken with an exchange in flight resumes the run exactly,
also when only rank 0 takes it; under DDP (whose buffer broadcast, and the loop's own
allreduce, run while the exchange is in flight) the run is the plain loop's."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import onebit
from onebit.collectives import ring_allreduce_bytes
from onebit.testing import spawn_workers

FREEZE = 3
STEPS = 9
SHAPES = [(6, 5), (5,), (3, 7), (40,)]
NAN_STEP = 6  # the step whose gradient on rank 1 is not finite, in the cases that inject it

# (optimizer, options, inject a non-finite gradient)
CASES = [
    ("OneBitLamb", dict(kernels="numba", verify_every=1), False),  # replicas checked each step
    ("OneBitLamb", dict(kernels="torch", compression="fused"), True),
    ("OneBitLamb", dict(kernels="numba", bucket_cap_mb=100 * 4 / 2**20), False),
    ("OneBitAdam", dict(kernels="torch"), True),
]


def _gradients(step: int, rank: int, inject: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
    if inject and step == NAN_STEP and rank == 1:
        grads[2][1, 1] = float("nan")
    return grads


def _build(name: str, params, options: dict, delayed: bool):
    cls = getattr(onebit, name)
    return cls(params, lr=0.02, freeze_step=FREEZE, delayed_exchange=delayed, **options)


def _trajectory(rank: int, name: str, options: dict, inject: bool, delayed: bool):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = _build(name, params, options, delayed)
    weights, predicted = [], []
    for step in range(1, STEPS + 1):
        for param, grad in zip(params, _gradients(step, rank, inject), strict=True):
            param.grad = grad
        optimizer.step()
        weights.append(torch.cat([w.reshape(-1) for w in optimizer.shared_weights()]))
        predicted.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
    if not delayed:
        assert all(torch.equal(a, b) for a, b in zip(weights, predicted, strict=True))
    pending = optimizer.update_pending
    optimizer.finish_exchange()
    final = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    return weights, predicted, final, pending, optimizer.bytes_sent, optimizer.skipped_steps


def _runs(rank: int, world: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the injected steps' skip warnings
        return [
            [_trajectory(rank, name, options, inject, delayed) for delayed in (False, True)]
            for name, options, inject in CASES
        ]


def test_delayed_steps_are_the_undelayed_steps_one_step_late():
    ranks = spawn_workers(_runs, 2, timeout_s=240)
    for index, (name, options, inject) in enumerate(CASES):
        case = f"{name} {options} non-finite step: {inject}"
        for rank, runs in enumerate(ranks):
            (plain, _, plain_final, plain_pending, plain_bytes, plain_skipped) = runs[index][0]
            (late, predicted, late_final, pending, late_bytes, late_skipped) = runs[index][1]
            assert not plain_pending and pending, case
            for step in range(FREEZE):  # the warm-up is not delayed
                assert torch.equal(late[step], plain[step]), (case, rank, step + 1)
                assert torch.equal(predicted[step], plain[step]), (case, rank, step + 1)
            for step in range(FREEZE, STEPS):  # each rank's own prediction
                other = ranks[1 - rank][index][1][1][step]
                assert not torch.equal(predicted[step], late[step]), (case, rank, step + 1)
                assert not torch.equal(predicted[step], other), (case, rank, step + 1)
            for step in range(FREEZE, STEPS - 1):  # step s + 1 applies step s's update
                assert torch.equal(late[step + 1], plain[step]), (case, rank, step + 2)
                assert not torch.equal(late[step + 1], late[step]) or (
                    inject and step + 1 == NAN_STEP
                ), (case, step)
            assert torch.equal(late_final, plain_final), case
            # the failed step's gradient flags went out before its exchange failed
            flags = ring_allreduce_bytes(len(SHAPES), 2) if inject else 0
            assert late_bytes == {**plain_bytes, "compression": plain_bytes["compression"] + flags}
            assert late_skipped == plain_skipped == int(inject), case
            assert torch.equal(late_final, ranks[0][index][1][2]), (case, rank)


def _checkpointed(rank: int, world: int):
    """Three delayed runs of one model: uninterrupted; rank 0 alone taking a checkpoint at
    step 5; both ranks taking one at step 5, then a new model and optimizer loading it and
    taking the steps after it."""

    def run(steps, save_on=(), start=None):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
        optimizer = _build("OneBitLamb", params, dict(kernels="numba"), True)
        first = 1
        if start is not None:
            model_state, optimizer_state, first = start
            with torch.no_grad():
                for param, saved in zip(params, model_state, strict=True):
                    param.copy_(saved)
            optimizer.load_state_dict(torch.load(io.BytesIO(optimizer_state)))
        weights, saved = {}, None
        for step in range(first, steps + 1):
            for param, grad in zip(params, _gradients(step, rank, False), strict=True):
                param.grad = grad
            optimizer.step()
            weights[step] = torch.cat([p.detach().reshape(-1) for p in params]).clone()
            if step == 5 and rank in save_on:
                buffer = io.BytesIO()
                torch.save(optimizer.state_dict(), buffer)
                saved = ([p.detach().clone() for p in params], buffer.getvalue(), step + 1)
        optimizer.finish_exchange()
        weights["final"] = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        return weights, saved

    uninterrupted, _ = run(STEPS)
    rank0_saved, _ = run(STEPS, save_on=(0,))
    _, saved = run(5, save_on=(0, 1))
    pending = torch.load(io.BytesIO(saved[1]))["onebit"]["pending_update"]
    resumed, _ = run(STEPS, start=saved)
    return uninterrupted, rank0_saved, resumed, pending["step"]


def test_a_checkpoint_with_an_exchange_in_flight_resumes_the_run_exactly():
    ranks = spawn_workers(_checkpointed, 2, timeout_s=180)
    for rank, (uninterrupted, rank0_saved, resumed, pending_step) in enumerate(ranks):
        assert pending_step == 5
        for key, weights in uninterrupted.items():
            assert torch.equal(rank0_saved[key], weights), (rank, key)
            if key == "final" or key > 5:
                assert torch.equal(resumed[key], weights), (rank, key)
        assert torch.equal(uninterrupted["final"], ranks[0][0]["final"])


class _Net(nn.Module):
    """A network with a buffer, so that DDP broadcasts it in every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.norm, self.last = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)

    def forward(self, x):
        return self.last(torch.tanh(self.norm(self.first(x))))


def _ddp_and_plain(rank: int, world: int):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from onebit.ddp import register_comm_hook

    out = {}
    for under_ddp in (False, True):
        net = _Net()
        model = DistributedDataParallel(net) if under_ddp else net
        optimizer = onebit.OneBitLamb(
            net.parameters(), lr=0.01, freeze_step=FREEZE, delayed_exchange=True
        )
        if under_ddp:
            register_comm_hook(model, optimizer)
        else:
            optimizer.process_group = None
        losses = []
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(16, 8, generator=generator)
            y = torch.randn(16, 2, generator=generator)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not under_ddp and optimizer.needs_averaged_gradients:
                for param in net.parameters():
                    dist.all_reduce(param.grad)
                    param.grad.div_(world)
            optimizer.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)  # the loop's own collective, while the exchange runs
            losses.append(logged.item())
        optimizer.finish_exchange()
        weights = [p.detach().clone() for p in net.parameters()]
        out[under_ddp] = weights, losses, optimizer.bytes_sent["compression"]
    return out


@pytest.mark.slow
def test_under_ddp_the_delayed_run_is_the_plain_loops():
    ranks = spawn_workers(_ddp_and_plain, 2, timeout_s=180)
    for rank, out in enumerate(ranks):
        plain, ddp = out[False], out[True]
        assert plain[1] == ddp[1], rank
        assert all(torch.equal(a, b) for a, b in zip(plain[0], ddp[0], strict=True)), rank
        assert plain[2] == ddp[2] > 0
        assert all(torch.equal(a, b) for a, b in zip(out[True][0], ranks[0][True][0], strict=True))
