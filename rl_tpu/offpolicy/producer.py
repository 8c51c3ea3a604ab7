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
  as the engine's host-local copies (at most k + 1, made by the learner) until the chunk that
  needs them starts; weights never change within a chunk (an eval that borrows the engine,
  `engine_at`, waits for the chunk to end and puts the chunk's version back after).
- free-running: a chunk may start while fewer than k steps' worth of groups wait for the
  learner (admission: the producer is never more than about k steps ahead; counted in
  groups, since a partial-rollout chunk completes a varying number of them); new weights
  reach the engine as soon as the publisher thread has loaded them (an SGLang export and
  reload runs there, beside the learner's next step), between decode chunks, so a generation
  can span versions (per-token versions say which). Groups older than k when the learner reaches them
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

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rl_tpu import parallel
from rl_tpu.agent import close_paused, paused_task
from rl_tpu.core.shared_weights import wait_for_shared_weights
from rl_tpu.core.trajectory import NO_VERSION, Trajectory, group_version, groups_of
from rl_tpu.data.tasks import TaskStream

log = logging.getLogger(__name__)

# play(tasks [(position, Task)], chunk, round_index) -> trajectories, task-major, G per task
PlayFn = Callable[[list, int, int], list[Trajectory]]
# select(played, play_more(round) -> more, any_host(flag) -> bool) -> (chosen, metrics)
SelectFn = Callable[..., tuple[list[Trajectory], dict]]


def staleness_metrics(groups: list[list[Trajectory]], learner_version: int) -> dict:
    ages = [learner_version - v for v in map(group_version, groups) if v != NO_VERSION]
    return {"rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "rollout/staleness_max": float(max(ages, default=0))}


# How per-host rollout and replay metrics combine over hosts (`metrics_over_hosts`); any
# other key is a mean of the hosts' values (each host trains as many groups, so an unweighted
# mean is the mean over the global batch).
_HOST_SUMS = ("rollout/played_tokens", "rollout/dropped_stale", "replay/groups",
              "replay/buffer_groups")
_HOST_MAXES = ("rollout/staleness_max", "rollout/refill_rounds")
_HOST_MEANS = ("rollout/staleness_mean", "rollout/informative_group_frac",
               "rollout/filler_group_frac", "rollout/branch_turn", "replay/staleness_mean")


def metrics_over_hosts(metrics: dict) -> dict:
    """The producer's and the replay buffer's metrics (each host's: the producer's are made
    where no collective may run) over every host, as one host playing every task would
    report them. The learner's thread calls this (a
    collective with several processes). Keys outside the tables above, and the time/ keys
    (each host's own clock), stay this host's."""
    if jax.process_count() == 1:
        return metrics
    keys = _HOST_SUMS + _HOST_MAXES + _HOST_MEANS  # the same order on every host
    local = np.array([[k in metrics, float(metrics.get(k, 0.0))] for k in keys], np.float64)
    gathered = parallel.across_hosts(local, "gather")  # [hosts, keys, (present, value)]
    out = dict(metrics)
    for i, key in enumerate(keys):
        present = gathered[:, i, 0] > 0
        if not present.any():
            continue
        values = gathered[present, i, 1]
        out[key] = float(values.sum() if key in _HOST_SUMS else
                         values.max() if key in _HOST_MAXES else values.mean())
    return out



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
        wait_for_shared_weights(self._engine, version)

    @contextlib.contextmanager
    def engine_at(self, params, version: int):
        """The engine already serves `version`: published at the end of the step."""
        del params, version
        yield self._engine

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
                 groups_per_step: int, partial: Optional[PartialRollouts] = None,
                 keep_stale: bool = False, shared_with_eval: bool = False):
        """`partial`: play through partial rollouts (free-running only: chunks then hold a
        varying number of groups). `keep_stale`: groups older than k are trained on, their
        old tokens masked by the trainer (rollout.mask_stale_tokens), instead of dropped.
        `shared_with_eval`: the eval borrows the engine (SGLang servers: `engine_at`), so a
        deterministic producer keeps the copy it loaded last, to load it again after."""
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: the async producer needs >= 1")
        if partial is not None and deterministic:
            raise ValueError("partial rollouts run free: set rollout.deterministic=False")
        self._partial, self._keep_stale = partial, keep_stale
        self._play = partial if partial is not None else play
        self._select, self._stream = select, stream
        self._engine, self._to_engine = engine, to_engine
        self.k, self.deterministic, self.groups_per_step = max_staleness, deterministic, \
            groups_per_step
        self._cond = threading.Condition()
        self._published = 0  # the newest version the learner has published
        self._held: dict[int, Any] = {}  # deterministic: version -> params, until used
        # deterministic, engine shared with eval: the producer holds `_engine_lock` while a
        # chunk plays; `_loaded` is what it loaded last, reloaded when an eval swapped it
        self._shared_with_eval = shared_with_eval
        self._engine_lock = threading.Lock()
        self._loaded: Optional[tuple[int, Any]] = None
        self._swapped = False
        self._ready: dict[int, list[Trajectory]] = {}  # chunk -> its selected trajectories
        self._ready_metrics: dict[int, dict] = {}
        self._in_flight: list = []  # free-running: tasks of the chunk being played
        # partial rollouts: tasks of groups not complete after the last chunk (snapshotted by
        # the producer thread between chunks, when nothing else touches them)
        self._partial_pending: list = []
        self._leftover: list[list[Trajectory]] = []  # free-running: groups not yet trained
        self._next_chunk = 1
        self._stream_before: dict[int, dict] = {}  # chunk -> stream state before it was read
        self._replay_tasks: list = []  # free-running resume: tasks to play before the stream
        self._error: Optional[BaseException] = None
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        # free-running: the engine's copy of the newest published version, waiting for the
        # publisher thread (one at a time, in version order on every host)
        self._to_publish: Optional[tuple[Any, int]] = None
        self._publisher: Optional[threading.Thread] = None

    # -- learner side ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()
        if not self.deterministic:
            self._publisher = threading.Thread(target=self._publish_loop,
                                               name="weight-publisher", daemon=True)
            self._publisher.start()

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
            chosen, dropped = [], 0
            taken = []  # (metrics, groups) of each chunk this step took from the queue
            while len(chosen) < self.groups_per_step:
                while not self._leftover:  # a partial-rollout chunk may complete no group
                    self._wait_for(lambda: bool(self._ready), step)
                    with self._cond:
                        chunk = min(self._ready)
                        self._leftover = groups_of(self._ready.pop(chunk))
                        chunk_metrics = self._ready_metrics.pop(chunk, {})
                        self._cond.notify_all()  # room for the producer (admission)
                    taken.append((chunk_metrics, len(self._leftover)))
                group = self._leftover.pop(0)
                version = group_version(group)
                if (not self._keep_stale and version != NO_VERSION
                        and learner_version - version > self.k):
                    dropped += 1  # too stale to train on: the bound is a promise
                    continue
                chosen.append(group)
            # A step may take several chunks (a chunk holds fewer groups than a step when
            # groups were dropped or partial rollouts completed few), and each chunk's metrics
            # are logged once, by the step that takes it: select_groups' counts (played
            # tokens, refill rounds) add up; its rates and means (informative and filler
            # group fractions, branch turn) are weighted by each chunk's groups.
            summed = ("rollout/played_tokens", "rollout/refill_rounds")
            metrics = {}
            for key in dict.fromkeys(key for chunk_metrics, _ in taken for key in chunk_metrics):
                values = [(m[key], groups) for m, groups in taken if key in m]
                weight = sum(groups for _, groups in values)
                if key in summed:
                    metrics[key] = float(sum(value for value, _ in values))
                elif weight:
                    metrics[key] = sum(value * groups for value, groups in values) / weight
                else:  # chunks that completed no group: a plain mean
                    metrics[key] = sum(value for value, _ in values) / len(values)
        idle = time.time() - waited
        metrics = dict(metrics)
        metrics.update(staleness_metrics(chosen, learner_version))
        metrics.update({"rollout/dropped_stale": float(dropped), "time/learner_idle_s": idle})
        return [t for g in chosen for t in g], metrics

    def publish(self, params, version: int) -> None:
        """Version `version`'s weights. Free-running, the engine's copy is made now (the learner
        donates `params` next step) and handed to the publisher thread, which loads it into the
        engine (an SGLang export and reload, or the sampler's reshard) while the learner trains
        on: the learner waits only when the previous version is still being published.
        Deterministic, a copy waits for the chunk that is to use them. The learner's time here
        is the trainer's `time/sync_s`."""
        if self.deterministic:
            # the engine's host-local copy, made here: the producer thread only receives it
            held = self._engine_copy(params)
            with self._cond:
                self._held[version] = held
                self._published = version
                self._cond.notify_all()
            return
        if self._publisher is None:  # not started (a caller driving the producer by hand)
            self._engine.update_weights(self._to_engine(params), str(version))
            with self._cond:
                self._published = version
                self._cond.notify_all()
            return
        copy = self._engine_copy(params)
        with self._cond:
            while self._to_publish is not None and self._error is None:
                self._cond.wait(timeout=1.0)
            self._raise_if_failed(f"publishing version {version}")
            loaded = self._published
        # Every host's publisher is done with `loaded`: servers every host shares hold it (a
        # barrier, here on the main thread, outside the lock the producer thread needs), and
        # other hosts' requests may name it (LoRA adapters: before, they could name a version
        # process 0 had not loaded yet).
        wait_for_shared_weights(self._engine, loaded)
        with self._cond:
            self._to_publish = (copy, version)
            self._cond.notify_all()

    def _engine_copy(self, params):
        """The engine's own copy of `params`, made on the learner's (main) thread:
        `to_engine` (host_copies) is a cross-host collective, and the learner donates `params`
        to its next step, so whatever a thread later loads must be a copy of its own (one
        process: host_copies hands back the arrays themselves)."""
        copies = self._to_engine(params)  # all params, or a LoRA policy's adapters alone
        originals = {id(x) for x in jax.tree.leaves(params)}
        return jax.tree.map(lambda c: jnp.copy(c) if id(c) in originals else c, copies)

    def _publish_loop(self) -> None:
        """Loads each handed-over version into the engine, in order (no version is skipped,
        so every host runs the same sequence); host-local work only, no collective."""
        try:
            while True:
                with self._cond:
                    while self._to_publish is None and not self._stop:
                        self._cond.wait(timeout=1.0)
                    if self._to_publish is None:
                        return
                    params, version = self._to_publish
                self._engine.update_weights(params, str(version))
                with self._cond:
                    self._to_publish = None
                    self._published = version
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the learner, which raises it
            log.exception("weight publisher failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _raise_if_failed(self, what: str) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout producer failed before {what}: "
                               f"{self._error}") from self._error

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
                        "chunks": {c: self._ready[c] for c in range(step + 1, last + 1)},
                        "chunk_metrics": {c: self._ready_metrics.get(c, {})
                                          for c in range(step + 1, last + 1)}}
        with self._cond:
            pending = [task for g in self._leftover for task in _group_task(g)]
            for c in sorted(self._ready):
                pending += [task for g in groups_of(self._ready[c]) for task in _group_task(g)]
            pending += list(self._in_flight) + list(self._partial_pending)
            pending = sorted(dict(pending).items())  # each task once, in stream order
            # the resumed producer replays `pending` as one chunk, numbered as the newest chunk
            # they come from (the one in flight, else the last one played), so that the chunks
            # after it keep their numbers (seeds, horizon schedule) rather than run one ahead
            newest = self._next_chunk - 1 if pending and not self._in_flight \
                else self._next_chunk
            return {"mode": "free", "stream": self._stream.get_state(), "pending": pending,
                    "next_chunk": newest}

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
            self._ready_metrics = {int(c): m for c, m in state.get("chunk_metrics", {}).items()}
        else:
            self._replay_tasks = list(state["pending"])

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)
        if self._publisher is not None:  # finishes the version it is loading, if any
            self._publisher.join(timeout=600)
        if self._partial is not None:
            self._partial.close()

    def _wait_for(self, ready: Callable[[], bool], step: int):
        with self._cond:
            while not ready():
                self._raise_if_failed(f"step {step}")
                self._cond.wait(timeout=1.0)

    # -- producer thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                chunk = self._next_chunk
                # chunk c may start once version c - 1 - k exists (the staleness bound)
                needed = max(0, chunk - 1 - self.k)
                with self._cond:
                    while not self._stop and self._may_start(needed) is None:
                        self._cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    resume_only = self._may_start(needed) == "resume"
                    if self.deterministic:
                        params = self._held.pop(needed, None)
                        for v in [v for v in self._held if v < needed]:
                            del self._held[v]
                    self._stream_before[chunk] = self._stream.get_state()
                    for c in [c for c in self._stream_before if c < chunk - self.k - 1]:
                        del self._stream_before[c]
                    if resume_only:  # partial rollouts: finish what runs, start nothing new
                        tasks = []
                    elif self._replay_tasks:
                        tasks, self._replay_tasks = self._replay_tasks, []
                    else:
                        tasks = self._stream.next()
                    self._in_flight = list(tasks) + list(self._partial_pending)
                with self._engine_lock:
                    if self.deterministic:
                        self._load_for_chunk(params, needed)
                    played = self._play(tasks, chunk, 0)
                    # no collectives here: refill rounds are decided by this host alone
                    chosen, metrics = self._select(
                        played, lambda r: self._play(self._read_more(), chunk, r), lambda f: f)
                pending = self._partial.pending_tasks() if self._partial is not None else []
                with self._cond:
                    self._ready[chunk] = chosen
                    self._ready_metrics[chunk] = metrics
                    self._in_flight, self._partial_pending = [], pending
                    self._next_chunk = chunk + 1
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the learner, which raises it
            log.exception("rollout producer failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _load_for_chunk(self, params, version: int) -> None:
        """Deterministic: the engine gets the version the chunk is sampled with (host-local
        copies the learner made in `publish`: no collective here); after an eval borrowed
        the engine, the last version loaded goes back in."""
        if params is None and self._swapped and self._loaded is not None:
            version, params = self._loaded
        if params is None:
            return
        self._engine.update_weights(params, str(version))
        self._swapped = False
        if self._shared_with_eval:
            self._loaded = (version, params)

    @contextlib.contextmanager
    def engine_at(self, params, version: int):
        """The producer's engine serving exactly `version` (`params`, the learner's) while the
        caller evaluates with it: for an engine the eval shares (SGLang servers). Learner's
        thread. Free-running, that is the engine once the publisher has loaded `version`
        (the next comes only when the learner publishes again, after the eval); lock-step,
        `version` is loaded between two chunks and the producer's own goes back after."""
        if not self.deterministic:
            self._wait_for(lambda: self._published >= version and self._to_publish is None,
                           version)
            wait_for_shared_weights(self._engine, version)
            yield self._engine
            return
        copy = self._engine_copy(params)  # here, on the main thread: a collective
        with self._engine_lock:
            self._engine.update_weights(copy, str(version))
            self._swapped = True
            yield self._engine

    def _may_start(self, needed_version: int) -> Optional[str]:
        """Admission (under the lock): "new" (a chunk of new tasks), "resume" (partial
        rollouts: only the paused episodes go on) or None (wait). Deterministic, a chunk
        needs the version it is sampled with; free-running, fewer than k steps of groups may
        wait for the learner, groups still being played counted too (else the producer would
        keep starting tasks under old weights while the learner is busy)."""
        if self.deterministic:
            return "new" if self._published >= needed_version else None
        limit = self.k * self.groups_per_step
        ready = sum(len(groups_of(trajs)) for trajs in self._ready.values())
        if ready + len(self._partial_pending) < limit:
            return "new"
        if self._partial_pending and ready < limit:
            return "resume"
        return None

    def _read_more(self) -> list:
        with self._cond:
            tasks = self._stream.next()
            self._in_flight = self._in_flight + list(tasks)
        return tasks


class PartialRollouts:
    """A play function for partial rollouts: each chunk spends `rollout.partial_token_budget`
    generated tokens, first on the episodes the previous chunk left running (under the newer
    weights the engine now has: a trajectory spans versions, each token keeping its own), then
    on the chunk's new tasks. Returns the groups whose every episode has ended; ended episodes
    of unfinished groups wait here for their siblings.

    play(tasks, chunk, round_index, resume) -> (ended trajectories, paused episodes).
    """

    def __init__(self, play: Callable, samples_per_task: int):
        self._play, self.g = play, samples_per_task
        self.paused: list = []
        self.waiting: dict[int, list[Trajectory]] = {}

    def __call__(self, tasks: list, chunk: int, round_index: int) -> list[Trajectory]:
        ended, self.paused = self._play(tasks, chunk, round_index, self.paused)
        for traj in ended:
            self.waiting.setdefault(traj.group_id, []).append(traj)
        out = []
        for gid in [gid for gid, trajs in self.waiting.items() if len(trajs) == self.g]:
            out += sorted(self.waiting.pop(gid), key=lambda t: t.info["sample_index"])
        return out

    def pending_tasks(self) -> list:
        """(position, Task) of every group not yet complete: a restarted producer replays them."""
        tasks = {t.group_id: t.info["task"] for trajs in self.waiting.values() for t in trajs}
        tasks.update(paused_task(ep) for ep in self.paused)
        return sorted(tasks.items())

    def close(self) -> None:
        close_paused(self.paused)
        self.paused = []


def _group_task(group: list[Trajectory]) -> list:
    """The (position, Task) a group was played from, to play again after a resume."""
    info = group[0].info
    return [info["task"]] if "task" in info else []
