"""`tir`: tool-integrated reasoning. Arithmetic too long to do in one's head; every ```python
block of a reply runs in the sandbox (rl_tpu.sandbox) and its output is the next observation;
the reward is on the final answer.

    env = make("tir")
    env.reset(task)            # "Compute 4817 * 2963 - 512."
    env.step("```python\\nprint(4817 * 2963 - 512)\\n```")   # observation "14272259", reward 0
    env.step("<answer>14272259</answer>")                     # reward 1.0, success, done

A reply with an answer (the last <answer>...</answer>, else the last \\boxed{...}, as the
math env reads answers) ends the episode: reward 1.0 when it is the right integer (commas and
spaces ignored), else 0; code in the same reply is not run. A reply with no answer and one or
more ```python blocks runs them, in order, each in one sandbox execution; the observation is
each block's stdout, or the tail of its error (truncated to `max_output_chars`). With
`carry_state` (default) a block runs after the earlier blocks that ran cleanly, their output
silenced, so variables carry over as in a notebook. A reply with neither is an invalid action
(the episode goes on). The agent loop's turn limit (env.max_turns) bounds the tool calls; an
episode that reaches it unanswered scores 0.

Tasks are seeded (train and eval from disjoint seed ranges): `a op b op c` with a and b of
3-4 digits and c of 1-3, op in + - *. The teacher (for SFT) uses the tool with probability
`skill` (print the expression, then answer the printed value); otherwise it answers at once
from a slip of mental arithmetic (the product without its last term, a wrong answer), the
habit RL should break.
"""

from __future__ import annotations

import random
import re
from typing import Optional

from rl_tpu.core.env import Env, SeededTasks, StepResult, Task, invalid_action, register
from rl_tpu.envs.code import SANDBOX_MODES, shared_sandbox

SYSTEM_PROMPT = ("Solve the problem. To run Python, write a ```python block; its output comes "
                 "back. Give the final answer as <answer>N</answer>.")
_CODE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_SILENCED = '''import io as _io, sys as _sys
_real_stdout, _sys.stdout = _sys.stdout, _io.StringIO()
{blocks}
_sys.stdout = _real_stdout
'''


def final_answer(reply: str) -> Optional[str]:
    """The reply's final answer: its last <answer>...</answer>, else its last \\boxed{...}."""
    tags = _ANSWER.findall(reply) or _BOXED.findall(reply)
    return tags[-1].strip() if tags else None


def as_integer(text: str) -> Optional[int]:
    cleaned = re.sub(r"[\s,_]", "", text)
    return int(cleaned) if re.fullmatch(r"[+-]?\d{1,40}", cleaned) else None


def code_blocks(reply: str) -> list[str]:
    return [b for b in _CODE.findall(reply) if b.strip()]


def draw_tir_task(rng: random.Random, split: str, index: int) -> dict:
    del split, index
    a, b = rng.randint(100, 9999), rng.randint(100, 9999)
    c = rng.randint(1, 999)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expression = f"{a} {op1} {b} {op2} {c}"
    return {"expression": expression, "answer": str(eval(expression)),  # our own digits only
            "prompt": f"Compute {expression}."}


class TirTasks(SeededTasks):
    def __init__(self, train_seed: int, eval_seed: int, train_size: int, eval_size: int):
        super().__init__("tir", draw_tir_task, train_seed, eval_seed, train_size, eval_size)


@register("tir")
class TirEnv(Env):
    name = "tir"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, sandbox: str = "bubblewrap", carry_state: bool = True,
                 max_output_chars: int = 400, wall_seconds: float = 5.0, memory_mb: int = 512,
                 pool_size: int = 2, train_seed: int = 1_000_000, eval_seed: int = 0,
                 train_size: int = 1_000_000, eval_size: int = 500):
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"sandbox={sandbox!r}; choose one of {SANDBOX_MODES}")
        self._tasks = TirTasks(train_seed, eval_seed, train_size, eval_size)
        self.sandbox = shared_sandbox(sandbox, wall_seconds, memory_mb, pool_size)
        self.carry_state, self.max_output_chars = bool(carry_state), int(max_output_chars)
        self._task: Optional[Task] = None
        self._kept: list[str] = []  # blocks that ran cleanly (carry_state)
        self._tool_calls = 0
        self._last_output: Optional[str] = None  # the teacher answers from it

    def tasks(self) -> TirTasks:
        return self._tasks

    def reset(self, task: Task) -> str:
        if "answer" not in task.data or "prompt" not in task.data:
            raise ValueError(f"tir task {task.task_id!r} needs 'prompt' and 'answer'; take "
                             "tasks from env.tasks().get(split, index)")
        self._task, self._kept, self._last_output, self._tool_calls = task, [], None, 0
        return task.data["prompt"]

    def step(self, action: str) -> StepResult:
        if self._task is None:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        action = action if isinstance(action, str) else str(action)
        answer = final_answer(action)
        if answer is not None:
            gold, self._task = self._task.data["answer"], None
            value = as_integer(answer)
            correct = value is not None and value == int(gold)
            info = {"success": correct, "gold": gold, "answer": answer,
                    "tool_calls": self._tool_calls}
            return StepResult("Correct." if correct else f"Not correct: the answer is {gold}.",
                              float(correct), True, info)
        blocks = code_blocks(action)
        if not blocks:
            return invalid_action("write a ```python block to run code, or give the answer "
                                  "as <answer>N</answer>")
        outputs = [self._run(block) for block in blocks]
        self._tool_calls += len(blocks)
        self._last_output = outputs[-1]
        observation = outputs[0] if len(outputs) == 1 else "\n".join(
            f"Output of block {i + 1}:\n{out}" for i, out in enumerate(outputs))
        return StepResult(observation, 0.0, False, {"tool_calls": len(blocks)})

    def _run(self, block: str) -> str:
        prior = ""
        if self.carry_state and self._kept:
            indented = "\n".join(f"exec({b!r}, globals())" for b in self._kept)
            prior = _SILENCED.format(blocks=indented)
        execution = self.sandbox.run(prior + block)
        if execution.status == "ok":
            self._kept.append(block)
            out = execution.stdout.strip() or "(no output: print the value you need)"
            return out[-self.max_output_chars:]
        tail = execution.stderr.strip()[-self.max_output_chars:]
        return f"Error ({execution.status}):\n{tail}" if tail else f"Error ({execution.status})"

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        """The teacher (module docstring), in the episode's current state."""
        expression = task.data["expression"]
        if self._last_output is not None:
            return f"<answer>{self._last_output.strip()}</answer>"
        if rng.random() < skill:
            return f"```python\nprint({expression})\n```"
        head = expression.rsplit(" ", 2)[0]  # drop the last term: a slip, never the answer
        return f"<answer>{eval(head)}</answer>"  # our own digits only
