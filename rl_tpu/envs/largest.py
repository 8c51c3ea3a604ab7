"""`largest`: name the largest of a few digits. The quickstart's task, small enough for a tiny
model on a laptop CPU, with an exact reward and an imperfect teacher to imitate.

    env = make("largest")                    # 5 digits 0-9 per task
    env.reset(task) -> "Which number is largest? 3 7 2 5 1"
    env.step("7")   -> reward 1.0, done, success

An episode is one question and one reply. The reply is right when its text, stripped, is the
largest number's digit(s); anything else scores 0 (the observation says what was expected).

Tasks are reproducible by index: task i of a split is drawn from `Random(split_seed + i)`, with
the train and eval seed ranges disjoint (checked), so the eval set is the same every time.
With 5 digits there are 10^5 lists: train and eval share list *text* only by chance.

The teacher (`teacher_reply`) is deliberately imperfect, the setting of an RL-beats-imitation
demo: with probability `skill` it names the largest number, otherwise it names the FIRST number
of the list (a systematic mistake, right only when the first number happens to be the largest).
With skill 0.3 and 5 digits it solves about 0.3 + 0.7 * P(first is largest) ~ 0.47 of the
tasks. A model that imitates it puts most of its mass on "the first number", so its greedy
reply is usually wrong; sampling still finds the largest number often enough for a verifiable
reward to teach it the rule the teacher only half follows.
"""

from __future__ import annotations

import random
from rl_tpu.core.env import OneReplyEnv, SeededTasks, StepResult, Task, register

SYSTEM_PROMPT = "Reply with the largest number of the list, and nothing else."
QUESTION = "Which number is largest?"


class LargestTasks(SeededTasks):
    """Lists of `num_items` integers in [0, max_value]; train and eval from disjoint seeds."""

    def __init__(self, num_items: int, max_value: int, train_seed: int, eval_seed: int,
                 train_size: int, eval_size: int):
        if num_items < 2:
            raise ValueError(f"num_items={num_items}: a list needs at least 2 numbers")
        if max_value < 1:
            raise ValueError(f"max_value={max_value} must be >= 1")
        self.num_items, self.max_value = num_items, max_value
        super().__init__("largest", self._draw, train_seed, eval_seed, train_size, eval_size)

    def _draw(self, rng: random.Random, split: str, index: int) -> dict:
        del split, index  # both splits draw alike, from their own seeds
        numbers = [rng.randint(0, self.max_value) for _ in range(self.num_items)]
        return {"numbers": numbers, "answer": str(max(numbers))}


def question(numbers) -> str:
    return f"{QUESTION} " + " ".join(str(n) for n in numbers)


def teacher_reply(task: Task, rng: random.Random, skill: float) -> str:
    """The imperfect teacher: the largest number with probability `skill`, else the first."""
    numbers = task.data["numbers"]
    return str(max(numbers)) if rng.random() < skill else str(numbers[0])


@register("largest")
class LargestEnv(OneReplyEnv):
    name = "largest"
    system_prompt = SYSTEM_PROMPT
    needs = "numbers"

    def __init__(self, num_items: int = 5, max_value: int = 9, train_seed: int = 1_000_000,
                 eval_seed: int = 0, train_size: int = 1_000_000, eval_size: int = 1000):
        self._tasks = LargestTasks(num_items, max_value, train_seed, eval_seed, train_size,
                                   eval_size)

    def question(self, task: Task) -> str:
        return question(task.data["numbers"])

    def teacher(self, task: Task, rng: random.Random, skill: float) -> str:
        return teacher_reply(task, rng, skill)

    def score(self, task: Task, reply: str) -> StepResult:
        answer = task.data["answer"]
        if reply == answer:
            return StepResult("Correct.", 1.0, True, {"success": True})
        return StepResult(f"Not correct: the largest is {answer}.", 0.0, True,
                          {"success": False, "gold": answer})
