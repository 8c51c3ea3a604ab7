"""Function calling: tool-call formats and parsing (`calls`), a registry of tools with their
JSON schemas and safe execution (`registry`), built-in tools (`builtins`: calculator, python
in the sandbox, search), and an Env wrapper that plays them (`env.ToolEnv`)."""

from rl_tpu.tools.builtins import (builtin_tools, calculator_tool, evaluate_arithmetic,
                                   python_tool, search_tool)
from rl_tpu.tools.calls import (CALL_FORMATS, ParsedReply, ToolCall, call_format_of,
                                format_tool_call, parse_tool_calls)
from rl_tpu.tools.env import ToolEnv
from rl_tpu.tools.registry import Tool, ToolRegistry, ToolResult

__all__ = ["CALL_FORMATS", "ParsedReply", "Tool", "ToolCall", "ToolEnv", "ToolRegistry",
           "ToolResult", "builtin_tools", "calculator_tool", "call_format_of",
           "evaluate_arithmetic", "format_tool_call", "parse_tool_calls", "python_tool",
           "search_tool"]
