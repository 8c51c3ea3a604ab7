"""`evens` (rl_tpu/envs/evens.py): several right answers a task, an exact reward, and a teacher
whose right answers are spread over them."""

import random

import pytest

from rl_tpu.core.env import make
from rl_tpu.envs.evens import EvensTasks, teacher_reply


def test_every_even_number_of_the_list_is_right_and_nothing_else():
    env = make("evens")
    task = env.tasks().get("eval", 3)
    numbers = task.data["numbers"]
    assert env.reset(task) == "Name an even number of the list: " + " ".join(map(str, numbers))
    evens = sorted({n for n in numbers if n % 2 == 0})
    assert task.data["answers"] == [str(n) for n in evens] and len(evens) >= 1
    for n in range(10):
        env.reset(task)
        result = env.step(f" {n}\n")
        assert result.done and result.reward == float(n in evens)
        assert result.info["success"] == (n in evens)
    env.reset(task)
    assert env.step("eight").reward == 0.0
    assert env.step("8").info["invalid_action"]  # the episode is over


def test_tasks_hold_enough_evens_and_the_splits_are_fixed_and_apart():
    tasks = EvensTasks(num_items=6, max_value=9, min_even=2, train_seed=100, eval_seed=0,
                       train_size=1000, eval_size=50)
    for i in range(50):
        numbers = tasks.get("eval", i).data["numbers"]
        assert len(numbers) == 6 and sum(n % 2 == 0 for n in numbers) >= 2
        assert tasks.get("eval", i).data == EvensTasks(6, 9, 2, 100, 0, 1000, 50).get(
            "eval", i).data
    with pytest.raises(ValueError, match="overlap"):
        EvensTasks(6, 9, 2, train_seed=0, eval_seed=10, train_size=100, eval_size=10)
    with pytest.raises(ValueError, match="min_even=7"):
        EvensTasks(6, 9, 7, 100, 0, 10, 10)


def test_the_teacher_is_right_as_often_as_its_skill_says_and_spreads_its_answers():
    """skill 0.3: right with p = 0.3 + 0.7 * P(the first number is even), and every even
    number of a list among its right answers over many draws."""
    env, rng = make("evens"), random.Random(0)
    tasks = [env.tasks().get("train", i) for i in range(2000)]
    first_even = sum(t.data["numbers"][0] % 2 == 0 for t in tasks) / len(tasks)
    right = sum(teacher_reply(t, rng, 0.3) in t.data["answers"] for t in tasks) / len(tasks)
    assert abs(right - (0.3 + 0.7 * first_even)) < 0.03
    task = tasks[0]
    seen = {teacher_reply(task, rng, 1.0) for _ in range(200)}
    assert seen == set(task.data["answers"])
