"""Tool calls in a model's reply: which text format a chat template uses, and parsing it.

Instruct models write function calls as text their chat template defines; the template also
renders a structured assistant message (`tool_calls=[...]`) back into that same text. Two
formats cover the models rl_tpu trains:

  hermes       Qwen2.5 / Qwen3 (and Hermes-style templates): each call is a JSON object
               `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`
               tags; a reply may hold several, with text around them.
  llama3_json  Llama 3.1 / 3.2 instruct: the whole reply is one JSON object
               `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`).
               Llama's template renders one call per assistant message; a reply holding
               several objects separated by ";" is still parsed, each as a call.

`call_format_of(tokenizer)` reads the format from the template's own text; `parse_tool_calls`
turns a reply into a `ParsedReply`; `format_tool_call` writes a call the way the template does
(for teachers and demos). Model output is never trusted: parsing never raises, and each
malformed call becomes a message in `ParsedReply.errors` that the env can hand back to the
model as an observation. Parsing is linear in the reply's length, and the JSON of a call is
bounded before Python decodes it: at most MAX_JSON_DEPTH levels of nesting (Python's decoder
recurses once a level, so 1,000 nested `[` would be a RecursionError) and integers of at most
MAX_INTEGER_DIGITS digits (Python refuses to convert longer ones, and a tool cannot use them).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rl_tpu.http_limits import deeper_than

CALL_FORMATS = ("hermes", "llama3_json")
MAX_JSON_DEPTH = 64
MAX_INTEGER_DIGITS = 1000

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


class UnreadableJson(ValueError):
    """JSON that is well-formed or not but past what a call may hold (too deep, a too long
    integer): the message says which bound and what to write instead."""


def _bounded_integer(digits: str) -> int:
    if len(digits) - digits.startswith("-") > MAX_INTEGER_DIGITS:
        raise UnreadableJson(f"it holds an integer of {len(digits.lstrip('-'))} digits; the most "
                             f"is {MAX_INTEGER_DIGITS}")
    return int(digits)


_DECODER = json.JSONDecoder(parse_int=_bounded_integer)


def _check_depth(text: str) -> None:
    # the servers' scan of request bodies; non-ASCII bytes are never structure, and
    # surrogatepass lets a lone surrogate in the text through to be refused later by name
    if deeper_than(text.encode("utf-8", "surrogatepass"), MAX_JSON_DEPTH):
        raise UnreadableJson(f"it nests more than {MAX_JSON_DEPTH} levels of [ and {{")


def decode_call_json(text: str) -> Any:
    """json.loads within the bounds of the module docstring, for a call's JSON from anywhere
    (a reply, a client's arguments string). Raises json.JSONDecodeError (malformed) or
    UnreadableJson (past a bound): both ValueErrors."""
    _check_depth(text)
    return _DECODER.decode(text)


def _lone_surrogate(value: Any) -> bool:
    """Whether a decoded value holds half a UTF-16 pair (JSON's "\\ud800" escape alone): no
    text encoding can carry it to a tool, a tokenizer or an HTTP reply."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call: the tool's name, its arguments (a JSON object), and an id (the
    OpenAI `tool_call_id`; "" when the format carries none, as both formats here do)."""

    name: str
    arguments: dict
    id: str = ""

    def as_message_call(self) -> dict:
        """The OpenAI / transformers structured form, for an assistant message's `tool_calls`."""
        call = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id:
            call["id"] = self.id
        return call


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text and its calls.

    content: the reply's text outside the calls, stripped ("" for a reply that is only calls).
    calls: the well-formed calls, in order.
    errors: one message per malformed call, saying what was wrong with it.
    """

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


def _template_text(tokenizer) -> str:
    """The chat template source of a ChatTokenizer, a transformers tokenizer, or a string."""
    if isinstance(tokenizer, str):
        return tokenizer
    hf = getattr(tokenizer, "hf", tokenizer)
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):  # named templates: the "tool_use" one holds the tool format
        template = template.get("tool_use") or template.get("default") or ""
    return template or ""


def call_format_of(tokenizer) -> str:
    """The tool-call format of `tokenizer`'s chat template: "hermes" or "llama3_json".

    Accepts a `ChatTokenizer`, a `transformers` tokenizer, or the template text itself. The
    format is read from what the template writes for a structured call, so a fine-tuned model
    that kept its base model's template is recognised too.

    Raises:
      ValueError: the tokenizer has no chat template, or its template has no tool support
        (it never renders `tools` or an assistant message's `tool_calls`).
    """
    text = _template_text(tokenizer)
    if not text:
        raise ValueError("the tokenizer has no chat template, so it has no tool-call format; "
                         "use an instruct model's tokenizer (e.g. Qwen2.5-Instruct, "
                         "Llama-3.1-Instruct)")
    if "tool_calls" not in text and "tools" not in text:
        raise ValueError("the chat template has no tool support: it never renders `tools` or an "
                         "assistant message's `tool_calls`; function calling needs a template "
                         "that does (e.g. Qwen2.5-Instruct's or Llama-3.1-Instruct's)")
    if "<tool_call>" in text:
        return "hermes"
    if '"parameters"' in text or "ipython" in text:
        return "llama3_json"
    raise ValueError("the chat template mentions tools but writes calls in a format rl_tpu does "
                     f"not parse; supported: {', '.join(CALL_FORMATS)} (<tool_call> JSON tags as "
                     "in Qwen2.5, or a bare JSON object with \"parameters\" as in Llama 3.1)")


def parse_tool_calls(text: str, call_format: str) -> ParsedReply:
    """Split a model reply into its text and tool calls. Never raises on model output, and
    takes time linear in its length.

    Raises:
      ValueError: `call_format` is not one of CALL_FORMATS (a configuration error).
    """
    if call_format not in _PARSERS:
        raise ValueError(f"unknown call_format {call_format!r}; use one of {CALL_FORMATS}")
    text = text if isinstance(text, str) else ""
    try:
        return _PARSERS[call_format](text)
    except Exception as e:  # noqa: BLE001 - a guard only: the bounds above leave no known way
        # here (the fuzz test checks it never fires), but a reply must not fail a step or a route
        return ParsedReply(text.strip(), (), (f"the reply could not be read for tool calls "
                                              f"({type(e).__name__}); write each call as one "
                                              f"JSON object",))


def format_tool_call(name: str, arguments: dict, call_format: str) -> str:
    """One call as a model writes it in `call_format` (the inverse of `parse_tool_calls`):
    what a teacher's demo must contain to teach that format."""
    if call_format == "hermes":
        return f'{_HERMES_OPEN}{json.dumps({"name": name, "arguments": arguments})}{_HERMES_CLOSE}'
    if call_format == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments})
    raise ValueError(f"unknown call_format {call_format!r}; use one of {CALL_FORMATS}")


