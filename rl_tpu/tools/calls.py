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
turns a reply into a `ParsedReply`. Model output is never trusted: parsing never raises, and
each malformed call becomes a message in `ParsedReply.errors` that the env can hand back to
the model as an observation.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

CALL_FORMATS = ("hermes", "llama3_json")

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


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
    """Split a model reply into its text and tool calls. Never raises on model output.

    Raises:
      ValueError: `call_format` is not one of CALL_FORMATS (a configuration error).
    """
    if call_format == "hermes":
        return _parse_hermes(text if isinstance(text, str) else "")
    if call_format == "llama3_json":
        return _parse_llama3_json(text if isinstance(text, str) else "")
    raise ValueError(f"unknown call_format {call_format!r}; use one of {CALL_FORMATS}")


def _call_from_json(body: str, arguments_key: str, where: str) -> tuple[ToolCall | None, str]:
    """(the call, "") from the JSON text of one call, or (None, what is wrong with it)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, (f"{where} is not valid JSON ({e.msg} at character {e.pos}): "
                      f"{body.strip()[:200]!r}")
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
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return None, (f'{where} to {name!r}: "{key}" must be a JSON object of argument names to '
                      f"values, got {type(args).__name__}: {json.dumps(obj.get(key))[:200]}")
    call_id = obj.get("id")
    return ToolCall(name.strip(), args, call_id if isinstance(call_id, str) else ""), ""


def _parse_hermes(text: str) -> ParsedReply:
    calls, errors, outside, at = [], [], [], 0
    for n, m in enumerate(_HERMES_BLOCK.finditer(text), 1):
        outside.append(text[at:m.start()])
        at = m.end()
        call, error = _call_from_json(m.group(1), "arguments", f"tool call {n}")
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    rest = text[at:]
    opened = rest.find(_HERMES_OPEN)
    if opened >= 0:  # a call the model began and never closed (often cut by length)
        errors.append(f"tool call {len(calls) + len(errors) + 1} has no closing </tool_call>: "
                      f"{rest[opened:][:200]!r}")
        rest = rest[:opened]
    outside.append(rest)
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
    decoder = json.JSONDecoder()
    calls, errors, pos, n = [], [], 0, 0
    while pos < len(body):
        n += 1
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            errors.append(f"tool call {n} is not valid JSON ({e.msg} at character {e.pos}): "
                          f"{body[pos:][:200]!r}")
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
                          f"{body[pos:][:200]!r}")
            break
    return ParsedReply("", tuple(calls), tuple(errors))
