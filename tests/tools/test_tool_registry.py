"""The tool registry: schemas from signatures, argument checks, and every failure as a text."""

from typing import Literal, Optional

import pytest

from rl_tpu.sandbox import sandbox_unavailable_reason
from rl_tpu.tools import (Tool, ToolCall, ToolRegistry, ToolResult, builtin_tools,
                          calculator_tool, evaluate_arithmetic, python_tool)
from rl_tpu.tools.builtins import format_number, search_tool
from rl_tpu.tools.registry import check_arguments


def lookup(city: str, days: int = 1, units: Literal["metric", "imperial"] = "metric",
           note: Optional[str] = None) -> dict:
    """The weather forecast for a city.

    Longer text that is not the description.

    Args:
      city: the city's name,
        as people write it.
      days (int): how many days ahead.
      units: metric or imperial.

    Returns:
      the forecast.
    """
    if city == "Atlantis":
        raise LookupError("no such city")
    return {"city": city, "days": days, "units": units}


def test_schema_from_signature_and_docstring():
    tool = Tool.from_function(lookup)
    assert tool.schema == {"type": "function", "function": {
        "name": "lookup", "description": "The weather forecast for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "the city's name, as people write it."},
            "days": {"type": "integer", "description": "how many days ahead."},
            "units": {"type": "string", "enum": ["metric", "imperial"],
                      "description": "metric or imperial."},
            "note": {"type": "string"}},
            "required": ["city"]}}}


def test_schema_refusals():
    def star(*values: int):
        pass

    def unknown_type(x: set):
        pass

    with pytest.raises(ValueError, match="keyword arguments only"):
        Tool.from_function(star)
    with pytest.raises(ValueError, match="is no JSON type"):
        Tool.from_function(unknown_type)
    with pytest.raises(ValueError, match="tool name 'a b'"):
        Tool("a b", "", {"type": "object"}, print)
    with pytest.raises(ValueError, match="type 'object'"):
        Tool("f", "", {"type": "string"}, print)


def test_register_forms_and_duplicates():
    registry = ToolRegistry()

    @registry.register
    def ping() -> str:
        """Answers pong."""
        return "pong"

    @registry.register(name="echo", description="Echoes.",
                       parameters={"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"]})
    def whatever(text):
        return text

    assert registry.names == ["ping", "echo"] and ping() == "pong"
    assert registry.schemas[1]["function"]["description"] == "Echoes."
    with pytest.raises(ValueError, match="registered already"):
        registry.add(ping)
    assert registry.execute(ToolCall("echo", {"text": "hi"})) == ToolResult("echo", "hi")


def test_execute_results_and_errors():
    registry = ToolRegistry([lookup], max_result_chars=30)
    ok = registry.execute(ToolCall("lookup", {"city": "Oslo"}, id="c1"))
    # The dict as JSON, cut at 30 characters with a note saying how much was left out.
    full = '{"city": "Oslo", "days": 1, "units": "metric"}'
    assert ok.ok and ok.content == full[:30] + f"\n... [cut: {len(full) - 30} more characters]"
    assert ok.as_message() == {"role": "tool", "content": ok.content, "name": "lookup",
                               "tool_call_id": "c1"}
    cases = [  # (call, the error message)
        (ToolCall("weather", {}), "unknown tool 'weather'; the tools are: lookup"),
        (ToolCall("lookup", {}), "bad arguments for 'lookup': missing required argument 'city'"),
        (ToolCall("lookup", {"city": "Oslo", "hours": 3}),
         "bad arguments for 'lookup': unknown argument 'hours' (it takes 'city', 'days', "
         "'units', 'note')"),
        (ToolCall("lookup", {"city": "Oslo", "days": True}),
         "bad arguments for 'lookup': argument 'days' must be integer, got bool true"),
        (ToolCall("lookup", {"city": "Oslo", "units": "kelvin"}),
         "bad arguments for 'lookup': argument 'units' must be one of ['metric', 'imperial'], "
         'got "kelvin"'),
        (ToolCall("lookup", {"city": "Atlantis"}), "'lookup' failed: LookupError: no such city"),
    ]
    for call, message in cases:
        result = ToolRegistry([lookup]).execute(call)
        assert (result.ok, result.error, result.content) == (False, message, f"Error: {message}")


