"""The rollout producers with a stand-in engine and play function: the staleness bound, lock-step
versions, dropped groups, and resuming (deterministic: the same batches; free-running: no task
lost or repeated)."""

import threading
import time

import numpy as np
import pytest

from rl_tpu.core.env import Task
from rl_tpu.offpolicy.producer import AsyncProducer, SyncProducer
from rl_tpu.core.trajectory import Trajectory, group_version, groups_of

G = 2  # samples per task
PER_STEP = 3  # tasks (groups) per step


class Stream:
    """A task stream like data.tasks.TaskStream: step s gives positions [3s, 3s + 3)."""

    def __init__(self):
        self.step = 0

    def next(self):
        out = [(self.step * PER_STEP + j, Task(f"t{self.step * PER_STEP + j}"))
               for j in range(PER_STEP)]
        self.step += 1
        return out

    def get_state(self):
        return {"step": self.step}

    def set_state(self, state):
        self.step = state["step"]


class Engine:
    def __init__(self):
        self.version = 0
        self.lock = threading.Lock()

    def update_weights(self, params, version):
        with self.lock:
            self.version = int(version)


def make_play(engine, lag=0, delay=0.0):
    """Plays by stamping each token with the engine's version (minus `lag` in odd chunks:
    older data, as a slow env or a resumed partial rollout would give)."""
    played = []

    def play(tasks, chunk, round_index):
        time.sleep(delay)
        version = max(engine.version - (lag if chunk % 2 else 0), 0)
        out = []
        for position, task in tasks:
            played.append(position)
            for s in range(G):
                out.append(Trajectory(
                    tokens=np.arange(4, dtype=np.int32), loss_mask=np.array([0, 1, 1, 1], bool),
                    behaviour_logprobs=np.zeros(4, np.float32),
                    turn_ids=np.array([-1, 0, 0, 0], np.int32), rewards=[float(s)],
                    reward=float(s), success=bool(s), num_turns=1,
                    weight_versions=[str(version)], task_id=task.task_id, group_id=position,
                    finish="done", messages=[], info={"task": (position, task),
                                                      "chunk": chunk}))
        return out
    play.played = played
    return play


def select(played, play_more, any_host):
    return played, {"rollout/played_tokens": float(3 * len(played))}


def producer(engine, play, k, deterministic, stream=None):
    return AsyncProducer(play, select, stream or Stream(), engine, lambda p: p, max_staleness=k,
                         deterministic=deterministic, groups_per_step=PER_STEP)


def train(p, steps, first=1):
    """The learner's side: take each step's batch, 'train', publish the next version."""
    seen = []
    for step in range(first, first + steps):
        trajs, metrics = p.next_batch(step)
        seen.append((step, trajs, metrics))
        p.publish({"w": np.float32(step)}, step)
    return seen


@pytest.mark.parametrize("k", [1, 2, 4])
def test_deterministic_producer_is_exactly_k_versions_behind(k):
    engine = Engine()
    p = producer(engine, make_play(engine), k, deterministic=True)
    p.start()
    try:
        seen = train(p, 8)
    finally:
        p.close()
    for step, trajs, metrics in seen:
        assert len(groups_of(trajs)) == PER_STEP
        assert {group_version(g) for g in groups_of(trajs)} == {max(0, step - 1 - k)}
        assert metrics["rollout/staleness_max"] == min(k, step - 1)
        assert metrics["rollout/dropped_stale"] == 0
        # chunk c holds the tasks step c would train on when synchronous
        assert sorted(t.group_id for t in trajs[::G]) == list(range((step - 1) * PER_STEP,
                                                                    step * PER_STEP))


def test_free_running_drops_groups_older_than_k():
    engine = Engine()
    # every other chunk's data come out 8 versions older than the engine says: beyond k = 2
    play = make_play(engine, lag=8)
    p = producer(engine, play, 2, deterministic=False)
    p.start()
    try:
        seen = train(p, 12)
    finally:
        p.close()
    for step, trajs, metrics in seen:
        for group in groups_of(trajs):
            assert (step - 1) - group_version(group) <= 2  # never older than k
        assert metrics["rollout/staleness_max"] <= 2
    assert sum(m["rollout/dropped_stale"] for _, _, m in seen) > 0


def test_free_running_resume_loses_and_repeats_no_task():
    engine = Engine()
    p = producer(engine, make_play(engine, delay=0.01), 2, deterministic=False)
    p.start()
    try:
        first = train(p, 3)
        state = p.state(3)
    finally:
        p.close()
    trained = [t.group_id for _, trajs, _ in first for t in trajs[::G]]
    # a fresh producer (a restarted process) from the saved state
    engine2 = Engine()
    engine2.version = 3
    stream = Stream()
    q = producer(engine2, make_play(engine2), 2, deterministic=False, stream=stream)
    q.load_state(state, 3)
    q.start()
    try:
        second = train(q, 3, first=4)
    finally:
        q.close()
    trained += [t.group_id for _, trajs, _ in second for t in trajs[::G]]
    assert len(trained) == len(set(trained))  # nothing repeated
    assert sorted(trained) == list(range(len(trained)))  # nothing lost: positions 0.. in full


