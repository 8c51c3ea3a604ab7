"""Built-in tools cannot be made slow by their arguments, and a call stopped by its deadline is
an error the model reads while the episode goes on.

The calculator and search run in the env worker's own thread, which nothing can stop, so their
arguments are bounded: the table below runs in a child process (a regression there would hang
this process, not fail it) and each expression must end at once, as a tool error. The python
tool runs in a sandbox process that is killed at its wall limit."""

import json
import subprocess
import sys

import pytest

from rl_tpu.core.env import Env, StepResult, Task
from rl_tpu.sandbox import Limits, sandbox_unavailable_reason
from rl_tpu.tools import ToolCall, ToolEnv, ToolRegistry, python_tool, search_tool
from rl_tpu.tools.builtins import MAX_QUERY_CHARS

# (expression, what the error says): each argument of each operation past its bound
ADVERSARIAL = [
    ("round(5, -10**9)", "ndigits -1000000000 is out of range"),   # was 10**(10**9)
    ("round(10**100, -10**6)", "ndigits -1000000 is out of range"),
    ("round(1.5, 10**9)", "ndigits 1000000000 is out of range"),
    ("round(2.5, 0.5)", "ndigits must be an integer"),
    ("9 ** 9 ** 9", "the exponent 387420489 is too large"),
    ("2 ** 1000", "the result is too large"),                      # refused before it runs
    ("(10**100) ** 1000", "the result is too large"),
    ("(-7) ** 999", "the result is too large"),
    ("10**100 * 10**100 * 10**100", "the result is too large"),
    ("1" + "0" * 400, "too large"),                                 # a 401-digit literal
    ("-" * 300 + "1", "nests more than 100 levels"),
    ("(1+" * 120 + "1" + ")" * 120, "nests more than 100 levels"),
    ("+".join(["9"] * 200), "nests more than 100 levels"),
    ("abs(-" * 60 + "2" + ")" * 60, "nests more than 100 levels"),
    ("(" * 210 + "1" + ")" * 210, "not an arithmetic expression"),  # past the parser's limit
    ("1" * 501, "the most is 500"),
    ("max(" + ",".join(["1"] * 100) + ")", "max takes 1 to 64 arguments"),
    ("min()", "min takes 1 to 64 arguments"),
    ("sqrt(1, 2)", "sqrt takes 1 argument"),
    ("sqrt(-1)", "math domain error"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("1e308 * 10", "too large"),
    ("1 << 10**9", "BinOp is not allowed"),                         # no shifts
    ("factorial(10**6)", "unknown function 'factorial'"),           # no factorials
    ("int('9' * 5000)", "unknown function 'int'"),                  # no string-to-int
    ("[1] * 10**9", "List is not allowed"),
    ("1\x00", "not an arithmetic expression"),
    ("\ud800", "not an arithmetic expression"),
]

CHILD = """
import json, sys, time
from rl_tpu.tools import ToolCall, ToolRegistry, calculator_tool
registry = ToolRegistry([calculator_tool()])
out = []
for expression in json.loads(sys.stdin.read()):
    started = time.perf_counter()
    result = registry.execute(ToolCall("calculator", {"expression": expression}))
    out.append([result.ok, result.content, time.perf_counter() - started])
print(json.dumps(out))
"""


def test_every_calculator_argument_is_bounded():
    expressions = [e for e, _ in ADVERSARIAL] + ["round(2.567, 2)", "2 ** 332", "round(5, -1)"]
    child = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(expressions),
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    results = json.loads(child.stdout)
    for (expression, message), (ok, content, seconds) in zip(ADVERSARIAL, results):
        assert not ok and content.startswith("Error: 'calculator' failed: ValueError: ")
        assert message in content, (expression[:40], content)
        assert seconds < 1.0, (expression[:40], seconds)  # each takes well under a millisecond
    assert [content for _, content, _ in results[len(ADVERSARIAL):]] == [
        "2.57", str(2 ** 332), "0"]  # the bounds leave ordinary arithmetic alone


class Passages:
    def search(self, query, k):
        return [({"title": "T", "text": query[:20]}, 1.0)]


def test_a_search_query_is_bounded():
    registry = ToolRegistry([search_tool(Passages())])
    assert registry.execute(ToolCall("search", {"query": "x" * MAX_QUERY_CHARS})).ok
    long = registry.execute(ToolCall("search", {"query": "the " * 100_000}))
    assert not long.ok and f"the most is {MAX_QUERY_CHARS}" in long.content


class Question(Env):
    name = "question"
    system_prompt = "Answer."

    def reset(self, task):
        return "What is 6 * 7?"

    def step(self, action):
        return StepResult("ok", float(action == "42"), True, {"success": action == "42"})


@pytest.fixture(scope="module")
def sandbox_mode():
    return "bubblewrap" if sandbox_unavailable_reason() is None else "unsafe_no_isolation"


def test_a_python_call_past_its_deadline_is_stopped_and_the_episode_goes_on(sandbox_mode):
    limits = Limits(wall_seconds=1.0, cpu_seconds=30.0)
    env = ToolEnv(Question(), ToolRegistry([python_tool(sandbox_mode, limits, pool_size=1)]),
                  "hermes")
    env.reset(Task("t"))
    spin = json.dumps({"name": "python", "arguments": {
        "code": "print('started', flush=True)\nwhile True:\n    pass"}})
    result = env.step(f"<tool_call>{spin}</tool_call>")
    assert not result.done and result.info["tool_errors"] == 1
    [message] = result.info["observation_messages"]
    assert message["content"].startswith(
        "Error: 'python' failed: TimeoutError: the program ran past its wall-clock time limit "
        "and was stopped; what it wrote before:\nstarted")
    # the sandbox process is gone, not abandoned: the next call runs at once, and the answer
    # still scores
    again = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}'
                     "</tool_call>")
    assert again.info["observation_messages"][0]["content"] == "42"
    final = env.step("42")
    assert final.done and final.reward == 1.0
    env.close()
