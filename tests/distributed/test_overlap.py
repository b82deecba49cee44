"""The exchange overlapped with backward (ALGORITHM.md, "Exchange overlapped with backward") on
real gloo processes: the same bits as the bucketed exchange after backward, in a plain loop and
under DDP; collectives started before backward returns; non-finite gradients in a bucket sent
late; gradient accumulation; what it refuses."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import onebit
from onebit import kernels
from onebit.exchange import NonFiniteError
from onebit.testing import spawn_workers

CPU_BACKENDS = [name for name in kernels.available() if name != "triton"]
FREEZE, STEPS = 2, 7
BUCKET_MB = 96 * 4 / 2**20  # buckets of 96 float32 elements: several per layer, uneven
INF_STEP = 5  # a compression step whose first-layer gradient is infinite on rank 1


class _Net(nn.Module):
    """Three layers and a branch used on even steps only; ``spare`` never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 20)
        self.middle = nn.Linear(20, 20)
        self.branch = nn.Linear(20, 20)
        self.last = nn.Linear(20, 3)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.middle(torch.tanh(self.first(x))))
        if step % 2 == 0:
            h = h + torch.tanh(self.branch(h))
        return self.last(h)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def _setup(rank: int, backend: str, mode: str, inf_step, current, **options):
    net = _Net()
    ddp = mode.startswith("ddp")
    model = DistributedDataParallel(net, find_unused_parameters=True) if ddp else net
    optimizer = onebit.OneBitLamb(
        net.parameters(),
        lr=0.02,
        freeze_step=FREEZE,
        kernels=backend,
        bucket_cap_mb=BUCKET_MB,
        overlap_backward=not mode.endswith("after"),
        **{"compression": "fused", **options},  # buckets of the fused buffer: several a layer
    )
    if ddp:
        onebit.ddp.register_comm_hook(model, optimizer)
    if inf_step is not None and rank == 1:
        net.first.weight.register_hook(lambda g: g * float("inf") if current[0] == inf_step else g)
    return net, model, optimizer


