"""onebit's dense DiLoCo against torchft 0.2.0's ``torchft.local_sgd.DiLoCo``, round by round.

    .venv/bin/python benchmarks/diloco_vs_torchft.py [--rounds 5] [--sync-every 4] [--workers 2]
        [--fragments 1|2] [--delay TAU] [--local-share A]

(``RUST_LOG=info`` shows torchft's quorum log, quiet by default.)

Needs torchft (``pip install torchft==0.2.0 torch==<the installed torch>``). Starts W worker
processes (``torch.multiprocessing`` spawn, gloo on localhost, every port chosen by the OS at run
time). Each worker trains the same model (``Linear(8, 16), Tanh, Linear(16, 4)`` built after
``torch.manual_seed(0)``) with MSE loss on batches that depend only on (worker, step), twice:

* torchft: the worker is a replica group of one rank with its own ``Manager`` (gloo
  ``ProcessGroupGloo``, ``use_async_quorum=False``, ``init_sync=False``, ``min_replica_size=W``)
  under a ``LighthouseServer`` in the parent; ``DiLoCo(manager, [model], inner, outer,
  sync_every=H)`` is the context of the training loop;
* onebit: ``onebit.DiLoCo(model.parameters(), inner, sync_every=H, exchange="dense",
  outer_optimizer=outer)`` over a gloo ``torch.distributed`` group of the W workers.

Both with the inner optimizer ``AdamW(lr=1e-2, weight_decay=0.01)`` and the outer optimizer
``SGD(lr=0.7, momentum=0.9, nesterov=True)``. The weights are recorded after every round (after
every H-th inner step). Prints, per round, the largest absolute difference between torchft's and
onebit's weights on worker 0, that difference over the largest |weight|, whether the two are
equal bit for bit, and whether the workers of each implementation agree bit for bit. Exits 0 if
every round's relative difference is below 1e-5 and every torchft round committed, 1 otherwise,
77 when torchft is not installed.

Streaming DiLoCo: ``--fragments 2`` makes the two linear layers the fragments (torchft's
``model_fragments``, each with its own outer SGD; onebit's ``fragments`` lists of their
parameters under one outer SGD, whose state is per parameter), ``--delay`` is torchft's
``fragment_sync_delay`` and onebit's ``delay``, ``--local-share`` torchft's
``fragment_update_alpha`` and onebit's ``local_share``. The weights are then recorded after
every turn (every H/K-th inner step), a "round" of the table being one turn; the workers'
weights then differ (each holds its own weights of the fragments not just exchanged), in both
implementations alike.

What had to match torchft's semantics (torchft/local_sgd.py and manager.py, 0.2.0):

* the pseudo-gradient is ``original_parameters - local_param`` (``_save_grads``), the sign
  onebit uses (θ_r - θ_{r,i});
* ``Manager.allreduce`` averages: a gloo SUM, then ``tensor /= num_participants`` (onebit:
  SUM, then ``div_(W)``); torchft reduces each parameter on its own, onebit one flat buffer.
  With 2 workers the sum is one addition and the runs agree bit for bit; with 3 or more, gloo
  adds the ranks in an order that depends on the buffer's layout, so the averages (and the
  weights after them) differ in the last bits of float32;
* the round ends at the H-th inner step in both (torchft's step post-hook calls
  ``manager.start_quorum()`` itself when ``_local_step == sync_every - fragment_sync_delay``,
  so no call to ``start_quorum`` and no ``OptimizerWrapper`` is needed);
* the outer step: restore the backup (a CPU copy), gradients = the average, ``outer.step()``,
  new backup, ``lerp_(local, fragment_update_alpha=0)`` (exact), ``outer.zero_grad()``;
* ``init_sync=False``: with the default, a replica at step 0 may be healed from the primary's
  checkpoint at the first quorum (which comes after the first round's inner steps); the
  workers build identical models from one seed, so no healing is wanted. The tool counts
  calls of the registered ``load_state_dict`` to show none happened.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import version
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

THRESHOLD = 1e-5


@dataclass(frozen=True)
class Stream:
    """The schedule: H, the fragments K, the delay and the local share; a turn of H/K steps."""

    sync_every: int
    fragments: int
    delay: int
    local_share: float
    rounds: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Stream:
        return cls(args.sync_every, args.fragments, args.delay, args.local_share, args.rounds)

    @property
    def turn(self) -> int:
        return self.sync_every // self.fragments

    @property
    def turns(self) -> int:
        return self.rounds * self.fragments


DIMS = (8, 16, 4)
BATCH = 16


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The model (seeded), its inner AdamW and its outer Nesterov SGD."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.Tanh(), torch.nn.Linear(DIMS[1], DIMS[2])
    )
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return model, inner, outer


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s batch at inner step ``step`` (a function of the two only)."""
    gen = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(BATCH, DIMS[0], generator=gen)
    y = torch.randn(BATCH, DIMS[2], generator=gen)
    return x, y


