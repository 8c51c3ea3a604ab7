"""`code_repair`: the fixer sees its failing test and tries again; the tester names an input
that exposes a buggy program. Rewards worked out by hand."""

import random

import pytest

from rl_tpu.core.env import Task, make
from rl_tpu.envs.code_repair import CodeRepairEnv, parse_input
from rl_tpu.sandbox import sandbox_unavailable_reason

MODE = "bubblewrap" if sandbox_unavailable_reason() is None else "unsafe_no_isolation"

# f(x) = max(x, 4): x = -1 and 3 are clamped, 5 and 12 are not
AT_LEAST_4 = Task("r/0", {"kind": "at_least", "constants": [4], "role": "fixer",
                          "prompt": "Write f(x): x, but never less than 4.",
                          "tests": [{"call": f"f({x})", "expected": repr(max(x, 4))}
                                    for x in (-1, 3, 5, 12)]})
SLIP, RIGHT = "def f(x):\n    return x", "def f(x):\n    return max(x, 4)"


def env(**kwargs):
    return CodeRepairEnv(sandbox=MODE, **kwargs)


def test_a_failing_program_gets_its_failure_and_the_fix_is_paid_in_full():
    e = env()
    assert e.reset(AT_LEAST_4) == "Write f(x): x, but never less than 4."
    first = e.step(SLIP)
    assert (first.reward, first.done) == (0.0, False)
    assert first.observation == ("Passed 2 of 4 tests.\nf(-1) returned -1, expected 4\n"
                                 "Fix the program.")
    fixed = e.step(RIGHT)
    assert (fixed.reward, fixed.done) == (1.0, True)
    assert fixed.info["attempts"] == 2 and fixed.info["first_try"] == 0.5
    assert fixed.info["success"]


def test_a_first_try_success_ends_at_once():
    e = env()
    e.reset(AT_LEAST_4)
    result = e.step(RIGHT)
    assert (result.reward, result.done, result.info["attempts"]) == (1.0, True, 1)


def test_out_of_attempts_pays_the_last_programs_fraction():
    e = env(max_attempts=2)
    e.reset(AT_LEAST_4)
    e.step(SLIP)
    last = e.step("def f(x):\n    return 4")  # right for -1 and 3 only
    assert (last.reward, last.done) == (0.5, True)
    assert "Fix the program." not in last.observation
    assert e.step(RIGHT).info == {"invalid_action": True}  # the episode is over


def test_the_retry_discount_pays_less_for_a_repair():
    e = env(retry_discount=0.5, max_attempts=3)
    e.reset(AT_LEAST_4)
    e.step(SLIP)
    e.step(SLIP)
    assert e.step(RIGHT).reward == 0.25  # third program: 1.0 x 0.5^2


def test_the_tester_is_paid_when_its_input_exposes_the_bug():
    e = env(roles="fixer,tester")
    tester = e.tasks().get("train", 1)
    assert tester.data["role"] == "tester" and "This program has a bug" in tester.data["prompt"]
    assert e.tasks().get("train", 0).data["role"] == "fixer"
    assert all(e.tasks().get("eval", i).data["role"] == "fixer" for i in range(6))
    bug = Task("t/1", {"role": "tester", "kind": "at_least", "constants": [4],
                       "buggy": SLIP, "prompt": "..."})
    e.reset(bug)
    exposed = e.step("f(2)")  # the bug returns 2, the right value is 4
    assert exposed.reward == 1.0 and exposed.info["input"] == 2
    assert exposed.observation == "The test exposes the bug: f(2) returned 2, expected 4"
    e.reset(bug)
    assert e.step("9").reward == 0.0  # above the bound the bug is right
    e.reset(bug)
    assert e.step("a test").reward == 0.0


def test_the_tester_teacher_picks_an_exposing_input_when_skilled():
    e = env(roles="fixer,tester")
    tester = e.tasks().get("train", 1)
    for seed in range(5):
        e.reset(tester)
        assert e.step(e.teacher_reply(tester, random.Random(seed), 1.0)).reward == 1.0


@pytest.mark.parametrize("reply, value", [("f(12)", 12), ("-3", -3), ("f( 7 )", 7),
                                          ("Try\nf(5)", 5), ("f(x)", None), ("", None)])
def test_parse_input(reply, value):
    assert parse_input(reply) == value


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="max_attempts=0"):
        env(max_attempts=0)
    with pytest.raises(ValueError, match="roles='tester'"):
        env(roles="tester")
    with pytest.raises(ValueError, match="tester role needs tasks='functions'"):
        env(roles="fixer,tester", tasks="humaneval")
    assert make("code_repair", sandbox=MODE).name == "code_repair"


def test_long_feedback_keeps_its_start_and_end():
    from rl_tpu.envs.code_repair import shorten

    assert shorten("short") == "short"
    long = "A" * 100 + "B" * 300 + "C" * 200
    assert shorten(long) == "A" * 100 + " ... " + "C" * 200
