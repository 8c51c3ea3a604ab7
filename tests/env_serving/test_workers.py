"""Tests for rl_tpu.env_serving.workers: parallel calls, per-call time limits, stuck calls handed off.

Stuck calls block on a threading.Event the test sets at the end, so no thread outlives its
test by more than a moment; time limits are a few tenths of a second, with wide margins.
"""

import threading
import time

import pytest

from rl_tpu.env_serving.workers import Outcome, WorkerPool


def returning(value, sleep_s=0.0):
    def call():
        time.sleep(sleep_s)
        return value
    return call


def raising(error):
    def call():
        raise error
    return call


def blocked_on(event):
    def call():
        event.wait(10)
        return "released"
    return call


def test_outcomes_come_back_in_order_with_errors_as_values():
    with WorkerPool(num_threads=3, timeout_s=5.0) as pool:
        # The slow first call finishes last, yet its Outcome is still first.
        calls = [returning("a", 0.1), raising(ValueError("bad move")), returning("c"),
                 raising(KeyError("k"))]
        out = pool.map(calls)
    assert [o.value for o in out] == ["a", None, "c", None]
    assert [o.error for o in out] == [None, "ValueError: bad move", None, "KeyError: 'k'"]
    assert [o.ok for o in out] == [True, False, True, False]
    assert not any(o.timed_out for o in out)
    assert out[0].seconds >= 0.1
    assert pool.map([]) == []


def test_time_limit_counts_from_start_not_from_queueing():
    # One thread, four calls of 0.3 s under a 1.0 s limit: the fourth waits 0.9 s in the queue
    # and runs 0.3 s, 1.2 s after map began, yet none of them timed out. (The 0.7 s between a
    # call's run time and the limit absorbs a loaded machine's scheduling delays.)
    with WorkerPool(num_threads=1, timeout_s=1.0) as pool:
        start = time.monotonic()
        out = pool.map([returning(i, 0.3) for i in range(4)])
        elapsed = time.monotonic() - start
    assert [o.value for o in out] == [0, 1, 2, 3] and all(o.ok for o in out)
    assert elapsed >= 1.2  # the last call started after the limit had passed since map began
    # `seconds` is each call's own run time, not its time in the queue.
    assert all(0.3 <= o.seconds < 0.9 for o in out), [o.seconds for o in out]
    assert pool.retired == 0


def test_stuck_call_times_out_and_is_closed_when_it_returns():
    release = threading.Event()
    returned = []
    with WorkerPool(num_threads=2, timeout_s=0.2) as pool:
        start = time.monotonic()
        stuck, fine = pool.map([blocked_on(release), returning("ok")])
        elapsed = time.monotonic() - start
        assert fine.value == "ok"
        assert stuck.timed_out and stuck.error == "timed out after 0.2 s" and stuck.value is None
        assert 0.2 <= elapsed < 1.0 and stuck.seconds >= 0.2
        # The callback waits for the call itself to return (here: when the test lets it).
        stuck.on_return(lambda: returned.append("closed"))
        time.sleep(0.05)
        assert returned == []
        release.set()
        deadline = time.monotonic() + 5
        while not returned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert returned == ["closed"]
        # A finished call's callback runs at once.
        fine.on_return(lambda: returned.append("now"))
        assert returned == ["closed", "now"]
        assert pool.retired == 1


def test_stuck_call_holds_up_neither_its_queue_nor_later_batches():
    # One thread, which the first call never gives back: the call queued behind it in the
    # same batch, and the next batch, run on a fresh thread instead of waiting for it.
    release = threading.Event()
    try:
        with WorkerPool(num_threads=1, timeout_s=0.2) as pool:
            start = time.monotonic()
            stuck, queued = pool.map([blocked_on(release), returning("queued")])
            assert stuck.timed_out and queued.value == "queued"
            assert time.monotonic() - start < 1.0
            start = time.monotonic()
            (later,) = pool.map([returning("later")])
            assert later.value == "later" and time.monotonic() - start < 0.5
            assert pool.retired == 1
    finally:
        release.set()


def test_several_stuck_calls_in_one_batch():
    release = threading.Event()
    try:
        with WorkerPool(num_threads=2, timeout_s=0.2) as pool:
            out = pool.map([blocked_on(release), blocked_on(release)] +
                           [returning(i) for i in range(4)])
        assert [o.timed_out for o in out] == [True, True] + [False] * 4
        assert [o.value for o in out[2:]] == [0, 1, 2, 3]
    finally:
        release.set()


def test_no_time_limit_waits():
    with WorkerPool(num_threads=2, timeout_s=None) as pool:
        out = pool.map([returning("slow", 0.3), returning("fast")])
    assert [o.value for o in out] == ["slow", "fast"] and not out[0].timed_out


def test_inline_runs_on_the_callers_thread_without_limits():
    seen = []

    def where():
        seen.append(threading.current_thread())
        return len(seen)

    with WorkerPool(num_threads=0, timeout_s=0.01) as pool:
        out = pool.map([where, returning("slow", 0.05), raising(RuntimeError("boom")), where])
    assert seen == [threading.current_thread()] * 2
    assert [o.value for o in out] == [1, "slow", None, 2]
    assert out[1].ok and not out[1].timed_out and out[1].seconds >= 0.05  # no limit inline
    assert out[2].error == "RuntimeError: boom"


def test_outcome_without_a_call_runs_callbacks_at_once():
    # The agent builds Outcomes itself for env steps it answers without stepping the env.
    calls = []
    Outcome(value=3).on_return(lambda: calls.append(1))
    assert calls == [1]


@pytest.mark.parametrize("kwargs,match", [
    ({"num_threads": -1}, "num_threads must be >= 0"),
    ({"num_threads": 2, "timeout_s": 0}, "timeout_s must be > 0"),
    ({"num_threads": 2, "timeout_s": -3.0}, "timeout_s must be > 0"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkerPool(**kwargs)
