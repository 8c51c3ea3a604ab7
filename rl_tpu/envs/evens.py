"""`evens`: name any even number of a list. A task with several right answers, for the BAPO
testbed (configs/bapo_entropy.py): where `largest` has one answer and rewards collapsing onto
it, here a policy can stay spread over the right answers or collapse onto one, so its entropy
and the number of distinct right answers it gives in k samples say something that success
alone does not.

    env = make("evens")                      # 6 digits 0-9 a task, at least 2 of them even
    env.reset(task) -> "Name an even number of the list: 3 8 2 7 4 5"
    env.step("8")   -> reward 1.0, done, success (so would "2" and "4")

An episode is one question and one reply; the reply is right when its text, stripped, is one
of the list's even numbers. Tasks are reproducible by index, train and eval from disjoint
seeds (as `largest`).

The teacher (`teacher_reply`) is imperfect in a way RL can fix and that keeps the demos
diverse: with probability `skill` it names one of the even numbers, drawn uniformly, else the
first number of the list (right only when that one is even). With skill 0.3 it solves about
0.3 + 0.7 * 0.5 = 0.65 of the tasks, and its right answers are spread over every even number.
"""

from __future__ import annotations

import random
from rl_tpu.core.env import OneReplyEnv, SeededTasks, StepResult, Task, register

SYSTEM_PROMPT = "Reply with one even number of the list, and nothing else."
QUESTION = "Name an even number of the list:"


class EvensTasks(SeededTasks):
    """Lists of `num_items` integers in [0, max_value] holding at least `min_even` even
    numbers (redrawn until they do); train and eval from disjoint seeds."""

    def __init__(self, num_items: int, max_value: int, min_even: int, train_seed: int,
                 eval_seed: int, train_size: int, eval_size: int):
        if not 1 <= min_even <= num_items:
            raise ValueError(f"min_even={min_even} must be in [1, num_items={num_items}]")
        if max_value < 1:
            raise ValueError(f"max_value={max_value} must be >= 1 (0 and 1: one even number)")
        self.num_items, self.max_value, self.min_even = num_items, max_value, min_even
        super().__init__("evens", self._draw, train_seed, eval_seed, train_size, eval_size)

    def _draw(self, rng: random.Random, split: str, index: int) -> dict:
        del split, index  # both splits draw alike, from their own seeds
        while True:
            numbers = [rng.randint(0, self.max_value) for _ in range(self.num_items)]
            evens = sorted({n for n in numbers if n % 2 == 0})
            if sum(n % 2 == 0 for n in numbers) >= self.min_even:
                return {"numbers": numbers, "answers": [str(n) for n in evens]}


def question(numbers) -> str:
    return f"{QUESTION} " + " ".join(str(n) for n in numbers)


def teacher_reply(task: Task, rng: random.Random, skill: float) -> str:
    """An even number of the list, uniformly, with probability `skill`; else the first."""
    if rng.random() < skill:
        return rng.choice(task.data["answers"])
    return str(task.data["numbers"][0])


@register("evens")
class EvensEnv(OneReplyEnv):
    name = "evens"
    system_prompt = SYSTEM_PROMPT
    needs = "answers"

    def __init__(self, num_items: int = 6, max_value: int = 9, min_even: int = 2,
                 train_seed: int = 1_000_000, eval_seed: int = 0, train_size: int = 1_000_000,
                 eval_size: int = 1000):
        self._tasks = EvensTasks(num_items, max_value, min_even, train_seed, eval_seed,
                                 train_size, eval_size)

    def question(self, task: Task) -> str:
        return question(task.data["numbers"])

    def teacher(self, task: Task, rng: random.Random, skill: float) -> str:
        return teacher_reply(task, rng, skill)

    def score(self, task: Task, reply: str) -> StepResult:
        answers = task.data["answers"]
        if reply in answers:
            return StepResult("Correct.", 1.0, True, {"success": True, "answer": reply})
        return StepResult(f"Not correct: the even numbers are {', '.join(answers)}.", 0.0, True,
                          {"success": False, "gold": answers})
