"""Writes of a run that fail: one error a user can act on, and no pile of tracebacks.

A step that cannot be written (a full disk, no permission, a read-only filesystem) is an
OSError from our own writes or, from orbax's background threads, a ValueError tensorstore
raises with the OS error inside its message (`RESOURCE_EXHAUSTED: ... No space left on device
[os_error_code='28']`). checkpoint.py turns either into one `CheckpointWriteError`
naming the step, the path, the cause, what to do and the last good step; rl_tpu/metrics.py
raises a RunWriteError for a metrics line or TensorBoard event it cannot write.

The same failure is also reported by the threads that hit it: orbax logs it at ERROR with a
traceback from each thread and again from its finaliser, and tensorstore's write callbacks,
arriving after orbax's event loop has given up, print `RuntimeError: Event loop is closed`
through sys.unraisablehook, dozens of times. `quiet_background_failure_reports` cuts the
first to one line each and drops the second, and asyncio's "Task exception was never
retrieved" for the failed writes' sibling tasks. Nothing here imports jax or orbax, so a
launcher can catch RunWriteError cheaply.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from typing import Optional


class RunWriteError(OSError):
    """A run's output (a checkpoint, its metrics) could not be written: the disk is full, the
    directory not writable, the filesystem read-only. `str()` is the one line a user reads:
    what, the path, the cause and what to do. `code` is the OS's errno when one is known
    (tensorstore reports it inside its message). Launchers end the run with that line."""

    def __init__(self, what: str, path: str, cause: BaseException, after: str = ""):
        code, reason = storage_cause(cause)
        todo = _WHAT_TO_DO.get(code, _CHECK_DISK)
        super().__init__(f"cannot write {what} to {path}: {reason}; {todo}"
                         + (f"; {after}" if after else ""))
        self.what, self.path, self.reason, self.code = what, path, reason, code


class CheckpointWriteError(RunWriteError):
    """A checkpoint (a step, its host state, a static item) could not be written; the line
    also names the last good step, the one a rerun resumes from."""

    def __init__(self, what: str, path: str, cause: BaseException, last_good: Optional[int]):
        super().__init__(what, path, cause,
                         f"the last good checkpoint is step {last_good}" if last_good is not None
                         else "no checkpoint was written before it")
        self.last_good = last_good


_CHECK_DISK = "check the disk (space, permissions) or pick another --workdir"
_WHAT_TO_DO = {
    errno.ENOSPC: "free space there or pick another --workdir",
    errno.EDQUOT: "free space within your quota or pick another --workdir",
    errno.EACCES: "make the directory writable or pick another --workdir",
    errno.EPERM: "make the directory writable or pick another --workdir",
    errno.EROFS: "its filesystem is read-only: pick another --workdir",
    errno.EFBIG: "a file-size limit (ulimit -f) stopped it: raise the limit or pick another "
                 "--workdir",
}
# tensorstore names the OS error inside its message: `... No space left on device
# [os_error_code='28']`
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def storage_cause(err: BaseException) -> tuple[Optional[int], str]:
    """(errno or None, a short reason) of a failed write: an OSError's own, or the OS error a
    tensorstore message names, else the exception's first 300 characters."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno is not None and not isinstance(e, RunWriteError):
            return e.errno, e.strerror or os.strerror(e.errno)
        match = _OS_ERROR_CODE.search(str(e))
        if match:
            code = int(match.group(1))
            return code, os.strerror(code)
    return None, _short_text(f"{type(err).__name__}: {err}")


def _chain(err: BaseException):
    """err and its causes, outermost first (a wrapped write error names its cause inside)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def is_storage_error(err: BaseException) -> bool:
    """An OSError, or the error tensorstore raises for a failed read or write (a ValueError
    whose message starts with its status code, e.g. `RESOURCE_EXHAUSTED: ...`)."""
    return isinstance(err, OSError) or bool(
        isinstance(err, ValueError) and (_OS_ERROR_CODE.search(str(err)) or re.match(
            r"(RESOURCE_EXHAUSTED|PERMISSION_DENIED|OUT_OF_RANGE|UNKNOWN|INTERNAL|"
            r"FAILED_PRECONDITION|UNAVAILABLE|DATA_LOSS|ABORTED): ", str(err))))


class _OneLineOrbaxErrors(logging.Filter):
    """Orbax's background threads log a failed write at ERROR with its traceback, several
    times over (each thread, then the finalizer); the failure surfaces once anyway, as a
    CheckpointWriteError. Their records keep one shortened line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "orbax" in (record.pathname or "") and \
                record.exc_info:
            record.msg, record.args = _short_text(record.getMessage()), None
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


class _NoUnretrievedWriteErrors(logging.Filter):
    """asyncio logs "Task exception was never retrieved" for each of orbax's write tasks that
    failed beside the one whose error was raised, when they are garbage-collected: a storage
    error already reported as the run's error. Those records are dropped; others pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "never retrieved" in str(record.msg)
                    and is_storage_error(exc))


def _quiet_late_loop_callbacks(unraisable) -> None:
    """sys.unraisablehook: drops the `RuntimeError: Event loop is closed` that tensorstore
    reports when a write completes after orbax's event loop gave up on a failed save (there
    is no one left to tell, and the failure itself is raised); the rest goes on unchanged."""
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and \
            unraisable.object is None:
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook
_quieted = False


def quiet_background_failure_reports() -> None:
    """Installs the filters and the hook above, once per process (orbax's tracebacks stay
    whole with RL_TPU_DEBUG=1)."""
    global _quieted, _previous_unraisablehook  # pylint: disable=global-statement
    if _quieted:
        return
    if os.environ.get("RL_TPU_DEBUG") != "1":  # the launchers' switch for full tracebacks
        logging.getLogger("absl").addFilter(_OneLineOrbaxErrors())
    logging.getLogger("asyncio").addFilter(_NoUnretrievedWriteErrors())
    if sys.unraisablehook is not _quiet_late_loop_callbacks:
        _previous_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _quiet_late_loop_callbacks
    _quieted = True


def _short_text(text: str, limit: int = 300) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."
