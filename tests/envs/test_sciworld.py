"""ScienceWorld with rl_tpu's options (0..1 progress rewards, the system prompt, round-robin
tasks over every family, a reply limit instead of the move limit). Needs Java; one JVM for the
whole module (it takes seconds to start)."""

import random
import shutil

import pytest

pytest.importorskip("scienceworld")

from garbage import garbage_actions, one_of, step_through

from rl_tpu.core import env as env_lib
from rl_tpu.envs import sciworld as sciworld_module
from rl_tpu.envs.sciworld import SciWorldEnv

RL_TPU = dict(reward="delta", prompt="system", tasks="round_robin", max_steps=100,
              move_limit=None)
needs_java = pytest.mark.skipif(
    shutil.which("java") is None,
    reason="ScienceWorld needs a Java runtime on PATH (e.g. apt-get install openjdk-17-jre-headless)")


@pytest.fixture(scope="module")
def env():
    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs a Java runtime on PATH (e.g. apt-get install "
                    "openjdk-17-jre-headless)")
    e = env_lib.make("sciworld", **RL_TPU)
    yield e
    e.close()


def _play(env, task) -> dict:
    demo = env.demonstration(task)
    # Some gold paths (grow-fruit, genetics, inclined planes) take over 100 steps, the
    # default max_steps: lift the limit while replaying them.
    saved, env.max_steps = env.max_steps, None
    try:
        env.reset(task)
        total, result = 0.0, None
        for action in demo:
            result = env.step(action)
            total += result.reward
            if result.done:
                break
    finally:
        env.max_steps = saved
    return {**result.info, "total": total, "done": result.done}


def test_missing_java_is_a_clear_error(monkeypatch):
    """Runs without Java too: the error names what to install."""
    monkeypatch.setattr(sciworld_module.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="openjdk"):
        SciWorldEnv()


@needs_java
def test_tasks_cover_the_package_splits(env):
    ts = env.tasks()
    sizes = {s: ts.size(s) for s in ("train", "eval", "test")}
    assert all(n > 1000 for n in sizes.values()), sizes
    first = [ts.get("eval", i).data["task_name"] for i in range(30)]
    assert len(set(first)) == 30  # round-robin: every task family in the first 30
    train = {ts.get("train", i).task_id for i in range(0, sizes["train"], 7)}
    evals = {ts.get("eval", i).task_id for i in range(sizes["eval"])}
    assert not train & evals
    assert ts.get("eval", 5) == ts.get("eval", 5)


@needs_java
def test_reset_and_step(env):
    task = env.tasks().get("eval", 0)
    obs = env.reset(task)
    assert obs.startswith("Your task is") and "This room is called" in obs
    r = env.step("look around")
    assert not r.done and r.reward == 0.0 and "This room" in r.observation
    r = env.step("fly to the moon")
    assert r.info["invalid_action"] and r.observation.startswith("Invalid action:") and not r.done
    r = env.step("inventory")
    assert "inventory" in r.observation.lower()
    assert env.conversation_start() is None and env.system_prompt.startswith("You are an agent")
    assert env.agentgym_name == ""


def test_options_are_checked():
    with pytest.raises(ValueError, match="reward must be one of"):
        SciWorldEnv(reward="sparse")
    with pytest.raises(ValueError, match="task_names"):
        SciWorldEnv(task_names=["boil"])


@needs_java
def test_failing_focus_ends_with_zero_reward(env):
    env.reset(env.tasks().get("eval", 0))  # boil: focusing on the agent fails the task
    r = env.step("focus on agent")
    assert r.done and r.info["failed"] and r.reward == 0.0 and not r.info["success"]
    assert env.step("look around").done  # after the end: an observation, no exception


@needs_java
def test_max_steps_truncates():
    small = SciWorldEnv(**{**RL_TPU, "max_steps": 2}, task_names=["find-animal"])
    try:
        small.reset(small.tasks().get("train", 0))
        assert not small.step("look around").done
        r = small.step("look around")
        assert r.done and r.info["truncated"]
        assert {small.tasks().get("train", i).data["task_name"] for i in range(5)} == {"find-animal"}
    finally:
        small.close()


@pytest.mark.slow  # plays whole demonstrations (~10 s); reset/step are covered in the fast suite
@needs_java
def test_demonstration_solves_first_eval_tasks(env):
    """Gold paths on 6 eval tasks (6 families); the 50-task version is marked slow."""
    for i in range(6):
        info = _play(env, env.tasks().get("eval", i))
        assert info["success"] and info["total"] == pytest.approx(1.0) and info["done"], (i, info)


@needs_java
@pytest.mark.slow
def test_demonstration_solves_20_eval_tasks(env):
    infos = [_play(env, env.tasks().get("eval", i)) for i in range(20)]
    rate = sum(i["success"] for i in infos) / 20
    assert rate >= 0.9, rate


# ScienceWorld's own kinds: commands it parses but refuses (and answers to a numbered choice
# it never offered), legal ones that keep the episode going, ambiguous or overlong ones.
GARBAGE = [
    one_of("pick up the sun", "open", "go to moon", "connect agent to agent", "pour air in air",
           "move door to door", "use thermometer on", "read", "look in agent", "0", "1", "99",
           "teleport to kitchen"),
    one_of("look around", "inventory", "task", "open door to hallway", "wait1"),
    lambda rng: "open door" if rng.random() < 0.5 else "look at " + "very " * rng.randrange(1, 80),
]


@needs_java
def test_garbage_actions_never_raise(env):
    """1,000 steps in ~2 s: steps are cheap once the JVM is up."""
    ts = env.tasks()
    actions = garbage_actions(random.Random(4), 1000, GARBAGE)
    step_through(env, actions, [ts.get("eval", 5 + i) for i in range(3)])
    assert _play(env, ts.get("eval", 6))["success"]  # still usable


@needs_java
def test_lone_surrogates_are_an_invalid_action(env):
    env.reset(env.tasks().get("eval", 5))
    r = env.step("look at \ud800\udfff")
    assert r.info["invalid_action"] and not r.done
