"""`code`: the model writes a program; its reward is the fraction of hidden unit tests it passes.

    env = make("code")                          # generated functions of one integer (code_tasks)
    env = make("code", tasks="humaneval")       # HumanEval's 164 problems, eval split only
    obs = env.reset(env.tasks().get("eval", 0))
    env.step("def f(x):\\n    return x * 3 + 1")  # -> reward 0.75 when 3 of 4 tests pass

The program is the reply's last ```python (or bare ```) block, else the whole reply. The
program never judges itself (rl_tpu/envs/code_verdict.py says how, and why that holds): one
sandbox execution runs it and asks it each call the tests make (`f(3)`, or the arguments a
HumanEval assert passes), and it answers with plain data (rl_tpu/envs/plain_data.py); the
expected values never enter its process. A `call` test is compared here; a HumanEval test runs
its own statements on the decoded answers in a second, fresh sandbox the program never ran
in. So forging the harness's records, exiting early, patching builtins or returning an object
equal to everything earns nothing; a test the program did not answer (it exited, hung, or blew
a limit) counts as failed, and the tests it answered before still count. `info` holds
passed/tests, success (every test passed), the sandbox's status and `error`: the first failing
test's message (input, expected, got) or the tail of its traceback.

Without a working sandbox the env refuses to start (SandboxUnavailable's message) unless
`sandbox="unsafe_no_isolation"` (a plain subprocess with rlimits) is named.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Optional

from rl_tpu.core.env import Env, StepResult, Task, register
from rl_tpu.envs import code_verdict
from rl_tpu.envs.code_tasks import make_task_source, teacher_program
from rl_tpu.sandbox import Limits, SandboxUnavailable, sandbox_unavailable_reason
from rl_tpu.sandbox import shared_sandbox as process_sandbox

SYSTEM_PROMPT = ("Write the Python function the task asks for. Reply with the code only, e.g.\n"
                 "def f(x):\n    return x + 1")
SANDBOX_MODES = ("bubblewrap", "unsafe_no_isolation")

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_program(reply: str) -> str:
    """The program in a reply: its last fenced block (```python or bare ```; an unclosed last
    fence runs to the end of the reply), else the whole reply."""
    reply = reply if isinstance(reply, str) else str(reply)
    blocks = _FENCE.findall(reply)
    return (blocks[-1] if blocks else reply).strip("\n")


# ---------------------------------------------------------------------------------------------
# The verdict: the program answers calls with plain data; the tests run elsewhere (code_verdict)
# ---------------------------------------------------------------------------------------------


def check_tests(tests: list[dict]) -> None:
    """Each test is {"call": "f(3)", "expected": "7"} (the call's value must equal the literal,
    exact type included) or {"exec": "assert ...", "show": "..."} (statements that pass unless
    they raise)."""
    for test in tests:
        if "call" in test and "expected" in test:
            try:
                ast.literal_eval(test["expected"])
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise ValueError(f"a call test's expected value must be a Python literal; got "
                                 f"{test['expected']!r}") from None
        elif "exec" not in test:
            raise ValueError(f"a test is {{'call', 'expected'}} or {{'exec'}}; got {test!r}")


@dataclasses.dataclass
class TestReport:
    """What one candidate's execution showed: which tests passed, and why the first failed."""

    passed: list[bool]
    status: str  # the sandbox's: ok | error | timeout | cpu_limit | memory_limit | ...
    error: str = ""  # the first failure's message ("" when every test passed)
    failed_test: Optional[int] = None  # its index (None: the program did not load, or none)

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @property
    def success(self) -> bool:
        return bool(self.passed) and all(self.passed)


def describe_failure(test: dict, record: Optional[dict]) -> str:
    """One failing test in words: `f(3) returned 9, expected 7` or the statement and the tail
    of its traceback."""
    shown = test.get("call") or test.get("show") or test.get("exec", "")
    if record is None:
        return f"{shown}: {code_verdict.NO_RESULT}"
    if "error" in record:
        return f"{shown} raised:\n{record['error'].rstrip()}"
    return f"{shown} returned {record.get('got')}, expected {test.get('expected')}"


# ---------------------------------------------------------------------------------------------
# Sandboxes, shared by every env of a process (a pool each; envs come and go per episode)
# ---------------------------------------------------------------------------------------------



