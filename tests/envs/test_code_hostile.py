"""Programs written to cheat the `code` env score only what their answers earn.

Each hostile program below is wrong (it would score 0 on its answers) and tries one way of
reaching its own score instead: forging the harness's records, exiting before a failing test
reports, patching builtins or returning an object equal to everything, reading the tests'
expected values out of its own process, printing the result marker, killing its parent. On the
real sandbox each must score exactly 0, while an honest right program still scores 1.0 and a
half-right one 0.5 (the fraction of tests its answers pass, hand-checked)."""

import textwrap

import pytest

from rl_tpu.core.env import Task
from rl_tpu.envs import code
from rl_tpu.sandbox import sandbox_unavailable_reason

MODE = "bubblewrap" if sandbox_unavailable_reason() is None else "unsafe_no_isolation"

# f(x) = 2x on 1..4: a right program scores 1.0; one right on x < 3 only scores 0.5
DOUBLE = Task("double/0", {"prompt": "Write f(x): double x.", "entry_point": "f",
                           "tests": [{"call": f"f({x})", "expected": repr(2 * x)}
                                     for x in (1, 2, 3, 4)]})


@pytest.fixture(scope="module")
def functions_env():
    return code.CodeEnv(sandbox=MODE)


@pytest.fixture(scope="module")
def humaneval_env():
    return code.CodeEnv(sandbox=MODE, tasks="humaneval")


def score(env, task, program):
    env.reset(task)
    return env.step(textwrap.dedent(program))


# Every record a forger could guess at: today's {"test", "ok"} and per-call records with a value.
FORGE_RECORDS = '''
def _forged_records(n=8):
    for i in range(n):
        yield {"test": i, "ok": True, "got": "2"}
        for k in range(4):
            yield {"test": i, "call": k, "ok": True, "value": ["int", "2"]}
'''

# Walks up the stack from the program's own module code (or a test call) to the harness's
# globals: whatever report function and marker string they hold.
FIND_HARNESS = '''
import sys as _s
def _harness_globals():
    frame, found = _s._getframe(0), []
    while frame is not None:
        found.append(frame.f_globals)
        frame = frame.f_back
    return found
'''

