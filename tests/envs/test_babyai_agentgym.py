"""The babyai env's default, AgentGym's BabyAI: levels and seeds by data_idx, observations,
macros, rewards, score.

Grids used below (minigrid 3.x, `env.pprint_grid()`; x grows east, y grows south):
  data_idx 0  = GoToRedBallGrey seed 0, max_steps 64: agent (6,5) facing west; red ball (2,2),
                grey key (2,3), grey box (4,3), grey key (4,4), grey ball (5,4), grey keys
                (4,6) (5,6). Facing west, "right" is north.
  data_idx 41 = GoToRedBall seed 1, max_steps 64: agent (3,4) facing north; red ball (1,6),
                yellow key (2,6), grey box (1,4).
  data_idx 12 = OpenRedDoor seed 0, max_steps 50: agent (3,2) facing south; red door (4,3).
  data_idx 5  = GoTo seed 0: agent (12,11) facing west; red closed door (9,14); (9,12),
                (9,13), (10..11,11) and (9,15) empty.
Rewards are minigrid's 1 - 0.9 * moves / max_steps, moves counted by hand from these grids.
"""

import json
import random

import pytest

pytest.importorskip("minigrid")

from rl_tpu.core import env as env_lib  # noqa: E402
from rl_tpu.core.agentgym_parse import TOO_MANY_ACTIONS  # noqa: E402
from rl_tpu.envs.babyai import (ACK, COMPLETED, LEVELS, MAX_TURNS, NO_CHANGE,  # noqa: E402
                                NOT_RECOGNIZED, BabyAIEnv, BabyAITasks, data_idx_of,
                                level_and_seed)
from rl_tpu.core.env import Task  # noqa: E402


@pytest.fixture(scope="module")
def env():
    env = env_lib.make("babyai")
    yield env
    env.close()


def task(i):
    return Task(f"babyai_{i}", {"data_idx": i})


def act(env, action):
    return env.step(f"Thought:\nI will do it.\n\nAction:\n{action}")


def actions_of(observation):
    """The listed actions of an observation (its `Available actions: [...]` line)."""
    line = next(ln for ln in observation.splitlines() if ln.startswith("Available actions: "))
    return json.loads(line[len("Available actions: "):])


# -- levels, seeds, tasks -------------------------------------------------------------------

def test_forty_levels_in_minigrid_order_first_and_last_as_agentgym():
    import gymnasium
    assert len(LEVELS) == 40 and len(set(LEVELS)) == 40
    assert LEVELS[0] == "BabyAI-GoToRedBallGrey-v0"      # AgentGym's level 1
    assert LEVELS[39] == "BabyAI-BossLevelNoUnlock-v0"   # AgentGym's level 40
    first_of_class = {}
    for key, spec in gymnasium.registry.items():
        if key.startswith("BabyAI-"):
            first_of_class.setdefault(spec.entry_point, key)
    assert list(first_of_class.values()) == list(LEVELS)


@pytest.mark.parametrize("data_idx, level, seed", [
    (0, "BabyAI-GoToRedBallGrey-v0", 0), (1, "BabyAI-GoToRedBall-v0", 0),
    (39, "BabyAI-BossLevelNoUnlock-v0", 0), (41, "BabyAI-GoToRedBall-v0", 1),
    (12, "BabyAI-OpenRedDoor-v0", 0), (80 + 5, "BabyAI-GoTo-v0", 2)])
def test_data_idx_picks_level_mod_40_and_seed_div_40(data_idx, level, seed):
    assert level_and_seed(data_idx) == (level, seed)


def test_data_idx_from_data_or_id():
    assert data_idx_of(Task("babyai_123")) == 123
    assert data_idx_of(Task("x", {"data_idx": 7})) == 7
    with pytest.raises(ValueError, match="data_idx"):
        data_idx_of(Task("babyai"))


def test_task_source_splits_are_disjoint_and_reproducible():
    tasks = BabyAITasks(train_size=50, eval_size=400)
    assert tasks.get("eval", 0) == Task("babyai_0") and tasks.get("eval", 0).data == {"data_idx": 0}
    assert tasks.get("train", 0).data == {"data_idx": 4000}
    eval_ids = {tasks.get("eval", i).data["data_idx"] for i in range(400)}
    train_ids = {tasks.get("train", i).data["data_idx"] for i in range(50)}
    assert eval_ids == set(range(400)) and not eval_ids & train_ids
    with pytest.raises(IndexError):
        tasks.get("eval", 400)
    with pytest.raises(ValueError, match="eval_size"):
        BabyAITasks(eval_size=5000)


