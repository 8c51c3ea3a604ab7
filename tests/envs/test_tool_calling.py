"""The tool_calling env: a task env with tools, its teacher, its demos, and the format check."""

import json
import random

import pytest

from rl_tpu.agent import env_tools
from rl_tpu.core.env import make
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes import sft
from rl_tpu.recipes.env_factory import check_call_format
from rl_tpu.recipes.config import CALCULATOR_ARITHMETIC
from rl_tpu.tools.calls import CALL_FORMATS, ToolCall, parse_tool_calls

TASK_KWARGS = {"config": dict(CALCULATOR_ARITHMETIC), "isolate": False,
               "system_prompt": "Answer in <answer>...</answer>."}


def calculator_env(**kwargs):
    return make("tool_calling", task_env="arithmetic", task_kwargs=TASK_KWARGS, **kwargs)


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(build_tokenizer(512))


def test_a_call_then_the_copied_result_is_right():
    env = calculator_env()
    task = env.tasks().get("train", 0)
    expression = task.data["metadata"]["expression"]  # e.g. "67 * 17"
    a, op, b = expression.split()
    value = int(a) + int(b) if op == "+" else int(a) * int(b)  # worked out here, not by the env
    env.reset(task)
    call = ('<tool_call>' + json.dumps({"name": "calculator", "arguments": {
        "expression": expression}}) + '</tool_call>')
    result = env.step(call)
    assert not result.done and result.reward == 0.0
    assert result.info["observation_messages"] == [
        {"role": "tool", "content": str(value), "name": "calculator"}]
    final = env.step(f"<answer>{value}</answer>")
    assert final.done and final.reward == 1.0 and final.info["success"]
    env.close()


def test_the_teacher_calls_at_skill_one_and_guesses_wrong_at_skill_zero():
    env = calculator_env()
    task = env.tasks().get("train", 3)
    messages, success = sft.teacher_episode(env, task, random.Random(0), 1.0, max_turns=2)
    assert success
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["content"].startswith('<tool_call>{"name": "calculator"')
    assert messages[4]["content"] == f"<answer>{messages[3]['content']}</answer>"
    messages, success = sft.teacher_episode(env, task, random.Random(0), 0.0, max_turns=2)
    assert not success and [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert "<tool_call>" not in messages[2]["content"]
    env.close()


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_the_teacher_writes_calls_in_the_configured_format(call_format):
    env = calculator_env(call_format=call_format)
    task = env.tasks().get("train", 3)
    messages, success = sft.teacher_episode(env, task, random.Random(0), 1.0, max_turns=2)
    assert success  # the env parsed the teacher's call in its own format and ran it
    call = messages[2]["content"]
    expected = ToolCall("calculator", {"expression": task.data["metadata"]["expression"]})
    assert parse_tool_calls(call, call_format).calls == (expected,)
    other = next(f for f in CALL_FORMATS if f != call_format)
    assert parse_tool_calls(call, other).calls == ()  # a demo teaches one format, not both
    env.close()


def test_a_demo_is_the_template_of_the_whole_chat_with_tools(tok):
    env = calculator_env()
    messages, _ = sft.teacher_episode(env, env.tasks().get("train", 5), random.Random(0), 1.0, 2)
    tools = env_tools(env)
    ids, mask = sft.chat_example(messages, tok, "demo", tools=tools)
    # the template closes the last turn with "\n" after <|im_end|> (the eos the demo ends on)
    assert ids + tok.encode("\n") == tok.apply_chat_template(messages, tools=tools)
    trained = [i for i, m in zip(ids, mask) if m]
    replies = [tok.encode(m["content"]) + [tok.eos_token_id] for m in messages
               if m["role"] == "assistant"]
    assert trained == replies[0] + replies[1]  # the tool's result carries no loss
    env.close()


def test_tools_are_built_ins_or_functions_by_module_path():
    env = calculator_env(tools="calculator,textwrap:dedent")
    names = [t["function"]["name"] for t in env.tools]
    assert names == ["calculator", "dedent"]
    env.close()
    with pytest.raises(ValueError, match="neither a built-in"):
        calculator_env(tools="calculator,dedent")
    with pytest.raises(ValueError, match="cannot import"):
        calculator_env(tools="no_such_module_xyz:f")
    with pytest.raises(ValueError, match="names a tool twice"):
        calculator_env(tools="calculator,calculator")
    with pytest.raises(ValueError, match="cannot wrap itself"):
        make("tool_calling", task_env="tool_calling")


def test_a_call_format_the_template_does_not_write_is_refused_before_a_run(tok):
    check_call_format(lambda: calculator_env(), tok)  # the tiny template writes hermes calls
    with pytest.raises(ValueError, match="set env.kwargs.call_format='hermes'"):
        check_call_format(lambda: calculator_env(call_format="llama3_json"), tok)
    plain = ChatTokenizer(build_tokenizer(512))
    plain.hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="no tool support"):
        check_call_format(lambda: calculator_env(), plain)
    check_call_format(lambda: make("largest"), plain)  # an env without tools: nothing to check
