"""reasoning-gym envs: countdown, arithmetic, any dataset; scoring, splits, hostile answers."""

import random
import time

import pytest

pytest.importorskip("reasoning_gym")

from garbage import code_points, garbage_actions, one_of, step_through, text

from rl_tpu.core import env as env_lib
from rl_tpu.env_serving.isolated import IsolatedWorkers
from rl_tpu.envs.reasoning import ReasoningGymEnv


@pytest.fixture(scope="module")
def workers():
    # One private pool for the module, closed at the end: no stray processes after the tests.
    pool = IsolatedWorkers(num_workers=2)
    yield pool
    pool.close()


@pytest.mark.parametrize("name,kwargs", [("countdown", {}), ("arithmetic", {}),
                                         ("reasoning_gym", {"dataset": "chain_sum"})])
def test_reference_answer_scores_one(name, kwargs, workers):
    env = env_lib.make(name, workers=workers, **kwargs)
    assert "<answer>" in env.system_prompt
    for i in range(3):
        task = env.tasks().get("eval", i)
        obs = env.reset(task)
        assert obs == task.data["question"]
        r = env.step(f"Let me think. <answer>{task.data['answer']}</answer>")
        assert r.done and r.reward == 1.0 and r.info["success"], (task, r)
        assert env.step("again").done  # after the single turn: an observation, no exception


def test_wrong_missing_and_partial_answers(workers):
    env = env_lib.make("countdown", workers=workers)
    task = env.tasks().get("eval", 0)
    env.reset(task)
    r = env.step("no tags at all")
    assert r.done and r.reward == 0.0 and not r.info["format_ok"]
    env.reset(task)
    numbers = task.data["metadata"]["numbers"]
    r = env.step(f"<answer>{' + '.join(map(str, numbers))}</answer>")
    # countdown's partial credit for using exactly the given numbers (unless the sum hits)
    assert r.done and (r.reward == 0.05 or r.info["success"])
    env.reset(task)
    r = env.step("<answer>1</answer><answer>" + task.data["answer"] + "</answer>")  # last one counts
    assert r.reward == 1.0


def test_splits_are_reproducible_and_seed_disjoint(workers):
    env = ReasoningGymEnv("basic_arithmetic", eval_size=50, workers=workers)
    ts = env.tasks()
    assert ts.size("eval") == 50 and ts.size("train") == 100_000
    assert ts.get("train", 7).data == ts.get("train", 7).data
    again = ReasoningGymEnv("basic_arithmetic", eval_size=50, workers=workers)
    assert again.tasks().get("eval", 7).data["question"] == ts.get("eval", 7).data["question"]
    assert ts.get("train", 0).task_id != ts.get("eval", 0).task_id
    with pytest.raises(ValueError, match="overlap"):
        ReasoningGymEnv("basic_arithmetic", train_seed=10, eval_seed=0, eval_size=50)
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        env_lib.make("reasoning_gym", dataset="no_such_dataset")
    with pytest.raises(IndexError):
        ts.get("eval", 50)


def test_task_from_id_only(workers):
    env = env_lib.make("arithmetic", workers=workers)
    task = env.tasks().get("eval", 4)
    assert env.reset(env_lib.Task(task.task_id)) == task.data["question"]
    assert env.step(f"<answer>{task.data['answer']}</answer>").reward == 1.0


def test_in_process_scoring():
    env = env_lib.make("countdown", isolate=False)
    task = env.tasks().get("train", 3)
    env.reset(task)
    assert env.step(f"<answer>{task.data['answer']}</answer>").reward == 1.0


def test_hanging_scorer_is_cut_off(workers):
    """countdown's scorer evaluates 10**10**10 with no bound: the worker is killed instead."""
    env = env_lib.make("countdown", workers=workers, score_timeout_s=1.0)
    task = env.tasks().get("eval", 0)
    env.reset(task)
    env.step(f"<answer>{task.data['answer']}</answer>")  # warm the worker (imports)
    env.reset(task)
    start = time.monotonic()
    r = env.step("<answer>10**10**10</answer>")
    assert r.done and r.reward == 0.0 and "score_error" in r.info
    assert time.monotonic() - start < 30
    env.reset(task)
    assert env.step(f"<answer>{task.data['answer']}</answer>").reward == 1.0  # usable after


# reasoning-gym's own kinds: answers its scorers parse (or eval) that are broken or huge.
GARBAGE = [
    lambda rng: "<answer>" + text(rng, "0123456789+-*/() ", 10_240) + "</answer>",
    lambda rng: "<answer>" + code_points(rng, 0, 31, 20, 20) + "</answer>",
    one_of("<answer></answer>", "<answer>", "</answer>", "<answer>1/0</answer>",
           "<answer>import os</answer>", "<answer>()</answer>",
           "<answer>99999999999999999999*9</answer>", "<ANSWER>3</ANSWER>",
           "<answer>1e309</answer>", "<answer>nan</answer>"),
    lambda rng: "<answer>" + "x" * rng.randrange(10_001, 12_000) + "</answer>",
    lambda rng: f"<answer>{rng.randrange(-10**6, 10**6)}</answer>",
    lambda rng: "<answer>" + text(rng, "abc☃\u202e", 1, 100) + "</answer>",
]


@pytest.mark.parametrize("name", ["countdown", "arithmetic"])
def test_garbage_actions_never_raise(name, workers):
    env = env_lib.make(name, workers=workers)
    ts = env.tasks()
    tasks = [ts.get("train", i) for i in range(20)]  # countdown builds ~100 tasks/s: reuse some
    results = step_through(env, garbage_actions(random.Random(1), 1000, GARBAGE), tasks)
    assert all(r.done for r in results)  # single turn
    task = ts.get("eval", 1)
    env.reset(task)
    assert env.step(f"<answer>{task.data['answer']}</answer>").reward == 1.0