def test_deterministic_resume_repeats_the_same_batches():
    def batches(resume_at=None):
        engine = Engine()
        p = producer(engine, make_play(engine), 2, deterministic=True)
        p.start()
        try:
            if resume_at is None:
                return [(s, [t.group_id for t in tr], [t.oldest_version for t in tr])
                        for s, tr, _ in train(p, 7)]
            head = train(p, resume_at)
            state = p.state(resume_at)
        finally:
            p.close()
        engine = Engine()
        engine.version = resume_at  # the restored weights
        q = producer(engine, make_play(engine), 2, deterministic=True)
        q.load_state(state, resume_at)
        q.start()
        try:
            tail = train(q, 7 - resume_at, first=resume_at + 1)
        finally:
            q.close()
        return [(s, [t.group_id for t in tr], [t.oldest_version for t in tr])
                for s, tr, _ in head + tail]

    assert batches(resume_at=3) == batches()


def test_sync_producer_plays_on_call():
    engine = Engine()
    p = SyncProducer(make_play(engine), select, Stream(), engine, lambda x: x, lambda f: f)
    trajs, metrics = p.next_batch(1)
    assert metrics["rollout/staleness_max"] == 0 and len(trajs) == PER_STEP * G
    p.publish({}, 1)
    assert engine.version == 1
    assert p.state(1) == {"stream": {"step": 1}}


def test_producer_failure_reaches_the_learner():
    engine = Engine()

    def broken(tasks, chunk, round_index):
        raise OSError("env server went away")

    p = producer(engine, broken, 1, deterministic=False)
    p.start()
    try:
        with pytest.raises(RuntimeError, match="env server went away"):
            p.next_batch(1)
    finally:
        p.close()


class SlowEngine(Engine):
    """An engine whose weight update takes `seconds` (an SGLang export and reload), recording
    the versions in the order it loaded them; `fail_at` raises on that version."""

    def __init__(self, seconds, fail_at=None):
        super().__init__()
        self.seconds, self.fail_at, self.loaded = seconds, fail_at, []

    def update_weights(self, params, version):
        time.sleep(self.seconds)
        if int(version) == self.fail_at:
            raise OSError(f"export of version {version} failed: disk full")
        super().update_weights(params, version)
        self.loaded.append(int(version))


def test_free_running_publish_loads_weights_beside_the_learner_in_order():
    engine = SlowEngine(0.5)
    p = producer(engine, make_play(engine), 2, deterministic=False)
    p.start()
    try:
        started = time.time()
        p.publish({"w": 1}, 1)
        assert time.time() - started < 0.25  # handed over, not loaded: the learner goes on
        p.publish({"w": 2}, 2)  # waits for version 1's load, then hands version 2 over
        assert 0.4 < time.time() - started < 1.5 and engine.loaded == [1]
        p.publish({"w": 3}, 3)
    finally:
        p.close()  # finishes the version being loaded
    assert engine.loaded == [1, 2, 3] and engine.version == 3  # every version, in order


def test_a_failed_weight_load_reaches_the_learner():
    engine = SlowEngine(0.0, fail_at=1)
    p = producer(engine, make_play(engine, delay=0.05), 2, deterministic=False)
    p.start()
    try:
        p.publish({"w": 1}, 1)
        with pytest.raises(RuntimeError, match="disk full"):
            for step in range(2, 6):
                p.next_batch(step)
                p.publish({"w": step}, step)
    finally:
        p.close()


def test_a_step_built_from_several_chunks_logs_all_their_metrics():
    """4 groups a step from chunks of 3: step 1 takes chunk 1 whole and one group of chunk 2,
    so its metrics are both chunks': DAPO's select_groups (all groups informative in chunk 1,
    one of three in chunk 2, whose other two are fillers) gives means weighted by each
    chunk's groups, (3 x 1 + 3 x 1/3) / 6 = 2/3 informative and (3 x 0 + 3 x 2/3) / 6 = 1/3
    fillers, and played tokens summed, 2 x (3 groups x 2 samples x 3 ids) = 36."""
    from types import SimpleNamespace

    from rl_tpu.recipes.algorithms import select_groups
    engine = Engine()
    play = make_play(engine)

    def play_equal_rewards_in_chunk_2(tasks, chunk, round_index):
        out = play(tasks, chunk, round_index)
        for traj in out:
            if chunk == 2 and traj.group_id != tasks[0][0]:  # equal rewards: uninformative
                traj.reward = 0.0
        return out

    algo = SimpleNamespace(dynamic_sampling=True, max_refill_rounds=0)
    p = AsyncProducer(play_equal_rewards_in_chunk_2,
                      lambda played, more, any_host: select_groups(played, PER_STEP, G, algo,
                                                                   more, any_host),
                      Stream(), engine, lambda params: params, max_staleness=2,
                      deterministic=False, groups_per_step=PER_STEP + 1)
    p.start()
    try:
        trajs, metrics = p.next_batch(1)
    finally:
        p.close()
    assert len(groups_of(trajs)) == PER_STEP + 1
    assert metrics["rollout/informative_group_frac"] == pytest.approx(2 / 3)
    assert metrics["rollout/filler_group_frac"] == pytest.approx(1 / 3)
    assert metrics["rollout/played_tokens"] == 36.0
    assert metrics["rollout/refill_rounds"] == 0.0


