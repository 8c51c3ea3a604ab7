"""`guess`: find a hidden number by guesses and "higher" / "lower". An iterative optimisation
task in miniature, for the TL-GRPO testbed (configs/tl_grpo_guess.py): the state (the hidden
number) is the same every turn, each turn proposes a solution and is scored on its own, and an
episode is worth its best turn (`env.reward_reduce = "max"`), as in TL-GRPO's circuit sizing.

    env = make("guess")                      # a number in [0, 63]
    env.reset(task) -> "Guess the hidden number, from 0 to 63. Reply with a number."
    env.step("32")  -> "Lower.", reward 1 - |32 - t| / 63
    env.step("17")  -> "Correct!", reward 1.0, done, success

A turn's reward is its closeness, 1 - |guess - target| / max_value (1 for the number itself);
a reply that is no whole number in range is an invalid action (reward 0, the episode goes on).
Tasks are reproducible by index, train and eval from disjoint seeds. Halving the interval
finds any number in floor(log2(max_value + 1)) + 1 guesses (7 for 0-63).

The teacher (`teacher_reply`) keeps the interval the feedback so far allows: with probability
`skill` it guesses its middle, else a number drawn uniformly from it (never one the feedback
ruled out), so its demonstrations are consistent but slower than halving.

Deterministic given the task and the replies (`replayable`), so a branching rollout may restore
a state by replaying the actions (rl_tpu/agent/branching.py).
"""

from __future__ import annotations

import random
import re
from typing import Optional

from rl_tpu.core.env import Env, SeededTasks, StepResult, Task, invalid_action, register

_NUMBER = re.compile(r"^\s*(-?\d+)\s*\.?\s*$")


@register("guess")
class GuessEnv(Env):
    name = "guess"
    replayable = True  # reset(task) and the same replies reach the same state

    def __init__(self, max_value: int = 63, train_seed: int = 1_000_000, eval_seed: int = 0,
                 train_size: int = 1_000_000, eval_size: int = 1000):
        if max_value < 1:
            raise ValueError(f"max_value={max_value} must be >= 1")
        self.max_value = max_value
        self.system_prompt = (f"Find the hidden number from 0 to {max_value}. Reply with one "
                              "number a turn, and nothing else.")
        self._tasks = SeededTasks(
            "guess", lambda rng, split, index: {"target": rng.randint(0, max_value)},
            train_seed, eval_seed, train_size, eval_size)
        self._task: Optional[Task] = None
        self._low, self._high = 0, max_value  # what the feedback so far allows

    def tasks(self) -> SeededTasks:
        return self._tasks

    def reset(self, task: Task) -> str:
        if "target" not in task.data:
            raise ValueError(f"task {task.task_id!r} has no 'target'; take tasks from "
                             "env.tasks().get(split, index)")
        self._task, self._low, self._high = task, 0, self.max_value
        return f"Guess the hidden number, from 0 to {self.max_value}. Reply with a number."

    def step(self, action: str) -> StepResult:
        if self._task is None:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        match = _NUMBER.match(str(action))
        guess = int(match.group(1)) if match else None
        if guess is None or not 0 <= guess <= self.max_value:
            return invalid_action(f"reply with one whole number from 0 to {self.max_value}")
        target = self._task.data["target"]
        closeness = 1.0 - abs(guess - target) / self.max_value
        if guess == target:
            self._task = None
            return StepResult("Correct!", 1.0, True, {"success": True, "guess": guess})
        if guess < target:
            self._low = max(self._low, guess + 1)
            return StepResult("Higher.", closeness, False, {"success": False, "guess": guess})
        self._high = min(self._high, guess - 1)
        return StepResult("Lower.", closeness, False, {"success": False, "guess": guess})

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        """The middle of the interval the feedback allows with probability `skill`, else a
        number drawn uniformly from it (module docstring)."""
        del task  # the env's own state holds what the teacher knows
        if rng.random() < skill:
            return str((self._low + self._high) // 2)
        return str(rng.randint(self._low, self._high))
