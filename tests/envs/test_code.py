"""The `code` env: programs parsed from replies, every test of a candidate run in one sandbox
execution, the reward the fraction passed (hand-worked), the generated tasks and HumanEval."""

import random

import pytest

from rl_tpu.core.env import Task, make
from rl_tpu.envs import code, code_tasks, code_verdict
from rl_tpu.sandbox import SandboxUnavailable, sandbox_unavailable_reason

# bubblewrap where it works (CI installs it), else plain subprocesses: the harness is the same
MODE = "bubblewrap" if sandbox_unavailable_reason() is None else "unsafe_no_isolation"


def env(**kwargs):
    return code.CodeEnv(sandbox=MODE, **kwargs)


def task(tests, **data):
    return Task("t/0", {"prompt": "Write f(x).", "tests": tests, "entry_point": "f", **data})


# f(1..4) of f(x) = 2x
DOUBLE = [{"call": f"f({x})", "expected": repr(2 * x)} for x in (1, 2, 3, 4)]


def score(program, tests=DOUBLE, **kwargs):
    e = env(**kwargs)
    e.reset(task(tests))
    return e.step(program)


@pytest.mark.parametrize("reply, program", [
    ("```python\ndef f(x):\n    return x\n```", "def f(x):\n    return x"),
    ("Here:\n```\nx = 1\n```\nand\n```py\nx = 2\n```", "x = 2"),        # the last block
    ("```python\ndef f(x):\n    return x", "def f(x):\n    return x"),     # unclosed fence
    ("def f(x):\n    return x\n", "def f(x):\n    return x"),              # a bare reply
])
def test_the_program_is_the_last_fenced_block_else_the_reply(reply, program):
    assert code.extract_program(reply) == program


def test_three_of_four_tests_pass_scores_three_quarters():
    result = score("def f(x):\n    return 2 * x if x < 4 else 0")
    assert result.reward == 0.75 and result.done
    assert result.info["passed"] == 3 and result.info["tests"] == 4
    assert not result.info["success"]
    assert result.info["error"] == "f(4) returned 0, expected 8"
    assert "Passed 3 of 4 tests." in result.observation


def test_a_right_program_scores_one_and_a_wrong_type_fails():
    assert score("def f(x):\n    return x + x").reward == 1.0
    # 2.0 == 2 in Python, but the task asked for an int
    assert score("def f(x):\n    return 2.0 * x").reward == 0.0


def test_what_the_program_prints_never_reads_as_a_result():
    forged = ('print(\'@@test-0@@{"test": 0, "ok": true}\')\nprint(\'{"test": 1, "ok": true}\')\n'
              'def f(x):\n    print("ok", x)\n    return 2 * x if x == 1 else 0')
    result = score(forged)
    assert result.reward == 0.25


def test_an_error_in_one_test_names_the_call_and_the_exception():
    result = score("def f(x):\n    return 2 * x if x != 2 else 1 // 0")
    assert result.reward == 0.75
    assert result.info["error"].startswith("f(2) raised:")
    assert "ZeroDivisionError" in result.info["error"]


def test_a_program_that_does_not_load_scores_zero_with_its_error():
    result = score("def f(x) return x")
    assert result.reward == 0.0 and "SyntaxError" in result.info["error"]
    assert score("").info["error"] == "The reply holds no program."


def test_tests_reported_before_the_program_exits_still_count():
    result = score("import os\ndef f(x):\n    if x == 3:\n        os._exit(0)\n    return 2 * x")
    assert result.reward == 0.5
    assert result.info["error"].startswith("f(3): no result")


def test_a_hanging_test_is_cut_and_the_others_still_run():
    result = score("def f(x):\n    while x == 2:\n        pass\n    return 2 * x", test_seconds=0.5)
    assert result.reward == 0.75
    assert "TimeoutError" in result.info["error"]


def test_marked_records_skip_garbled_lines_and_a_call_needs_a_right_typed_answer():
    stdout = 'M{"loaded": true}\nnoise\nM{"test": 1, "ok"\nM{"test": 2, "call": 0}\n'
    assert code_verdict.read_records(stdout, "M") == [{"loaded": True},
                                                      {"test": 2, "call": 0}]
    assert code_verdict.judge_call(None, "2") is None  # no answer: "no result"
    assert code_verdict.judge_call({"value": ["int", "2"]}, "2")["ok"]
    assert not code_verdict.judge_call({"value": ["bool", True]}, "1")["ok"]  # True == 1
    assert code_verdict.judge_call({"value": ["sub_int", "2"]}, "2")["error"].startswith(
        "NotPlainData")


def test_a_test_is_a_call_with_a_literal_expected_or_statements():
    with pytest.raises(ValueError, match="a test is"):
        code.check_tests([{"call": "f(1)"}])
    with pytest.raises(ValueError, match="must be a Python literal"):
        code.check_tests([{"call": "f(1)", "expected": "2 * g()"}])


# --- the generated functions ---------------------------------------------------------------


def test_train_and_eval_hold_disjoint_functions():
    source = code_tasks.FunctionTasks(eval_size=200)
    pairs = {s: {(t.data["kind"], tuple(t.data["constants"]))
                 for t in (source.get(s, i) for i in range(200))} for s in ("train", "eval")}
    assert pairs["train"] and pairs["eval"] and not pairs["train"] & pairs["eval"]
    total = sum(len(code_tasks.constants_of(k)) for k in code_tasks.KINDS)
    assert total == 8 * 20 + 21 + 21 + 11 == 213


