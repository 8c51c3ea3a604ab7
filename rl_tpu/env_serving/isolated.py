"""Worker processes that run a function with a hard deadline, callable from any thread.

Checkers such as math-verify bound their time with `signal.alarm`, which works only in a
process's main thread, and some scorers (reasoning-gym's countdown evaluating `10**10**10`)
have no bound at all. `IsolatedWorkers` runs each call in a child process, where such code
runs in *its* main thread, and kills and replaces a child that overruns the deadline. Calls
cross the pipe pickled, so the function must be importable (module-level).
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

_HEADER = struct.Struct("<Q")  # payload length of one pickled message on the worker pipes
# Children start with `python -c` importing this module, not multiprocessing's spawn, which
# would re-run an unguarded user script.
_WORKER_MAIN = "from rl_tpu.env_serving.isolated import _serve_worker; _serve_worker()"


class WorkerError(RuntimeError):
    """The function raised inside the worker; the message names the exception."""


# ---------------------------------------------------------------------------------------------
# Worker processes with a hard deadline per call.
# ---------------------------------------------------------------------------------------------


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    chunks, left = [], n
    while left:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([fd], [], [], wait)[0]:
            raise TimeoutError("worker did not answer in time")
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("worker exited")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Worker:
    """One child python running `_serve_worker`; messages are length-prefixed pickles."""

    def __init__(self):
        env = dict(os.environ)
        # The child imports the called function's module the way this process does.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        # A fresh interpreter rather than multiprocessing's spawn: spawn re-imports the parent's
        # __main__, which runs unguarded top-level code of a user's script a second time.
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     env=env, close_fds=True)
        self.calls = 0
        self.prepared: set[str] = set()

    def call(self, payload: bytes, timeout_s: float) -> tuple[bool, Any]:
        """Sends one pickled (fn, args); returns the unpickled (ok, value) answer."""
        self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
        self.calls += 1
        return pickle.loads(_read_exact(fd, size, deadline))

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class IsolatedWorkers:
    """Runs picklable top-level functions in child processes, each call under a hard deadline.

    `call(fn, *args)` blocks until a worker is free (at most `num_workers` exist; they start
    on demand), runs `fn(*args)` there and returns its result. A call that overruns
    `timeout_s` gets its worker killed (a fresh one takes its slot on the next call) and raises
    `TimeoutError`; an exception inside `fn` raises `WorkerError`. Thread-safe.
    """

    def __init__(self, num_workers: Optional[int] = None, timeout_s: float = 10.0,
                 start_timeout_s: float = 120.0):
        self.num_workers = num_workers or max(1, min(4, os.cpu_count() or 1))
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s  # a fresh worker's first call also imports
        # A slot per worker: whoever holds one uses an idle worker or starts a new one, so a
        # killed worker's slot is never lost and the count never exceeds num_workers.
        self._slots = threading.BoundedSemaphore(self.num_workers)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._alive: list[_Worker] = []
        self._closed = False
        atexit.register(self.close)

    def call(self, fn: Callable, *args, timeout_s: Optional[float] = None,
             prepare: Optional[tuple] = None) -> Any:
        """`fn(*args)` in a worker. `prepare=(setup_fn, setup_args)` runs once per worker
        before its first such call, under `start_timeout_s`: the slow imports and table
        building belong there, so the real call's deadline can stay tight."""
        name = getattr(fn, "__name__", repr(fn))
        payload = pickle.dumps((fn, args))  # unpicklable input fails here, in the caller
        setup = pickle.dumps(prepare) if prepare is not None else None
        budget = self.timeout_s if timeout_s is None else timeout_s
        self._slots.acquire()
        try:
            worker = self._take()
            try:
                if setup is not None and setup not in worker.prepared:
                    self._checked(worker, setup, self.start_timeout_s, "preparing " + name)
                    worker.prepared.add(setup)
                ok, value = self._checked(worker, payload, budget, name)
            except BaseException:
                self._discard(worker)
                raise
            self._idle.put(worker)
        finally:
            self._slots.release()
        if not ok:
            raise WorkerError(value)
        return value

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("IsolatedWorkers is closed")
            while True:
                try:
                    worker = self._idle.get_nowait()
                except queue.Empty:
                    break
                if worker.proc.poll() is None:
                    return worker
                # It died while idle (killed from outside, out of memory): start another.
                worker.kill()
                self._alive.remove(worker)
            worker = _Worker()
            self._alive.append(worker)
            return worker

    def _checked(self, worker: _Worker, payload: bytes, budget: float, what: str):
        if worker.calls == 0:
            budget += self.start_timeout_s  # a fresh interpreter imports before it answers
        try:
            return worker.call(payload, budget)
        except TimeoutError:
            raise TimeoutError(f"{what} ran over {budget:.0f}s; its worker was killed") from None
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            raise WorkerError(f"worker died during {what}: {e!r}") from None

    def _discard(self, worker: _Worker):
        worker.kill()
        with self._lock:
            if worker in self._alive:
                self._alive.remove(worker)

    def close(self):
        with self._lock:
            self._closed = True
            workers, self._alive = self._alive, []
        for w in workers:
            w.kill()


def _serve_worker():
    """Child side: read (fn, args), answer (ok, result-or-error), until stdin closes."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # whatever the called code prints goes to stderr, not into the protocol
    inp = sys.stdin.buffer
    while True:
        header = inp.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        (size,) = _HEADER.unpack(header)
        try:
            fn, args = pickle.loads(inp.read(size))
            result = (True, fn(*args))
            payload = pickle.dumps(result)
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            payload = pickle.dumps((False, f"{type(e).__name__}: {e}"))
        out.write(_HEADER.pack(len(payload)) + payload)


_SHARED_WORKERS: Optional[IsolatedWorkers] = None
_SHARED_LOCK = threading.Lock()


def shared_workers() -> IsolatedWorkers:
    """One process-wide pool, so many env instances (one per server thread) share a few
    workers instead of each starting its own."""
    global _SHARED_WORKERS
    with _SHARED_LOCK:
        if _SHARED_WORKERS is None or _SHARED_WORKERS._closed:
            _SHARED_WORKERS = IsolatedWorkers()
        return _SHARED_WORKERS


