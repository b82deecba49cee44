"""The bucketed exchange (ALGORITHM.md, "Bucketed exchange") on real gloo processes: against
the test oracle bucket by bucket, inside the optimizers against the float64 model, one bucket
equal to the whole-buffer exchange, resume, non-finite input, messages in flight."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.onebit_problem import (
    FREEZE,
    GROUP_HYPER,
    HYPER,
    MASK,
    STEPS,
    assert_follows_model_and_ranks_agree,
    build,
    grad_fn,
    initial_params,
    set_grads,
)
from helpers.oracle import oracle_compressed_allreduce
from helpers.oracle_onebit import oracle_run

import onebit
from onebit import kernels
from onebit.exchange import BucketedExchange, FlatExchange, TrafficCounter
from onebit.testing import spawn_workers

CPU_BACKENDS = [name for name in kernels.available() if name != "triton"]
FUSED_BACKENDS = [name for name in kernels.available() if name != "torch"]  # triton interpreted
NUMELS = [37, 100, 13]  # 150 elements, padded to 160 (n = 2, 4) or 168 (n = 3)
BUCKET = 70  # elements: buckets of 64, 64, 32 at n = 2 and 4; 48, 48, 48, 24 at n = 3
CALLS = 3


def _inputs(world: int, numel: int, call: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * world + call)
    return torch.randn(world, numel, generator=gen) * torch.linspace(0.5, 2.0, numel)


#: The exchanges checked against the oracle: in buckets, or whole; each with a buffer of the
#: caller's (error updates after the last check) and with its own ``send_buffer()`` (error
#: updates computed while the bytes travel, then taken as the error state).
VARIANTS = [(kind, own) for kind in ("bucketed", "whole") for own in (False, True)]


def _bucketed_calls(rank: int, world: int):
    return {
        (backend, kind, own): _calls_on(rank, world, backend, kind, own)
        for backend in CPU_BACKENDS
        for kind, own in VARIANTS
    }


def _calls_on(rank: int, world: int, backend: str, kind: str = "bucketed", own: bool = False):
    exchange = BucketedExchange(None, BUCKET) if kind == "bucketed" else FlatExchange(None)
    chosen = kernels.select(torch.zeros(8), backend)
    exchange.bind(NUMELS, torch.float32, torch.device("cpu"), chosen, TrafficCounter())
    size = exchange.buffer_size(NUMELS)
    results = []
    for call in range(CALLS):
        buffer = exchange.send_buffer() if own else torch.empty(size)
        buffer.copy_(_inputs(world, size, call)[rank])
        results.append(exchange.exchange(buffer).decode(torch.empty(size)))
    errors = exchange.worker_error.clone(), exchange.server_error.clone()
    buckets = exchange.buckets() if kind == "bucketed" else [(0, size)]
    return results, errors, buckets, exchange.traffic.bytes_sent


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_bucket_equals_the_oracle_bit_for_bit(world):
    calls = spawn_workers(_bucketed_calls, world, timeout_s=120)
    for key in calls[0]:
        _check_against_the_oracle([calls[rank][key] for rank in range(world)], world, key[0])


def _check_against_the_oracle(ranks, world: int, backend: str) -> None:
    buckets = ranks[0][2]
    sizes = [end - start for start, end in buckets]
    if len(sizes) > 1:
        assert len(sizes) >= 3 and len(set(sizes)) == 2  # several buckets, the last smaller
    size = buckets[-1][1]
    oracle = [(torch.zeros(world, e - s), torch.zeros(world, (e - s) // world)) for s, e in buckets]
    for call in range(CALLS):
        inputs = _inputs(world, size, call)
        expected = torch.empty(size)
        for b, (start, end) in enumerate(buckets):
            expected[start:end], *oracle[b] = oracle_compressed_allreduce(
                inputs[:, start:end].contiguous(), *oracle[b], kernels=backend
            )
        for rank in range(world):
            assert torch.equal(ranks[rank][0][call], expected), (call, rank)
    offset = 0
    for rank in range(world):
        worker_error, server_error = ranks[rank][1]
        for b, (start, end) in enumerate(buckets):
            chunk = (end - start) // world
            assert torch.equal(worker_error[start:end], oracle[b][0][rank]), (rank, b)
            assert torch.equal(server_error[offset : offset + chunk], oracle[b][1][rank])
            offset += chunk
        offset = 0
    scales = 3 * 4 * (world - 1) * len(buckets)  # worker scale, code, server scale per bucket
    assert ranks[0][3]["compressed_allreduce"] == CALLS * (
        2 * (world - 1) * size // world // 8 + scales
    )


def _optimizer_runs(rank: int, world: int):
    """1-bit LAMB and 1-bit Adam with buckets of 16 elements (4 buckets of the 56 padded to
    64 at n = 2), and 1-bit LAMB with one bucket beside the whole-buffer exchange."""
    out = {}
    for name, kind, bucket in (
        ("lamb", "lamb", 16 * 8 / 2**20),
        ("adam", "adam", 16 * 8 / 2**20),
        ("one bucket", "lamb", 1.0),
        ("whole buffer", "lamb", None),
    ):
        params, optimizer = build(kind, torch.float64, bucket_cap_mb=bucket)
        history = []
        for _ in range(STEPS):
            set_grads(params, rank)
            optimizer.step()
            history.append([p.detach().clone() for p in params])
        out[name] = history, optimizer.error_feedback, optimizer.bytes_sent
    return out


def _on_two_ranks(rank: int, world: int, directory):
    """Every run the optimizer tests below read, in one pair of processes."""
    return {
        "runs": _optimizer_runs(rank, world),
        "resume": _resume(rank, world, directory),
        "non_finite": _non_finite_in_a_later_bucket(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bucketed")
    return spawn_workers(_on_two_ranks, 2, args=(directory,), timeout_s=240)


def test_optimizers_with_buckets_follow_the_model_and_one_bucket_is_the_whole_buffer(two_ranks):
    world = 2
    results = [ranks["runs"] for ranks in two_ranks]
    masks = [None, None, None, MASK]
    for name, kind in (("lamb", "lamb"), ("adam", "adam")):
        expected = oracle_run(
            kind,
            initial_params(),
            grad_fn,
            world,
            STEPS,
            FREEZE,
            GROUP_HYPER,
            HYPER,
            masks,
            bucket_elements=16,
        )
        histories = [results[rank][name][0] for rank in range(world)]
        assert_follows_model_and_ranks_agree(histories, expected, 1e-9, f"bucketed {name}")
        flat = oracle_run(
            kind, initial_params(), grad_fn, world, STEPS, FREEZE, GROUP_HYPER, HYPER, masks
        )
        assert not torch.equal(flat[-1][0], expected[-1][0])  # more scales: another trajectory
    for rank in range(world):
        one, whole = results[rank]["one bucket"], results[rank]["whole buffer"]
        assert all(
            torch.equal(a, b)
            for s, t in zip(one[0], whole[0], strict=True)
            for a, b in zip(s, t, strict=True)
        )
        assert all(torch.equal(a, b) for a, b in zip(one[1], whole[1], strict=True))
        assert one[2] == whole[2]
    compressed = results[0]["lamb"][2]["compression"] - results[0]["whole buffer"][2]["compression"]
    assert compressed == (STEPS - FREEZE) * 3 * 8 * (world - 1) * 3  # 3 more buckets' scalars


def _unequal_bucket_runs(rank: int, world: int):
    """1-bit LAMB and 1-bit Adam over tensors of ``NUMELS`` in buckets of 64, 64 and 32
    elements (chunks of 32, 32 and 16 per server), with every backend: the weights after
    each step."""
    out = {}
    for backend in kernels.available():
        for name, kind in (("lamb", onebit.OneBitLamb), ("adam", onebit.OneBitAdam)):
            gen = torch.Generator().manual_seed(3)
            params = [
                torch.nn.Parameter(torch.randn(n, generator=gen, dtype=torch.float64))
                for n in NUMELS
            ]
            optimizer = kind(
                params,
                lr=0.01,
                freeze_step=3,
                compression="fused",
                bucket_cap_mb=BUCKET * 8 / 2**20,
                kernels=backend,
            )
            history = []
            for step in range(8):
                gen = torch.Generator().manual_seed(100 * rank + step)
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
                optimizer.step()
                history.append(torch.cat([p.detach().clone() for p in params]))
            out[backend, name] = history
    return out


@pytest.mark.skipif(not FUSED_BACKENDS, reason="needs a fused backend")
def test_fused_backends_read_buckets_whose_chunks_differ_in_size():
    """Each fused backend decodes every bucket with its own chunks' scales: its weights follow
    the torch reference's to summation order, and the ranks agree bit for bit."""
    ranks = spawn_workers(_unequal_bucket_runs, 2, timeout_s=240)
    for (backend, name), history in ranks[0].items():
        reference = ranks[0]["torch", name]
        for step, (got, want) in enumerate(zip(history, reference, strict=True)):
            where = f"{backend} {name} step {step + 1}"
            torch.testing.assert_close(
                got, want, rtol=1e-12, atol=1e-12, msg=lambda m, w=where: f"{w}: {m}"
            )
            assert torch.equal(got, ranks[1][backend, name][step])


