"""Running one program in one fresh sandbox, and the pool that keeps sandboxes warm.

A sandbox here is one started launcher (rl_tpu/sandbox/launcher.py), inside bwrap or, in the
unsafe mode, as a plain child process. It runs exactly one program and is then killed; the pool
only moves the start (bwrap's namespaces and mounts, the interpreter's import) ahead of the run,
on a thread of its own, so every run still gets a sandbox nothing ran in before."""

from __future__ import annotations

import collections
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Optional

from rl_tpu.sandbox import bubblewrap
from rl_tpu.sandbox.launcher import HEADER_BYTES
from rl_tpu.sandbox.limits import Execution, Limits
from rl_tpu.sandbox.totals import SandboxBudget, process_budget, worst_case_bytes

# A sandbox that has not started the program this long after being handed it is broken (bwrap
# failed, the interpreter is missing), not slow: the run raises instead of reporting a timeout.
START_TIMEOUT_SECONDS = 60.0
READ_CHUNK = 65536
# The launcher says at most "ready", "started" and "memory" on its status pipe.
STATUS_BYTES = 4096
MODES = ("bubblewrap", "unsafe_no_isolation")
log = logging.getLogger(__name__)


class Started:
    """One launcher, up and waiting on its stdin for a program."""

    def __init__(self, process: subprocess.Popen, status_fd: int, workdir: Optional[str],
                 init_pidfd: Optional[int]):
        self.process = process
        self.status_fd = status_fd  # read end of the launcher's status pipe
        self.workdir = workdir  # the unsafe mode's temporary cwd, removed after the run
        # bwrap's init, pid 1 of the sandbox's pid namespace, as a pidfd (no pid-reuse race).
        self.init_pidfd = init_pidfd
        # close() may kill a sandbox while its run releases it: no signal through a closed fd.
        self.lock = threading.Lock()
        self.released = False

    def kill(self):
        with self.lock:
            if not self.released:
                self.kill_unlocked()

    def kill_unlocked(self):
        if self.init_pidfd is not None:
            # Killing the namespace's init kills everything in it, and the init is not reaped
            # before all of it is gone; bwrap exits once its init has. So when the wait on bwrap
            # returns, nothing of the sandbox is left (killing bwrap itself would leave the
            # teardown to run on after it, through --die-with-parent).
            try:
                signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
                return
            except ProcessLookupError:
                pass  # already gone: bwrap is exiting or has
        if self.process.returncode is not None:
            return  # reaped: its pid may belong to another process by now
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the unsafe mode's process group
        except (ProcessLookupError, PermissionError):
            pass

    def release(self):
        with self.lock:
            self.kill_unlocked()
            self.released = True
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # never seen; bwrap itself then goes the hard way
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.init_pidfd is not None:
            bubblewrap.await_init(self.init_pidfd)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            try:
                stream.close()
            except OSError:
                pass
        os.close(self.status_fd)
        if self.init_pidfd is not None:
            os.close(self.init_pidfd)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def count_user_tasks(uid: int) -> int:
    """Processes and threads this uid holds on the host: what RLIMIT_NPROC counts when no user
    namespace of its own separates a sandbox's processes (the unsafe mode)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue  # gone meanwhile
    return total


class Sandbox:
    """Runs Python programs, each in a fresh sandbox; `run` is safe from many threads at once.

    Made by `make_sandbox`. pool_size sandboxes are kept started ahead of time for the default
    limits' tmpfs size; a run with another tmpfs size, or one that finds the pool empty, starts
    its own sandbox (cold). Every run first waits for room in `budget` (default: the one budget
    of this process, totals.process_budget), reserving its worst case (totals.worst_case_bytes)
    until it ends."""

    def __init__(self, mode: str, limits: Limits, pool_size: int,
                 budget: Optional[SandboxBudget] = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be a rl_tpu.sandbox.Limits, got {type(limits).__name__}")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 0:
            raise ValueError(f"pool_size must be an int >= 0, got {pool_size!r}")
        self.mode = mode
        self.limits = limits
        self.pool_size = pool_size
        self.budget = budget if budget is not None else process_budget()
        self._ready: collections.deque[Started] = collections.deque()
        self._live: set[Started] = set()  # every started launcher not yet released
        self._condition = threading.Condition()
        self._closed = False
        self._spawner = None
        if pool_size:
            # One long-lived thread starts every pooled sandbox: bwrap's --die-with-parent fires
            # when the *thread* that started it ends, so a caller's short-lived thread must not.
            self._spawner = threading.Thread(target=self._keep_pool_full, daemon=True,
                                             name="sandbox-pool")
            self._spawner.start()

    # -- starting -----------------------------------------------------------------------------

    def _start(self, tmpfs_bytes: int) -> Started:
        status_read, status_write = os.pipe()
        info_read, info_write = os.pipe()
        isolated = self.mode == "bubblewrap"
        filter_fd = bubblewrap.seccomp_filter_fd() if isolated else None
        passed = (status_write, info_write, filter_fd) if isolated else (status_write,)
        workdir = None
        try:
            if isolated:
                inner = bubblewrap.launcher_command(bubblewrap.SANDBOX_PYTHON, status_write,
                                                    tmpfs_bytes)
                command = bubblewrap.bubblewrap_command(inner, info_fd=info_write,
                                                        seccomp_fd=filter_fd)
                options = bubblewrap.spawn_options()
            else:
                workdir = tempfile.mkdtemp(prefix="rl_tpu-unsafe-sandbox-")
                command = bubblewrap.launcher_command(bubblewrap.unsafe_python(), status_write)
                options = bubblewrap.spawn_options(isolated=False, cwd=workdir)
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, pass_fds=passed, bufsize=0,
                                       **options)
        except BaseException:
            os.close(status_read)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            os.close(status_write)
            os.close(info_write)
            if filter_fd is not None:
                os.close(filter_fd)
        try:
            init_pidfd = bubblewrap.read_init_pidfd(info_read) if isolated else None
        finally:
            os.close(info_read)
        started = Started(process, status_read, workdir, init_pidfd)
        with self._condition:
            self._live.add(started)
        return started

    def _keep_pool_full(self):
        while True:
            with self._condition:
                while not self._closed and len(self._ready) >= self.pool_size:
                    self._condition.wait()
                if self._closed:
                    return
            try:
                started = self._start(self.limits.tmpfs_bytes)
            except OSError as error:  # fork failed (host out of processes?): try again soon
                log.warning("sandbox pool could not start a sandbox: %s", error)
                time.sleep(1.0)
                continue
            with self._condition:
                if self._closed:
                    self._discard(started)
                    return
                self._ready.append(started)

    def _take(self, tmpfs_bytes: int) -> Started:
        with self._condition:
            if self._closed:
                raise RuntimeError("this sandbox is closed")
            while self._ready and tmpfs_bytes == self.limits.tmpfs_bytes:
                started = self._ready.popleft()
                self._condition.notify_all()  # the pool thread refills
                if started.process.poll() is None:
                    return started
                self._discard(started)  # died while waiting; a cold start says why
        return self._start(tmpfs_bytes)

    def _discard(self, started: Started):
        started.release()
        with self._condition:
            self._live.discard(started)

    # -- running ------------------------------------------------------------------------------

    def run(self, code: str, stdin: str = "", limits: Optional[Limits] = None) -> Execution:
        """Runs `code` (Python 3 source) with `stdin` as its standard input under `limits`
        (default: this sandbox's), in a sandbox nothing ran in before."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        if not isinstance(stdin, str):
            raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
        limits = self.limits if limits is None else limits
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be a rl_tpu.sandbox.Limits, got {type(limits).__name__}")
        with self.budget.reserve(worst_case_bytes(limits)):
            started = self._take(limits.tmpfs_bytes)
            try:
                return self._execute(started, code, stdin, limits)
            finally:
                self._discard(started)

    def _processes_allowed(self, limits: Limits) -> int:
        if self.mode == "bubblewrap":
            # The sandbox's user namespace has its own count (Linux 5.14+): bwrap's init + ours.
            return limits.processes + bubblewrap.SANDBOX_OWN_PROCESSES
        # No namespace of its own: the count is the whole uid's, so the budget goes on top of
        # what the uid holds now (uid 0 is never limited by the kernel at all).
        return count_user_tasks(os.getuid()) + limits.processes

    def _execute(self, started: Started, code: str, stdin: str, limits: Limits) -> Execution:
        # "replace": a lone surrogate in model output becomes "?" instead of failing the call.
        source = code.encode("utf-8", "replace")
        header = (f"{limits.cpu_seconds} {limits.memory_bytes} "
                  f"{self._processes_allowed(limits)} {limits.open_files} "
                  f"{len(source)}").ljust(HEADER_BYTES)
        payload = memoryview(header.encode("ascii") + source + stdin.encode("utf-8", "replace"))
        process = started.process
        outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
        status_lines = bytearray()
        stdin_fd = process.stdin.fileno()
        os.set_blocking(stdin_fd, False)
        selector = selectors.DefaultSelector()
        selector.register(stdin_fd, selectors.EVENT_WRITE)
        for fd in (*outputs, started.status_fd):
            selector.register(fd, selectors.EVENT_READ)
        # Readable once the launcher (unsafe) or bwrap has exited: what the program left running
        # is then killed, so an orphan holding stdout open cannot hold the run to its wall limit.
        exited_fd = os.pidfd_open(process.pid)
        selector.register(exited_fd, selectors.EVENT_READ)
        begin = time.monotonic()
        deadline = begin + START_TIMEOUT_SECONDS
        program_started = False
        ended_by = None  # "timeout" / "output_limit" when this side killed the sandbox
        written = 0
        try:
            while selector.get_map() and ended_by is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if not program_started:
                        raise RuntimeError(f"the {self.mode} sandbox did not start a program "
                                           f"in {START_TIMEOUT_SECONDS:.0f} s")
                    ended_by = "timeout"
                    break
                for key, _ in selector.select(remaining):
                    fd = key.fd
                    if fd == exited_fd:
                        selector.unregister(fd)
                        started.kill()
                        continue
                    if fd == stdin_fd:
                        try:
                            written += os.write(fd, payload[written:written + READ_CHUNK])
                        except BrokenPipeError:  # the program exited without reading it all
                            written = len(payload)
                        if written == len(payload):
                            selector.unregister(fd)
                            process.stdin.close()
                        continue
                    data = os.read(fd, READ_CHUNK)
                    if not data:
                        selector.unregister(fd)
                    elif fd == started.status_fd:
                        status_lines += data
                        if not program_started and b"started\n" in status_lines:
                            program_started = True
                            deadline = time.monotonic() + limits.wall_seconds
                        if len(status_lines) > STATUS_BYTES:
                            # Only a program writing to the fd itself gets here: stop reading
                            # (its writes then block) rather than hold what it sends.
                            selector.unregister(fd)
                    else:
                        outputs[fd] += data
                        if len(outputs[fd]) > limits.output_bytes:
                            del outputs[fd][limits.output_bytes:]
                            ended_by = "output_limit"
            if ended_by is None:
                # Every pipe closed; the sandbox is ending (or closed its fds and lives on).
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    ended_by = "timeout"
            if ended_by is not None:
                started.kill()
            returncode = process.wait()
        finally:
            selector.close()
            os.close(exited_fd)
        seconds = time.monotonic() - begin
        stdout, stderr = (bytes(outputs[s.fileno()]).decode("utf-8", "replace")
                          for s in (process.stdout, process.stderr))
        if not program_started and ended_by is None:
            raise RuntimeError(f"the {self.mode} sandbox failed before the program started "
                               f"(exit {returncode}): {stderr.strip() or 'no stderr'}")
        status, exit_code = self._status(returncode, ended_by, b"memory\n" in status_lines)
        return Execution(stdout=stdout, stderr=stderr, status=status, exit_code=exit_code,
                         seconds=seconds)

    def _status(self, returncode: int, ended_by: Optional[str], memory_error: bool):
        if ended_by is not None:
            return ended_by, None
        signal_number = None
        if returncode < 0:  # the unsafe mode's launcher is our direct child
            signal_number = -returncode
        elif self.mode == "bubblewrap" and returncode > 128:
            # bwrap exits 128 + N when the program died of signal N (as a shell reports it); a
            # program's own sys.exit(128 + N) reads the same, a known ambiguity.
            signal_number = returncode - 128
        if signal_number == signal.SIGXCPU:
            return "cpu_limit", None
        if signal_number is not None:
            return "killed", None
        if returncode == 0:
            return "ok", 0
        return ("memory_limit" if memory_error else "error"), returncode

    # -- closing ------------------------------------------------------------------------------

    def close(self):
        """Kills every sandbox this object started, pooled or running; runs in flight end
        "killed". Safe to call twice."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if self._spawner is not None:
            self._spawner.join()
        with self._condition:
            pooled = list(self._ready)
            self._ready.clear()
            running = [s for s in self._live if s not in pooled]
        for started in running:
            started.kill()  # its run() reaps it and returns "killed"
        for started in pooled:
            self._discard(started)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
