"""`selfplay_arithmetic`: one env, two roles, for two-role self-play (rl_tpu/recipes/selfplay.py).

A task's `role` says which side of the game an episode plays:

    propose   "Write a new arithmetic problem." The reply must be an expression of 2 to
              `max_terms` integers in [0, `max_number`] joined by + - * (e.g. "12 + 7 * 3");
              it is checked (and its value computed) here, and rewarded by the recipe once
              the solver has tried it. A reply that is no such expression is invalid: reward 0.
    solve     "Compute: 12 + 7 * 3" -> the reply's first integer must equal the value (Python's
              precedence: * before + and -): reward 1, success; else 0.

The proposer's reply is parsed, not trusted: `info["expression"]` is the canonical form
("12 + 7 * 3"), `info["value"]` its value, `info["terms"]` its number of integers (the
difficulty logged over training) and `info["valid"]`; an invalid proposal has valid False.

Tasks: the train split alternates roles (even index: propose, odd: solve a random problem), so
a warm start on the teacher's demonstrations covers both (`train_roles="solve"`: solve tasks
only, for a solver trained without self-play); the eval split is solve tasks only,
a fixed held-out set of problems of 2-3 terms, so eval success is the solver's accuracy.
The teacher (`teacher_reply`): proposes a random expression of 2 to 3 terms, and solves
correctly with probability `skill` (else it answers the value of the first term alone).
"""

from __future__ import annotations

import random
import re
from typing import Optional

from rl_tpu.core.env import Env, SeededTasks, StepResult, Task, invalid_action, register

SYSTEM_PROMPT = ("You play two roles. Asked to write a problem, reply with an arithmetic "
                 "expression of integers joined by + - * and nothing else. Asked to compute, "
                 "reply with the integer value and nothing else.")
PROPOSE = "Write a new arithmetic problem."
_TERM = re.compile(r"\s*(\d+)\s*")
_OPERATOR = re.compile(r"\s*([-+*])\s*")
_INTEGER = re.compile(r"-?\d+")


def parse_expression(text: str, max_terms: int, max_number: int) -> Optional[tuple[str, int, int]]:
    """(canonical form, value, number of terms) of an expression of 2..max_terms integers in
    [0, max_number] joined by + - *, the whole reply (surrounding spaces aside); else None."""
    text = str(text).strip()
    terms, operators, at = [], [], 0
    while True:
        match = _TERM.match(text, at)
        if not match:
            return None
        number = match.group(1)
        if len(number) > len(str(max_number)) or int(number) > max_number:
            return None
        terms.append(int(number))
        at = match.end()
        if at == len(text):
            break
        match = _OPERATOR.match(text, at)
        if not match:
            return None
        operators.append(match.group(1))
        at = match.end()
    if not 2 <= len(terms) <= max_terms:
        return None
    canonical = " ".join([str(terms[0])] + [f"{op} {t}" for op, t in zip(operators, terms[1:])])
    return canonical, evaluate(terms, operators), len(terms)


def evaluate(terms: list[int], operators: list[str]) -> int:
    """The value with * before + and - (left to right within each)."""
    sums, product = [], terms[0]
    signs = [1]
    for op, term in zip(operators, terms[1:]):
        if op == "*":
            product *= term
        else:
            sums.append(product)
            product = term
            signs.append(1 if op == "+" else -1)
    sums.append(product)
    return sum(s * v for s, v in zip(signs, sums))


def random_expression(rng: random.Random, terms: int, max_number: int) -> str:
    numbers = [rng.randint(0, max_number) for _ in range(terms)]
    ops = [rng.choice("+-*") for _ in range(terms - 1)]
    return " ".join([str(numbers[0])] + [f"{o} {n}" for o, n in zip(ops, numbers[1:])])


def solve_task(task_id: str, expression: str, max_terms: int, max_number: int) -> Task:
    parsed = parse_expression(expression, max_terms, max_number)
    if parsed is None:
        raise ValueError(f"{expression!r} is not an expression of 2..{max_terms} integers in "
                         f"[0, {max_number}] joined by + - *")
    canonical, value, terms = parsed
    return Task(task_id, {"role": "solve", "expression": canonical, "value": value,
                          "terms": terms})


def _draw_task(rng: random.Random, split: str, index: int, max_terms: int,
               max_number: int, train_roles: str) -> dict:
    """train: propose / solve alternating by index (or solve only); eval: solve only (2-3
    terms)."""
    if split == "train" and train_roles == "both" and index % 2 == 0:
        return {"role": "propose"}
    expression = random_expression(rng, rng.randint(2, min(3, max_terms)), max_number)
    return solve_task("", expression, max_terms, max_number).data


@register("selfplay_arithmetic")
class SelfPlayArithmeticEnv(Env):
    name = "selfplay_arithmetic"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, max_terms: int = 4, max_number: int = 20, train_seed: int = 1_000_000,
                 eval_seed: int = 0, train_size: int = 1_000_000, eval_size: int = 1000,
                 train_roles: str = "both"):
        if max_terms < 2 or max_number < 1:
            raise ValueError(f"max_terms={max_terms} must be >= 2 and max_number={max_number} "
                             ">= 1")
        if train_roles not in ("both", "solve"):
            raise ValueError(f"train_roles={train_roles!r}: 'both' (self-play) or 'solve' (a "
                             "solver trained on random problems alone, the control)")
        self.max_terms, self.max_number = max_terms, max_number
        self._tasks = SeededTasks(
            "selfplay", lambda rng, split, index: _draw_task(rng, split, index, max_terms,
                                                             max_number, train_roles),
            train_seed, eval_seed, train_size, eval_size)
        self._task: Optional[Task] = None

    def tasks(self) -> SeededTasks:
        return self._tasks

    def reset(self, task: Task) -> str:
        role = task.data.get("role")
        if role not in ("propose", "solve"):
            raise ValueError(f"task {task.task_id!r} has role {role!r}; expected 'propose' or "
                             "'solve' (take tasks from env.tasks(), or solve_task(...))")
        self._task = task
        return PROPOSE if role == "propose" else f"Compute: {task.data['expression']}"

    def step(self, action: str) -> StepResult:
        task, self._task = self._task, None
        if task is None:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        if task.data["role"] == "propose":
            parsed = parse_expression(action, self.max_terms, self.max_number)
            if parsed is None:
                result = invalid_action(
                    f"{str(action).strip()[:60]!r} is not 2 to {self.max_terms} integers in "
                    f"[0, {self.max_number}] joined by + - *", valid=False)
                result.done = True
                return result
            canonical, value, terms = parsed
            return StepResult("Problem recorded.", 0.0, True,
                              {"valid": True, "expression": canonical, "value": value,
                               "terms": terms})
        found = _INTEGER.search(str(action))
        right = found is not None and int(found.group()) == task.data["value"]
        return StepResult("Correct." if right else f"Not correct: {task.data['value']}.",
                          1.0 if right else 0.0, True, {"success": right})

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        """A random 2-3 term problem; a correct answer with probability `skill`, else the
        first term's value."""
        if task.data["role"] == "propose":
            return random_expression(rng, rng.randint(2, min(3, self.max_terms)),
                                     self.max_number)
        if rng.random() < skill:
            return str(task.data["value"])
        return task.data["expression"].split()[0]
