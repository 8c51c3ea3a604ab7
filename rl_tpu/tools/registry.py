"""Tools a model may call: a name, a JSON schema for the arguments, and a Python callable.

    registry = ToolRegistry([calculator_tool()])

    @registry.register
    def lookup(city: str, units: str = "metric") -> str:
        '''The current weather in a city.

        Args:
          city: the city's name.
          units: "metric" or "imperial".
        '''
        ...

    registry.schemas            # [{"type": "function", "function": {...}}, ...] for tools=
    registry.execute(call)      # a ToolResult; never raises

A schema comes from the function's signature and docstring (Google-style "Args:" lines give
each argument's description) unless one is given. `execute` checks the arguments against the
schema (required names present, no unknown names, JSON types) before calling, and turns every
failure into an error text for the model: an unknown tool, bad arguments, a function that
raises. A malformed call is an observation the policy learns from, never an exception.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from typing import Any, Callable, Optional, Sequence

from rl_tpu.tools.calls import ToolCall

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               tuple: "array", dict: "object"}
# What each JSON schema type accepts (bool is an int in Python but not a JSON integer).
_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}
DEFAULT_MAX_RESULT_CHARS = 4000


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one call gave: the text for the tool message, and whether it failed (and why)."""

    name: str
    content: str
    error: Optional[str] = None  # None: the call ran; else what went wrong (also in content)
    call_id: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_message(self) -> dict:
        """The role "tool" chat message carrying this result."""
        message = {"role": "tool", "content": self.content, "name": self.name}
        if self.call_id:
            message["tool_call_id"] = self.call_id
        return message


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the model may call by `name` with keyword arguments matching `parameters`.

    parameters: a JSON schema of type "object" (`properties`, `required`).
    function: called as `function(**arguments)`; its result becomes the tool message (a str
      as it is, anything else as JSON).
    """

    name: str
    description: str
    parameters: dict
    function: Callable[..., Any]

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 letters, digits, '_', '.' or "
                             "'-', starting with a letter or '_' (the OpenAI function-name rule)")
        if not callable(self.function):
            raise TypeError(f"tool {self.name!r}: function must be callable, "
                            f"got {type(self.function).__name__}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type "
                             f"'object', got {self.parameters!r:.200}")

    @property
    def schema(self) -> dict:
        """The OpenAI-style schema chat templates render (`tools=`)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    @classmethod
    def from_function(cls, function: Callable[..., Any], name: Optional[str] = None,
                      description: Optional[str] = None,
                      parameters: Optional[dict] = None) -> "Tool":
        """A Tool from a Python function; its schema from the signature and docstring unless
        `parameters` is given. Raises ValueError for a signature a schema cannot describe
        (*args, positional-only, an annotation that is no JSON type)."""
        name = name or function.__name__
        doc = inspect.getdoc(function) or ""
        if description is None:
            description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
        if parameters is None:
            parameters = schema_of_signature(function, name, _argument_docs(doc))
        return cls(name, description, parameters, function)


