"""Env errors a run cannot miss: a warning when every episode of a step or an eval failed, a
stop when that goes on, and the first traceback of each kind of error kept in the workdir.

An episode that ends in `env_error` (rl_tpu/agent/loop.py: make_env, reset or step raised,
timed out or returned something malformed; an agent program raised) carries no loss, and the
run goes on: one flaky env call should not end a week of training. But when *every* episode
fails (a missing package, a dead env server, a bug in the env), a run that goes on trains on
nothing, and its metrics look like a policy that never succeeds. So:

- Each error kind (the failed call and the exception type, numbers blanked: "reset:
  RuntimeError", "step (turn N): timed out") is written once, with its traceback and the step
  it was first seen at, to W/env_errors.log (host i > 0: W/env_errors.host<i>.log), and named
  in a warning line the first time.
- A training step's rollout or an eval whose episodes all failed logs a warning with the count
  and the first error.
- `env.max_failed_steps` training steps in a row whose episodes all failed (default 3; 0 never
  stops) stop the run with `EnvFailuresError`, one line naming the first error (the launchers
  print it, exit status 2); so does a run that reaches its last step with every step's
  episodes failed, however short it is (a 2-step smoke run must not exit 0 having played
  nothing). An eval only warns: its tasks are not what the run trains on.

Multi-host: the decision reads the episode and error counts summed over every host
(`agent.evaluation.episode_stats`), the same on each, so every host stops at the same step;
the error text and the log are each host's own.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Optional, Sequence

from rl_tpu.core.trajectory import Trajectory

log = logging.getLogger(__name__)

LOG_FILE = "env_errors.log"
MAX_KINDS = 50  # a log of distinct kinds, not of every error: bounded whatever the env does


class EnvFailuresError(RuntimeError):
    """Every episode of `env.max_failed_steps` rounds in a row (or of the whole run) failed."""


def first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[:limit] + "..."


def error_kind(error: str) -> str:
    """What tells two errors apart in the log: the failed call and the exception type (the
    text before the second ':'), numbers blanked so each turn's step errors are one kind."""
    head = ":".join(first_line(error, 10_000).split(":")[:2])
    return re.sub(r"\d+", "N", head)[:160]


def warn_all_failed(what: str, failed: Sequence[Trajectory], episodes: int,
                    tracebacks: Optional[str] = None) -> str:
    """Logs that all `episodes` of `what` (every host's) ended in an env error, naming the
    first of this host's `failed`; returns that error's first line."""
    error = (first_line(str(failed[0].info.get("error", "no message"))) if failed
             else "(on another host)")
    where = f" (tracebacks: {tracebacks})" if tracebacks else ""
    log.warning("%s: all %d episodes ended in an env error, the first: %s%s", what,
                int(episodes), error, where)
    return error


class EnvFailureWatch:
    """Watches each round's episodes (module docstring); one per run, on every host."""

    def __init__(self, workdir: str, max_failed_steps: int, host: int = 0):
        if max_failed_steps < 0:
            raise ValueError(f"env.max_failed_steps={max_failed_steps} must be >= 0 "
                             "(0: never stop)")
        self.max_failed_steps = max_failed_steps
        name = LOG_FILE if host == 0 else f"env_errors.host{host}.log"
        self.path = os.path.join(workdir, name)
        self.kinds: set[str] = set()
        self.failed_in_a_row = 0  # training steps whose episodes all failed, up to the last
        self.any_played = False  # a training step with an episode that played (on any host)
        self.first_error: Optional[str] = None  # of the first of those failed steps

    def observe(self, step: int, trajectories: Sequence[Trajectory], episodes: int,
                errors: int, eval_: bool = False) -> None:
        """Step `step`'s rollout (or its eval, `eval_`) played `trajectories` here, and
        `episodes` with `errors` env errors over every host (the same numbers on each)."""
        failed = [t for t in trajectories if t.finish == "env_error"]
        for traj in failed:
            self._log_kind(step, traj)
        if episodes <= 0:
            return
        all_failed = errors >= episodes
        if all_failed:
            error = warn_all_failed(f"eval at step {step}" if eval_ else f"step {step}",
                                    failed, episodes, self.path)
        if eval_:
            return
        if not all_failed:
            self.any_played = True
            self.failed_in_a_row, self.first_error = 0, None
            return
        self.failed_in_a_row += 1
        if self.first_error is None:
            self.first_error = error

    def stop_if_failing(self, step: int, last: bool = False) -> None:
        """Raises EnvFailuresError after step `step` when `env.max_failed_steps` steps in a
        row had every episode fail, or at the run's `last` step when every step had."""
        limit = self.max_failed_steps
        if not limit or not self.failed_in_a_row:
            return
        if not (self.failed_in_a_row >= limit or (last and not self.any_played)):
            return
        steps = (f"step {step}" if self.failed_in_a_row == 1 else
                 f"steps {step - self.failed_in_a_row + 1}-{step}")
        raise EnvFailuresError(
            f"every episode of {steps} ended in an env error, the first: {self.first_error} "
            f"(tracebacks: {self.path}; env.max_failed_steps={limit}, 0 never stops)")

    def _log_kind(self, step: int, traj: Trajectory) -> None:
        error = str(traj.info.get("error", "no message"))
        kind = error_kind(error)
        if kind in self.kinds or len(self.kinds) >= MAX_KINDS:
            return
        self.kinds.add(kind)
        trace = traj.info.get("error_traceback") or "(no traceback: the call did not raise)\n"
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a") as f:
                f.write(f"=== step {step}: {kind}\n{error}\n{trace}\n")
        except OSError as err:  # the log is a help, not the run: a full disk fails elsewhere
            log.warning("could not write %s: %s", self.path, err)
        log.warning("env error of a new kind at step %d: %s (traceback: %s)", step,
                    first_line(error), self.path)
