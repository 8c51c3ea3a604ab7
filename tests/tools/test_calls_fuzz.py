"""parse_tool_calls on hostile replies, in both call formats: nesting past Python's recursion
limit, integers past its int-parsing limit, unicode (lone surrogates, right-to-left marks,
NUL), truncation at every cut point of valid calls, thousands of repeated tags, and seeded
random mixes of the syntax. The parser must never raise, never fall back to its last-resort
guard, hand out only calls a tool, a tokenizer and an HTTP reply can carry, and stay linear in
the reply's length."""

import json
import random
import time

import pytest

from rl_tpu.tools.calls import (CALL_FORMATS, MAX_INTEGER_DIGITS, MAX_JSON_DEPTH, ParsedReply,
                                ToolCall, format_tool_call, parse_tool_calls)

GUARD = "could not be read for tool calls"  # the guard's message: a bound the parser missed


def parse_checked(text: str, call_format: str) -> ParsedReply:
    """parse_tool_calls, and every property of its result a consumer relies on."""
    parsed = parse_tool_calls(text, call_format)
    assert isinstance(parsed, ParsedReply) and isinstance(parsed.content, str)
    assert not any(GUARD in e for e in parsed.errors), parsed.errors
    for call in parsed.calls:
        assert isinstance(call.name, str) and call.name.strip()
        assert isinstance(call.arguments, dict)
        # what the OpenAI route (ensure_ascii) and a tool's prompt text (utf-8) do with a call
        json.dumps(call.arguments)
        json.dumps(call.arguments, ensure_ascii=False).encode("utf-8")
    for error in parsed.errors:
        assert isinstance(error, str) and len(error) < 2000
        error.encode("utf-8")  # an error message is an observation the tokenizer must take
    return parsed


def wrap(call_format: str, body: str) -> str:
    return f"<tool_call>{body}</tool_call>" if call_format == "hermes" else body


def call_text(call_format: str, arguments_json: str) -> str:
    key = "arguments" if call_format == "hermes" else "parameters"
    return wrap(call_format, f'{{"name": "f", "{key}": {arguments_json}}}')


DEEP = [1_000, 3_000, 100_000]