def _json_type(annotation, where: str) -> Optional[dict]:
    """The JSON schema of a Python annotation (None: any value)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    origin = typing.get_origin(annotation)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:  # Optional[X]: X (a missing optional argument is left out)
            return _json_type(members[0], where)
        types = [_json_type(a, where) for a in members]
        return None if any(t is None for t in types) else {"type": [t["type"] for t in types]}
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {"type": _JSON_TYPES.get(type(values[0]), "string"), "enum": values}
    base = origin or annotation
    if base in _JSON_TYPES:
        return {"type": _JSON_TYPES[base]}
    raise ValueError(f"{where}: annotation {annotation!r} is no JSON type; use str, int, float, "
                     "bool, list, dict (or Optional/Literal of them), or pass parameters=")


def schema_of_signature(function: Callable[..., Any], name: str,
                        docs: Optional[dict[str, str]] = None) -> dict:
    """The "object" JSON schema of `function`'s keyword arguments: a property per argument
    (type from its annotation, description from `docs`), required when it has no default."""
    properties, required = {}, []
    hints = typing.get_type_hints(function) if not isinstance(function, type) else {}
    for param in inspect.signature(function).parameters.values():
        where = f"tool {name!r}, argument {param.name!r}"
        if param.kind in (param.VAR_POSITIONAL, param.POSITIONAL_ONLY):
            raise ValueError(f"{where}: a tool takes keyword arguments only (no *args or "
                             "positional-only arguments)")
        if param.kind is param.VAR_KEYWORD:
            continue
        prop = _json_type(hints.get(param.name, param.annotation), where) or {}
        if docs and param.name in docs:
            prop["description"] = docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required}


def _argument_docs(doc: str) -> dict[str, str]:
    """{argument: description} from a Google-style "Args:" section."""
    out, current, inside = {}, None, False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            inside = True
            continue
        if inside:
            m = re.match(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
            if m and line.startswith((" ", "\t")):
                current = m.group(1)
                out[current] = m.group(2).strip()
            elif stripped and current and line.startswith((" ", "\t")):
                out[current] += " " + stripped
            elif stripped.endswith(":") or (stripped and not line.startswith((" ", "\t"))):
                inside = False  # the next section (Returns:, Raises:, ...)
    return out


def check_arguments(arguments: dict, schema: dict) -> Optional[str]:
    """What is wrong with `arguments` for the "object" schema, or None when they fit.

    Checks the top level only (required names, unknown names unless additionalProperties
    allows them, each value's JSON type and enum): enough for a policy to learn to call
    correctly, without a JSON Schema dependency.
    """
    properties = schema.get("properties", {})
    missing = [n for n in schema.get("required", []) if n not in arguments]
    if missing:
        return (f"missing required argument{'s' * (len(missing) > 1)} "
                f"{', '.join(map(repr, missing))}")
    if schema.get("additionalProperties", False) is False:
        unknown = [n for n in arguments if n not in properties]
        if unknown:
            return (f"unknown argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}"
                    f" (it takes {', '.join(map(repr, properties)) or 'none'})")
    for arg, value in arguments.items():
        prop = properties.get(arg) or {}
        kinds = prop.get("type")
        kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
        if kinds and not any(_CHECKS.get(k, lambda v: True)(value) for k in kinds):
            return (f"argument {arg!r} must be {' or '.join(kinds)}, got "
                    f"{type(value).__name__} {json.dumps(value)[:80]}")
        if "enum" in prop and value not in prop["enum"]:
            return f"argument {arg!r} must be one of {prop['enum']}, got {json.dumps(value)[:80]}"
    return None


def result_text(value: Any, max_chars: int) -> str:
    """A tool's return value as the tool message's text, cut to `max_chars`."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n... [cut: {len(text) - max_chars} more characters]"
    return text


class ToolRegistry:
    """Tools by name; `schemas` for the chat template, `execute` for a model's calls.

    Args:
      tools: Tools, or plain functions (each becomes `Tool.from_function(f)`).
      max_result_chars: a longer result is cut there (a tool's output is a prompt the policy
        reads next turn: it must not fill the context).
    """

    def __init__(self, tools: Sequence[Tool | Callable[..., Any]] = (),
                 max_result_chars: int = DEFAULT_MAX_RESULT_CHARS):
        if max_result_chars < 1:
            raise ValueError(f"max_result_chars must be >= 1, got {max_result_chars}")
        self.max_result_chars = max_result_chars
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool | Callable[..., Any]) -> Tool:
        """Adds a Tool (or a function, as `Tool.from_function`); a name may be added once."""
        if not isinstance(tool, Tool):
            tool = Tool.from_function(tool)
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is registered already")
        self._tools[tool.name] = tool
        return tool

    def register(self, function: Optional[Callable[..., Any]] = None, *,
                 name: Optional[str] = None, description: Optional[str] = None,
                 parameters: Optional[dict] = None):
        """Decorator (bare or with arguments) adding a function as a tool; returns the
        function unchanged."""
        def add(f):
            self.add(Tool.from_function(f, name, description, parameters))
            return f
        return add(function) if function is not None else add

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Tool:
        return self._tools[name]

    @property
    def schemas(self) -> list[dict]:
        """Every tool's schema, in registration order (what `tools=` takes)."""
        return [t.schema for t in self._tools.values()]

    def execute(self, call: ToolCall) -> ToolResult:
        """Runs one call; every failure is a ToolResult with `error` set, never an exception
        (except KeyboardInterrupt/SystemExit, which are not the model's doing)."""
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return self._error(call, f"unknown tool {call.name!r}; the tools are: {known}")
        problem = check_arguments(call.arguments, tool.parameters)
        if problem:
            return self._error(call, f"bad arguments for {call.name!r}: {problem}")
        try:
            value = tool.function(**call.arguments)
        except Exception as e:  # noqa: BLE001 - the model's call failed: tell the model
            return self._error(call, f"{call.name!r} failed: {type(e).__name__}: {e}")
        return ToolResult(call.name, result_text(value, self.max_result_chars), None, call.id)

    def error_result(self, message: str, name: str = "") -> ToolResult:
        """A result for a call that could not even be parsed (`ParsedReply.errors`)."""
        return ToolResult(name, f"Error: {message}", message)

    def _error(self, call: ToolCall, message: str) -> ToolResult:
        return ToolResult(call.name, f"Error: {message}", message, call.id)

    def close(self) -> None:
        """Closes the tools that hold resources (a connection, a pool): those whose function
        has a `close` method."""
        for tool in self._tools.values():
            close = getattr(tool.function, "close", None)
            if callable(close):
                close()
