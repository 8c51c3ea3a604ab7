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

With several processes, JAX's distributed runtime takes SIGTERM itself and spreads the notice
(see `should_stop`); SIGINT stays this module's.

Handlers are installed only on the main thread (Python delivers signals there) and the ones
they replace are restored on exit, so a notebook or a test runner gets its Ctrl-C back.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped early on a signal, after checkpointing `step`; rerunning resumes."""

    def __init__(self, step: int, where: str, signum: int):
        self.step, self.where, self.signum = step, where, signum
        name = signal.Signals(signum).name if signum else "a signal to another host"
        super().__init__(
            f"stopped on {name} after step {step}, checkpointed in {where}; "
            "rerun the same command to resume from there")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + (self.signum or signal.SIGTERM)


class PreemptionGuard:
    """Records SIGTERM / SIGINT while a run is inside it (see the module doc). Guards nest (a
    launcher's around a recipe's): the outermost one installs the handlers and puts the old
    ones back, and every guard sees the same signal."""

    _depth = 0  # guards entered and not left, process-wide
    _signum: Optional[int] = None  # the first signal received inside the outermost guard
    _previous: dict[int, object] = {}

    def __enter__(self) -> "PreemptionGuard":
        cls = PreemptionGuard
        if threading.current_thread() is not threading.main_thread():
            # a run driven from a thread: signals go to the main thread, not here
            log.warning("not on the main thread: SIGTERM / SIGINT will not checkpoint the run")
            return self
        if cls._depth == 0:
            cls._signum = None
            cls._previous = {signum: signal.signal(signum, _on_signal) for signum in SIGNALS}
        cls._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        cls = PreemptionGuard
        if threading.current_thread() is not threading.main_thread() or cls._depth == 0:
            return
        cls._depth -= 1
        if cls._depth == 0:
            for signum, handler in cls._previous.items():
                signal.signal(signum, handler)
            cls._previous, cls._signum = {}, None

    @property
    def signum(self) -> Optional[int]:
        return PreemptionGuard._signum

    def should_stop(self) -> bool:
        return should_stop()

    def preempted(self, step: int, workdir: str) -> Preempted:
        return Preempted(step, workdir, PreemptionGuard._signum or 0)


def _on_signal(signum, frame) -> None:
    del frame
    if PreemptionGuard._signum is not None:  # the second: the user wants out now
        sys.stderr.write(f"\n{signal.Signals(signum).name} again: exiting at once; the last "
                         "complete checkpoint is kept\n")
        sys.stderr.flush()
        os._exit(128 + signum)
    PreemptionGuard._signum = signum
    sys.stderr.write(f"\n{signal.Signals(signum).name}: finishing this step, then "
                     "checkpointing and stopping (send it again to exit at once)\n")
    sys.stderr.flush()


_checks = 0  # should_stop calls in this process: the same count on every host at each call


def should_stop() -> bool:
    """Whether any host has received a signal: the same answer on every host (with several
    processes a collective: every host calls it at the same point, on the main thread, once a
    step).

    In a multi-process job JAX's distributed runtime takes SIGTERM itself (its pre-emption
    notifier replaces this module's handler) and spreads the notice to every host through
    its coordination service; `reached_preemption_sync_point` then says, on every host at
    the same call, that this is the step to checkpoint and stop at. It wants an increasing id
    at every call, from the same start on every host: this process's count of calls (a loop's
    own step restarts with each round or fine-tune)."""
    global _checks
    from rl_tpu import parallel  # here: the launchers import this module before jax
    _checks += 1
    if _jax_preemption_notice(_checks) and PreemptionGuard._signum is None:
        PreemptionGuard._signum = signal.SIGTERM
    return bool(parallel.across_hosts(PreemptionGuard._signum is not None, "any"))


def _jax_preemption_notice(check: int) -> bool:
    import jax
    if jax.process_count() == 1:
        return False
    from jax.experimental import multihost_utils
    try:
        return bool(multihost_utils.reached_preemption_sync_point(check))
    except RuntimeError:  # jax_enable_preemption_service off: the signal handler's flag only
        return False


def stop_here(step: int, where: str, save: Callable[[], None]) -> None:
    """At the end of step `step` of a loop: when any host was signalled, `save()` (which
    must leave the step's checkpoint whole on disk) and raise Preempted, on every host."""
    if should_stop():
        save()
        raise Preempted(step, where, PreemptionGuard._signum or 0)
