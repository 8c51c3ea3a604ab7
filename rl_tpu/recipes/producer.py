"""The rollout phase as a producer of task groups: synchronous, or asynchronous within a staleness bound.

    producer = make_producer(config, play, stream, ...)
    trajectories, metrics = producer.next_batch(step)   # the groups step `step` trains on
    ...                                                 # update
    producer.publish(params, version=step)              # the engine samples with them next

Versions: step k's update produces weight version k; version 0 is the policy before RL. A
group's staleness, when step s trains on it, is (s - 1) - the oldest version any of its tokens
was sampled with: on-policy data (sampled by version s - 1) has staleness 0.

`SyncProducer` (rollout.max_staleness = 0) plays the step's tasks when asked, on the learner's
thread: today's on-policy loop, collectives allowed (DAPO's refill rounds agree across hosts).

`AsyncProducer` (rollout.max_staleness = k >= 1) plays in a thread of its own, one chunk of the
task stream at a time (chunk c = the tasks step c would train on when synchronous), while the
learner trains. Two modes:
- deterministic (`rollout.deterministic`): lock-step, exactly k versions behind: chunk c is
  sampled with version max(0, c - 1 - k), so step s trains on data of staleness exactly
  min(k, s - 1) and the run is a function of the config alone. Published versions are held
  (at most k + 1 copies) until the chunk that needs them starts; weights never change
  within a chunk.
- free-running: chunk c may start once the learner has published version c - 1 - k
  (admission: the producer is never more than k + 1 chunks ahead); new weights reach the
  engine as soon as they are published, between decode chunks, so a generation can span
  versions (per-token versions say which). Groups older than k when the learner reaches them
  are dropped and counted (`rollout/dropped_stale`); the learner takes the next ones, so no
  trained token is ever more than k versions old.

No collective runs in the producer thread (its pace differs per host): DAPO's refill is
decided per host there, and every cross-host metric is taken by the learner's thread.

Resume (`state()` -> `load_state()`, saved with the checkpoint of step s):
- deterministic: the chunks s + 1 .. s + k are complete at save time (they need versions up
  to s - 1); their trajectories are saved, and the producer restarts at chunk s + k + 1 with
  the restored weights (version s): the resumed run repeats the uninterrupted one number for
  number.
- free-running: the tasks read from the stream but not yet trained on (ready or in flight)
  are saved with the stream position after them; a resumed producer plays those first, then
  continues the stream: no task is lost or repeated (groups dropped as stale stay dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from rl_tpu.data.tasks import TaskStream
from rl_tpu.trajectory import NO_VERSION, Trajectory

log = logging.getLogger(__name__)

# play(tasks [(position, Task)], chunk, round_index) -> trajectories, task-major, G per task
PlayFn = Callable[[list, int, int], list[Trajectory]]
# select(played, play_more(round) -> more, any_host(flag) -> bool) -> (chosen, metrics)
SelectFn = Callable[..., tuple[list[Trajectory], dict]]


def groups_of(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories -> their groups (samples of one task), in order of first appearance."""
    groups: dict[int, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    return list(groups.values())


def group_version(group: list[Trajectory]) -> int:
    """The oldest weight version of any token of the group (NO_VERSION: it sampled nothing)."""
    versions = [t.oldest_version for t in group if t.oldest_version != NO_VERSION]
    return min(versions) if versions else NO_VERSION


def staleness_metrics(groups: list[list[Trajectory]], learner_version: int) -> dict:
    ages = [learner_version - v for v in map(group_version, groups) if v != NO_VERSION]
    return {"rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "rollout/staleness_max": float(max(ages, default=0))}


class SyncProducer:
    """On-policy: the step's tasks are played when the learner asks, on its thread."""

    def __init__(self, play: PlayFn, select: SelectFn, stream: TaskStream, engine,
                 to_engine: Callable[[Any], Any], any_host: Callable[[bool], bool]):
        self._play, self._select, self._stream = play, select, stream
        self._engine, self._to_engine, self._any_host = engine, to_engine, any_host

    def next_batch(self, step: int) -> tuple[list[Trajectory], dict]:
        tasks = self._stream.next()
        played = self._play(tasks, step, 0)
        chosen, metrics = self._select(
            played, lambda r: self._play(self._stream.next(), step, r), self._any_host)
        metrics.update(staleness_metrics(groups_of(chosen), step - 1))
        metrics.update({"rollout/dropped_stale": 0.0, "time/learner_idle_s": 0.0})
        return chosen, metrics

    def publish(self, params, version: int) -> None:
        self._engine.update_weights(self._to_engine(params), str(version))

    def state(self, step: int) -> dict:
        return {"stream": self._stream.get_state()}

    def load_state(self, state: dict, step: int) -> None:
        self._stream.set_state(state["stream"])

    def close(self) -> None:
        pass


class AsyncProducer:
    """Rollouts in a thread, at most `max_staleness` versions behind the learner."""

    def __init__(self, play: PlayFn, select: SelectFn, stream: TaskStream, engine,
                 to_engine: Callable[[Any], Any], *, max_staleness: int, deterministic: bool,
                 groups_per_step: int):
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: the async producer needs >= 1")
        self._play, self._select, self._stream = play, select, stream
        self._engine, self._to_engine = engine, to_engine
        self.k, self.deterministic, self.groups_per_step = max_staleness, deterministic, \
            groups_per_step
        self._cond = threading.Condition()
        self._published = 0  # the newest version the learner has published
        self._held: dict[int, Any] = {}  # deterministic: version -> params, until used
        self._ready: dict[int, list[Trajectory]] = {}  # chunk -> its selected trajectories
        self._ready_metrics: dict[int, dict] = {}
        self._in_flight: list = []  # free-running: tasks of the chunk being played
        self._leftover: list[list[Trajectory]] = []  # free-running: groups not yet trained
        self._next_chunk = 1
        self._stream_before: dict[int, dict] = {}  # chunk -> stream state before it was read
        self._replay_tasks: list = []  # free-running resume: tasks to play before the stream
        self._error: Optional[BaseException] = None
        self._stop = False
        self._thread: Optional[threading.Thread] = None

    # -- learner side ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def next_batch(self, step: int) -> tuple[list[Trajectory], dict]:
        """The groups step `step` trains on: waits for them (the wait is
        `time/learner_idle_s`); free-running, drops groups older than k."""
        waited = time.time()
        learner_version = step - 1
        if self.deterministic:
            self._wait_for(lambda: step in self._ready, step)
            with self._cond:
                chosen = groups_of(self._ready.pop(step))
                metrics = self._ready_metrics.pop(step, {})
            dropped = 0
        else:
            chosen, dropped, metrics = [], 0, {}
            while len(chosen) < self.groups_per_step:
                if not self._leftover:
                    self._wait_for(lambda: bool(self._ready), step)
                    with self._cond:
                        chunk = min(self._ready)
                        self._leftover = groups_of(self._ready.pop(chunk))
                        chunk_metrics = self._ready_metrics.pop(chunk, {})
                    metrics = metrics or chunk_metrics
                group = self._leftover.pop(0)
                version = group_version(group)
                if version != NO_VERSION and learner_version - version > self.k:
                    dropped += 1  # too stale to train on: the bound is a promise
                    continue
                chosen.append(group)
        idle = time.time() - waited
        metrics = dict(metrics)
        metrics.update(staleness_metrics(chosen, learner_version))
        metrics.update({"rollout/dropped_stale": float(dropped), "time/learner_idle_s": idle})
        return [t for g in chosen for t in g], metrics

    def publish(self, params, version: int) -> None:
        """Version `version`'s weights. Free-running, they go to the engine now (between its
        decode chunks); deterministic, a copy waits for the chunk that is to use them."""
        if self.deterministic:
            held = jax.tree.map(jnp.copy, params)  # the learner donates `params` next step
            with self._cond:
                self._held[version] = held
                self._published = version
                self._cond.notify_all()
            return
        self._engine.update_weights(self._to_engine(params), str(version))
        with self._cond:
            self._published = version
            self._cond.notify_all()

    def state(self, step: int) -> dict:
        """What a checkpoint of step `step` needs to resume the producer (see module doc)."""
        if self.deterministic:
            # chunks step+1 .. step+k need versions <= step - 1, all published: wait for them
            last = step + self.k
            self._wait_for(lambda: all(c in self._ready for c in range(step + 1, last + 1)),
                           step)
            with self._cond:
                return {"mode": "deterministic", "next_chunk": last + 1,
                        "stream": self._stream_before[last + 1]
                        if last + 1 in self._stream_before else self._stream.get_state(),
                        "chunks": {c: self._ready[c] for c in range(step + 1, last + 1)}}
        with self._cond:
            pending = [task for g in self._leftover for task in _group_task(g)]
            for c in sorted(self._ready):
                pending += [task for g in groups_of(self._ready[c]) for task in _group_task(g)]
            pending += list(self._in_flight)
            return {"mode": "free", "stream": self._stream.get_state(), "pending": pending,
                    "next_chunk": self._next_chunk}

    def load_state(self, state: dict, step: int) -> None:
        """Before `start`: continue where a saved producer stopped."""
        if (state.get("mode") == "deterministic") != self.deterministic:
            raise ValueError("the checkpoint's producer ran in another mode (deterministic or "
                             "free-running); resume with the same rollout.deterministic")
        self._stream.set_state(state["stream"])
        self._next_chunk = int(state["next_chunk"])
        self._published = step
        if self.deterministic:
            self._ready = {int(c): trajs for c, trajs in state["chunks"].items()}
        else:
            self._replay_tasks = list(state["pending"])

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)

    def _wait_for(self, ready: Callable[[], bool], step: int):
        with self._cond:
            while not ready():
                if self._error is not None:
                    raise RuntimeError(f"the rollout producer failed before step {step}: "
                                       f"{self._error}") from self._error
                self._cond.wait(timeout=1.0)

    # -- producer thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                chunk = self._next_chunk
                # chunk c may start once version c - 1 - k exists (the staleness bound)
                needed = max(0, chunk - 1 - self.k)
                with self._cond:
                    while not self._stop and self._published < needed:
                        self._cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    if self.deterministic:
                        params = self._held.pop(needed, None)
                        for v in [v for v in self._held if v < needed]:
                            del self._held[v]
                    self._stream_before[chunk] = self._stream.get_state()
                    for c in [c for c in self._stream_before if c < chunk - self.k - 1]:
                        del self._stream_before[c]
                    if self._replay_tasks:
                        tasks, self._replay_tasks = self._replay_tasks, []
                    else:
                        tasks = self._stream.next()
                    self._in_flight = list(tasks)
                if self.deterministic and params is not None:
                    self._engine.update_weights(self._to_engine(params), str(needed))
                played = self._play(tasks, chunk, 0)
                # no collectives here: refill rounds are decided by this host alone
                chosen, metrics = self._select(
                    played, lambda r: self._play(self._read_more(), chunk, r), lambda f: f)
                with self._cond:
                    self._ready[chunk] = chosen
                    self._ready_metrics[chunk] = metrics
                    self._in_flight = []
                    self._next_chunk = chunk + 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the learner, which raises it
            log.exception("rollout producer failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _read_more(self) -> list:
        with self._cond:
            tasks = self._stream.next()
            self._in_flight = self._in_flight + list(tasks)
        return tasks


def _group_task(group: list[Trajectory]) -> list:
    """The (position, Task) a group was played from, to play again after a resume."""
    info = group[0].info
    return [info["task"]] if "task" in info else []
