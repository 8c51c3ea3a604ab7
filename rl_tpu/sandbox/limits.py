"""What a sandboxed run may use (`Limits`), what it gave back (`Execution`), and the error a
sandbox that cannot work on this machine raises (`SandboxUnavailable`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

# Every status an Execution can carry. "error" is a nonzero exit (a Python traceback included);
# "killed" is death by a signal none of the limits sent (SIGSEGV, SIGABRT, an unexplained SIGKILL).
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed")


@dataclass(frozen=True)
class Limits:
    """Per-run limits. The defaults are sized for unit-test programs.

    wall_seconds: from handing the program over to its end; past it the whole sandbox is killed.
    cpu_seconds: CPU time of the program's process (RLIMIT_CPU, whole seconds, rounded up),
        counted from when the program starts, not from the interpreter's start.
    memory_bytes: address space of each process (RLIMIT_AS).
    processes: processes and threads the sandbox may hold at once (see docs for when this is
        enforced exactly).
    output_bytes: per stream (stdout, stderr); what comes past it is cut and the run killed.
    tmpfs_bytes: size of the private writable tmpfs that is the program's cwd, /tmp and $HOME
        (and, in bubblewrap, of a second one at /dev/shm: at most twice this is writable); each
        also holds at most one file, directory or link a 4 KiB page of it (totals.tmpfs_inodes).
    open_files: fds each process may hold (RLIMIT_NOFILE): what bounds the socket and pipe
        buffers a process can fill (totals.py).
    """

    wall_seconds: float = 5.0
    cpu_seconds: float = 4.0
    memory_bytes: int = 512 * 2**20
    processes: int = 8
    output_bytes: int = 64 * 1024
    tmpfs_bytes: int = 64 * 2**20
    open_files: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Limits.{field.name} must be a positive number, got {value!r}")
        for name in ("memory_bytes", "processes", "output_bytes", "tmpfs_bytes", "open_files"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"Limits.{name} must be an int, got {getattr(self, name)!r}")
        if self.memory_bytes < 64 * 2**20:
            # The interpreter alone maps ~30 MB; below this it cannot start the program at all.
            raise ValueError(
                f"Limits.memory_bytes must be at least 64 MiB, got {self.memory_bytes}")
        if self.processes < 2:
            raise ValueError(f"Limits.processes must be at least 2, got {self.processes}")
        if self.open_files < 16:
            # The launcher holds 4 and the interpreter opens a few more while it imports.
            raise ValueError(f"Limits.open_files must be at least 16, got {self.open_files}")


@dataclass(frozen=True)
class Execution:
    """One program's run: its output (cut to Limits.output_bytes a stream), how it ended, and the
    wall seconds from handing it the program to its end."""

    stdout: str
    stderr: str
    status: str
    exit_code: Optional[int]
    seconds: float

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"Execution.status must be one of {STATUSES}, got {self.status!r}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class SandboxUnavailable(RuntimeError):
    """bubblewrap cannot isolate programs on this machine; the message says why and the fix."""
