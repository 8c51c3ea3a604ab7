"""`tir`: python blocks run in the sandbox and their output comes back; the answer is scored."""

import random

import pytest

from rl_tpu.core.env import Task, make
from rl_tpu.envs.tir import TirEnv, as_integer, final_answer
from rl_tpu.sandbox import sandbox_unavailable_reason

MODE = "bubblewrap" if sandbox_unavailable_reason() is None else "unsafe_no_isolation"
TASK = Task("tir/0", {"expression": "1234 * 5678 - 9", "answer": "7006643",
                      "prompt": "Compute 1234 * 5678 - 9."})


def block(source):
    return f"Let me run it.\n```python\n{source}\n```"


def test_code_output_comes_back_and_the_answer_is_scored():
    e = TirEnv(sandbox=MODE)
    assert e.reset(TASK) == "Compute 1234 * 5678 - 9."
    ran = e.step(block("print(1234 * 5678 - 9)"))
    assert (ran.observation, ran.reward, ran.done) == ("7006643", 0.0, False)
    end = e.step("So <answer>7,006,643</answer>")
    assert (end.reward, end.done, end.info["success"], end.info["tool_calls"]) == (1.0, True, True, 1)


def test_variables_carry_over_unless_turned_off_and_errors_show_their_tail():
    e = TirEnv(sandbox=MODE)
    e.reset(TASK)
    assert e.step(block("x = 1234 * 5678\nprint('set')")).observation == "set"
    assert e.step(block("print(x - 9)")).observation == "7006643"  # 'set' is not printed again
    failed = e.step(block("print(y)"))
    assert failed.observation.startswith("Error (error):") and "NameError" in failed.observation
    assert e.step(block("print(x)")).observation == "7006652"  # the failed block is not kept
    fresh = TirEnv(sandbox=MODE, carry_state=False)
    fresh.reset(TASK)
    fresh.step(block("x = 1"))
    assert "NameError" in fresh.step(block("print(x)")).observation


def test_two_blocks_in_one_reply_and_silence():
    e = TirEnv(sandbox=MODE)
    e.reset(TASK)
    both = e.step(block("print(1)") + "\n" + block("x = 2"))
    assert both.observation == ("Output of block 1:\n1\nOutput of block 2:\n"
                                "(no output: print the value you need)")


def test_a_wrong_or_missing_answer():
    e = TirEnv(sandbox=MODE)
    e.reset(TASK)
    assert e.step("no idea").info["invalid_action"]
    wrong = e.step("\\boxed{7006642}")
    assert (wrong.reward, wrong.done, wrong.info["success"]) == (0.0, True, False)
    assert wrong.observation == "Not correct: the answer is 7006643."


@pytest.mark.parametrize("reply, answer", [
    ("<answer>12</answer> and <answer>13</answer>", "13"), ("so \\boxed{ 7 }", "7"),
    ("<answer>1</answer> \\boxed{2}", "1"), ("nothing", None)])
def test_final_answer(reply, answer):
    assert final_answer(reply) == answer


def test_as_integer():
    assert as_integer(" -1,234 ") == -1234 and as_integer("12.5") is None and as_integer("x") is None


def test_the_teacher_uses_the_tool_when_skilled_and_slips_when_not():
    e = TirEnv(sandbox=MODE)
    e.reset(TASK)
    rng = random.Random(0)
    assert e.teacher_reply(TASK, rng, 1.0) == "```python\nprint(1234 * 5678 - 9)\n```"
    e.step(e.teacher_reply(TASK, rng, 1.0))
    assert e.step(e.teacher_reply(TASK, rng, 1.0)).reward == 1.0
    e.reset(TASK)
    slip = e.teacher_reply(TASK, rng, 0.0)
    assert slip == "<answer>7006652</answer>" and e.step(slip).reward == 0.0


def test_tasks_are_seeded_and_the_env_is_registered():
    e = make("tir", sandbox=MODE, eval_size=5)
    t = e.tasks().get("eval", 3)
    assert t.data == e.tasks().get("eval", 3).data
    assert t.data["prompt"] == f"Compute {t.data['expression']}." and e.tasks().size("eval") == 5
    assert int(t.data["answer"]) == eval(t.data["expression"])
