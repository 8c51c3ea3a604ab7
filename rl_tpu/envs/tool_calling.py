"""tool_calling: any registered task env, played with tools the model calls (function calling).

    set_env(c, "tool_calling", task_env="arithmetic", tools="calculator", call_format="hermes")

The env is `rl_tpu.tools.ToolEnv` around `task_env` (made with `task_kwargs`): the tools'
schemas go into the prompt through the policy's chat template, each reply's calls are parsed
in `call_format` (the template's own: "hermes" for Qwen2.5/Qwen3 and rl_tpu's tiny tokenizer,
"llama3_json" for Llama 3.1; `rl_tpu.tools.call_format_of(tokenizer)` reads it from the
template, and the trainer checks the two agree), run, and answered with role "tool" messages;
a reply without a call is the answer the task env scores.

Tools: built-ins by name (`calculator`, `python`: code in rl_tpu's sandbox, mode
`python_sandbox`) and user functions as "package.module:function" (their JSON schema from the
signature and docstring, `Tool.from_function`), comma-separated in `tools`.

The teacher (for an SFT warm start, `teacher_reply`): on a task that states its expression
(arithmetic's `metadata.expression`) and with a calculator, it calls the calculator with the
expression `skill` of the time, written in `call_format` (a Llama demo teaches Llama's calls),
and then answers with the result; otherwise it answers at once through the task env's own
teacher at skill 0 (a slip: the tiny model cannot multiply two 2-digit numbers in its head,
so the answer without the tool is the wrong one). What RL can learn here is to call the tool
every time and copy its result, which imitation of a teacher that calls it `skill` of the
time does not give.
"""

from __future__ import annotations

import importlib
import random
from typing import Optional

from rl_tpu.core.env import StepResult, Task, make, register
from rl_tpu.tools.builtins import builtin_tools
from rl_tpu.tools.calls import format_tool_call
from rl_tpu.tools.env import ToolEnv
from rl_tpu.tools.registry import Tool, ToolRegistry

BUILTIN_TOOLS = ("calculator", "python")


def user_function(spec: str):
    """The function named by "package.module:function"; a clear error for anything else."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"tool {spec!r} is neither a built-in ({', '.join(BUILTIN_TOOLS)}) nor "
                         "a function named as 'package.module:function'")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tool {spec!r}: cannot import it ({e})") from e
    if not callable(function):
        raise ValueError(f"tool {spec!r} is a {type(function).__name__}, not a function")
    return function


def tool_registry(tools: str, python_sandbox: str = "bubblewrap") -> ToolRegistry:
    """The registry `tools` names: built-ins and "module:function"s, comma-separated."""
    names = [t.strip() for t in tools.split(",") if t.strip()]
    if not names:
        raise ValueError("tool_calling needs at least one tool (e.g. tools='calculator')")
    if len(set(names)) != len(names):
        raise ValueError(f"tools {tools!r} names a tool twice")
    registry = ToolRegistry()
    for name in names:
        if name in BUILTIN_TOOLS:
            for tool in builtin_tools([name], python_mode=python_sandbox):
                registry.add(tool)
        else:
            registry.add(Tool.from_function(user_function(name)))
    return registry


class TeachingToolEnv(ToolEnv):
    """ToolEnv with the calculator teacher of the module docstring; it keeps the last tool
    results of the episode for the teacher's answer."""

    def reset(self, task: Task) -> str:
        self.last_results: list[str] = []
        return super().reset(task)

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        messages = result.info.get("observation_messages")
        if messages:
            self.last_results = [m["content"] for m in messages]
        return result

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        expression = (task.data.get("metadata") or {}).get("expression")
        teacher = getattr(self.task_env, "teacher_reply", None)
        if not expression or "calculator" not in self.registry:
            if teacher is None:
                raise ValueError(f"{self.name} has no teacher: its task env has none and its "
                                 "tasks state no expression for the calculator")
            return teacher(task, rng, skill)
        if self.last_results:  # the calculator answered: copy its result
            return f"<answer>{self.last_results[-1]}</answer>"
        if rng.random() < skill:  # in the policy's own format: the demo teaches it
            return format_tool_call("calculator", {"expression": expression}, self.call_format)
        if teacher is None:
            return "<answer>0</answer>"
        return teacher(task, rng, 0.0)


@register("tool_calling")
def make_tool_calling(task_env: str = "arithmetic", task_kwargs: Optional[dict] = None,
                      tools: str = "calculator", call_format: str = "hermes",
                      python_sandbox: str = "bubblewrap", max_calls_per_reply: int = 2,
                      max_tool_turns: int = 2) -> ToolEnv:
    if task_env == "tool_calling":
        raise ValueError("tool_calling cannot wrap itself; name a task env (e.g. arithmetic)")
    inner = make(task_env, **dict(task_kwargs or {}))
    try:
        registry = tool_registry(tools, python_sandbox)
        env = TeachingToolEnv(inner, registry, call_format, max_calls_per_reply=max_calls_per_reply,
                              max_tool_turns=max_tool_turns)
    except Exception:
        inner.close()
        raise
    env.name = "tool_calling"
    return env