def _resume(rank: int, world: int, tmp_path):
    """The bucketed 1-bit LAMB's trajectory straight through and resumed from a checkpoint."""
    return _bucketed_lamb(rank, None), _bucketed_lamb(rank, tmp_path)


def _bucketed_lamb(rank: int, tmp_path):
    params, optimizer = build("lamb", torch.float64, bucket_cap_mb=16 * 8 / 2**20)
    history = []
    for step in range(STEPS):
        if tmp_path is not None and step == FREEZE + 3:
            path = tmp_path / f"rank{rank}.pt"
            torch.save(optimizer.state_dict(), path)
            weights = [p.detach().clone() for p in params]
            params, optimizer = build("lamb", torch.float64, bucket_cap_mb=16 * 8 / 2**20)
            for p, w in zip(params, weights, strict=True):
                p.data.copy_(w)
            optimizer.load_state_dict(torch.load(path))
        set_grads(params, rank)
        optimizer.step()
        history.append([p.detach().clone() for p in params])
    return history


def test_resume_from_a_bucketed_checkpoint_is_bit_identical(two_ranks):
    for straight, resumed in (ranks["resume"] for ranks in two_ranks):
        for a, b in zip(resumed, straight, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _non_finite_in_a_later_bucket(rank: int, world: int):
    params, optimizer = build("lamb", torch.float64, bucket_cap_mb=16 * 8 / 2**20)
    for _ in range(FREEZE + 2):
        set_grads(params, rank)
        optimizer.step()
    errors = [e.clone() for e in optimizer.error_feedback]
    weights = [p.detach().clone() for p in params]
    set_grads(params, rank)
    if rank == 1:
        params[0].grad[0, 0] = float("inf")  # bucket 0: exchanged last, after the others
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    untouched = all(
        torch.equal(a, b) for a, b in zip(errors, optimizer.error_feedback, strict=True)
    )
    unmoved = all(torch.equal(p.detach(), w) for p, w in zip(params, weights, strict=True))
    skipped = any("skipped on every rank" in str(w.message) for w in caught)
    return untouched, unmoved, skipped, optimizer.skipped_steps


def test_a_non_finite_later_bucket_skips_on_every_rank_with_the_state_untouched(two_ranks):
    for untouched, unmoved, skipped, count in (ranks["non_finite"] for ranks in two_ranks):
        assert untouched and unmoved and skipped and count == 1


def _own_buffer_non_finite(rank: int, world: int):
    """A NaN, on rank 1 only, with the exchange's own buffer, in the last bucket exchanged
    (bucket 0: its check fails once every message but its server phase's is sent) and then in
    the first (bucket 2: every server phase is still to send): every rank raises, its error
    state untouched, after updates went to scratch; and the next exchange gives what an
    exchange that never failed gives (nothing posted ahead is left for its messages)."""
    bound = dict(
        dtype=torch.float32,
        device=torch.device("cpu"),
        backend=kernels.select(torch.zeros(8)),
        traffic=TrafficCounter(),
    )
    failing, clean = BucketedExchange(None, BUCKET), BucketedExchange(None, BUCKET)
    for exchange in (failing, clean):
        exchange.bind(NUMELS, **bound)
    size = failing.buffer_size(NUMELS)

    def call(exchange: BucketedExchange, inputs: int) -> torch.Tensor:
        exchange.send_buffer().copy_(_inputs(world, size, inputs)[rank])
        return exchange.exchange(exchange.send_buffer()).decode(torch.empty(size))

    call(failing, 0)
    call(clean, 0)
    outcomes = []
    for element in (0, size - 1):  # in bucket 0, exchanged last; in bucket 2, exchanged first
        errors = [e.clone() for e in failing.errors()]
        buffer = failing.send_buffer()
        buffer.copy_(_inputs(world, size, 1)[rank])
        if rank == 1:
            buffer[element] = float("nan")
        try:
            failing.exchange(buffer)
            raised = False
        except FloatingPointError:
            raised = True
        untouched = all(torch.equal(a, b) for a, b in zip(errors, failing.errors(), strict=True))
        outcomes.append((raised, untouched))
    same = torch.equal(call(failing, 2), call(clean, 2))
    same_errors = all(
        torch.equal(a, b) for a, b in zip(failing.errors(), clean.errors(), strict=True)
    )
    return outcomes, same and same_errors


def test_a_non_finite_bucket_leaves_the_errors_untouched_with_the_exchanges_own_buffer():
    expected = ([(True, True), (True, True)], True)
    assert spawn_workers(_own_buffer_non_finite, 2, timeout_s=120) == [expected] * 2


def _messages_of_one_exchange(rank: int, world: int):
    """The point-to-point calls and collectives of one bucketed exchange over gloo, in order."""
    import torch.distributed as dist

    calls = []
    for name in ("irecv", "isend", "all_to_all_single", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def record(*args, original=original, name=name, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        setattr(dist, name, record)
    exchange = BucketedExchange(None, BUCKET)
    exchange.bind(
        NUMELS, torch.float32, torch.device("cpu"), kernels.select(torch.zeros(8)), TrafficCounter()
    )
    exchange.send_buffer().copy_(_inputs(world, exchange.buffer_size(NUMELS), 0)[rank])
    exchange.exchange(exchange.send_buffer())
    return calls, len(exchange.buckets())


def _two_in_flight(rank: int, world: int):
    """Two exchanges over one group in flight at once, the second begun driven to its end
    before the first sends anything, against the same two one after the other."""
    exchanges = [BucketedExchange(None, BUCKET) for _ in range(4)]
    for exchange in exchanges:
        exchange.bind(
            NUMELS,
            torch.float32,
            torch.device("cpu"),
            kernels.select(torch.zeros(8)),
            TrafficCounter(),
        )
    size = exchanges[0].buffer_size(NUMELS)
    for call, exchange in enumerate(exchanges):
        exchange.send_buffer().copy_(_inputs(world, size, call % 2)[rank])
    first, second = (e.begin(e.send_buffer()) for e in exchanges[:2])
    second_result, first_result = second.complete(), first.complete()
    apart = [e.exchange(e.send_buffer()) for e in exchanges[2:]]
    pairs = [(first_result, apart[0]), (second_result, apart[1])]
    return all(
        torch.equal(a.decode(torch.empty(size)), b.decode(torch.empty(size))) for a, b in pairs
    )


def test_exchanges_in_flight_together_keep_their_own_messages():
    assert spawn_workers(_two_in_flight, 2, timeout_s=120) == [True, True]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_receive_is_posted_before_the_first_send(world):
    """Over gloo every message's receives (a worker and a server message per bucket, from
    each peer) are posted before any bytes are sent, and the messages go point to point."""
    for calls, buckets in spawn_workers(_messages_of_one_exchange, world, timeout_s=120):
        messages = 2 * buckets * (world - 1)
        assert calls == ["irecv"] * messages + ["isend"] * messages
