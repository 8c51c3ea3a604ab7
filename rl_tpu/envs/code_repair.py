"""`code_repair`: multi-turn code, a fixer that repairs its program from the failing test, and
optionally a tester that writes a test exposing a buggy program (two roles of one model).

    env = make("code_repair", max_attempts=3)
    env.reset(task)                             # the problem, as in `code`
    env.step("def f(x):\\n    return x * 3")    # fails: "f(24) returned 72, expected 83. Fix..."
    env.step("def f(x):\\n    return x * 3 + 11")  # passes: reward 1.0, done

Fixer: each reply's program runs against the task's hidden tests in the sandbox (as `code`
does). When every test passes, or after `max_attempts` programs, the episode ends with the
reward of the last program: the fraction of its tests that passed, times
`retry_discount ** (attempts - 1)` (1.0: a repair is worth a first-try solution; lower pays
for getting it right at once). Before that, a failing program gets the first failure as the
next observation (the call, what it returned and what was expected, or the error's tail) and
reward 0. info["first_try"] is the first program's fraction, so a run can log how much the
repairs add.

Tester (roles="fixer,tester", `functions` tasks only): the train split's odd tasks show the
problem and a buggy program (the teacher's one-step-short slip); the reply names an input,
`f(12)` or `12`. It is paid 1.0 when the buggy program's value at that input (run in the
sandbox) differs from the right one (computed here), so the test exposes the bug; 0
otherwise. The eval split is fixer tasks only, so eval success is the fixer's.

The teacher (for SFT): a fixer's first program is right with probability `skill`, else the
slip; after a failure it writes the right program with probability `skill` again. A tester
picks an input that exposes the slip with probability `skill`, else a random one.
"""

from __future__ import annotations

import random
import re
from typing import Optional

from rl_tpu.core.env import SeededTasks, StepResult, Task, register
from rl_tpu.envs.code import CodeEnvBase, run_tests
from rl_tpu.envs import code_tasks

SYSTEM_PROMPT = ("Write the Python function the task asks for; reply with the code only, e.g.\n"
                 "def f(x):\n    return x + 1\nWhen a test fails, reply with the fixed code. "
                 "Asked for a test, reply with an input that shows the bug, e.g. f(7).")
FIX = "Fix the program."
_INPUT = re.compile(r"^\s*(?:f\s*\(\s*)?(-?\d{1,6})\s*\)?\s*$")


def parse_input(reply: str) -> Optional[int]:
    """The integer a tester names: `f(12)` or `12` (the reply's last non-empty line)."""
    lines = [line for line in str(reply).splitlines() if line.strip()]
    match = _INPUT.match(lines[-1]) if lines else None
    return int(match.group(1)) if match else None


def shorten(text: str, head: int = 100, tail: int = 200) -> str:
    """The failure as feedback: its start (the call) and end (the exception), the middle of a
    long traceback cut, so the next turn keeps room in the context."""
    return text if len(text) <= head + tail + 5 else f"{text[:head]} ... {text[-tail:]}"


def draw_repair_task(rng: random.Random, split: str, index: int, tester: bool) -> dict:
    data = code_tasks.draw_function_task(rng, split, index)
    if tester and split == "train" and index % 2 == 1:
        kind, constants = data["kind"], tuple(data["constants"])
        buggy = code_tasks.program(kind, constants, slip=True)
        data.update(role="tester", buggy=buggy,
                    prompt=(f"{data['prompt']}\nThis program has a bug:\n{buggy}\n"
                            "Write a test input that shows it."))
    else:
        data["role"] = "fixer"
    return data


class RepairTasks(SeededTasks):
    def __init__(self, tester: bool, train_seed: int, eval_seed: int, train_size: int,
                 eval_size: int):
        super().__init__("repair", lambda rng, split, i: draw_repair_task(rng, split, i, tester),
                         train_seed, eval_seed, train_size, eval_size)


