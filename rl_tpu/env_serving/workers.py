"""A pool of worker threads for blocking env calls, each call with its own time limit.

Envs are ordinary Python objects whose `reset`/`step` may block for a long time: a simulator
that hangs, an env server that stopped answering. The agent loop steps many envs at once and
must not stall all of them on one. `WorkerPool.map(calls)` runs a batch of zero-argument calls
in parallel threads and returns one `Outcome` per call, in order; a call that raises or runs
past `timeout_s` becomes an Outcome with an `error`, never an exception of `map`.

Python cannot kill a thread. A call that times out keeps its thread until it returns by
itself, so the pool hands such calls off: its Outcome says "timed out", the executor that
holds them is retired (its other threads end as they finish), and a fresh one takes over the
calls still queued and every later batch, so a stuck call never takes a thread away from
anything else. The caller decides what
to do with the object the stuck call was using (typically: never touch it again, close it once
the call returns, via `Outcome.on_return`).

Nothing here knows about envs or JAX: a call is any callable.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
import traceback
from typing import Any, Callable, Optional, Sequence


@dataclasses.dataclass
class Outcome:
    """What one call came to. Exactly one of `value` (when `error` is None) or `error` holds.

    `error` is "ExceptionType: message" for a call that raised (`traceback` its full traceback,
    for the run's env error log), or "timed out after N s" (then `timed_out` is True and the
    call may still be running). `seconds` is the time the call
    ran, from when a thread started it (not from when it was queued).
    """

    value: Any = None
    error: Optional[str] = None
    seconds: float = 0.0
    timed_out: bool = False
    traceback: Optional[str] = None
    _future: Optional[cf.Future] = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def on_return(self, callback: Callable[[], Any]) -> None:
        """Runs `callback()` once the call has really returned: at once for a finished call,
        later (in the call's own thread) for one that timed out and is still running."""
        if self._future is None or self._future.done():
            callback()
        else:
            self._future.add_done_callback(lambda _f: callback())


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _failed(e: BaseException, seconds: float) -> Outcome:
    return Outcome(error=_error_text(e), seconds=seconds,
                   traceback="".join(traceback.format_exception(e)))


class WorkerPool:
    """Runs batches of blocking calls on `num_threads` threads with a per-call time limit.

    Args:
      num_threads: threads that run calls at once (>= 1); 0 runs every call inline on the
        caller's thread, in order and without time limits (for debugging and profiling, where
        threads get in the way of tracebacks and profilers).
      timeout_s: the most seconds one call may run, counted from when a thread picks it up, so
        a batch larger than the pool queues without its calls timing out; None: no limit.

    Use as a context manager, or call `shutdown()`; either way, calls still running are not
    waited for.
    """

    def __init__(self, num_threads: int, timeout_s: Optional[float] = None):
        if num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 runs calls inline), got {num_threads}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds (None: no limit), got {timeout_s}")
        self.num_threads, self.timeout_s = num_threads, timeout_s
        self.retired = 0  # executors handed off because a call of theirs timed out
        self._executor = self._new_executor()

    def _new_executor(self) -> Optional[cf.ThreadPoolExecutor]:
        if self.num_threads == 0:
            return None
        return cf.ThreadPoolExecutor(self.num_threads, thread_name_prefix="rl_tpu-env")

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def map(self, calls: Sequence[Callable[[], Any]]) -> list[Outcome]:
        """Runs every call; returns their Outcomes in the order of `calls`. Returns when each
        call has finished or run out of time."""
        if self._executor is None:
            return [self._inline(call) for call in calls]
        # Written by the worker threads: when each call started and finished.
        started: list[Optional[float]] = [None] * len(calls)
        finished: list[float] = [0.0] * len(calls)

        def timed(i, call):
            started[i] = time.monotonic()
            try:
                return call()
            finally:
                finished[i] = time.monotonic()

        futures = {self._executor.submit(timed, i, c): i for i, c in enumerate(calls)}
        outcomes: list[Optional[Outcome]] = [None] * len(calls)
        pending = set(futures)
        while pending:
            wait_s = None
            if self.timeout_s is not None:
                running = [started[futures[f]] for f in pending if started[futures[f]] is not None]
                # Wake at the earliest deadline of a running call; while calls are only queued
                # there is no deadline yet, so poll until one starts.
                wait_s = (max(0.0, min(running) + self.timeout_s - time.monotonic())
                          if running else 0.01)
            done, pending = cf.wait(pending, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            for f in done:
                i = futures[f]
                seconds = finished[i] - (started[i] or finished[i])
                try:
                    outcomes[i] = Outcome(value=f.result(), seconds=seconds)
                except Exception as e:  # noqa: BLE001 - a failed call is an Outcome, not a crash
                    outcomes[i] = _failed(e, seconds)
            if self.timeout_s is None:
                continue
            now = time.monotonic()
            stuck = [f for f in pending if started[futures[f]] is not None
                     and now - started[futures[f]] >= self.timeout_s]
            for f in stuck:
                i = futures[f]
                pending.discard(f)
                outcomes[i] = Outcome(error=f"timed out after {self.timeout_s:g} s",
                                      seconds=now - started[i], timed_out=True, _future=f)
            if stuck:
                pending = self._retire(pending, futures, timed, calls)
        return outcomes  # type: ignore[return-value]

    def _retire(self, pending, futures, timed, calls):
        """Swaps in a fresh executor: the stuck calls keep their threads in the old one, and
        the calls still queued behind them (a batch larger than the pool) move to the new one,
        where they no longer wait for threads that may never come free. Calls already
        running stay where they are. Returns the new pending set (`futures` is updated)."""
        old, self._executor = self._executor, self._new_executor()
        self.retired += 1
        moved = set()
        for f in pending:
            if f.cancel():  # only succeeds for a call no thread has started
                i = futures.pop(f)
                g = self._executor.submit(timed, i, calls[i])
                futures[g] = i
                moved.add(g)
            else:
                moved.add(f)
        old.shutdown(wait=False)
        return moved

    @staticmethod
    def _inline(call: Callable[[], Any]) -> Outcome:
        start = time.monotonic()
        try:
            return Outcome(value=call(), seconds=time.monotonic() - start)
        except Exception as e:  # noqa: BLE001
            return _failed(e, time.monotonic() - start)

    def shutdown(self) -> None:
        """Drops queued calls and frees idle threads; running calls finish in the background."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
