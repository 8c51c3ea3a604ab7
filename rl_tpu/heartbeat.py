"""A line every few seconds while a long phase runs, so a screen or a log file never sits
silent through a server's warm-up or an eval:

    with Heartbeat("warm-up: compiling the server's programs"):
        batcher.warmup()

prints `warm-up: compiling the server's programs, 5 s`, `..., 10 s`, ... (every `every_s`
seconds; a phase shorter than that prints nothing). The same plain lines on a terminal and in
a log file: no carriage returns, at most one line every `every_s` seconds. `detail()`, when
given, adds what the phase can say of its progress (`3/8 rungs`). A thread does the printing,
so the phase itself needs no hooks; it stops when the phase ends, however it ends.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional, TextIO

DEFAULT_EVERY_S = 5.0


class Heartbeat:
    """A context manager printing `<what>, <seconds> s[, detail()]` every `every_s` seconds
    while its block runs (module docstring); nothing when not `enabled` (another process
    than 0, or quiet)."""

    def __init__(self, what: str, every_s: float = DEFAULT_EVERY_S, enabled: bool = True,
                 out: Optional[TextIO] = None, detail: Optional[Callable[[], str]] = None):
        self.what, self.every_s, self.enabled = what, float(every_s), enabled
        self._out, self._detail = out, detail
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._started = 0.0
        self.lines: list[str] = []  # what it printed (tests, and a caller's own summary)

    def __enter__(self) -> "Heartbeat":
        self._started = time.monotonic()
        if self.enabled and self.every_s > 0:
            self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            line = f"{self.what}, {self.elapsed():.0f} s"
            if self._detail is not None:
                try:
                    line += f", {self._detail()}"
                except Exception:  # noqa: BLE001  a progress detail never stops the phase
                    pass
            self.lines.append(line)
            print(line, file=self._out or sys.stdout, flush=True)
