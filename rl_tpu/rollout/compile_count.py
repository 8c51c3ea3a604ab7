"""How many XLA programs a sampler has compiled, as JAX itself reports them.

A hand-kept set of "shapes compiled so far" drifts from the truth: it missed the prefix cache's
programs, eager ops, and a program compiled twice for two input shardings of one shape. Here
every backend compile JAX records (its "/jax/core/compile/backend_compile_duration" event,
which a persistent-cache load records too: that is a program the process had to obtain) counts
toward the `CompileCounter` active on the thread that triggered it. A sampler runs its device
work inside `with counter.counting():`, so compiles caused by other code in the process
(the trainer's step, another sampler) are not its own.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_active = threading.local()  # .counter: the CompileCounter of the code running on this thread


class CompileCounter:
    """Counts the programs compiled on threads while they run inside `counting()`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._names: collections.Counter = collections.Counter()  # jitted function -> programs
        self._seconds: collections.Counter = collections.Counter()  # ... -> seconds compiling

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._names.values())

    def by_name(self) -> dict[str, int]:
        """Programs per jitted function (e.g. {'jit(decode)': 6}): which shapes to look at."""
        with self._lock:
            return dict(self._names)

    def seconds_by_name(self) -> dict[str, float]:
        """Seconds spent compiling (or loading) each jitted function's programs."""
        with self._lock:
            return dict(self._seconds)

    @contextlib.contextmanager
    def counting(self):
        """Compiles on this thread count here until the block ends (nested blocks: the
        innermost counter counts)."""
        outer = getattr(_active, "counter", None)
        _active.counter = self
        try:
            yield self
        finally:
            _active.counter = outer

    def _add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._names[name] += 1
            self._seconds[name] += seconds


def active() -> "CompileCounter | None":
    """The counter compiles on this thread count toward now (None: none), for work handed to
    another thread to count where it would have here."""
    return getattr(_active, "counter", None)


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event != BACKEND_COMPILE_EVENT:
        return
    counter = getattr(_active, "counter", None)
    if counter is not None:
        counter._add(str(kwargs.get("fun_name", "?")), duration)


jax.monitoring.register_event_duration_secs_listener(_on_event)
