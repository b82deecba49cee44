"""The guard after the freeze on real gloo ranks (ALGORITHM.md, "The guard after the freeze"):
gradients that grow after the freeze make it return to dense refresh steps and freeze again;
the trajectory follows the float64 model of the spec given those refreshes (errors zeroed at
the return, the stage anew at the second freeze), every rank decides alike and stays
bit-identical, the refresh steps' bytes are counted, and a checkpoint taken at the finding or
in the refresh resumes exactly (also with the delayed exchange). When the refreshes happen is
tested against a model of the statistics in unit/test_variance_guard.py. 0/1 Adam's guard, which
watches the momentum rebuilt at each synchronisation, follows its own float64 model with the
local intervals started again after the refresh."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers.onebit_problem import (
    FREEZE,
    GROUP_HYPER,
    HYPER,
    MASK,
    assert_follows_model_and_ranks_agree,
    build,
    grad_fn,
    initial_params,
)
from helpers.oracle_onebit import oracle_run
from helpers.oracle_zero_one_adam import oracle_zero_one_adam
from helpers.zero_one_adam_problem import HYPER as ZERO_ONE_HYPER
from helpers.zero_one_adam_problem import MASK as ZERO_ONE_MASK
from helpers.zero_one_adam_problem import build as build_zero_one
from helpers.zero_one_adam_problem import grad_fn as zero_one_grad_fn
from helpers.zero_one_adam_problem import initial_params as zero_one_initial_params
from helpers.zero_one_adam_problem import lr_fn

from onebit.testing import spawn_workers

STEPS = 70


def grad_scale(step: int) -> float:
    """The gradients grow 30 % a step from step 22 to 40, after the freeze at 10: the check
    after step 40 (the second after the baseline of steps 11-20) finds it."""
    return 1.3 ** (min(max(step, 22), 40) - 22)


def _set_grads(params, rank, step):
    for index, p in enumerate(params):
        p.grad = (grad_fn(rank, index, p.detach().double()) * grad_scale(step)).to(p.dtype)


def _run(rank, params, opt, first, last):
    history = []
    for step in range(first, last + 1):
        _set_grads(params, rank, step)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


#: 1-bit LAMB's options here: its momentum_bound would hold the growing steps at Adam's
#: largest, and the momentum energy below the guard's limit (ALGORITHM.md, "The guard after
#: the freeze").
UNBOUNDED = {"lamb": {"momentum_bound": False}, "adam": {}}


def _trajectories(rank, world_size):
    out = {}
    for kind in ("adam", "lamb"):
        for compression in ("per_tensor", "fused"):
            params, opt = build(kind, torch.float64, compression, **UNBOUNDED[kind])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                history = _run(rank, params, opt, 1, STEPS)
            out[kind, compression] = {
                "history": history,
                "refreshes": opt.refreshes,
                "bytes": opt.bytes_sent,
                "warned": sum("fallen behind" in str(w.message) for w in caught),
            }
    return out


def test_refreshes_follow_the_model_and_every_rank_decides_alike():
    results = spawn_workers(_trajectories, 2, timeout_s=240)
    masks = [None, None, None, MASK]
    for (kind, compression), run in results[0].items():
        label = f"{kind} {compression}"
        refreshes = run["refreshes"]
        assert refreshes and all(last is not None for _, last in refreshes), label
        assert results[1][kind, compression]["refreshes"] == refreshes, label
        assert run["warned"] == len(refreshes)  # on the logging rank, once a refresh
        assert results[1][kind, compression]["warned"] == 0
        expected = oracle_run(
            kind,
            initial_params(),
            grad_fn,
            2,
            STEPS,
            FREEZE,
            GROUP_HYPER,
            HYPER | UNBOUNDED[kind],
            masks,
            compression=compression,
            refreshes=refreshes,
            grad_scale=grad_scale,
        )
        histories = [results[rank][kind, compression]["history"] for rank in range(2)]
        assert_follows_model_and_ranks_agree(histories, expected, 1e-9, label)
        dense = 2 * (2 - 1) * (56 + 4) * 8 // 2  # the allreduce of gradients and flags
        refreshed = sum(last - first + 1 for first, last in refreshes)
        assert run["bytes"]["refresh"] == refreshed * dense
        assert run["bytes"]["warmup"] == FREEZE * dense


def _resumed(rank, world_size, directory, save_at, options):
    """The run straight through, and one resumed from its checkpoint after ``save_at``."""
    runs = []
    for start in (0, save_at):
        params, opt = build("lamb", torch.float32, "per_tensor", **options)
        if start:
            saved = torch.load(f"{directory}/rank{rank}.pt", weights_only=True)
            with torch.no_grad():
                for p, value in zip(params, saved["params"], strict=True):
                    p.copy_(value)
            opt.load_state_dict(saved["optimizer"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(start + 1, STEPS + 1):
                _set_grads(params, rank, step)
                opt.step()
                if step == save_at and not start:
                    state = {"params": [p.detach() for p in params], "optimizer": opt.state_dict()}
                    torch.save(copy.deepcopy(state), f"{directory}/rank{rank}.pt")
            opt.finish_exchange()
        runs.append(([p.detach().clone() for p in params], opt.refreshes, opt.bytes_sent))
    return runs


@pytest.mark.parametrize(
    "options, finding",
    [
        pytest.param(UNBOUNDED["lamb"], 40, marks=pytest.mark.slow),
        # The stage's first step lands no update, so the baseline ends a step later.
        pytest.param(UNBOUNDED["lamb"] | {"delayed_exchange": True}, 41, marks=pytest.mark.slow),
    ],
    ids=["plain", "delayed"],
)
def test_a_checkpoint_at_the_finding_or_in_the_refresh_resumes_exactly(tmp_path, options, finding):
    for save_at in (finding, finding + 3):  # the check that finds it, a refresh step
        results = spawn_workers(_resumed, 2, args=(str(tmp_path), save_at, options), timeout_s=180)
        for (straight, refreshes, sent), (resumed, refreshes_again, sent_again) in results:
            assert refreshes and refreshes[0][0] == finding + 1, refreshes
            assert refreshes_again == refreshes and sent_again == sent
            assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
        assert all(
            torch.equal(a, b) for a, b in zip(results[0][0][0], results[1][0][0], strict=True)
        )


#: 0/1 Adam frozen after step 12 (variance updates at 1, 2, 4, 6, 8, 12, synchronised momentum
#: steps between), then a synchronisation every step for 8 steps, then every 2nd.
ZERO_ONE_STEPS = 90
ZERO_ONE_SCHEDULE = dict(
    var_freeze_step=12,
    var_update_scaler=2,
    local_step_scaler=8,
    local_step_clipper=2,
    pre_freeze_exchange="momentum",
)


def zero_one_grad_scale(step: int) -> float:
    """The gradients grow 30 % a step from step 26 to 40, after the freeze at 12."""
    return 1.3 ** (min(max(step, 26), 40) - 26)


def _zero_one_trajectory(rank, world_size):
    params, opt = build_zero_one(torch.float64, variance_guard="refresh", **ZERO_ONE_SCHEDULE)
    history, kinds = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, ZERO_ONE_STEPS + 1):
            for group, first in zip(opt.param_groups, (0, 2), strict=True):
                group["lr"] = lr_fn(step, first)
            for index, p in enumerate(params):
                p.grad = zero_one_grad_fn(rank, index, p.detach()) * zero_one_grad_scale(step)
            kinds.append(opt.stage)
            opt.step()
            history.append([p.detach().clone() for p in params])
    warned = sum("fallen behind" in str(w.message) for w in caught)
    return history, kinds, opt.refreshes, opt.bytes_sent, warned


def test_zero_one_adams_refresh_follows_the_model_and_every_rank_decides_alike():
    results = spawn_workers(_zero_one_trajectory, 2, timeout_s=180)
    history, kinds, refreshes, sent, warned = results[0]
    assert refreshes and all(last is not None for _, last in refreshes)
    assert results[1][2] == refreshes and results[1][1] == kinds
    assert (warned, results[1][4]) == (len(refreshes), 0)  # on the logging rank, once a refresh
    first, last = refreshes[0]
    assert kinds[first - 2] == "sync"  # the finding follows a synchronisation
    assert "local" in kinds[: first - 1] and "local" in kinds[last:]
    expected = oracle_zero_one_adam(
        zero_one_initial_params(),
        zero_one_grad_fn,
        lr_fn,
        2,
        ZERO_ONE_STEPS,
        {**ZERO_ONE_HYPER, **ZERO_ONE_SCHEDULE},
        masks=[None, None, None, ZERO_ONE_MASK],
        refreshes=refreshes,
        grad_scale=zero_one_grad_scale,
    )
    for rank in range(2):
        for step, (got, want) in enumerate(
            zip(results[rank][0], (e[rank] for e in expected), strict=True), start=1
        ):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(
                    a, b, rtol=1e-9, atol=1e-9, msg=lambda m, s=step: f"step {s}: {m}"
                )
    for step, kind in enumerate(kinds, start=1):
        same = all(
            torch.equal(a, b)
            for a, b in zip(results[0][0][step - 1], results[1][0][step - 1], strict=True)
        )
        assert same == (kind != "local"), f"step {step} ({kind})"
    assert sent["refresh"] == sent["variance_update"] // 6 * (last - first + 1)  # 6 updates to T