def test_rollout_weight_version_ignores_episodes_that_sampled_nothing():
    """An episode that failed at reset sampled no token (oldest_version -1, NO_VERSION): the
    step's rollout/weight_version is the oldest version of those that sampled, 3 here, and -1
    only when none did."""
    from types import SimpleNamespace

    from rl_tpu.recipes.config import base_config
    from rl_tpu.recipes.rl import Trainer
    engine = Engine()
    engine.version = 3
    sampled = make_play(engine)([(0, Task("t0"))], 1, 0)
    failed_at_reset = Trajectory(
        tokens=np.zeros(0, np.int32), loss_mask=np.zeros(0, bool),
        behaviour_logprobs=np.zeros(0, np.float32), turn_ids=np.zeros(0, np.int32), rewards=[],
        reward=0.0, success=False, num_turns=0, weight_versions=[], task_id="t1", group_id=1,
        finish="env_error", messages=[], info={"error": "reset: env server unreachable"})
    assert failed_at_reset.oldest_version == -1
    trainer = SimpleNamespace(config=base_config(), reward_mix=None)
    metrics = Trainer._rollout_metrics(trainer, sampled + [failed_at_reset], 1)
    assert metrics["rollout/weight_version"] == 3.0
    assert Trainer._rollout_metrics(trainer, [failed_at_reset], 1)[
        "rollout/weight_version"] == -1.0


def wait_until(p, condition, what, timeout_s=120.0):
    """The producer's condition wait, bounded: a test that would hang fails naming `what`."""
    deadline = time.monotonic() + timeout_s
    with p._cond:
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            p._cond.wait(timeout=0.5)


def test_free_running_resume_keeps_chunk_numbers_in_step_with_the_stream():
    """Chunk c holds the tasks of stream step c (those step c trains on, when nothing is
    dropped); its number seeds its sampling and sets its horizon (schedules.horizon_turns).
    A resume replays the pending tasks as one chunk numbered as the newest chunk they come
    from, so the chunks after it keep the numbers of an uninterrupted run. Here the
    checkpoint of step 3 is taken with chunk 4 played and chunk 5 not started: numbering the
    replay chunk 5 would leave every later chunk one ahead of its tasks for the rest of the
    run (one more per such resume)."""
    def publish_loaded(p, version):
        """Publishes `version` and waits for the engine to hold it, so that every chunk is
        played within the staleness bound and none is dropped: a dropped chunk makes the
        learner read the next one and shifts the chunks this test follows."""
        p.publish({"w": version}, version)
        wait_until(p, lambda: p._published >= version, f"version {version} loaded")

    k, step = 1, 3
    engine = Engine()
    p = producer(engine, make_play(engine), k, deterministic=False)
    p.start()
    try:
        for s in range(1, step + 1):
            _, metrics = p.next_batch(s)
            assert metrics["rollout/dropped_stale"] == 0
            if s < step:
                publish_loaded(p, s)
        wait_until(p, lambda: step + 1 in p._ready, f"chunk {step + 1} played")
        state = p.state(step)
    finally:
        p.close()
    assert [position for position, _ in state["pending"]] == list(
        range(step * PER_STEP, (step + 1) * PER_STEP))

    engine = Engine()
    engine.version = step
    q = producer(engine, make_play(engine), k, deterministic=False)
    q.load_state(state, step)
    q.start()
    chunks = {}
    try:
        for s in range(step + 1, step + 5):
            trajectories, metrics = q.next_batch(s)
            assert metrics["rollout/dropped_stale"] == 0
            chunks.update({t.group_id: t.info["chunk"] for t in trajectories[::G]})
            publish_loaded(q, s)
    finally:
        q.close()
    assert sorted(chunks) == list(range(step * PER_STEP, (step + 4) * PER_STEP))
    assert {position: position // PER_STEP + 1 for position in chunks} == chunks
