"""The maze env: moves, walls, the goal, invalid replies, reproducible tasks at the drawn
shortest-path lengths, and a teacher whose skill-1 walk is a shortest path."""

import random

import pytest

from rl_tpu.envs.base import Task, make
from rl_tpu.envs.maze import MazeEnv, distances

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


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="min_steps=5 <= max_steps=3"):
        MazeEnv(min_steps=5, max_steps=3)
    with pytest.raises(ValueError, match="offers a path"):
        MazeEnv(size=2, min_steps=9, max_steps=9).tasks().get("train", 0)
    assert isinstance(make("maze"), MazeEnv)