def shared_sandbox(mode: str, wall_seconds: float, memory_mb: int, pool_size: int):
    """The process's sandbox for these settings (`rl_tpu.sandbox.shared_sandbox`); refuses a
    mode that does not work here (SandboxUnavailable, saying why) unless it is
    unsafe_no_isolation."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox={mode!r}; choose one of {SANDBOX_MODES}")
    reason = sandbox_unavailable_reason() if mode == "bubblewrap" else None
    if reason:  # checked here to name the env kwarg (the sandbox's own hint is its Python API)
        raise SandboxUnavailable(sandbox_missing_message(reason))
    limits = Limits(wall_seconds=wall_seconds, cpu_seconds=wall_seconds,
                    memory_bytes=int(memory_mb) * 2**20,
                    output_bytes=64 * 1024, tmpfs_bytes=64 * 2**20)
    try:
        return process_sandbox(mode, limits, int(pool_size))
    except SandboxUnavailable as e:  # found unworkable after the check (a failed start)
        raise SandboxUnavailable(sandbox_missing_message(str(e))) from e


def sandbox_missing_message(reason: str) -> str:
    """One line (a launcher prints it as the run's last): why there is no sandbox, how to get
    one, and the override that runs without one and what that risks."""
    return (f"the bubblewrap sandbox the code envs run model-written programs in cannot run "
            f"here: {reason}. Install bubblewrap (apt-get install bubblewrap) on a kernel that "
            f"allows unprivileged user namespaces, or give the env sandbox=unsafe_no_isolation "
            f"(on the command line: --config.env.kwargs.sandbox=unsafe_no_isolation), which "
            f"is unsafe: the programs then run as plain subprocesses under resource limits "
            f"only, able to read and write this machine's files and reach its network; use it "
            f"only on a machine you can lose")


def run_tests(sandbox, program: str, tests: list[dict], setup: str = "",
              test_seconds: float = 2.0, entry_point: str = "", reference: str = "",
              helpers: str = "") -> TestReport:
    """Scores `program` on `tests` (code_verdict says how, and why the program cannot reach
    the verdict): one sandbox run of the program, plus a replay run when a test is an `exec`
    one. Those need `entry_point` (the function the tests call as `candidate`), `reference`
    (a program that passes them; their calls are recorded from it) and `helpers` (the prompt's
    code the tests may use, without a solution)."""
    if not tests:
        raise ValueError("a task needs at least one test")
    check_tests(tests)
    sources = [t["exec"] for t in tests if "call" not in t]
    if sources and not (entry_point and reference):
        raise ValueError("exec tests need the task's entry_point and a reference solution "
                         "(their calls are recorded from it)")
    asked = iter(code_verdict.reference_calls(sandbox, reference, setup, sources, entry_point,
                                              test_seconds) if sources else [])
    calls = [[{"expression": t["call"]}] if "call" in t else next(asked) for t in tests]
    answers, execution = code_verdict.ask(sandbox, program, calls, entry_point, test_seconds)
    status = execution.status
    if not answers.loaded:
        why = (answers.load_error or execution.stderr[-400:]
               or f"it ended before any test ran (sandbox status {status})")
        return TestReport([False] * len(tests), status,
                          "The program failed to run:\n" + why.rstrip())
    exec_index = [i for i, t in enumerate(tests) if "call" not in t]
    replayed = {}
    if exec_index:
        verdicts = code_verdict.replay(sandbox, helpers, setup, sources, entry_point,
                                       [calls[i] for i in exec_index],
                                       [answers.per_test[i] for i in exec_index], test_seconds)
        replayed = {i: verdicts.get(j) for j, i in enumerate(exec_index)}
    records = {}
    for i, test in enumerate(tests):
        if "call" in test:
            records[i] = code_verdict.judge_call(
                answers.per_test[i][0] if answers.per_test[i] else None, test["expected"])
        else:
            record = replayed.get(i)
            records[i] = None if record is None or record.get("no_result") else record
    passed = [bool(records[i] and records[i].get("ok")) for i in range(len(tests))]
    first = next((i for i, ok in enumerate(passed) if not ok), None)
    if first is None:
        return TestReport(passed, status)
    error = describe_failure(tests[first], records[first])
    if records[first] is None and status != "ok":
        error += f" [sandbox: {status}]"
    return TestReport(passed, status, error, first)


# ---------------------------------------------------------------------------------------------
# The env
# ---------------------------------------------------------------------------------------------


def task_tests(task: Task) -> tuple[str, list[dict], str]:
    """(program prefix, tests, setup) of a task: a HumanEval task's prompt goes before the
    reply, so a reply that is only the function body completes it."""
    data = task.data
    if "tests" not in data:
        raise ValueError(f"code task {task.task_id!r} has no 'tests'; take tasks from "
                         "env.tasks().get(split, index)")
    return data.get("program_prefix", ""), data["tests"], data.get("setup", "")


def assemble(prefix: str, program: str, entry_point: str = "") -> str:
    """The program to run: a reply that defines `entry_point` itself follows the prompt (its
    imports and helpers stay, the new definition wins); a bare body completes the prompt."""
    if not prefix:
        return program
    if entry_point and re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", program, re.M):
        return prefix.rstrip() + "\n    pass\n\n" + program + "\n"
    return prefix + program + "\n"


class CodeEnvBase(Env):
    """Shared by the single-turn env and the repair env: tasks, the sandbox, one verdict."""

    system_prompt = SYSTEM_PROMPT

    def __init__(self, tasks: str = "functions", sandbox: str = "bubblewrap",
                 wall_seconds: float = 5.0, test_seconds: float = 2.0, memory_mb: int = 512,
                 pool_size: int = 2, max_program_chars: int = 8000, **task_kwargs):
        self._tasks = make_task_source(tasks, **task_kwargs)
        self.task_family = tasks
        self.sandbox = shared_sandbox(sandbox, wall_seconds, memory_mb, pool_size)
        self.test_seconds, self.max_program_chars = float(test_seconds), int(max_program_chars)
        self._task: Optional[Task] = None

    def tasks(self):
        return self._tasks

    def teacher_reply(self, task: Task, rng, skill: float) -> str:
        """The task family's imperfect teacher (code_tasks), for SFT demonstrations."""
        return teacher_program(task, rng, skill)

    def reset(self, task: Task) -> str:
        task_tests(task)  # a clear error for a task without tests
        self._task = task
        return task.data["prompt"]

    def check(self, reply: str) -> tuple[TestReport, dict]:
        """Runs the reply's program against the task's tests: (report, info)."""
        prefix, tests, setup = task_tests(self._task)
        program = extract_program(reply)
        info = {"tests": len(tests), "passed": 0, "success": False, "status": "", "error": ""}
        if not program.strip():
            info["error"] = "The reply holds no program."
            return TestReport([False] * len(tests), "no_program", info["error"]), info
        if len(program) > self.max_program_chars:
            info["error"] = (f"The program is {len(program)} characters; the limit is "
                             f"{self.max_program_chars}.")
            return TestReport([False] * len(tests), "too_long", info["error"]), info
        entry, canonical = self._task.data.get("entry_point", ""), self._task.data.get("canonical")
        full = assemble(prefix, program, entry)
        report = run_tests(self.sandbox, full, tests, setup, self.test_seconds, entry,
                           reference=assemble(prefix, canonical, entry) if canonical else "",
                           helpers=assemble(prefix, "    pass") if prefix else "")
        info.update(passed=sum(report.passed), success=report.success, status=report.status,
                    error=report.error)
        return report, info


def verdict(report: TestReport, info: dict) -> str:
    text = f"Passed {info['passed']} of {info['tests']} tests."
    return text if report.success else f"{text}\n{info['error']}"


@register("code")
class CodeEnv(CodeEnvBase):
    """One problem, one program, scored once by the fraction of its tests that pass."""

    name = "code"

    def __init__(self, tasks: str = "functions", sandbox: str = "bubblewrap",
                 wall_seconds: float = 5.0, test_seconds: float = 2.0, memory_mb: int = 512,
                 pool_size: int = 2, max_program_chars: int = 8000, train_seed: int = 1_000_000,
                 eval_seed: int = 0, train_size: int = 1_000_000, eval_size: int = 500):
        super().__init__(tasks, sandbox, wall_seconds, test_seconds, memory_mb, pool_size,
                         max_program_chars, train_seed=train_seed, eval_seed=eval_seed,
                         train_size=train_size, eval_size=eval_size)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        report, info = self.check(action)
        self._task = None
        return StepResult(verdict(report, info), report.fraction, True, info)
