"""Single-turn math answers over a user's JSONL, checked with math-verify.

    env = make("math", path="problems.jsonl")        # fields question/problem + answer/solution
    obs = env.reset(env.tasks().get("eval", 0))      # the problem text
    env.step("... so <answer>\\frac{1}{2}</answer>")  # reward 1.0 if equivalent to the reference

Why worker processes: math-verify bounds its parsing and comparison time with `signal.alarm`,
which only works in the main thread; from any other thread it refuses (ValueError) unless its
timeouts are turned off (`parsing_timeout=None`, `timeout_seconds=None`), and then it can hang:
`\\boxed{9^{9^{9^9}}}` never finishes. Env servers and rollout pools call `step` from worker
threads, so by default every check runs in a small pool of child processes (`IsolatedWorkers`)
where math-verify runs in *their* main thread with its own timeouts, and the parent kills a
child that overruns a hard deadline (a C-level loop that ignores signals, say); the pool is
`rl_tpu.env_serving.isolated`, shared with the reasoning-gym scorers.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Optional

from rl_tpu.core.env import Env, StepResult, Task, TaskSource, register
from rl_tpu.env_serving.isolated import IsolatedWorkers, WorkerError, shared_workers
from rl_tpu.optional import require

SYSTEM_PROMPT = """Solve the math problem. Reason step by step, then give only the final answer
inside <answer>...</answer>, in LaTeX where needed, e.g. <answer>\\frac{3}{4}</answer>.
Your reply is scored once: the episode ends after it."""

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# math-verify
# ---------------------------------------------------------------------------------------------


def _as_latex(text: str) -> str:
    """Bare LaTeX (`\\frac12`) parses only inside math delimiters; add them when missing."""
    return text if ("$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text) else f"${text}$"


def verify_answer(gold: str, prediction: str, timeout_s: Optional[int] = 5) -> bool:
    """math-verify's verdict on `prediction` against `gold` (both text). Call it from the main
    thread with a timeout, or anywhere with `timeout_s=None` at the risk of a hang."""
    require("math_verify", extra="envs", needed_by="the math env's answer check")
    from math_verify import parse, verify

    gold_parsed = parse(_as_latex(gold), parsing_timeout=timeout_s) or parse(gold, parsing_timeout=timeout_s)
    pred_parsed = (parse(_as_latex(prediction), parsing_timeout=timeout_s)
                   or parse(prediction, parsing_timeout=timeout_s))
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


class MathVerifier:
    """Thread-safe `verify(gold, prediction) -> bool`.

    isolate=True (default): every check runs in a worker process (see module docstring).
    isolate=False: checks from the main thread run in-process with math-verify's signal
    timeouts (faster, no child processes); checks from other threads still go to workers,
    since in-process they could only run without any timeout.
    """

    def __init__(self, timeout_s: int = 5, isolate: bool = True,
                 workers: Optional[IsolatedWorkers] = None):
        self.timeout_s, self.isolate = int(timeout_s), isolate
        self._workers = workers

    def verify(self, gold: str, prediction: str) -> bool:
        if not self.isolate and threading.current_thread() is threading.main_thread():
            return verify_answer(gold, prediction, self.timeout_s)
        workers = self._workers or shared_workers()
        # parse(gold), parse(pred) and verify each have timeout_s: allow all three, plus slack.
        return workers.call(verify_answer, gold, prediction, self.timeout_s,
                            timeout_s=3 * self.timeout_s + 5,
                            prepare=(verify_answer, ("1", "1", self.timeout_s)))


# ---------------------------------------------------------------------------------------------
# The env
# ---------------------------------------------------------------------------------------------


class MathTasks(TaskSource):
    """Rows of one JSONL split into train/eval by a hash of the question (stable when the file
    is reordered or grows), or two files when `eval_path` is given."""

    def __init__(self, train: list[Task], eval_: list[Task]):
        self._tasks = {"train": train, "eval": eval_}

    def size(self, split: str) -> int:
        self.check_split(split)
        return len(self._tasks[split])

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        return self._tasks[split][index]


def _read_rows(path: Path, question_field: Optional[str], answer_field: Optional[str]):
    if not path.exists():
        raise FileNotFoundError(f"math problems file {path} does not exist; pass path= a JSONL "
                                "file with one {\"question\": ..., \"answer\": ...} per line")
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no} is not valid JSON: {e}") from None
        q_field = question_field or next((f for f in ("question", "problem") if f in row), None)
        a_field = answer_field or next((f for f in ("answer", "solution") if f in row), None)
        if q_field not in row or a_field not in row:
            raise ValueError(f"{path}:{line_no} lacks a question or answer field (has "
                             f"{sorted(row)}); pass question_field= and answer_field=")
        rows.append((line_no, str(row[q_field]), str(row[a_field])))
    return rows


@register("math")
class MathEnv(Env):
    """One problem per episode; one reply, checked against the reference with math-verify."""

    name = "math"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, path: str, eval_path: Optional[str] = None,
                 question_field: Optional[str] = None,
                 answer_field: Optional[str] = None, eval_fraction: float = 0.1,
                 isolate: bool = True, timeout_s: int = 5, max_answer_chars: int = 2000):
        if not 0.0 <= eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
        path = Path(path)

        def tasks_of(p: Path, split: Optional[str]) -> list[Task]:
            return [Task(f"{p.stem}:{line_no}", {"question": q, "answer": a, "split": split})
                    for line_no, q, a in _read_rows(p, question_field, answer_field)]

        if eval_path is not None:
            train, eval_ = tasks_of(path, "train"), tasks_of(Path(eval_path), "eval")
        else:
            train, eval_ = [], []
            for task in tasks_of(path, None):
                # A hash of the text, not the line number: the split survives reordering.
                h = int.from_bytes(hashlib.sha256(task.data["question"].encode()).digest()[:8], "big")
                to_eval = h / 2**64 < eval_fraction
                task.data["split"] = "eval" if to_eval else "train"
                (eval_ if to_eval else train).append(task)
        self._tasks = MathTasks(train, eval_)
        self.verifier = MathVerifier(timeout_s=timeout_s, isolate=isolate)
        self.max_answer_chars = max_answer_chars
        self._task: Optional[Task] = None
        self._done = True

    def tasks(self) -> MathTasks:
        return self._tasks

    def reset(self, task: Task) -> str:
        if "question" not in task.data or "answer" not in task.data:
            raise ValueError(f"math task {task.task_id!r} needs 'question' and 'answer' in data")
        self._task, self._done = task, False
        return task.data["question"]

    def step(self, action: str) -> StepResult:
        if self._task is None or self._done:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        self._done = True  # single turn: whatever the reply, it is scored once
        action = action if isinstance(action, str) else str(action)
        tags = _ANSWER_TAG.findall(action)
        # Without the tag, fall back to math-verify's own extraction (\boxed{}, last formula).
        candidate = tags[-1].strip() if tags else action
        info = {"format_ok": bool(tags), "gold": self._task.data["answer"], "success": False}
        if not candidate.strip():
            return StepResult("No answer found: put the final answer in <answer>...</answer>.",
                              0.0, True, info)
        if len(candidate) > self.max_answer_chars:
            return StepResult(f"The answer is {len(candidate)} characters; the limit is "
                              f"{self.max_answer_chars}. Scored as wrong.", 0.0, True, info)
        try:
            correct = self.verifier.verify(self._task.data["answer"], candidate)
        except (TimeoutError, WorkerError) as e:
            info["verify_error"] = str(e)
            return StepResult("The answer could not be checked in time; scored as wrong.",
                              0.0, True, info)
        info["success"] = correct
        return StepResult("Correct." if correct else "Incorrect.", float(correct), True, info)
