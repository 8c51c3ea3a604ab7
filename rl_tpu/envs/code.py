"""`code`: the model writes a program; its reward is the fraction of hidden unit tests it passes.

    env = make("code")                          # generated functions of one integer (code_tasks)
    env = make("code", tasks="humaneval")       # HumanEval's 164 problems, eval split only
    obs = env.reset(env.tasks().get("eval", 0))
    env.step("def f(x):\\n    return x * 3 + 1")  # -> reward 0.75 when 3 of 4 tests pass

The program is the reply's last ```python (or bare ```) block, else the whole reply. All tests
of one candidate run in ONE sandbox execution (rl_tpu.sandbox): a harness script defines the
program, then runs each test and reports it on stdout as one line behind a random marker, so
what the program itself prints (redirected to stderr) never reads as a result; a test that
never reports (the program exited, hung, or blew a limit) counts as failed, and the tests
reported before it still count. `info` holds passed/tests, success (every test passed), the
sandbox's status and `error`: the first failing test's message (input, expected, got) or the
tail of its traceback.

The harness guards against a program's accidental output, not against a program written to
cheat: it runs in the same interpreter as the tests (as HumanEval's own harness does), so it
could read them. The sandbox bounds what it can do to the host, not to its own score.

Without a working sandbox the env refuses to start (SandboxUnavailable's message) unless
`sandbox="unsafe_no_isolation"` (a plain subprocess with rlimits) is named.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Optional

from rl_tpu.envs.base import Env, StepResult, Task, register

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
# The harness: one script runs the program and every test, reporting each behind a marker
# ---------------------------------------------------------------------------------------------

# The tests travel as JSON inside the script (no stdin: a program may read it). Each test is
# {"call": "f(3)", "expected": "7"} (the value of `call` must equal that of `expected`) or
# {"exec": "assert ...", "show": "..."} (statements that pass unless they raise).
_HARNESS = r'''
import io as _io, json as _json, signal as _signal, sys as _sys, traceback as _traceback
_report_to = _sys.stdout
_marker = %(marker)r
_tests = _json.loads(%(tests)r)
_test_seconds = %(test_seconds)r
def _report(record):
    _report_to.write(_marker + _json.dumps(record) + "\n")
    _report_to.flush()
def _tail(exc):  # the program's and the test's frames only, never the harness's
    frames = [f for f in _traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<")
              and f.filename != "<string>"]
    lines = _traceback.format_list(frames[-2:]) + _traceback.format_exception_only(type(exc), exc)
    return "".join(lines)[-%(tail_chars)d:]
def _alarm(signum, frame):
    raise TimeoutError("the test ran over %%.1f s" %% _test_seconds)
_sys.stdout = _sys.stderr  # the program's prints never mix with the reports
_namespace = {"__name__": "__main__"}
try:
    exec(compile(%(program)r, "<program>", "exec"), _namespace)
    exec(compile(%(setup)r, "<setup>", "exec"), _namespace)
except BaseException as exc:
    _report({"loaded": False, "error": _tail(exc)})
    raise SystemExit(0)
_report({"loaded": True})
_signal.signal(_signal.SIGALRM, _alarm)
for _i, _test in enumerate(_tests):
    _record = {"test": _i, "ok": False}
    _signal.setitimer(_signal.ITIMER_REAL, _test_seconds)
    try:
        if "call" in _test:
            _got = eval(_test["call"], _namespace)
            _expected = eval(_test["expected"], {})
            _record["ok"] = bool(type(_got) == type(_expected) and _got == _expected)
            _record["got"] = repr(_got)[:200]
        else:
            exec(compile(_test["exec"], "<test %%d>" %% _i, "exec"), _namespace)
            _record["ok"] = True
    except BaseException as exc:
        _record["error"] = _tail(exc)
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
    _report(_record)
'''


def harness_script(program: str, tests: list[dict], setup: str = "", marker: str = "",
                   test_seconds: float = 2.0, tail_chars: int = 400) -> str:
    """The script that runs `program`, then `setup`, then each test, reporting on stdout."""
    for test in tests:
        if not (("call" in test and "expected" in test) or "exec" in test):
            raise ValueError(f"a test is {{'call', 'expected'}} or {{'exec'}}; got {test!r}")
    return _HARNESS % {"marker": marker, "tests": json.dumps(tests), "program": program,
                       "setup": setup, "test_seconds": float(test_seconds),
                       "tail_chars": int(tail_chars)}


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
        return f"{shown}: no result (the program exited or ran out of time or memory first)"
    if "error" in record:
        return f"{shown} raised:\n{record['error'].rstrip()}"
    return f"{shown} returned {record.get('got')}, expected {test.get('expected')}"


def read_report(stdout: str, marker: str, tests: list[dict], status: str,
                stderr: str = "") -> TestReport:
    """Parses the harness's marked lines; tests with no line count as failed."""
    records, loaded = {}, None
    for line in stdout.splitlines():
        if not line.startswith(marker):
            continue
        try:
            record = json.loads(line[len(marker):])
        except json.JSONDecodeError:
            continue  # a line cut short by the output limit
        if "loaded" in record:
            loaded = record
        elif isinstance(record.get("test"), int):
            records[record["test"]] = record
    passed = [bool(records.get(i, {}).get("ok")) for i in range(len(tests))]
    if loaded is None or not loaded.get("loaded"):
        why = ((loaded or {}).get("error") or stderr[-400:]
               or f"it ended before any test ran (sandbox status {status})")
        return TestReport(passed, status, "The program failed to run:\n" + why.rstrip())
    first = next((i for i, ok in enumerate(passed) if not ok), None)
    if first is None:
        return TestReport(passed, status)
    error = describe_failure(tests[first], records.get(first))
    if first not in records and status != "ok":
        error += f" [sandbox: {status}]"
    return TestReport(passed, status, error, first)


