"""The maze env: moves, walls, the goal, invalid replies, reproducible tasks at the drawn
shortest-path lengths, a teacher whose skill-1 walk is a shortest path, and the hidden-goal
variant (sight, search, its teacher)."""

import random

import pytest

from rl_tpu.core.env import Task, make
from rl_tpu.envs.maze import MazeEnv, distances, in_sight

# a 3 x 3 grid with one wall in the middle: from (0, 0) to (2, 2) is 4 moves around it
TASK = Task("maze/test/0", {"walls": [[1, 1]], "start": [0, 0], "goal": [2, 2],
                                "shortest": 4})


def test_moves_walls_and_the_goal():
    env = MazeEnv(size=3)
    first = env.reset(TASK)
    assert first == ("You are at row 0, column 0. The goal is at row 2, column 2. "
                     "Open ways: south, east.")
    out = env.step("north")  # off the grid: a turn spent in place
    assert not out.done and out.reward == 0 and out.info["bumped"]
    assert out.observation.startswith("A wall blocks north; you stay. You are at row 0, column 0")
    out = env.step("Action: east")
    assert out.observation.startswith("You moved east. You are at row 0, column 1.")
    assert out.observation.endswith("Open ways: west, east.")  # (1, 1) is the wall
    assert env.step("south").info["bumped"]  # into the wall
    for move in ("east", "south"):
        assert env.step(move).reward == 0
    out = env.step("I go SOUTH")  # the last direction named, any case
    assert out.done and out.reward == 1.0 and out.info["success"]
    assert env.step("north").info["invalid_action"]  # over


def test_a_reply_without_a_direction_is_invalid_and_the_episode_goes_on():
    env = MazeEnv(size=3)
    env.reset(TASK)
    out = env.step("up")
    assert out.info.get("invalid_action") and not out.done and out.reward == 0
    assert env.step("east").observation.startswith("You moved east")


def test_tasks_are_reproducible_and_their_paths_in_range():
    env, again = MazeEnv(min_steps=3, max_steps=9), MazeEnv(min_steps=3, max_steps=9)
    lengths = []
    for i in range(60):
        task = env.tasks().get("train", i)
        assert task.data == again.tasks().get("train", i).data
        walls = frozenset(tuple(x) for x in task.data["walls"])
        reach = distances(walls, env.size, tuple(task.data["start"]))
        assert reach[tuple(task.data["goal"])] == task.data["shortest"]
        lengths.append(task.data["shortest"])
    assert min(lengths) >= 3 and max(lengths) <= 9 and len(set(lengths)) >= 5
    assert env.tasks().get("eval", 0).data != env.tasks().get("train", 0).data


def test_a_skill_one_teacher_walks_a_shortest_path_and_a_careless_one_still_tries():
    env = MazeEnv()
    for i in range(20):
        task = env.tasks().get("eval", i)
        env.reset(task)
        for turn in range(1, 100):
            if env.step(env.teacher_reply(task, random.Random(i), 1.0)).done:
                break
        assert turn == task.data["shortest"]
    task = env.tasks().get("eval", 0)
    env.reset(task)
    rng = random.Random(0)
    replies = {env.teacher_reply(task, rng, 0.0) for _ in range(20)}
    assert replies <= {"north", "south", "east", "west"}


def test_sight_stops_at_walls_edges_and_its_reach():
    walls = frozenset({(1, 1)})
    assert in_sight(walls, 3, (0, 1), 3) == {(0, 1), (0, 0), (0, 2)}  # the wall hides (2, 1)
    assert in_sight(frozenset(), 4, (0, 0), 2) == {(0, 0), (0, 1), (0, 2), (1, 0), (2, 0)}


def test_a_hidden_goal_is_named_once_sighted_and_stays_named():
    env = MazeEnv(size=3, hidden_goal=True, sight=1)
    assert env.reset(TASK) == ("You are at row 0, column 0. The goal is not in sight. "
                               "Open ways: south, east.")
    assert "not in sight" in env.step("east").observation  # (0, 1)
    assert "not in sight" in env.step("east").observation  # (0, 2): the goal is 2 below
    assert "The goal is at row 2, column 2." in env.step("south").observation  # next to it
    assert "The goal is at row 2, column 2." in env.step("north").observation  # remembered
    env.reset(TASK)  # a new episode forgets it
    assert "not in sight" in env.step("south").observation
    far = MazeEnv(size=3, hidden_goal=True)  # unlimited sight: (0, 2) sees down column 2
    far.reset(TASK)
    assert "The goal is at row 2" in far.step("east").observation + far.step("east").observation


def test_default_tasks_are_drawn_as_before_the_hidden_variant():
    assert MazeEnv().tasks().get("eval", 3).data == {
        "walls": [[0, 5], [1, 0], [2, 3], [3, 3], [4, 1]], "start": [5, 3], "goal": [2, 2],
        "shortest": 4, "seed": 3, "split": "eval", "index": 3}


def test_hidden_goals_start_out_of_sight_and_a_searching_teacher_finds_them():
    env = MazeEnv(hidden_goal=True, sight=1, max_steps=12)
    found_in, shortest = [], []
    for i in range(40):
        task = env.tasks().get("eval", i)
        walls = frozenset(tuple(x) for x in task.data["walls"])
        assert tuple(task.data["goal"]) not in in_sight(walls, 6, tuple(task.data["start"]), 1)
        assert "not in sight" in env.reset(task)
        rng = random.Random(i)
        for turn in range(1, 200):
            out = env.step(env.teacher_reply(task, rng, 1.0))
            assert not out.info.get("bumped")  # a search move never walks into a wall
            if out.done:
                break
        assert out.info["success"]  # it stands on every reachable cell in the end
        found_in.append(turn)
        shortest.append(task.data["shortest"])
    assert sum(found_in) > sum(shortest)  # the search costs turns a known goal would not


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="sight=-1 >= 0"):
        MazeEnv(sight=-1)
    with pytest.raises(ValueError, match="min_steps=5 <= max_steps=3"):
        MazeEnv(min_steps=5, max_steps=3)
    with pytest.raises(ValueError, match="offers a path"):
        MazeEnv(size=2, min_steps=9, max_steps=9).tasks().get("train", 0)
    assert isinstance(make("maze"), MazeEnv)
