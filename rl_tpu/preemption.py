"""Pre-emption: SIGTERM or SIGINT ends a run at a step boundary, checkpointed, on every host.

Pre-emptible TPU capacity sends SIGTERM some seconds before the machine goes; a user sends
SIGINT (Ctrl-C). Either way the run should lose nothing:

    with PreemptionGuard() as guard:
        for step in ...:
            ...                                # the whole step, on every host
            if guard.should_stop():            # agreed by every host, at the same step
                save(step); raise guard.preempted(step, workdir)

The signal handler only records the signal: the step in progress finishes (a half-done update
or a rollout cut mid-chunk would be lost work, or a host leaving a collective its peers are
in). At the end of each step every host asks `should_stop`, one tiny all-gather over hosts, so
they all stop after the same step even when the signal reached them at different moments
(a host that saw it late still stops with the others). A second signal exits at once: the
checkpoints already on disk stay whole (each is written to a temporary name, then renamed).

Handlers are installed only on the main thread (Python delivers signals there) and the ones
they replace are restored on exit, so a notebook or a test runner gets its Ctrl-C back.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Optional

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped early on a signal, after checkpointing `step`; rerunning resumes."""

    def __init__(self, step: int, workdir: str, signum: int):
        self.step, self.workdir, self.signum = step, workdir, signum
        name = signal.Signals(signum).name if signum else "a signal on another host"
        super().__init__(
            f"stopped on {name} after step {step}, checkpointed in {workdir}/checkpoints; "
            "rerun the same command to resume from there")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + (self.signum or signal.SIGTERM)


class PreemptionGuard:
    """Records SIGTERM / SIGINT while a run is inside it (see the module doc)."""

    def __init__(self):
        self.signum: Optional[int] = None  # the first signal this host received
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        else:  # a run driven from a thread (signals go to the main thread, not here)
            log.warning("not on the main thread: SIGTERM / SIGINT will not checkpoint the run")
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        del frame
        if self.signum is not None:  # the second: the user wants out now
            sys.stderr.write(f"\n{signal.Signals(signum).name} again: exiting at once; the "
                             "last complete checkpoint is kept\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        sys.stderr.write(f"\n{signal.Signals(signum).name}: finishing this step, then "
                         "checkpointing and stopping (send it again to exit at once)\n")
        sys.stderr.flush()

    def should_stop(self) -> bool:
        """Whether any host has received a signal: the same answer on every host (a
        collective with several processes: called by every host at the same point, on the
        main thread, once a step)."""
        from rl_tpu import parallel  # here: the launchers import this module before jax
        return bool(parallel.across_hosts(self.signum is not None, "any"))

    def preempted(self, step: int, workdir: str) -> Preempted:
        return Preempted(step, workdir, self.signum or 0)
