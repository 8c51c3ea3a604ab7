"""One trainer per workdir: an OS lock on W/trainer.lock, held for the whole run.

Two trainers in one workdir would interleave their checkpoint timelines (each moves the
other's newer steps to `superseded/` when it saves) or die on a step directory the other
removed. The launchers (`launch.train`, `launch.sft`) hold this lock around the recipe, and a
second one started on the same workdir stops at once, in one line naming the workdir and the
holder (pid and host).

The lock is `fcntl.flock` on an open file, so the kernel drops it when the holder's process
ends however it ends (kill -9, pre-emption, a crash): no stale lock is ever left to clear by
hand. The file itself stays (empty after a clean exit; the last holder's pid and host after a
kill, which the next run overwrites).

Multi-host: only process 0 takes it. Every host of one run writes into the same workdir (each
its share of a checkpoint), so a lock taken by every host on a shared filesystem would refuse
the run's own other hosts; process 0 is the host that stands for the run (it writes the
checkpoint metadata, moves superseded steps and writes the metrics). Its verdict is shared with
every host (one all-gather), so all of a refused run's hosts stop together rather than some
waiting in a collective for a host that left. On NFS, Linux carries flock across clients; on a
filesystem that keeps flock to one machine, two runs whose process 0 are on different machines
are not kept apart.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from typing import Iterator

LOCK_FILE = "trainer.lock"

# The locks this process holds: real path -> [open file, depth]. A launcher's hold and a
# recipe's nested inside it share one lock (a second flock on a new open file would refuse
# its own process).
_held: dict[str, list] = {}


class WorkdirLockedError(RuntimeError):
    """Another trainer holds the workdir (see the module doc)."""

    def __init__(self, workdir: str, holder: str):
        self.workdir, self.holder = workdir, holder
        super().__init__(
            f"workdir {workdir} is in use by another trainer ({holder}): two trainers in one "
            "workdir would overwrite each other's checkpoints; wait for it to end or stop it, "
            "or give this run another --workdir")


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
    """Holds `workdir`'s lock for the body (creating the workdir); raises WorkdirLockedError,
    on every host, when another trainer holds it."""
    from rl_tpu import parallel  # here: the launchers import this module before jax
    import jax

    parallel.maybe_initialize_distributed()
    mine = jax.process_index() == 0
    key = os.path.realpath(workdir)
    held, holder = True, ""
    if mine:
        held, holder = _acquire(workdir, key)
    if not parallel.across_hosts(held, "all"):
        raise WorkdirLockedError(workdir, holder or "process 0 of this run was refused it")
    try:
        yield
    finally:
        if mine:
            _release(key)


def _acquire(workdir: str, key: str) -> tuple[bool, str]:
    """(True, "") with the lock taken (or this process's hold deepened); (False, the holder as
    its file says) when another process holds it."""
    if key in _held:
        _held[key][1] += 1
        return True, ""
    os.makedirs(workdir, exist_ok=True)
    f = open(os.path.join(workdir, LOCK_FILE), "a+")  # created if absent, never truncated here
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read(500).strip() or "its pid and host not yet written"
        f.close()
        return False, holder
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    f.flush()
    _held[key] = [f, 1]
    return True, ""


def _release(key: str) -> None:
    entry = _held[key]
    entry[1] -= 1
    if entry[1]:
        return
    del _held[key]
    f = entry[0]
    f.truncate(0)  # empty again: a start that wrote nothing leaves an empty workdir behind
    f.close()  # closing the last descriptor drops the flock