def _train(
    rank: int,
    backend: str,
    mode: str,
    inf_step: int | None = None,
    resume_at: int | None = None,
    **options,
):
    """``STEPS`` steps of 1-bit LAMB in ``mode`` ("plain" or "ddp": overlapped in a plain
    loop or under DDP; "plain after", "ddp after": the buckets after backward), resumed from
    a checkpoint into a new model and optimizer after step ``resume_at``. Returns the
    parameters and error state at the end, and per step the buckets started when the input's
    gradient arrived (the end of backward) and whether the step was skipped."""
    current = [0]  # the loop's step
    net, model, optimizer = _setup(rank, backend, mode, inf_step, current, **options)
    started, skipped = [], []
    for step in range(1, STEPS + 1):
        current[0] = step
        x, y = _batch(rank, step)
        x.requires_grad_(True)
        seen = []
        x.register_hook(lambda g, seen=seen, o=optimizer: seen.append(o.buckets_started) or g)
        loss = nn.functional.mse_loss(model(x, step), y)
        optimizer.zero_grad()
        loss.backward()
        started.append(seen[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        skipped.append(any("non-finite" in str(w.message) for w in caught))
        if step == resume_at:
            saved = copy.deepcopy((net.state_dict(), optimizer.state_dict()))
            net, model, optimizer = _setup(rank, backend, mode, inf_step, current, **options)
            net.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
    params = [p.detach().clone() for p in net.parameters()]
    return params, [e.clone() for e in optimizer.error_feedback], started, skipped


def _runs(rank: int, world: int):
    """Every run of the tests below; at 3 ranks the plain loop's only."""
    out = {}
    paths = ("plain", "ddp") if world == 2 else ("plain",)
    for backend in CPU_BACKENDS:
        for path in paths:
            out[backend, path + " after"] = _train(rank, backend, path + " after")
            out[backend, path] = _train(rank, backend, path)
        out[backend, "inf after"] = _train(rank, backend, "plain after", INF_STEP)
        out[backend, "inf plain"] = _train(rank, backend, "plain", INF_STEP)
    if world == 2:
        for backend in CPU_BACKENDS:
            out[backend, "resumed"] = _train(rank, backend, "plain", resume_at=FREEZE + 2)
        out["accumulation"] = _accumulation(rank)
        out["raise"] = _raise_policy(rank)
    return out


class _Runs(dict):
    """The runs of each world size, spawned when a test first asks for them (3 ranks only in
    the end-to-end group)."""

    def __missing__(self, world: int):
        self[world] = spawn_workers(_runs, world, timeout_s=240)
        return self[world]


@pytest.fixture(scope="module")
def runs():
    return _Runs()


WORLDS = [2, pytest.param(3, marks=pytest.mark.slow)]


def _same(a, b) -> bool:
    """Parameters and error state bit for bit."""
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_overlapped_equals_the_bucketed_exchange_after_backward(runs, world, backend):
    ranks = runs[world]
    paths = ("plain", "ddp") if world == 2 else ("plain",)
    for rank in range(world):
        for path in paths:
            assert _same(ranks[rank][backend, path + " after"], ranks[rank][backend, path]), path
        if world == 2:
            assert _same(ranks[rank][backend, "plain"], ranks[rank][backend, "resumed"])  # exact
            # DDP's warm-up average of 2 ranks rounds as the optimizer's own
            assert _same(ranks[rank][backend, "plain"], ranks[rank][backend, "ddp"])
    for rank in range(1, world):  # parameters bit-identical on every rank
        for path in paths:
            for a, b in zip(ranks[0][backend, path][0], ranks[rank][backend, path][0], strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_buckets_start_before_backward_returns(runs, backend):
    for rank in range(2):
        for path in ("plain after", "ddp after"):  # nothing is sent during backward
            assert runs[2][rank][backend, path][2] == [0] * STEPS
        for mode in ("plain", "ddp"):
            started = runs[2][rank][backend, mode][2]
            # Warm-up and the stage's first step (which sets it up) send after backward. Then,
            # when the input's gradient arrives, every bucket but the first layer's has
            # started on the steps that use the branch; on the others the branch's bucket
            # (never ready) holds it and those after it in the fixed order, but the last
            # layer's has started.
            assert started[: FREEZE + 1] == [0] * (FREEZE + 1), mode
            for step, count in enumerate(started[FREEZE + 1 :], start=FREEZE + 2):
                assert count >= (8 if step % 2 == 0 else 1), (mode, started)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_non_finite_bucket_sent_last_skips_on_every_rank(runs, world, backend):
    for rank in range(world):
        after = runs[world][rank][backend, "inf after"]
        overlapped = runs[world][rank][backend, "inf plain"]
        expected = [step == INF_STEP for step in range(1, STEPS + 1)]
        assert after[3] == expected and overlapped[3] == expected
        assert _same(after, overlapped)


def _accumulation(rank: int):
    """Two micro-batches per step: the first under no_sync(), against the exchange after
    backward; then a second backward outside no_sync(), which must raise."""
    results = []
    for overlap in (False, True):
        net = _Net()
        optimizer = onebit.OneBitLamb(
            net.parameters(),
            freeze_step=1,
            bucket_cap_mb=BUCKET_MB,
            overlap_backward=overlap,
            compression="fused",
        )
        for step in range(1, 5):
            optimizer.zero_grad()
            with optimizer.no_sync():
                nn.functional.mse_loss(
                    net(*_batch(rank, step)[:1], 1), _batch(rank, step)[1]
                ).backward()
            nn.functional.mse_loss(
                net(_batch(rank, 10 + step)[0], 1), _batch(rank, step)[1]
            ).backward()
            optimizer.step()
        results.append([p.detach().clone() for p in net.parameters()])
    optimizer.zero_grad()
    for _ in range(2):
        try:
            nn.functional.mse_loss(net(_batch(rank, 0)[0], 1), _batch(rank, 0)[1]).backward()
        except RuntimeError as error:
            results.append(str(error))
            break
    return results


def test_accumulation_under_no_sync_and_a_second_backward_refused(runs):
    for after, overlapped, error in (rank["accumulation"] for rank in runs[2]):
        assert all(torch.equal(a, b) for a, b in zip(after, overlapped, strict=True))
        assert "second gradient" in error and "no_sync()" in error


def test_what_overlap_refuses():
    params = [nn.Parameter(torch.randn(4))]
    with pytest.raises(ValueError, match="max_grad_norm"):
        onebit.OneBitLamb(params, overlap_backward=True, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="not with node_groups"):
        onebit.OneBitAdam(params, overlap_backward=True, node_groups=(None, None))
    with pytest.raises(ValueError, match="True or False"):
        onebit.OneBitLamb(params, overlap_backward=1)
    optimizer = onebit.OneBitLamb(params, overlap_backward=True)
    assert optimizer.overlap_backward and optimizer.bucket_cap_mb == 25.0
    optimizer.grad_scale = torch.tensor(2.0)  # as torch.amp.GradScaler sets it
    params[0].grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="GradScaler"):
        optimizer.step()
    assert optimizer.step_count == 0


def test_raise_policy_raises_from_step_on_every_rank(runs):
    assert all(rank["raise"] for rank in runs[2])


def _raise_policy(rank: int) -> bool:
    try:
        _train(rank, "torch", "plain", INF_STEP, on_nonfinite="raise")
    except NonFiniteError:
        return True
    return False


def test_an_optimizer_that_is_gone_leaves_no_hook_behind():
    """In one process: the hooks of a collected optimizer are removed and start nothing;
    its successor on the same parameters overlaps alone."""
    net = _Net()

    def train(steps: int) -> onebit.OneBitLamb:
        optimizer = onebit.OneBitLamb(
            net.parameters(),
            freeze_step=1,
            bucket_cap_mb=BUCKET_MB,
            overlap_backward=True,
            compression="fused",
        )
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            nn.functional.mse_loss(net(_batch(0, step)[0], 0), _batch(0, step)[1]).backward()
            optimizer.step()
        return optimizer

    first = train(3)
    hooks = len(net.first.weight._post_accumulate_grad_hooks)
    del first
    gc.collect()
    assert not net.first.weight._post_accumulate_grad_hooks
    second = train(3)
    assert len(net.first.weight._post_accumulate_grad_hooks) == hooks == 1
    nn.functional.mse_loss(net(_batch(0, 9)[0], 0), _batch(0, 9)[1]).backward()
    assert second.buckets_started >= 8


def test_a_parameter_group_added_later_is_overlapped_too():
    """In one process: the tensors of a group added after construction start their buckets
    during backward as well, and the steps are those of the exchange after backward."""

    def train(overlap: bool) -> tuple[list[int], int, list[torch.Tensor]]:
        net = _Net()
        later = [*net.last.parameters(), *net.branch.parameters()]
        first = [p for p in net.parameters() if all(p is not q for q in later)]
        optimizer = onebit.OneBitLamb(
            first,
            freeze_step=1,
            bucket_cap_mb=BUCKET_MB,
            overlap_backward=overlap,
            compression="fused",
        )
        optimizer.add_param_group({"params": later, "lr": 0.005})
        started = []
        for step in range(1, 5):
            optimizer.zero_grad()
            x, y = _batch(0, 2 * step)  # even steps: every tensor but `spare` has a gradient
            nn.functional.mse_loss(net(x, 2 * step), y).backward()
            started.append(optimizer.buckets_started)
            optimizer.step()
        buckets = len(optimizer.exchange.buckets())
        return started, buckets, [p.detach().clone() for p in net.parameters()]

    started, buckets, overlapped = train(True)
    assert buckets >= 8 and started == [0, 0, buckets, buckets]  # all in backward, from step 3
    _, _, after_backward = train(False)
    assert all(torch.equal(a, b) for a, b in zip(overlapped, after_backward, strict=True))