def test_check_arguments_number_accepts_int_and_extra_allowed():
    schema = {"type": "object", "properties": {"x": {"type": "number"}},
              "additionalProperties": True}
    assert check_arguments({"x": 2, "y": 1}, schema) is None
    assert check_arguments({"x": "2"}, schema) == "argument 'x' must be number, got str \"2\""


@pytest.mark.parametrize("expression, value", [
    ("(3 + 4) * 2 / 7", "2"),        # 14 / 7 = 2.0, written as an integer
    ("2 ** 10", "1024"),
    ("2^3", "8"),                     # ^ read as a power, as people write it
    ("7 / 2", "3.5"),
    ("1 / 3", "0.333333333333"),      # 12 significant digits
    ("-3 % 5", "2"),                  # Python's modulo: -3 = -1 * 5 + 2
    ("sqrt(16) + abs(-2) + max(1, 5) + round(2.6)", "14"),  # 4 + 2 + 5 + 3
    ("17 * 23", "391"),
])
def test_calculator_values(expression, value):
    assert ToolRegistry([calculator_tool()]).execute(
        ToolCall("calculator", {"expression": expression})).content == value


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"),
    ("9 ** 9 ** 9", "the exponent 387420489 is too large (at most 1000)"),
    ("__import__('os').system('ls')", "Call is not allowed"),
    ("__import__('os')", "unknown function '__import__'"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "only numbers are allowed, not 'a'"),
    ("", "the expression is empty"),
    ("2 +", "not an arithmetic expression"),
    ("10.0 ** 300", "the result is too large"),
])
def test_calculator_refusals(expression, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate_arithmetic(expression)
    result = ToolRegistry([calculator_tool()]).execute(
        ToolCall("calculator", {"expression": expression}))
    assert not result.ok and message in result.content


def test_format_number():
    assert [format_number(v) for v in (3, 2.0, 0.1 + 0.2, 1e20, -0.5)] == [
        "3", "2", "0.3", "1e+20", "-0.5"]


class TwoPassages:
    def search(self, query, k):
        passages = [{"title": "Mount Keldor", "text": "Mount Keldor was first climbed in 1842."},
                    {"title": "", "text": "x" * 20}]
        return [(p, 1.0) for p in passages][:k] if "keldor" in query.lower() else []


def test_search_tool():
    registry = ToolRegistry([search_tool(TwoPassages(), top_k=2, max_passage_chars=10)])
    assert registry.execute(ToolCall("search", {"query": "Keldor"})).content == (
        "[1] Mount Keldor: Mount Keld ...\n[2] xxxxxxxxxx ...")
    assert registry.execute(ToolCall("search", {"query": "Zed"})).content == (
        "No passages match 'Zed'. Try the exact name of an entity.")
    with pytest.raises(ValueError, match="needs a search_index"):
        builtin_tools(["search"])
    with pytest.raises(ValueError, match="unknown built-in tool 'shell'"):
        builtin_tools(["shell"])


def test_python_tool_runs_in_the_sandbox():
    mode = "bubblewrap" if sandbox_unavailable_reason() is None else "unsafe_no_isolation"
    registry = ToolRegistry([python_tool(mode, pool_size=1)])
    try:
        assert registry.execute(ToolCall("python", {"code": "print(6 * 7)"})).content == "42"
        failed = registry.execute(ToolCall("python", {"code": "print('a')\n1 / 0"})).content
        assert failed.startswith("a\n[stderr]\nTraceback")
        assert failed.endswith("ZeroDivisionError: division by zero\n[error, exit code 1]")
        assert registry.execute(ToolCall("python", {"code": "pass"})).content == "[no output]"
    finally:
        registry.close()