# ---------------------------------------------------------------------------------------------
# Sandboxes, shared by every env of a process (a pool each; envs come and go per episode)
# ---------------------------------------------------------------------------------------------



def shared_sandbox(mode: str, wall_seconds: float, memory_mb: int, pool_size: int):
    """The process's sandbox for these settings (`rl_tpu.sandbox.shared_sandbox`); refuses a
    mode that does not work here (SandboxUnavailable, saying why) unless it is
    unsafe_no_isolation."""
    from rl_tpu.sandbox import Limits, SandboxUnavailable
    from rl_tpu.sandbox import shared_sandbox as process_sandbox

    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox={mode!r}; choose one of {SANDBOX_MODES}")
    limits = Limits(wall_seconds=wall_seconds, cpu_seconds=wall_seconds,
                    memory_bytes=int(memory_mb) * 2**20, processes=32,
                    output_bytes=64 * 1024, tmpfs_bytes=64 * 2**20)
    try:
        return process_sandbox(mode, limits, int(pool_size))
    except SandboxUnavailable as e:
        raise SandboxUnavailable(
            f"{e} (the code envs run model-written programs only in a sandbox; "
            "sandbox='unsafe_no_isolation' runs them as plain subprocesses with "
            "resource limits, on a machine you can lose)") from e


def run_tests(sandbox, program: str, tests: list[dict], setup: str = "",
              test_seconds: float = 2.0) -> TestReport:
    """Runs every test of `program` in one sandbox execution."""
    if not tests:
        raise ValueError("a task needs at least one test")
    marker = f"@@test-{secrets.token_hex(8)}@@"
    execution = sandbox.run(harness_script(program, tests, setup, marker, test_seconds))
    return read_report(execution.stdout, marker, tests, execution.status, execution.stderr)


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
        from rl_tpu.envs.code_tasks import make_task_source

        self._tasks = make_task_source(tasks, **task_kwargs)
        self.task_family = tasks
        self.sandbox = shared_sandbox(sandbox, wall_seconds, memory_mb, pool_size)
        self.test_seconds, self.max_program_chars = float(test_seconds), int(max_program_chars)
        self._task: Optional[Task] = None

    def tasks(self):
        return self._tasks

    def teacher_reply(self, task: Task, rng, skill: float) -> str:
        """The task family's imperfect teacher (code_tasks), for SFT demonstrations."""
        from rl_tpu.envs.code_tasks import teacher_program

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
        full = assemble(prefix, program, self._task.data.get("entry_point", ""))
        report = run_tests(self.sandbox, full, tests, setup, self.test_seconds)
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
