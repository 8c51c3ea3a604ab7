"""A sandbox for model-written code: each Python program runs in a fresh bubblewrap sandbox
(no network, read-only system dirs, a private tmpfs, its own pid/user/ipc/uts namespaces, a
seccomp filter) under limits on wall time, CPU time, memory, processes, open files and output.
A process-wide budget caps how many runs go at once and the sum of their worst-case memory. A
pool of warm sandboxes keeps the start off each run's path. docs/tools.md has the whole story.

    with make_sandbox() as sandbox:
        execution = sandbox.run("print(input()[::-1])", stdin="abc\\n")
        execution.status, execution.stdout   # ("ok", "cba\\n")
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from rl_tpu.sandbox.bubblewrap import sandbox_unavailable_reason, require_bubblewrap
from rl_tpu.sandbox.limits import STATUSES, Execution, Limits, SandboxUnavailable
from rl_tpu.sandbox.runner import MODES, Sandbox
from rl_tpu.sandbox.totals import (SandboxBudget, process_budget, set_process_budget,
                                   worst_case_bytes)

__all__ = ["Limits", "Execution", "STATUSES", "Sandbox", "make_sandbox", "shared_sandbox",
           "SandboxUnavailable", "sandbox_unavailable_reason", "SandboxBudget",
           "process_budget", "set_process_budget", "worst_case_bytes"]

_SHARED: dict[tuple, Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def make_sandbox(mode: str = "bubblewrap", limits: Limits = Limits(),
                 pool_size: int = 2, budget: Optional[SandboxBudget] = None) -> Sandbox:
    """A Sandbox in `mode`: "bubblewrap" (isolated; raises SandboxUnavailable, naming the fix,
    where bwrap cannot work) or "unsafe_no_isolation" (a plain child process under rlimits
    only: the program can read, write and reach whatever this process can). Its runs wait for
    room in `budget`, by default the process's (`process_budget()`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "bubblewrap":
        require_bubblewrap()
    else:
        logging.getLogger(__name__).warning(
            "sandbox mode unsafe_no_isolation: programs run as plain child processes with "
            "rlimits only; they can read and write this machine's files and reach its network")
    return Sandbox(mode, limits, pool_size, budget)


def shared_sandbox(mode: str = "bubblewrap", limits: Limits = Limits(),
                   pool_size: int = 2) -> Sandbox:
    """The process's one sandbox for these settings, made on first use (`make_sandbox`) and
    kept for the life of the process: the code envs and python tools of every episode run in
    one warm pool, instead of each env starting (and warming) a pool of its own. Never close
    it; each run still gets a fresh sandbox."""
    key = (mode, limits, pool_size)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = make_sandbox(mode=mode, limits=limits, pool_size=pool_size)
        return _SHARED[key]