def test_conversation_start_and_turn_limit(env):
    user, assistant = env.conversation_start()
    assert user["role"] == "user" and assistant == {"role": "assistant", "content": ACK}
    for needed in ("turn left", "move forward", "go to", "pickup", "go through",
                   "toggle and go through", "Thought:\n", "\n\nAction:\n"):
        assert needed in user["content"]
    assert MAX_TURNS == 20 and env.max_turns == 20 and env.system_prompt == ""
    assert isinstance(env_lib.make("babyai_agentgym"), BabyAIEnv)  # the old name: an alias
    assert env.agentgym_name == "babyai"  # what the env server reads


# -- observations and rewards ---------------------------------------------------------------

def test_reset_lists_objects_nearest_first(env):
    first = env.reset(task(0))
    lines = first.splitlines()
    assert lines[0] == "Your goal: go to the red ball"
    # grey key (5,6): 1 ahead, 1 left (south); grey ball (5,4): 1 ahead, 1 right (north).
    assert lines[1] == "There is a grey key 1 1 steps in front of you and 1 steps to your left."
    assert lines[2] == "There is a grey ball 1 1 steps in front of you and 1 steps to your right."
    # red ball (2,2): 4 ahead, 3 right: 7 steps, the farthest object in view.
    assert lines[-3] == "There is a red ball 1 4 steps in front of you and 3 steps to your right."
    assert lines[-2] == "You are not carrying anything."
    listed = actions_of(first)
    assert listed[:3] == ["turn left", "turn right", "move forward"]
    assert "go to red ball 1" in listed and "pickup grey box 1" in listed
    assert listed[-1] == "check available actions" and "drop" not in listed
    assert lines[-1].startswith('Available actions: ["turn left", "turn right", ')


def test_go_to_solves_go_to_red_ball_grey_in_one_turn(env):
    env.reset(task(0))
    result = act(env, "go to red ball 1")
    # Shortest route: turn right, 3 forward to (6,2), turn left, 3 forward to (3,2) = 8 moves.
    assert result.info["moves"] == 8
    assert result.reward == pytest.approx(1 - 0.9 * 8 / 64) == pytest.approx(0.8875)
    assert result.done and result.info["success"]
    assert result.observation.startswith(
        "There is a red ball 1 right in front of you 1 steps away.")
    assert result.observation.endswith(COMPLETED)
    after = env.step("Action: turn left")  # AgentGym's server errors after done
    assert after.done and after.info["episode_over"]


def test_unseen_target_then_turns_then_go_to(env):
    env.reset(task(41))
    missing = act(env, "go to red ball 1")  # the ball is behind the agent
    assert missing.observation.startswith("There is no red ball 1 in view.\nAvailable actions: [")
    assert missing.reward == 0.0 and not missing.done and env._env.step_count == 0
    act(env, "turn left")
    second = act(env, "turn left")  # now facing south; the ball is 2 ahead, 2 right (west)
    assert "There is a red ball 1 2 steps in front of you and 2 steps to your right." in \
        second.observation
    done = act(env, "Go To Red Ball 1.")  # the server lowercases; the parser drops the "."
    # forward to (3,5), turn right, 2 forward to (1,5), turn left: 5 moves, 7 in all.
    assert done.info["moves"] == 7
    assert done.reward == pytest.approx(1 - 0.9 * 7 / 64) == pytest.approx(0.9015625)
    assert done.done


def test_move_forward_is_not_listed_with_a_box_ahead(env):
    env.reset(task(41))
    act(env, "turn left")  # facing west: the grey box (1,4) is 2 ahead
    blocked = act(env, "move forward")
    assert "move forward" not in actions_of(blocked.observation)
    again = act(env, "move forward")
    assert again.observation.startswith("You cannot move forward: there is a box right in front")
    assert env._env.step_count == 2 and tuple(env._env.agent_pos) == (2, 4)


def test_pickup_macro_and_drop(env):
    env.reset(task(0))
    picked = act(env, "pickup grey key 1")  # forward to (5,5), turn left, pick up (5,6)
    assert env._env.step_count == 3 and env._env.carrying.type == "key"
    assert "You are carrying a grey key." in picked.observation
    listed = actions_of(picked.observation)
    assert "drop" in listed and not any(a.startswith("pickup") for a in listed)
    refused = act(env, "pickup grey ball 1")
    assert refused.observation.startswith("You are already carrying a grey key; drop it first.")
    dropped = act(env, "drop")
    assert env._env.carrying is None and env._env.step_count == 4
    assert dropped.observation.startswith("There is a grey key 1 right in front of you 1 steps")