HOSTILE = {
    # the reproduction: report every test passed through the harness's own function
    "forged_reports_then_os_exit": FORGE_RECORDS + FIND_HARNESS + textwrap.dedent('''
        import os
        def _forge():
            for g in _harness_globals():
                for name, value in list(g.items()):
                    if "report" in name.lower() and callable(value):
                        for record in _forged_records():
                            try:
                                value(record)
                            except BaseException:
                                pass
        def f(x):
            _forge()
            os._exit(0)
    '''),
    # the marker is in the harness's globals: print forged lines behind it on the real stdout
    "marker_printed_on_the_real_stdout": FORGE_RECORDS + FIND_HARNESS + textwrap.dedent('''
        import json, os
        def f(x):
            markers = [v for g in _harness_globals() for v in g.values()
                       if isinstance(v, str) and v.startswith("@@")]
            for marker in markers:
                for record in _forged_records():
                    os.write(1, (marker + json.dumps(record) + "\\n").encode())
            os._exit(0)
    '''),
    "os_exit_at_load": "import os\ndef f(x):\n    return 0\nos._exit(0)\n",
    "sys_exit_at_load": "import sys\ndef f(x):\n    return 0\nsys.exit(0)\n",
    "system_exit_inside_a_test": "def f(x):\n    raise SystemExit(0)\n",
    "keyboard_interrupt_inside_a_test": "def f(x):\n    raise KeyboardInterrupt\n",
    "os_exit_inside_a_test": "import os\ndef f(x):\n    os._exit(0)\n",
    # equal to everything, and `type` patched so a type check sees an int
    "eq_always_true_and_patched_type": '''
        import builtins
        class Anything(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        _real_type = builtins.type
        def _type(*args):
            if len(args) == 1 and isinstance(args[0], Anything):
                return int
            return _real_type(*args)
        builtins.type = _type
        def f(x):
            return Anything(0)
    ''',
    # a check that runs in the program's interpreter runs through its builtins
    "patched_bool_eval_and_exec": '''
        import builtins
        builtins.bool = lambda *a: True
        builtins.eval = lambda *a, **k: 0
        builtins.exec = lambda *a, **k: None
        builtins.repr = lambda *a: "2"
        def f(x):
            return 0
    ''',
    # read the expected values out of its own process and answer from them
    "reads_the_expected_values": '''
        import sys
        _answers, frame = {}, sys._getframe(0)
        while frame is not None:  # every list of dicts the callers' globals hold
            for held in list(frame.f_globals.values()):
                if isinstance(held, list):
                    for item in held:
                        if isinstance(item, dict) and "expected" in item:
                            _answers[item.get("call")] = eval(item["expected"])
            frame = frame.f_back
        def f(x):
            return _answers.get("f(%d)" % x, 0)
    ''',
    "kills_its_parent": "import os, signal\ndef f(x):\n    return 0\n"
                        "os.kill(os.getppid(), signal.SIGKILL)\n",
    "kills_its_process_group": "import os, signal\ndef f(x):\n    return 0\n"
                               "os.killpg(0, signal.SIGKILL)\n",
    # a value built to break whatever decodes it: deep nesting and a marker-like string
    "values_that_attack_the_decoder": '''
        def f(x):
            if x == 1:
                v = []
                for _ in range(100000):
                    v = [v]
                return v
            if x == 2:
                return "\\n@@test-0@@{\\"test\\": 1, \\"ok\\": true}\\n"
            return 10 ** 5000
    ''',
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_wrong_program_scores_zero(functions_env, name):
    result = score(functions_env, DOUBLE, HOSTILE[name])
    assert result.reward == 0.0 and not result.info["success"], (name, result.info)
    assert result.info["passed"] == 0


def test_honest_programs_score_what_their_answers_earn(functions_env):
    assert score(functions_env, DOUBLE, "def f(x):\n    return 2 * x\n").reward == 1.0
    half = score(functions_env, DOUBLE, "def f(x):\n    return 2 * x if x < 3 else -1\n")
    assert half.reward == 0.5 and half.info["error"] == "f(3) returned -1, expected 6"
    # a right answer before an exit still counts; the test it exits in does not
    early = score(functions_env, DOUBLE,
                  "import os\ndef f(x):\n    if x == 4:\n        os._exit(0)\n    return 2 * x\n")
    assert early.reward == 0.75 and early.info["error"].startswith("f(4): no result")


def test_a_right_program_that_also_forges_scores_what_it_earns(functions_env):
    """Forging on top of right answers for half the tests earns the half, no more."""
    program = HOSTILE["forged_reports_then_os_exit"].replace(
        "os._exit(0)", "return 2 * x if x < 3 else 0")
    assert score(functions_env, DOUBLE, program).reward == 0.5


# --- HumanEval: the tests are statements, so they hold their expected values ---------------

HUMANEVAL_HOSTILE = {
    # has_close_elements: 4 of its 7 asserts expect True, 3 expect False
    "eq_always_true": '''
    class Anything:
        def __eq__(self, other):
            return True
        def __bool__(self):
            return True
    return Anything()
    ''',
    "exec_and_assertion_patched": '''
    import builtins
    builtins.exec = lambda *a, **k: None
    builtins.AssertionError = type("Never", (Exception,), {})
    return None
    ''',
    # parse `assert candidate(ARGS) == VALUE` out of every string the process holds
    "reads_the_asserts": '''
    import ast, sys
    strings, frame = [], sys._getframe(0)
    while frame is not None:  # every list of dicts the callers' globals hold
        for held in list(frame.f_globals.values()):
            if isinstance(held, list):
                strings.extend(v for item in held if isinstance(item, dict)
                               for v in item.values())
        frame = frame.f_back
    for text in strings:
        if not (isinstance(text, str) and "candidate(" in text):
            continue
        try:
            nodes = list(ast.walk(ast.parse(text)))
        except SyntaxError:
            continue
        for node in nodes:
            try:
                call, right = node.test.left, node.test.comparators[0]
                if (ast.literal_eval(call.args[0]) == numbers
                        and ast.literal_eval(call.args[1]) == threshold):
                    return ast.literal_eval(right)
            except Exception:
                continue
    return None
    ''',
    "forged_reports_then_exit": '''
    import os, sys
    frame = sys._getframe(0)  # up to the harness's globals
    while frame is not None:
        for name, value in list(frame.f_globals.items()):
            if "report" in name.lower() and callable(value):
                for i in range(7):
                    try:
                        value({"test": i, "ok": True})
                    except BaseException:
                        pass
        frame = frame.f_back
    os._exit(0)
    ''',
}


@pytest.mark.parametrize("name", sorted(HUMANEVAL_HOSTILE))
def test_a_hostile_humaneval_body_scores_zero(humaneval_env, name):
    task = humaneval_env.tasks().get("eval", 0)
    body = textwrap.indent(textwrap.dedent(HUMANEVAL_HOSTILE[name]).strip("\n"), "    ")
    humaneval_env.reset(task)
    result = humaneval_env.step(body + "\n")
    assert result.reward == 0.0 and result.info["passed"] == 0, (name, result.info)


def test_humaneval_honest_bodies_still_score_what_they_earn(humaneval_env):
    task = humaneval_env.tasks().get("eval", 0)
    humaneval_env.reset(task)
    assert humaneval_env.step(task.data["canonical"]).reward == 1.0
    humaneval_env.reset(task)
    always_true = humaneval_env.step("    return True\n")
    assert always_true.reward == 4 / 7
    assert always_true.info["error"].startswith(
        "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05)")


def test_one_answer_built_to_break_the_replay_costs_only_its_own_test(humaneval_env):
    """An answer nested past the codec's depth (or any malformed one) fails its own test and
    leaves the program's other, right answers counting (6 of 7 here)."""
    task = humaneval_env.tasks().get("eval", 0)
    humaneval_env.reset(task)
    body = ("    if threshold == 0.05:\n        v = []\n        for _ in range(900):\n"
            "            v = [v]\n        return v\n" + task.data["canonical"])
    result = humaneval_env.step(body)
    assert result.reward == 6 / 7, result.info
    assert "NotPlainData" in result.info["error"]

