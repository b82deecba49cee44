"""``onebit.timing.time_calls``: the wall time of a method's calls, added up under a label."""

from __future__ import annotations

import collections
import time

import pytest

from onebit.timing import time_calls


class _Worker:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def work(self, seconds: float, *, fail: bool = False) -> float:
        """Sleep ``seconds``; return them (raise if ``fail``)."""
        self.calls.append((seconds, fail))
        time.sleep(seconds)
        if fail:
            raise ValueError("asked to fail")
        return seconds


def test_calls_are_timed_under_their_label_and_pass_through():
    seconds: collections.Counter = collections.Counter()
    time_calls(seconds, _Worker, "work", "Worker.work")
    try:
        worker = _Worker()
        start = time.perf_counter()
        assert worker.work(0.02) == 0.02
        assert worker.work(0.01) == 0.01
        elapsed = time.perf_counter() - start
        assert worker.calls == [(0.02, False), (0.01, False)]
        assert list(seconds) == ["Worker.work"]
        assert 0.03 <= seconds["Worker.work"] <= elapsed
        assert _Worker.work.__name__ == "work"
        assert _Worker.work.__doc__.startswith("Sleep")
    finally:
        _Worker.work = _Worker.work.__wrapped__


def test_a_call_that_raises_is_timed_and_its_error_kept():
    seconds: collections.Counter = collections.Counter()
    worker = _Worker()
    time_calls(seconds, worker, "work", "failing")
    with pytest.raises(ValueError, match="asked to fail"):
        worker.work(0.01, fail=True)
    assert seconds["failing"] >= 0.01
    assert worker.calls == [(0.01, True)]