def test_toggle_and_go_through_stops_at_success(env):
    env.reset(task(12))  # open the red door: forward to (3,3), turn left (east), toggle
    result = act(env, "toggle and go through red closed door 1")
    assert result.info["moves"] == 3 and tuple(env._env.agent_pos) == (3, 3)
    assert result.reward == pytest.approx(1 - 0.9 * 3 / 50) == pytest.approx(0.946)
    assert result.done


def test_doors_open_and_are_walked_through(env):
    env.reset(task(5))
    through = act(env, "toggle and go through red closed door 1")
    # 3 forward west, turn left, 2 forward to (9,13), toggle, forward twice: 9 moves.
    assert env._env.step_count == 9 and tuple(env._env.agent_pos) == (9, 15)
    assert through.reward == 0.0 and not through.done
    act(env, "turn left")
    back = act(env, "turn left")
    assert "There is a red open door 1 right in front of you 1 steps away." in back.observation
    assert "go through red open door 1" in actions_of(back.observation)
    act(env, "go through red open door 1")
    assert env._env.step_count == 13 and tuple(env._env.agent_pos) == (9, 13)


# -- AgentGym's handling of odd replies and its score ------------------------------------------

def test_empty_check_unknown_and_two_markers(env):
    first = env.reset(task(0))
    listing = first.splitlines()[-1]
    empty = env.step("I am not sure what to do.")  # no marker: the empty action
    assert empty.observation == f"{NO_CHANGE}\n{listing}" and not empty.done
    check = env.step("Action: please check the actions")
    assert check.observation == "\n".join(first.splitlines()[1:])
    unknown = env.step("Action: dance")
    assert unknown.observation == f"{NOT_RECOGNIZED}\n{listing}"
    two = env.step("Action: turn left\nAction: turn right")
    assert (two.observation, two.reward, two.done) == (TOO_MANY_ACTIONS, 0.0, False)
    assert env._env.step_count == 0  # none of these moved the agent


def test_done_is_false_when_the_reward_is_at_most_half_and_score_accumulates(env):
    env.reset(task(0))
    for _ in range(28):  # 28 turns: back to facing west, 28 moves spent
        assert not act(env, "turn left").done
    late = act(env, "go to red ball 1")
    r = 1 - 0.9 * 36 / 64  # 0.49375 <= 0.5
    assert late.info["step_reward"] == pytest.approx(r) == pytest.approx(0.49375)
    assert late.reward == pytest.approx(r) and not late.done
    assert late.observation.endswith(COMPLETED)
    kept = act(env, "dance")  # not recognized: the last reward is kept and counted again
    assert kept.reward == pytest.approx(2 * r) and not kept.done
    checked = act(env, "check available actions")
    assert checked.reward == pytest.approx(3 * r)
    turned = act(env, "turn right")  # a real move; no longer facing the ball: reward 0
    assert turned.reward == pytest.approx(3 * r) and turned.info["step_reward"] == 0.0


def test_done_when_the_reward_is_above_half(env):
    env.reset(task(0))
    for _ in range(24):
        act(env, "turn left")
    result = act(env, "go to red ball 1")  # 32 moves: 1 - 0.9 * 32 / 64 = 0.55
    assert result.reward == pytest.approx(0.55) and result.done


def test_wrong_verb_for_a_visible_object_says_so(env):
    env.reset(task(5))
    wrong = act(env, "go through red closed door 1")  # closed: only "toggle and go through"
    assert wrong.observation.startswith("You cannot go through the red closed door 1;")
    assert env._env.step_count == 0


@pytest.mark.parametrize("data_idx", range(40))
def test_every_level_plays_listed_actions(env, data_idx):
    """Seed 0 of each level, 20 turns of listed actions picked at random: every listed action
    is accepted, and every observation ends with the list (or the completion line)."""
    rng = random.Random(data_idx)
    observation = env.reset(task(data_idx))
    assert observation.startswith("Your goal: ")
    for _ in range(20):
        action = rng.choice(actions_of(observation))
        result = act(env, action)
        observation = result.observation
        assert not observation.startswith((NOT_RECOGNIZED, "You cannot", "There is no"))
        assert observation.endswith((COMPLETED, "]"))
        if result.done:
            break
