"""What one sandboxed run can hold of the host's memory at most (`worst_case_bytes`), and the
process-wide budget (`SandboxBudget`) that caps how many runs go at once and the sum of their
worst cases, so that programs together cannot push the trainer into the OOM killer.

Why the per-run bound holds (bubblewrap mode; docs/tools.md, "Memory: the total"):
- each process maps at most memory_bytes (RLIMIT_AS), and at most `processes` exist at once
  (RLIMIT_NPROC, per user namespace), plus the kernel's own per-process memory (page tables,
  stacks: KERNEL_BYTES_PER_PROCESS);
- memory held through an fd but outside the address space: memfd, SysV IPC, io_uring, inotify,
  BPF, non-unix sockets, unix datagram sockets (many senders queue into one receiver),
  raised socket buffers and grown pipes are refused by the seccomp filter (seccomp.py); what
  is left is a unix stream/seqpacket socket (about its default send buffer, one peer), a
  listener with at most 2 connections waiting, or a pipe (64 KiB), at most open_files of them a
  process (RLIMIT_NOFILE);
- fds in flight (sent over a unix socket, then closed) are capped by the kernel at the
  sender's RLIMIT_NOFILE for the whole uid, plus one message's SCM_MAX_FD;
- the two tmpfs hold at most tmpfs_bytes of pages each, and at most tmpfs_inodes of files,
  directories and links each (the launcher mounts them with nr_inodes), whose inodes and
  dentries are kernel memory the size limit does not count.
The unsafe mode has none of the fd-side refusals: its runs are counted the same, but the bound
does not hold there."""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
from typing import Optional

from rl_tpu.sandbox.limits import Limits
from rl_tpu.sandbox.seccomp import LISTEN_BACKLOG_MAX

PAGE_BYTES = 4096
# The kernel caps one unix message's fds at SCM_MAX_FD (include/net/scm.h).
SCM_MAX_FD = 253
# tmpfs reserves 1 KiB of "inode space" a file; with the inode and dentry themselves a file
# costs about that again (shmem_inode_cache + dentry): 2 KiB is a bound with margin.
INODE_BYTES = 2048
# Kernel stack (16 KiB), task and signal structs, fd table: per process, besides page tables.
KERNEL_BYTES_PER_PROCESS = 64 * 1024
# One page-table page (4 KiB) maps 2 MiB: mapping memory_bytes costs memory_bytes / 512.
PAGE_TABLE_FRACTION = 512


def default_socket_send_buffer() -> int:
    """net.core.wmem_default: a new socket's send buffer (208 KiB unless the host changed it);
    the larger of the host's and the kernel's default, in case the sandbox's own network
    namespace starts from the latter."""
    try:
        with open("/proc/sys/net/core/wmem_default") as value:
            return max(int(value.read()), 212992)
    except (OSError, ValueError):
        return 212992


# What one socket can hold: a unix stream socket queues up to its send buffer plus one message
# (at most half the buffer) before the sender blocks.
SOCKET_BYTES = 2 * default_socket_send_buffer()
# What one fd can hold: a socket, or a listening socket's queue of LISTEN_BACKLOG_MAX + 1
# connections not yet accepted (each a socket; the listener itself queues nothing); a pipe
# (64 KiB) or an epoll set (a few hundred bytes a watched fd) holds less.
FD_BYTES = (LISTEN_BACKLOG_MAX + 1) * SOCKET_BYTES


def tmpfs_inodes(tmpfs_bytes: int) -> int:
    """The nr_inodes each sandbox tmpfs is mounted with: one a page of its size (a file with
    content takes a page anyway), at least 256."""
    return max(tmpfs_bytes // PAGE_BYTES, 256)


def worst_case_bytes(limits: Limits) -> int:
    """The most host memory one bubblewrap run under `limits` can hold at once."""
    per_process = (limits.memory_bytes + limits.memory_bytes // PAGE_TABLE_FRACTION
                   + KERNEL_BYTES_PER_PROCESS + limits.open_files * FD_BYTES)
    per_tmpfs = limits.tmpfs_bytes + tmpfs_inodes(limits.tmpfs_bytes) * INODE_BYTES
    in_flight = (limits.open_files + SCM_MAX_FD) * FD_BYTES
    return limits.processes * per_process + 2 * per_tmpfs + in_flight


def host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class SandboxBudget:
    """Admits runs first come, first served while fewer than max_running are running and the
    sum of their worst cases stays within max_total_bytes. A run whose worst case alone is over
    max_total_bytes waits until nothing else runs, then runs alone (and holds the others back):
    the summed bound is then its own worst case, never more than one such run."""

    def __init__(self, max_running: int, max_total_bytes: int):
        for name, value in (("max_running", max_running), ("max_total_bytes", max_total_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxBudget.{name} must be an int >= 1, got {value!r}")
        self.max_running = max_running
        self.max_total_bytes = max_total_bytes
        self.running = 0
        self.reserved_bytes = 0
        # The most seen at once since this budget was made: for tests and logs.
        self.peak_running = 0
        self.peak_reserved_bytes = 0
        self._condition = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()
        self._tickets = itertools.count()

    @property
    def waiting(self) -> int:
        """Runs waiting for their turn now."""
        with self._condition:
            return len(self._queue)

    def _admits(self, ticket: int, bytes_: int) -> bool:
        if self._queue[0] != ticket or self.running >= self.max_running:
            return False
        return self.running == 0 or self.reserved_bytes + bytes_ <= self.max_total_bytes

    @contextlib.contextmanager
    def reserve(self, bytes_: int):
        """Held for a run's length: waits its turn, then counts `bytes_` until the run ends."""
        with self._condition:
            ticket = next(self._tickets)
            self._queue.append(ticket)
            try:
                self._condition.wait_for(lambda: self._admits(ticket, bytes_))
            finally:
                self._queue.remove(ticket)
                self._condition.notify_all()  # the next in line may fit too
            self.running += 1
            self.reserved_bytes += bytes_
            self.peak_running = max(self.peak_running, self.running)
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        try:
            yield
        finally:
            with self._condition:
                self.running -= 1
                self.reserved_bytes -= bytes_
                self._condition.notify_all()


def default_budget() -> SandboxBudget:
    """Half the host's memory for sandboxes, and twice as many runs at once as there are cores
    (at least 4): more only adds memory and processes, fewer would queue programs that sleep or
    wait out their wall limit behind each other."""
    return SandboxBudget(max_running=max(4, 2 * (os.cpu_count() or 1)),
                         max_total_bytes=host_memory_bytes() // 2)


_PROCESS_BUDGET: Optional[SandboxBudget] = None
_PROCESS_BUDGET_LOCK = threading.Lock()


def process_budget() -> SandboxBudget:
    """The one budget every Sandbox of this process shares unless given its own."""
    global _PROCESS_BUDGET
    with _PROCESS_BUDGET_LOCK:
        if _PROCESS_BUDGET is None:
            _PROCESS_BUDGET = default_budget()
        return _PROCESS_BUDGET


def set_process_budget(max_running: int, max_total_bytes: int) -> SandboxBudget:
    """Replaces the process-wide budget (runs already admitted finish under the old one); call
    it before the first run, e.g. to size the cap for a host shared with other jobs."""
    global _PROCESS_BUDGET
    budget = SandboxBudget(max_running, max_total_bytes)
    with _PROCESS_BUDGET_LOCK:
        _PROCESS_BUDGET = budget
    return budget