def flat(model: torch.nn.Module) -> list[float]:
    """The model's weights, one list (float32 values are exact as Python floats)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def fragments(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """The model's fragments: the whole model, or its two linear layers."""
    return [model] if count == 1 else [model[0], model[2]]


def train(
    worker: int, model: torch.nn.Module, inner: torch.optim.Optimizer, turns: int, turn: int
) -> list[list[float]]:
    """``turns * turn`` inner steps; the weights after every ``turn``-th."""
    history = []
    for step in range(turns * turn):
        x, y = batch(worker, step)
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()  # every turn-th step ends a turn (both implementations hook the step)
        if (step + 1) % turn == 0:
            history.append(flat(model))
    return history


def run_torchft(
    worker: int, workers: int, stream: Stream, lighthouse: str, timeout: float
) -> dict[str, Any]:
    """torchft's DiLoCo: this worker is a replica group of one rank."""
    from torchft.local_sgd import DiLoCo

    from onebit.train.torchft_diloco import replica_manager

    model, inner, outer = build()
    parts = fragments(model, stream.fragments)
    outers: torch.optim.Optimizer | list[torch.optim.Optimizer] = outer
    if stream.fragments > 1:
        outers = [
            torch.optim.SGD(part.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            for part in parts
        ]
    heals = []

    def load_state_dict(state: dict[str, Any]) -> None:
        heals.append(1)
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    manager, _store = replica_manager(
        worker, workers, lighthouse, timeout, load_state_dict, state_dict
    )
    try:
        with DiLoCo(
            manager,
            parts,
            inner,
            outers,
            sync_every=stream.sync_every,
            fragment_sync_delay=stream.delay,
            fragment_update_alpha=stream.local_share,
        ):
            history = train(worker, model, inner, stream.turns, stream.turn)
        committed = manager.current_step()  # one step per committed turn
    finally:
        manager.shutdown(wait=False)
    return {"history": history, "committed": committed, "heals": len(heals)}


def run_onebit(
    worker: int, workers: int, stream: Stream, store_port: int, timeout: float
) -> dict[str, Any]:
    """onebit's dense DiLoCo over a gloo group of the workers."""
    import onebit

    store = dist.TCPStore("localhost", store_port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group(
        "gloo", store=store, rank=worker, world_size=workers, timeout=timedelta(seconds=timeout)
    )
    try:
        model, inner, outer = build()
        with onebit.DiLoCo(
            model.parameters(),
            inner,
            sync_every=stream.sync_every,
            exchange="dense",
            outer_optimizer=outer,
            fragments=[list(part.parameters()) for part in fragments(model, stream.fragments)],
            delay=stream.delay,
            local_share=stream.local_share,
        ) as diloco:
            history = train(worker, model, inner, stream.turns, stream.turn)
            done = diloco.rounds
    finally:
        dist.destroy_process_group()
    return {"history": history, "committed": done}


def worker_main(
    worker: int,
    workers: int,
    stream: Stream,
    lighthouse: str,
    store_port: int,
    timeout: float,
    queue: Any,
) -> None:
    torch.set_num_threads(1)
    ft = run_torchft(worker, workers, stream, lighthouse, timeout)
    ob = run_onebit(worker, workers, stream, store_port, timeout)
    queue.put((worker, ft, ob))


def run_workers(args: argparse.Namespace) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """Start the lighthouse, the onebit rendezvous store and the workers; their results."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.workers, join_timeout_ms=100)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    queue = mp.get_context("spawn").SimpleQueue()
    results: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    context = None
    try:
        context = mp.spawn(
            worker_main,
            args=(
                args.workers,
                Stream.of(args),
                lighthouse.address(),
                store.port,
                args.timeout,
                queue,
            ),
            nprocs=args.workers,
            join=False,
        )
        deadline = time.monotonic() + args.timeout
        done = False
        while not done:
            while not queue.empty():
                worker, ft, ob = queue.get()
                results[worker] = (ft, ob)
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out after {args.timeout:.0f} s")
            done = context.join(timeout=0.2)
        while not queue.empty():
            worker, ft, ob = queue.get()
            results[worker] = (ft, ob)
    finally:
        if context is not None:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=5)
        lighthouse.shutdown()
        del store
    if sorted(results) != list(range(args.workers)):
        raise SystemExit(f"results from workers {sorted(results)} only")
    return results


def report(args: argparse.Namespace, results: dict[int, tuple[dict, dict]]) -> bool:
    """Print the table; whether every round is within the threshold."""
    ft0, ob0 = results[0]
    turns = Stream.of(args).turns
    ok = True
    for worker, (ft, ob) in sorted(results.items()):
        if ft["committed"] != turns or ob["committed"] != turns:
            print(
                f"worker {worker}: torchft committed {ft['committed']} turns, onebit "
                f"completed {ob['committed']}, of {turns}"
            )
            ok = False
        if ft["heals"]:
            print(f"worker {worker}: torchft healed from a peer {ft['heals']} times")
    print(
        f"{'round':>5} {'max |diff|':>12} {'rel diff':>12} {'bitwise':>8} "
        f"{'torchft workers':>16} {'onebit workers':>15}"
    )
    for r in range(turns):
        a = torch.tensor(ft0["history"][r])
        b = torch.tensor(ob0["history"][r])
        diff = (a - b).abs().max().item()
        rel = diff / a.abs().max().item()
        ft_agree = all(torch.equal(torch.tensor(ft["history"][r]), a) for ft, _ in results.values())
        ob_agree = all(torch.equal(torch.tensor(ob["history"][r]), b) for _, ob in results.values())
        yes = {True: "yes", False: "no"}
        print(
            f"{r + 1:>5} {diff:>12.3e} {rel:>12.3e} {yes[torch.equal(a, b)]:>8} "
            f"{yes[ft_agree]:>16} {yes[ob_agree]:>15}"
        )
        ok = ok and rel < THRESHOLD
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="outer rounds (default 5)")
    parser.add_argument(
        "--sync-every", type=int, default=4, help="inner steps per round, H (default 4)"
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--fragments", type=int, default=1, choices=(1, 2), help="fragments, K (default 1)"
    )
    parser.add_argument(
        "--delay", type=int, default=0, help="inner steps an exchange runs behind (default 0)"
    )
    parser.add_argument(
        "--local-share",
        type=float,
        default=0.0,
        help="share of the local move kept at a delayed outer step (default 0)",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before giving up (default 120)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.sync_every < 1 or args.workers < 1:
        parser.error("--rounds, --sync-every and --workers must be >= 1")
    if args.sync_every % args.fragments or not 0 <= args.delay < args.sync_every // args.fragments:
        parser.error("--sync-every must be a multiple of --fragments, --delay in [0, H/K)")
    if not 0.0 <= args.local_share <= 1.0:
        parser.error("--local-share must be in [0, 1]")
    try:
        torchft_version = version("torchft")
    except Exception:
        print("torchft is not installed: pip install torchft==0.2.0", file=sys.stderr)
        return 77
    from onebit.train.torchft_diloco import quiet_torchft_logs

    quiet_torchft_logs()
    print(
        f"torch {torch.__version__}, torchft {torchft_version}: {args.workers} workers, "
        f"{args.rounds} rounds of H={args.sync_every} inner steps, {args.fragments} "
        f"fragment(s), delay {args.delay}, local share {args.local_share:g}"
    )
    results = run_workers(args)
    ok = report(args, results)
    print(f"{'PASS' if ok else 'FAIL'}: every relative difference below {THRESHOLD:g}: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
