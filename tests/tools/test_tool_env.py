"""ToolEnv step by step: calls run, malformed calls and limits become tool messages, and a
reply without calls goes to the task env."""

import pytest

from rl_tpu.core.env import Env, StepResult, Task
from rl_tpu.tools import ToolEnv, ToolRegistry, calculator_tool

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'


class Echo(Env):
    name = "echo"
    system_prompt = "Answer."

    def __init__(self):
        self.answers, self.closed = [], False

    def reset(self, task):
        return "Q?"

    def step(self, action):
        self.answers.append(action)
        return StepResult(f"got {action}", 0.5, action == "final", {"success": action == "final"})

    def close(self):
        self.closed = True


def make(**kwargs):
    task = Echo()
    env = ToolEnv(task, ToolRegistry([calculator_tool()]), "hermes", **kwargs)
    assert env.reset(Task("t")) == "Q?"
    return env, task


def test_calls_run_and_come_back_as_tool_messages():
    env, task = make()
    result = env.step("Let me compute. " + CALL.format("6*7") + CALL.format("1/0"))
    assert (result.reward, result.done) == (0.0, False)
    assert result.info["observation_messages"] == [
        {"role": "tool", "content": "42", "name": "calculator"},
        {"role": "tool", "content": "Error: 'calculator' failed: ValueError: division by zero",
         "name": "calculator"}]
    assert result.info["tool_errors"] == 1
    assert result.observation == "42\n\nError: 'calculator' failed: ValueError: division by zero"
    assert task.answers == []  # the task env saw no answer yet
    assert env.tools == [calculator_tool().schema]


def test_a_reply_without_calls_is_the_answer():
    env, task = make()
    result = env.step("  final ")
    assert result == StepResult("got final", 0.5, True, {"success": True})
    assert task.answers == ["final"]
    assert "observation_messages" not in env.step("not yet").info  # a plain user observation


def test_malformed_calls_are_error_observations():
    env, _ = make()
    result = env.step('<tool_call>{"name": "calculator", "arguments": 3}</tool_call>'
                      "<tool_call>{oops}</tool_call>")
    contents = [m["content"] for m in result.info["observation_messages"]]
    assert contents[0] == ("Error: tool call 1 to 'calculator': \"arguments\" must be a JSON "
                           "object of argument names to values, got int: 3")
    assert contents[1].startswith("Error: tool call 2 is not valid JSON")
    assert result.info["tool_errors"] == 2 and not result.done


def test_limits():
    env, _ = make(max_calls_per_reply=2, max_tool_turns=2)
    first = env.step(CALL.format("1") + CALL.format("2") + CALL.format("3"))
    assert [m["content"] for m in first.info["observation_messages"]] == [
        "1", "2", "Error: too many tool calls in one reply (at most 2); call 3 ('calculator') "
                  "was not run"]
    assert not first.done and env.calls_made == 2
    second = env.step(CALL.format("4"))
    assert second.done and second.info["success"] is False and second.info["truncated"]
    assert second.observation == "4\n\nOut of tool turns (2)."


def test_a_reply_of_a_thousand_calls_is_a_few_messages():
    env, _ = make(max_calls_per_reply=2)
    result = env.step("<tool_call>{oops}</tool_call>" * 1000 + CALL.format("1") * 1000)
    assert [m["content"] for m in result.info["observation_messages"]] == [
        "Error: tool call 1 is not valid JSON (Expecting property name enclosed in double "
        "quotes at character 1): '{oops}'",
        "Error: tool call 2 is not valid JSON (Expecting property name enclosed in double "
        "quotes at character 1): '{oops}'",
        "Error: 998 more malformed tool calls in this reply were not read (at most 2 calls a "
        "reply)",
        "Error: too many tool calls in one reply (at most 2); calls 1 to 1000 were not run"]
    assert env.calls_made == 0 and not result.done
    many = env.step(CALL.format("1") + CALL.format("2") * 50)
    assert [m["content"] for m in many.info["observation_messages"]] == [
        "1", "2", "Error: too many tool calls in one reply (at most 2); calls 3 to 51 were not "
                  "run"]


def test_bad_configuration_and_close():
    with pytest.raises(ValueError, match="call_format must be one of"):
        ToolEnv(Echo(), ToolRegistry([calculator_tool()]), "xml")
    with pytest.raises(ValueError, match="registry is empty"):
        ToolEnv(Echo(), ToolRegistry(), "hermes")
    env, task = make()
    assert env.name == "echo+tools" and env.system_prompt == "Answer."
    env.close()
    assert task.closed