@pytest.mark.parametrize("call_format", CALL_FORMATS)
@pytest.mark.parametrize("depth", DEEP)
def test_nesting_past_the_recursion_limit_is_an_error(call_format, depth):
    for nested in ("[" * depth, "{\"a\": " * depth, "[" * depth + "]" * depth,
                   "[{" * (depth // 2) + "}]" * (depth // 2)):
        parsed = parse_checked(call_text(call_format, nested), call_format)
        assert not parsed.calls and "nests more than" in " ".join(parsed.errors)
        # the same nesting inside the JSON string of the arguments (OpenAI's wire form)
        parsed = parse_checked(call_text(call_format, json.dumps(nested)), call_format)
        assert not parsed.calls and "nests more than" in " ".join(parsed.errors)
    assert not parse_checked(wrap(call_format, "[" * depth), call_format).calls


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_nesting_within_the_bound_and_brackets_in_strings_are_calls(call_format):
    within = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)
    [call] = parse_checked(call_text(call_format, f'{{"x": {within}}}'), call_format).calls
    assert json.dumps(call.arguments["x"]) == within
    brackets = json.dumps({"x": "[" * 5000 + '\\"{' * 100})  # strings do not nest
    [call] = parse_checked(call_text(call_format, brackets), call_format).calls
    assert call.arguments == json.loads(brackets)


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_huge_numbers(call_format):
    for digits in (MAX_INTEGER_DIGITS + 1, 5_000, 100_000):
        for number in ("9" * digits, "-" + "9" * digits):
            parsed = parse_checked(call_text(call_format, f'{{"x": {number}}}'), call_format)
            assert not parsed.calls and f"{digits} digits" in parsed.errors[0]
            inner = json.dumps(f'{{"x": {number}}}')  # inside the arguments' JSON string
            assert not parse_checked(call_text(call_format, inner), call_format).calls
    [call] = parse_checked(call_text(call_format, f'{{"x": {"7" * MAX_INTEGER_DIGITS}}}'),
                           call_format).calls
    assert call.arguments["x"] == int("7" * MAX_INTEGER_DIGITS)
    for number in ("1e999999", "-1e999999", "1" * 5000 + ".5", "0." + "0" * 5000 + "1", "-0"):
        parse_checked(call_text(call_format, f'{{"x": {number}}}'), call_format)


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_unicode(call_format):
    for value in ("\u202eevil\u202c", "שלום עולם", "e\u0301" * 500, "😀", "\x00", "\ufeff",
                  "\U0010ffff"):
        [call] = parse_checked(call_text(call_format, json.dumps({"x": value})),
                               call_format).calls
        assert call.arguments == {"x": value}
    # a lone surrogate escape decodes to half a UTF-16 pair, which no encoding can carry
    for escape in ('"\\ud800"', '"\\udfff"', '"a\\ud83d"', '"\\ude00\\ud83d"'):
        parsed = parse_checked(call_text(call_format, f'{{"x": {escape}}}'), call_format)
        assert not parsed.calls and "lone surrogate" in parsed.errors[0]
    [call] = parse_checked(call_text(call_format, '{"x": "\\ud83d\\ude00"}'), call_format).calls
    assert call.arguments == {"x": "😀"}  # a whole pair is a character
    # raw surrogates and marks in the reply itself (a str a caller built, not a decode)
    for text in ("\ud800" + call_text(call_format, "{}") + "\udfff", "\u202e" * 1000,
                 "\x00" * 100, wrap(call_format, "\ud800")):
        parse_checked(text, call_format)


def valid_reply(call_format: str) -> tuple[str, list[ToolCall]]:
    calls = [ToolCall("calculator", {"expression": "17 * 23"}),
             ToolCall("search", {"query": "Mount Keldor", "k": [1, {"a": None}]})]
    if call_format == "hermes":
        text = "Let me see. " + "".join(format_tool_call(c.name, c.arguments, call_format)
                                        for c in calls) + " done"
    else:
        text = "<|python_tag|>" + "; ".join(format_tool_call(c.name, c.arguments, call_format)
                                            for c in calls)
    return text, calls


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_truncation_at_every_cut_point(call_format):
    text, calls = valid_reply(call_format)
    assert parse_checked(text, call_format).calls == tuple(calls)
    first_end = text.index(format_tool_call(calls[0].name, calls[0].arguments, call_format))
    first_end += len(format_tool_call(calls[0].name, calls[0].arguments, call_format))
    for cut in range(len(text) + 1):
        parsed = parse_checked(text[:cut], call_format)
        assert len(parsed.calls) <= 2
        if call_format == "hermes" and cut >= first_end:
            assert parsed.calls[0] == calls[0]  # a cut never loses a call it left whole
        parse_checked(text[cut:], call_format)


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_random_mixes_of_the_syntax(call_format):
    pieces = ["<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", "[", "]", '"', "\\",
              '"name"', '"arguments"', '"parameters"', ":", ",", ";", '"f"', " ", "\n", "null",
              "9" * 60, "1e999", "-", "\\u", "\\ud800", "\ud800", "\u202e", "\x00", "😀", "é",
              '{"name": "f", "arguments": {}}', '{"name": "f", "parameters": {"a": [1]}}',
              "[" * 1200, "{\"a\": " * 400, "9" * 4400]  # past Python's recursion, int limits
    rng = random.Random(45)
    for _ in range(1500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60)))
        parse_checked(text, call_format)
        parse_checked(wrap(call_format, text), call_format)


def seconds_to_parse(text: str, call_format: str) -> float:
    started = time.perf_counter()
    parse_checked(text, call_format)
    return time.perf_counter() - started


@pytest.mark.parametrize("call_format", CALL_FORMATS)
def test_time_is_linear_in_the_reply(call_format):
    """Replies of 32k repeated pieces: a quadratic parser (a lazy regex rescanning to the end
    from each unclosed `<tool_call>`: 17.8 s at 16k of them) takes over a minute here; this
    one at most half a second. The bound leaves a loaded machine 20x, and is still far below
    what a quadratic parse takes."""
    n = 32_000
    one_call = format_tool_call("f", {"x": 1}, call_format)
    replies = ["<tool_call>" * n, "<tool_call>{" * n, "</tool_call>" * n,
               "<tool_call></tool_call>" * n, "<tool_call>[" * n, one_call * (n // 8),
               (one_call + ";") * (n // 8), "{" + '"name": "f", ' * n, "[" * n, '"\\' * n,
               "\\" * n + '"', '"' + '\\"' * n, "{" * n + "<tool_call>" * n]
    for reply in replies:
        assert seconds_to_parse(reply, call_format) < 10.0, reply[:40]
