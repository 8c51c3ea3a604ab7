"""BabyAI's primitive-action mode (`actions="primitive"`): rendering, action parsing, tasks, the
bot's demonstrations, robustness."""

import random

import pytest

pytest.importorskip("minigrid")

from garbage import garbage_actions, one_of, step_through  # noqa: E402

from rl_tpu.core import env as env_lib  # noqa: E402
from rl_tpu.envs.babyai import (ACTIONS, PRIMITIVE_LEVELS, BabyAIEnv, BabyAITasks,  # noqa: E402
                                demonstrate, expert_actions, level_and_seed)
from rl_tpu.envs.babyai import parse_primitive as parse_action  # noqa: E402

PRIMITIVE = dict(actions="primitive", levels=PRIMITIVE_LEVELS)


@pytest.fixture(scope="module")
def env():
    env = env_lib.make("babyai", **PRIMITIVE)
    yield env
    env.close()


@pytest.mark.parametrize("text, expected", [
    ("turn left", "turn left"),
    ("TURN LEFT", "turn left"),
    ("Action: move forward", "move forward"),
    ("I see the ball ahead.\nAction: Move Forward.\n", "move forward"),
    ("Action: turn left\nthinking more...\nAction: turn right", "turn right"),
    ("action:pick up the red ball", "pick up"),
    ("Action: `toggle`", "toggle"),
    ("Action: open the door", "toggle"),
    ("Action: [drop]", "drop"),
    ("forward", "move forward"),
    ("Action: done", "done"),
    ("Action： left", "turn left"),  # full-width colon
])
def test_parse_action_is_lenient(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "Action:", "Action: fly", "x" * 10_000,
                                  "Action: turn around", None, 42, "\x00\x01", "左转"])
def test_parse_action_rejects_garbage(text):
    assert parse_action(text) is None


def test_reset_and_step_render_the_view(env):
    task = env.tasks().get("eval", 0)
    first = env.reset(task)
    assert first.startswith("Mission: ")
    assert "You are facing" in first and "carrying nothing" in first
    assert first == env.reset(task)  # same task, same grid
    assert env.conversation_start() is None and env.system_prompt.startswith("You are an agent")
    assert env.agentgym_name == ""

    result = env.step("Action: turn left")
    assert result.observation.startswith("You turned left.")
    assert result.reward == 0.0 and not result.done
    assert result.info["action"] == "turn left" and result.info["steps"] == 1

    bad = env.step("Action: fly away")
    assert bad.observation.startswith("Invalid action:") and bad.info["invalid_action"]
    assert not bad.done
    # It shows the view, but not the previous step's feedback as if it had happened again.
    view = result.observation.split("\n", 1)[1]
    assert "You turned left." not in bad.observation and bad.observation.endswith(view)
    assert "nothing happened" in bad.observation


def test_objects_are_placed_relative_to_the_agent(env):
    # Walk the bot's route and check the target's description shrinks to "1 step ahead".
    task = env.tasks().get("eval", 0)  # BabyAI-GoToRedBallGrey-v0: "go to the red ball"
    pairs = demonstrate(task, env)
    final_view = env.last_observation
    assert pairs and "Mission accomplished" in final_view
    assert "a red ball 1 step ahead" in final_view
    assert "Directly in front of you: a red ball." in final_view


def test_tasks_are_deterministic_and_splits_disjoint():
    tasks = BabyAITasks(train_size=1000, eval_size=100,
                        levels=["BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0"])
    assert tasks.get("train", 7) == tasks.get("train", 7)
    seeds = {s: {level_and_seed(tasks.get(s, i).data["data_idx"]) for i in range(n)}
             for s, n in (("train", 1000), ("eval", 100))}
    assert not {seed for _, seed in seeds["train"]} & {seed for _, seed in seeds["eval"]}
    assert {level for level, _ in seeds["eval"]} == {"BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0"}
    assert BabyAITasks(levels=[5, 19]).get("eval", 3) == tasks.get("eval", 3)  # numbers or ids
    with pytest.raises(IndexError):
        tasks.get("eval", 100)
    with pytest.raises(ValueError):
        tasks.get("test", 0)