@register("code_repair")
class CodeRepairEnv(CodeEnvBase):
    name = "code_repair"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, tasks: str = "functions", roles: str = "fixer", max_attempts: int = 3,
                 retry_discount: float = 1.0, sandbox: str = "bubblewrap",
                 wall_seconds: float = 5.0, test_seconds: float = 2.0, memory_mb: int = 512,
                 pool_size: int = 2, max_program_chars: int = 8000, train_seed: int = 1_000_000,
                 eval_seed: int = 0, train_size: int = 1_000_000, eval_size: int = 500):
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts} must be >= 1")
        if not 0.0 <= retry_discount <= 1.0:
            raise ValueError(f"retry_discount={retry_discount} must be in [0, 1]")
        role_set = {r.strip() for r in roles.split(",") if r.strip()}
        if not role_set or role_set - {"fixer", "tester"} or "fixer" not in role_set:
            raise ValueError(f"roles={roles!r}: 'fixer' or 'fixer,tester'")
        if "tester" in role_set and tasks != "functions":
            raise ValueError("the tester role needs tasks='functions' (a reference to "
                             "compare its input against)")
        super().__init__(tasks, sandbox, wall_seconds, test_seconds, memory_mb, pool_size,
                         max_program_chars, train_seed=train_seed, eval_seed=eval_seed,
                         train_size=train_size, eval_size=eval_size)
        if tasks == "functions":  # the same functions, with roles
            self._tasks = RepairTasks("tester" in role_set, train_seed, eval_seed, train_size,
                                      eval_size)
        self.max_attempts, self.retry_discount = int(max_attempts), float(retry_discount)
        self._attempts, self._first_try = 0, 0.0

    def reset(self, task: Task) -> str:
        if task.data.get("role") == "tester":
            if "buggy" not in task.data or "kind" not in task.data:
                raise ValueError(f"tester task {task.task_id!r} needs 'buggy', 'kind' and "
                                 "'constants'")
            self._task = task
        else:
            super().reset(task)
        self._attempts, self._first_try = 0, 0.0
        return task.data["prompt"]

    def step(self, action: str) -> StepResult:
        if self._task is None:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        if self._task.data.get("role") == "tester":
            return self._test(action)
        self._attempts += 1
        report, info = self.check(action)
        if self._attempts == 1:
            self._first_try = report.fraction
        info.update(attempts=self._attempts, first_try=self._first_try, role="fixer")
        header = f"Passed {info['passed']} of {info['tests']} tests."
        if report.success or self._attempts >= self.max_attempts:
            self._task = None
            reward = report.fraction * self.retry_discount ** (self._attempts - 1)
            text = header if report.success else f"{header}\n{info['error']}"
            return StepResult(text, reward, True, info)
        return StepResult(f"{header}\n{shorten(info['error'])}\n{FIX}", 0.0, False, info)

    def _test(self, action: str) -> StepResult:
        data, self._task = self._task.data, None
        x = parse_input(action)
        info = {"role": "tester", "success": False, "input": x}
        if x is None:
            return StepResult("No test input found: reply with e.g. f(7).", 0.0, True, info)
        kind, constants = data["kind"], tuple(data["constants"])
        test = {"call": f"f({x})", "expected": repr(code_tasks.reference(kind, constants, x))}
        report = run_tests(self.sandbox, data["buggy"], [test], test_seconds=self.test_seconds)
        exposed = not report.passed[0]
        info.update(success=exposed, error=report.error)
        text = (f"The test exposes the bug: {report.error}" if exposed
                else f"The buggy program passes f({x}) == {test['expected']}.")
        return StepResult(text, float(exposed), True, info)

    def teacher_reply(self, task: Task, rng, skill: float) -> str:
        """The fixer's or the tester's teacher (module docstring), in the current state."""
        data = task.data
        if data.get("role") == "tester":
            kind, constants = data["kind"], tuple(data["constants"])
            exposing = [x for x in range(-10, 31) if code_tasks.reference(kind, constants, x)
                        != _slip_value(kind, constants, x)]
            if exposing and rng.random() < skill:
                return f"f({rng.choice(exposing)})"
            return f"f({rng.randint(0, 30)})"
        return code_tasks.teacher_program(task, rng, skill)


def _slip_value(kind: str, constants: tuple, x: int) -> int:
    """The teacher's slip's value at x (the trusted twin of running the buggy program)."""
    return x * constants[0] if kind == "affine" else x
