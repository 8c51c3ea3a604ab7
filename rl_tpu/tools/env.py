"""A function-calling Env: any task env, played with tools the model calls between answers.

`ToolEnv(task_env, registry, call_format)` states the registry's schemas as its `tools` (the
agent loop renders them into the prompt through the chat template). Each assistant reply is
parsed in the tokenizer's call format (`rl_tpu.tools.calls`):

  calls (or malformed calls)  each well-formed call runs (`ToolRegistry.execute`) and each
        malformed one becomes an error text; the results come back as role "tool" messages,
        one per call in order (`info["observation_messages"]`), which the template wraps its
        own way (Qwen2.5: <tool_response> blocks in one user turn; Llama 3.1: ipython turns).
        Reward 0, not done. Text around the calls is the model's thinking and is ignored.
  no call                     the reply is the final answer: the task env's `step` scores it
        (its reward, done and info pass through; an answer the task env does not end on comes
        back as a user message, as without tools).

Episode-level limits: `max_calls_per_reply` (calls and malformed calls past it are refused,
all of them in one error result)
and `max_tool_turns` (the reply that uses the last one ends the episode unsuccessfully: a
policy that never answers must not run to the loop's turn limit on tool calls alone).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from rl_tpu.core.env import Env, StepResult, Task, TaskSource
from rl_tpu.tools.calls import CALL_FORMATS, ToolCall, parse_tool_calls
from rl_tpu.tools.registry import ToolRegistry, ToolResult


def run_reply_calls(registry: ToolRegistry, calls: Sequence[ToolCall], errors: Sequence[str],
                    limit: int, run: Optional[Callable[[ToolCall], ToolResult]] = None
                    ) -> list[ToolResult]:
    """The results of one reply's calls, in order: its malformed calls' errors first (their
    position among the calls is lost in parsing), then each call's result (`run(call)`, by
    default `registry.execute`). At most `limit` of them are read or run; the rest are named
    in one error result, so a reply of a thousand calls is not a thousand tool messages."""
    run = run or registry.execute
    results = [registry.error_result(e) for e in errors[:limit]]
    if len(errors) > limit:
        results.append(registry.error_result(
            f"{len(errors) - limit} more malformed tool calls in this reply were not read "
            f"(at most {limit} calls a reply)"))
    room = max(limit - len(errors), 0)
    results.extend(run(call) for call in calls[:room])
    refused = calls[room:]
    if len(refused) == 1:
        results.append(registry.error_result(
            f"too many tool calls in one reply (at most {limit}); call {room + 1} "
            f"({refused[0].name!r}) was not run", refused[0].name))
    elif refused:
        results.append(registry.error_result(
            f"too many tool calls in one reply (at most {limit}); calls {room + 1} to "
            f"{len(calls)} were not run"))
    return results


class ToolEnv(Env):
    """`task_env` with `registry`'s tools (see the module docstring).

    Args:
      task_env: scores the final answer (`step(answer)`), gives the first observation, the
        system prompt / conversation start and the tasks.
      registry: the tools.
      call_format: "hermes" or "llama3_json": the policy tokenizer's
        (`rl_tpu.tools.call_format_of(tokenizer)`).
      max_calls_per_reply: calls one reply may make; the rest get an error result.
      max_tool_turns: replies with calls an episode may make (None: no limit of its own).
      close_registry: close the registry's tools (those holding resources) with this env.
    """

    def __init__(self, task_env: Env, registry: ToolRegistry, call_format: str,
                 max_calls_per_reply: int = 4, max_tool_turns: Optional[int] = None,
                 close_registry: bool = True):
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
        if not len(registry):
            raise ValueError("the tool registry is empty; a function-calling env needs a tool")
        if max_calls_per_reply < 1:
            raise ValueError(f"max_calls_per_reply must be >= 1, got {max_calls_per_reply}")
        if max_tool_turns is not None and max_tool_turns < 1:
            raise ValueError(f"max_tool_turns must be >= 1 (None: no limit), got {max_tool_turns}")
        self.task_env, self.registry, self.call_format = task_env, registry, call_format
        self.max_calls_per_reply, self.max_tool_turns = max_calls_per_reply, max_tool_turns
        self.close_registry = close_registry
        self.name = f"{getattr(task_env, 'name', type(task_env).__name__)}+tools"
        self.system_prompt = task_env.system_prompt
        self.replayable = bool(getattr(task_env, "replayable", False))
        self.tool_turns = 0
        self.calls_made = 0

    @property
    def tools(self) -> list[dict]:
        return self.registry.schemas

    def conversation_start(self):
        start = getattr(self.task_env, "conversation_start", None)
        return start() if callable(start) else None

    def tasks(self) -> TaskSource:
        return self.task_env.tasks()

    def reset(self, task: Task) -> str:
        self.tool_turns = self.calls_made = 0
        return self.task_env.reset(task)

    def step(self, action: str) -> StepResult:
        parsed = parse_tool_calls(action, self.call_format)
        if not parsed.calls and not parsed.errors:
            return self.task_env.step(parsed.content)
        self.tool_turns += 1
        results = self.run_calls(parsed.calls, parsed.errors)
        messages = [r.as_message() for r in results]
        info = {"tool_calls": [{"name": c.name, "arguments": c.arguments} for c in parsed.calls],
                "tool_errors": sum(not r.ok for r in results),
                "observation_messages": messages}
        observation = "\n\n".join(m["content"] for m in messages)
        if self.max_tool_turns is not None and self.tool_turns >= self.max_tool_turns:
            return StepResult(observation + f"\n\nOut of tool turns ({self.max_tool_turns}).",
                              0.0, True, {**info, "success": False, "truncated": True})
        return StepResult(observation, 0.0, False, info)

    def run_calls(self, calls, errors) -> list[ToolResult]:
        """The results of one reply's calls (`run_reply_calls` with `max_calls_per_reply`)."""
        def run(call):
            self.calls_made += 1
            return self.registry.execute(call)

        return run_reply_calls(self.registry, calls, errors, self.max_calls_per_reply, run)

    def close(self) -> None:
        try:
            self.task_env.close()
        finally:
            if self.close_registry:
                self.registry.close()