def test_unknown_level_and_bad_task_are_clear_errors():
    with pytest.raises(ValueError, match="unknown BabyAI level"):
        BabyAIEnv(levels=["BabyAI-NoSuchLevel-v0"])
    with pytest.raises(ValueError, match="actions must be one of"):
        BabyAIEnv(actions="macro")
    env = BabyAIEnv(actions="primitive", levels=["BabyAI-GoToObj-v0"])
    with pytest.raises(ValueError, match="data_idx"):
        env.reset(env_lib.Task("t", {}))
    # A task may name its level and seed instead of a data_idx.
    assert env.reset(env_lib.Task("t", {"level": "BabyAI-GoToObj-v0", "seed": 3})).startswith(
        "Mission: go to")
    with pytest.raises(ValueError, match="demonstrate plays primitive actions"):
        demonstrate(env.tasks().get("eval", 0), BabyAIEnv())


def test_bot_solves_eval_tasks():
    env = BabyAIEnv(**PRIMITIVE)
    tasks = env.tasks()
    solved, lengths = 0, []
    for index in range(50):
        task = tasks.get("eval", index)
        actions = expert_actions(task, env)
        env.reset(task)
        for action in actions:
            result = env.step(f"Action: {action}")
        solved += bool(result.info["success"])
        lengths.append(len(actions))
        if result.info["success"]:
            # minigrid's reward: 1 - 0.9 * steps / max_steps.
            expected = 1 - 0.9 * result.info["steps"] / env._env.max_steps
            assert result.reward == pytest.approx(expected) and result.done
    rate = solved / 50
    print(f"BabyAI bot success on 50 eval tasks: {rate:.0%}, mean length "
          f"{sum(lengths) / len(lengths):.1f}, max {max(lengths)}")
    assert rate >= 0.9
    assert max(lengths) <= 20


def test_demonstration_pairs_observations_with_actions(env):
    task = env.tasks().get("eval", 4)  # PickupLoc
    pairs = demonstrate(task, env)
    assert pairs[0][0] == env.reset(task)
    assert all(action in ACTIONS for _, action in pairs)
    assert pairs[-1][1] == "pick up"


def test_step_outside_an_episode_is_an_observation():
    env = BabyAIEnv(actions="primitive", levels=["BabyAI-GoToObj-v0"])
    result = env.step("turn left")  # before any reset
    assert result.done and result.info["episode_over"]
    task = env.tasks().get("eval", 0)
    env.reset(task)
    for action in expert_actions(task):
        result = env.step(action)
    assert result.done
    after = env.step("turn left")
    assert after.done and after.reward == 0.0 and after.info["episode_over"]


# BabyAI's own kinds: actions it parses but cannot do, legal ones, inputs aimed at its parser.
GARBAGE = [
    one_of("Action: fly", "Action: jump", "Action: turn around", "Action: pick", "Action: 42",
           "Action: {}"),
    one_of("Action: drop", "Action: toggle", "Action: pick up", "Action: done",
           "Action: move forward"),  # valid but futile
    lambda rng: "Action: " + rng.choice(ACTIONS),
    "Action: " + "move forward " * 800,
    "Action: turn left\x00\x1b[31m",
    "\ud800 Action: \udfff",
    "\n" * 100 + "Action:\n",
]


def test_garbage_actions_never_raise_and_env_stays_usable():
    env = BabyAIEnv(**PRIMITIVE)
    tasks = env.tasks()
    step_through(env, garbage_actions(random.Random(0), 1000, GARBAGE),
                 [tasks.get("train", i) for i in range(200)])
    # A valid episode afterwards still works.
    task = tasks.get("eval", 1)
    env.reset(task)
    for action in expert_actions(task):
        result = env.step(f"Action: {action}")
    assert result.info["success"] and result.reward > 0


def test_max_steps_override_truncates():
    env = BabyAIEnv(actions="primitive", levels=["BabyAI-OpenDoor-v0"], max_steps=3)
    env.reset(env.tasks().get("eval", 0))
    results = [env.step("Action: turn left") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and not results[-1].info["success"]
    assert "ran out of steps" in results[-1].observation