def _call_from_json(body: str, arguments_key: str, where: str) -> tuple[ToolCall | None, str]:
    """(the call, "") from the JSON text of one call, or (None, what is wrong with it)."""
    try:
        obj = decode_call_json(body)
    except json.JSONDecodeError as e:
        return None, (f"{where} is not valid JSON ({e.msg} at character {e.pos}): "
                      f"{body.strip()[:200]!r}")
    except UnreadableJson as e:
        return None, f"{where} cannot be read: {e}: {body.strip()[:200]!r}"
    return _call_from_object(obj, arguments_key, where)


def _call_from_object(obj: Any, arguments_key: str, where: str) -> tuple[ToolCall | None, str]:
    if not isinstance(obj, dict):
        return None, (f"{where} must be a JSON object, got {type(obj).__name__}: "
                      f"{json.dumps(obj)[:200]}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, (f'{where} has no "name" (a non-empty string naming the tool): '
                      f"{json.dumps(obj)[:200]}")
    # Both keys are accepted in both formats: models trained on one often write the other.
    key = arguments_key if arguments_key in obj else next(
        (k for k in ("arguments", "parameters") if k in obj), arguments_key)
    args = obj.get(key, {})
    if isinstance(args, str):
        # Some models write the arguments as a JSON string (OpenAI's wire form): unwrap it.
        try:
            args = decode_call_json(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
        except UnreadableJson as e:
            return None, f'{where} to {name!r}: "{key}" cannot be read: {e}'
    if not isinstance(args, dict):
        return None, (f'{where} to {name!r}: "{key}" must be a JSON object of argument names to '
                      f"values, got {type(args).__name__}: {json.dumps(obj.get(key))[:200]}")
    if _lone_surrogate(name) or _lone_surrogate(args):
        return None, (f"{where} to {name!r} holds a lone surrogate escape (half of a \\ud800-"
                      "\\udfff pair): write the character itself, or both halves of the pair")
    call_id = obj.get("id")
    return ToolCall(name.strip(), args, call_id if isinstance(call_id, str) else ""), ""


def _parse_hermes(text: str) -> ParsedReply:
    # str.find from where the last block ended, never a regex: a lazy `<tool_call>(.*?)
    # </tool_call>` rescans to the end from every unclosed opening (quadratic in their number).
    calls, errors, outside, at = [], [], [], 0
    while (opened := text.find(_HERMES_OPEN, at)) >= 0:
        closed = text.find(_HERMES_CLOSE, opened + len(_HERMES_OPEN))
        outside.append(text[at:opened])
        if closed < 0:  # a call the model began and never closed (often cut by length)
            errors.append(f"tool call {len(calls) + len(errors) + 1} has no closing "
                          f"</tool_call>: {text[opened:opened + 200]!r}")
            at = len(text)
            break
        call, error = _call_from_json(text[opened + len(_HERMES_OPEN):closed], "arguments",
                                      f"tool call {len(calls) + len(errors) + 1}")
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
        at = closed + len(_HERMES_CLOSE)
    outside.append(text[at:])
    return ParsedReply("".join(outside).strip(), tuple(calls), tuple(errors))


def _parse_llama3_json(text: str) -> ParsedReply:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):].strip()
    looks_like_call = any(f'"{key}"' in body for key in ("name", "parameters", "arguments"))
    if not body.startswith("{") or not (tagged or looks_like_call):
        if tagged:  # the tag announces a call, so what follows must be one
            return ParsedReply("", (), (f"the text after {_PYTHON_TAG} is not a JSON call object: "
                                        f"{body[:200]!r}",))
        # Plain text, or JSON that is no call (e.g. an answer given as an object): no calls.
        return ParsedReply(text.strip())
    try:
        _check_depth(body)  # once for the whole reply: every call's decode is a part of it
    except UnreadableJson as e:
        return ParsedReply("", (), (f"the tool call cannot be read: {e}: {body[:200]!r}",))
    calls, errors, pos, n = [], [], 0, 0
    while pos < len(body):
        n += 1
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            errors.append(f"tool call {n} is not valid JSON ({e.msg} at character {e.pos}): "
                          f"{body[pos:pos + 200]!r}")
            break
        except UnreadableJson as e:
            errors.append(f"tool call {n} cannot be read: {e}: {body[pos:pos + 200]!r}")
            break
        call, error = _call_from_object(obj, "parameters", f"tool call {n}")
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
        if pos < len(body) and body[pos] != "{":
            errors.append(f"text after tool call {n} is neither another call nor a ';': "
                          f"{body[pos:pos + 200]!r}")
            break
    return ParsedReply("", tuple(calls), tuple(errors))


_PARSERS = {"hermes": _parse_hermes, "llama3_json": _parse_llama3_json}