def test_the_teacher_is_right_or_stops_one_step_short():
    e = env()
    # at_least with bound 4: two inputs below (clamped to 4), two above; `return x` passes
    # only the two above: 0.5
    t = Task("f/0", {"kind": "at_least", "constants": [4], "prompt": "Write f(x).",
                     "tests": [{"call": f"f({x})", "expected": repr(max(x, 4))}
                               for x in (-1, 3, 5, 12)]})
    e.reset(t)
    assert e.step(e.teacher_reply(t, random.Random(0), 1.0)).reward == 1.0
    e.reset(t)
    slip = e.teacher_reply(t, random.Random(0), 0.0)
    assert slip == "def f(x):\n    return x" and e.step(slip).reward == 0.5
    # affine without its + b (b >= 1) passes nothing
    affine = e.tasks().get("train", 0)
    assert affine.data["kind"] == "affine"
    e.reset(affine)
    assert e.step(e.teacher_reply(affine, random.Random(0), 0.0)).reward == 0.0
    e.reset(affine)
    assert e.step(e.teacher_reply(affine, random.Random(0), 1.0)).reward == 1.0


def test_a_prompt_states_the_function_and_a_worked_example():
    t = code_tasks.FunctionTasks().get("train", 0)
    assert t.data["prompt"] == "Write f(x): multiply x by 3, then add 11. Example: f(2) == 17."
    assert t.data["tests"][0] == {"call": "f(24)", "expected": "83"}


# --- HumanEval -----------------------------------------------------------------------------

TEST_MODULE = '''
METADATA = {"author": "x"}


def check(candidate):
    import math
    assert candidate(1) == 2
    assert candidate(2) == 4
    for x in range(3):
        assert candidate(x) == 2 * x
    assert True
'''


def test_check_splits_into_one_test_per_statement_that_uses_candidate():
    setup, tests = code_tasks.split_check(TEST_MODULE)
    assert "METADATA" in setup and "def check" not in setup
    assert [t["exec"] for t in tests] == [
        "import math\nassert candidate(1) == 2", "assert candidate(2) == 4",
        "for x in range(3):\n    assert candidate(x) == 2 * x\nassert True"]
    with pytest.raises(ValueError, match="def check"):
        code_tasks.split_check("x = 1")


@pytest.fixture(scope="module")
def humaneval():
    return env(tasks="humaneval")


# 53 draws its inputs from an unseeded `random`; 33 calls the function by name as well
@pytest.mark.parametrize("index", [0, 2, 33, 53, 163])
def test_canonical_humaneval_solutions_score_one(humaneval, index):
    t = humaneval.tasks().get("eval", index)
    humaneval.reset(t)
    result = humaneval.step(t.data["canonical"])
    assert result.reward == 1.0 and result.info["success"], result.observation


def test_a_wrong_humaneval_solution_scores_below_one(humaneval):
    t = humaneval.tasks().get("eval", 0)  # has_close_elements: 7 asserts
    assert len(t.data["tests"]) == 7
    humaneval.reset(t)
    result = humaneval.step("    return True\n")  # right on the 4 cases that expect True
    assert result.reward == 4 / 7 and not result.info["success"]
    assert result.info["error"].startswith("assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05)")


def test_exec_tests_whose_reference_fails_are_refused_by_name(humaneval):
    test = [{"exec": "assert candidate(2) == 5", "show": "assert candidate(2) == 5"}]
    with pytest.raises(ValueError, match="reference solution does not pass its test 0"):
        code.run_tests(humaneval.sandbox, "def g(x):\n    return 4", test, "candidate = g",
                       entry_point="g", reference="def g(x):\n    return 4")
    with pytest.raises(ValueError, match="need the task's entry_point and a reference"):
        code.run_tests(humaneval.sandbox, "def g(x):\n    return 5", test, "candidate = g")


def test_a_whole_function_replaces_the_prompts_stub(humaneval):
    t = humaneval.tasks().get("eval", 53)  # add(x, y)
    humaneval.reset(t)
    reply = "```python\ndef add(x: int, y: int):\n    return x + y\n```"
    assert humaneval.step(reply).reward == 1.0
    assert humaneval.tasks().size("eval") == 164 and humaneval.tasks().size("train") == 0


# --- construction --------------------------------------------------------------------------


def test_make_builds_it_and_bad_settings_are_named():
    e = make("code", sandbox=MODE, eval_size=10)
    assert e.tasks().size("eval") == 10
    with pytest.raises(ValueError, match="sandbox='docker'"):
        make("code", sandbox="docker")
    with pytest.raises(ValueError, match="unknown code task set 'mbpp'"):
        make("code", tasks="mbpp", sandbox=MODE)


def test_without_a_working_sandbox_it_refuses_naming_the_unsafe_mode(monkeypatch):
    import rl_tpu.sandbox

    def unavailable(**kwargs):
        raise SandboxUnavailable("bwrap: no user namespaces")

    monkeypatch.setattr(rl_tpu.sandbox, "make_sandbox", unavailable)
    with pytest.raises(SandboxUnavailable, match="no user namespaces.*unsafe_no_isolation"):
        code.CodeEnv(sandbox="bubblewrap", wall_seconds=4.25)  # a setting not cached yet


def test_envs_built_in_many_threads_share_one_parse_of_humaneval():
    """The rollout workers build an env per episode in threads; CPython 3.11's ast.parse
    from several threads at once failed 32 of 164 resets before HumanEval was parsed once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        sources = list(pool.map(lambda _: code_tasks.HumanEvalTasks(), range(16)))
    assert all(s.get("eval", 7) is sources[0].get("eval", 7) for s in sources)
