"""Function calling: tool-call formats and parsing (`calls`), a registry of tools with their
JSON schemas and safe execution (`registry`), and an Env wrapper that plays them (`env`)."""

from rl_tpu.tools.calls import (CALL_FORMATS, ParsedReply, ToolCall, call_format_of,
                                parse_tool_calls)

__all__ = ["CALL_FORMATS", "ParsedReply", "ToolCall", "call_format_of", "parse_tool_calls"]
