"""OpenAI's chat/completions and completions APIs as pure functions: request bodies checked and
turned into rl_tpu's requests, results turned into OpenAI's reply and stream-chunk shapes.

The rollout server (openai_routes.py) serves them; an agent-program recorder that talks to
the server, or replays what it answered, imports the same functions, so both read one shape.
Nothing here holds state or touches the device: a function takes the tokenizer it needs.

What a reply carries beyond OpenAI's fields (rl_tpu's, for RL: the exact ids and log-probs a
trainer learns from, without re-tokenizing the text): each choice has `prompt_token_ids`
(the prompt as the model saw it, chat template applied), `token_ids` (the completion's ids,
after any stop-string cut) and `weight_version` (the weights that sampled it, as /generate's
meta_info). `logprobs` (when asked for) has one entry per id of `token_ids`, in order.

What is refused with a 400 (BadRequest) rather than silently ignored: top_logprobs > 0 (the
sampler keeps the sampled token's log-probability only), completions' logprobs > 0 (same),
tool_choice other than "auto"/"none", best_of > 1, echo, suffix, a non-zero presence or
frequency penalty, logit_bias, a response_format other than text, and content parts other
than text.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional, Sequence, Union

from rl_tpu.core.engine import GenerateResult, SamplingParams
from rl_tpu.rollout.server_requests import stop_token_ids_field
from rl_tpu.serving import (INT32_MAX, INT64_MAX, INT64_MIN, BadRequest, flag_field,
                            integer_field, number_field, shown, text_field)
from rl_tpu.tools.calls import UnreadableJson, decode_call_json

ROLES = ("system", "developer", "user", "assistant", "tool")
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def error_body(message: str, param: Optional[str] = None,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape (the openai client reads error.message; rl_tpu's own errors are
    {"error": {"message"}}, a subset of it)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A checked /v1/chat/completions body. `max_tokens` None: as many as the context holds.
    `messages` are ready for the chat template (content as text, tool-call arguments as
    objects); `tools` is None when the template must not see them (none sent, or
    tool_choice "none")."""

    messages: list[dict]
    sampling: SamplingParams
    max_tokens: Optional[int]
    tools: Optional[list[dict]] = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A checked /v1/completions body: `prompts` are text or token ids (one or several)."""

    prompts: list[Union[str, list[int]]]
    sampling: SamplingParams
    max_tokens: Optional[int]
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


def _object(body: Any, where: str = "body") -> dict:
    if not isinstance(body, dict):
        raise BadRequest(f"'{where}' must be a JSON object, got {shown(body)}")
    return body


def _given(body: dict, name: str) -> bool:
    return body.get(name) is not None  # null is "not given", as OpenAI's API reads it


def _refuse_unsupported(body: dict) -> None:
    """Fields that would change what is sampled and that this server cannot honour."""
    for name in ("presence_penalty", "frequency_penalty"):
        if _given(body, name) and number_field(body[name], name, -2.0, 2.0) != 0:
            raise BadRequest(f"'{name}' is not supported by this server (send 0 or leave it "
                             "out)")
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequest(f"'response_format' {shown(fmt)} is not supported: this server "
                         "writes plain text (type 'text')")


def sampling_of(body: dict, max_tokens: Optional[int]) -> SamplingParams:
    """OpenAI's sampling fields (and SGLang's extras: top_k, min_tokens, ignore_eos,
    stop_token_ids) as SamplingParams. `max_tokens` None stands in as INT32_MAX until the
    server knows the prompt's length (`with_max_tokens`)."""
    stop = body["stop"] if _given(body, "stop") else []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a non-empty string or a list of them, got "
                         f"{shown(body.get('stop'))}")
    stop_ids = stop_token_ids_field(body["stop_token_ids"] if _given(body, "stop_token_ids")
                                    else [], "stop_token_ids")
    top_k = integer_field(body["top_k"], "top_k", -1, INT32_MAX) if _given(body, "top_k") else -1
    if top_k == 0:
        raise BadRequest("'top_k' must be -1 (all tokens) or >= 1, got 0")
    limit = INT32_MAX if max_tokens is None else max_tokens
    min_new = integer_field(body["min_tokens"], "min_tokens", 0, limit) if _given(
        body, "min_tokens") else 0
    return SamplingParams(
        max_new_tokens=limit, min_new_tokens=min_new,
        temperature=number_field(body["temperature"], "temperature", 0.0, float("inf"))
        if _given(body, "temperature") else 1.0,
        top_p=number_field(body["top_p"], "top_p", 0.0, 1.0, low_open=True)
        if _given(body, "top_p") else 1.0,
        top_k=top_k, stop=tuple(text_field(s, f"stop[{i}]") for i, s in enumerate(stop)),
        stop_token_ids=stop_ids,
        ignore_eos=flag_field(body["ignore_eos"], "ignore_eos") if _given(body, "ignore_eos")
        else False,
        n=integer_field(body["n"], "n", 1, INT32_MAX) if _given(body, "n") else 1,
        seed=integer_field(body["seed"], "seed", INT64_MIN, INT64_MAX) if _given(body, "seed")
        else None)


def with_max_tokens(sampling: SamplingParams, max_tokens: int) -> SamplingParams:
    """`sampling` with its token budget set (min_tokens checked against it)."""
    if sampling.min_new_tokens > max_tokens:
        raise BadRequest(f"'min_tokens' ({sampling.min_new_tokens}) is over max_tokens "
                         f"({max_tokens})")
    return dataclasses.replace(sampling, max_new_tokens=max_tokens)


def _max_tokens(body: dict, names: Sequence[str]) -> Optional[int]:
    values = {name: integer_field(body[name], name, 0, INT32_MAX) for name in names
              if _given(body, name)}
    if len(set(values.values())) > 1:
        raise BadRequest(f"{' and '.join(values)} disagree ({values}); send one")
    return next(iter(values.values()), None)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = flag_field(body["stream"], "stream") if _given(body, "stream") else False
    options = _object(body.get("stream_options") or {}, "stream_options")
    usage = options.get("include_usage")
    return stream, (flag_field(usage, "stream_options.include_usage") if usage is not None
                    else False)


def _content_text(content: Any, where: str) -> Optional[str]:
    """A message's content as text: a string, null, or a list of {"type": "text"} parts."""
    if content is None or isinstance(content, str):
        return None if content is None else text_field(content, where)
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string, null or a list of text parts, got "
                         f"{shown(content)}")
    texts = []
    for i, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise BadRequest(f"'{where}[{i}]' must be {{\"type\": \"text\", \"text\": ...}} "
                             f"(this server reads text only), got {shown(part)}")
        texts.append(text_field(part["text"], f"{where}[{i}].text"))
    return "".join(texts)


def _tool_call_for_template(call: Any, where: str) -> dict:
    """An assistant message's tool call as chat templates read it: arguments as an object
    (OpenAI sends them as a JSON string)."""
    call = _object(call, where)
    function = _object(call.get("function"), f"{where}.function")
    name, arguments = function.get("name"), function.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise BadRequest(f"'{where}.function.name' must be a non-empty string")
    if isinstance(arguments, str):
        try:  # bounded as a model's calls are (depth, digits): a client's JSON is no safer
            arguments = decode_call_json(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise BadRequest(f"'{where}.function.arguments' is not JSON: {err}") from err
        except UnreadableJson as err:
            raise BadRequest(f"'{where}.function.arguments' cannot be read: {err}") from err
    if not isinstance(arguments, dict):
        raise BadRequest(f"'{where}.function.arguments' must be a JSON object")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest(f"'messages' must be a non-empty list of messages, got {shown(raw)}")
    messages = []
    for i, message in enumerate(raw):
        message = _object(message, f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got "
                             f"{shown(role)}")
        out = {"role": "system" if role == "developer" else role,
               "content": _content_text(message.get("content"), f"messages[{i}].content")}
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"'messages[{i}].tool_calls' must be a list, on an assistant "
                                 "message")
            out["tool_calls"] = [_tool_call_for_template(c, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(calls)]
        elif out["content"] is None:
            raise BadRequest(f"'messages[{i}].content' is missing")
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
        messages.append(out)
    return messages


def _tools(body: dict) -> Optional[list[dict]]:
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise BadRequest(f"'tool_choice' {shown(choice)} is not supported: use \"auto\" or "
                         "\"none\"")
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise BadRequest(f"'tools' must be a list of tools, got {shown(tools)}")
    for i, tool in enumerate(tools):
        tool = _object(tool, f"tools[{i}]")
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ..., \"parameters\": ...}}}}, got {shown(tool)}")
    return None if choice == "none" else tools


def parse_chat_request(body: Any) -> ChatRequest:
    """A /v1/chat/completions body -> ChatRequest; BadRequest naming the first bad field."""
    body = _object(body)
    _refuse_unsupported(body)
    if _given(body, "top_logprobs") and integer_field(body["top_logprobs"], "top_logprobs", 0,
                                                 20) > 0:
        raise BadRequest("'top_logprobs' > 0 is not supported: this server returns the "
                         "sampled token's log-probability only (send logprobs: true, "
                         "top_logprobs: 0 or none)")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    stream, include_usage = _stream_flags(body)
    return ChatRequest(
        messages=_messages(body.get("messages")), sampling=sampling_of(body, max_tokens),
        max_tokens=max_tokens, tools=_tools(body),
        logprobs=flag_field(body["logprobs"], "logprobs") if _given(body, "logprobs") else False,
        stream=stream, include_usage=include_usage)


def _prompts(raw: Any, vocab_size: int) -> list[Union[str, list[int]]]:
    def ids(prompt: list, where: str) -> list[int]:
        if not prompt:
            raise BadRequest(f"'{where}' is empty: a prompt needs one token at least")
        for j, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int) or \
                    not 0 <= token < vocab_size:
                raise BadRequest(f"'{where}[{j}]' must be a token id in [0, {vocab_size}) "
                                 f"(the model's vocab), got {shown(token)}")
        return list(prompt)

    if isinstance(raw, str):
        return [text_field(raw, "prompt")]
    if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        return [ids(raw, "prompt")]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids "
                         f"or a list of such lists, got {shown(raw)}")
    prompts: list[Union[str, list[int]]] = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            prompts.append(text_field(p, f"prompt[{i}]"))
        elif isinstance(p, list):
            prompts.append(ids(p, f"prompt[{i}]"))
        else:
            raise BadRequest(f"'prompt[{i}]' must be a string or a list of token ids, got "
                             f"{shown(p)}")
    return prompts


def parse_completion_request(body: Any, vocab_size: int) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest; BadRequest naming the first bad field."""
    body = _object(body)
    _refuse_unsupported(body)
    if _given(body, "best_of") and integer_field(body["best_of"], "best_of", 1, INT32_MAX) > 1:
        raise BadRequest("'best_of' > 1 is not supported: ask for n samples instead")
    if body.get("echo"):
        raise BadRequest("'echo' is not supported: prompt_token_ids come with every choice")
    if body.get("suffix"):
        raise BadRequest("'suffix' is not supported by this server")
    logprobs = integer_field(body["logprobs"], "logprobs", 0, 5) if _given(body, "logprobs") \
        else None
    if logprobs:
        raise BadRequest("'logprobs' > 0 (top alternatives) is not supported: send "
                         "logprobs: 0 for the sampled tokens' log-probabilities")
    max_tokens = _max_tokens(body, ("max_tokens",))
    stream, include_usage = _stream_flags(body)
    return CompletionRequest(
        prompts=_prompts(body.get("prompt"), vocab_size),
        sampling=sampling_of(body, 16 if max_tokens is None else max_tokens),  # OpenAI's 16
        max_tokens=16 if max_tokens is None else max_tokens, logprobs=logprobs is not None,
        stream=stream, include_usage=include_usage)


# -- replies ---------------------------------------------------------------------------------

def finish_reason(result: GenerateResult, called_tools: bool = False) -> str:
    """OpenAI's finish_reason of a result ("tool_calls" when the reply called a tool)."""
    if called_tools and result.finish_reason == "stop":
        return "tool_calls"
    return FINISH_REASONS[result.finish_reason]


def tool_calls_json(calls: Sequence[Any], id_prefix: str = "call") -> list[dict]:
    """rl_tpu.tools.calls.ToolCall(name, arguments, id) -> OpenAI's tool_calls entries
    (arguments as a JSON string, as OpenAI sends them). A call whose format carries no id gets
    `{id_prefix}_{its place}`: a client answers each call by its id (a tool message's
    tool_call_id), so it needs one; make the prefix unique to the reply."""
    return [{"id": call.id or f"{id_prefix}_{j}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for j, call in enumerate(calls)]


def chat_logprobs(ids: Sequence[int], logprobs: Sequence[float],
                  token_text: Callable[[int], str]) -> dict:
    """OpenAI's chat `logprobs` object: one entry a token id, no alternatives."""
    content = []
    for token, logprob in zip(ids, logprobs):
        text = token_text(token)
        content.append({"token": text, "logprob": float(logprob),
                        "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return {"content": content}


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float],
                        token_text: Callable[[int], str], offset: int = 0) -> dict:
    """OpenAI's completions `logprobs` object (tokens, token_logprobs, text_offset), from
    character `offset` of the choice's text."""
    tokens = [token_text(t) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs],
            "top_logprobs": None, "text_offset": offsets}


def _ids_fields(prompt_ids: Sequence[int], result: GenerateResult) -> dict:
    return {"prompt_token_ids": list(prompt_ids), "token_ids": list(result.output_ids),
            "weight_version": result.weight_version}


def chat_choice(index: int, result: GenerateResult, text: str, prompt_ids: Sequence[int],
                parsed: Any = None, logprobs: bool = False,
                token_text: Optional[Callable[[int], str]] = None,
                call_id_prefix: str = "call") -> dict:
    """One chat choice. `text` is the decoded completion (stop string cut); `parsed`, when the
    request had tools, is rl_tpu.tools.calls.parse_tool_calls' ParsedReply of it;
    `token_text(id)` a token's text (for logprobs)."""
    calls = tuple(parsed.calls) if parsed is not None else ()
    content: Optional[str] = parsed.content if parsed is not None else text
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = tool_calls_json(calls, f"{call_id_prefix}_{index}")
        if not (content or "").strip():
            message["content"] = None  # as OpenAI: a reply that only calls has no content
    choice = {"index": index, "message": message,
              "logprobs": chat_logprobs(result.output_ids, result.logprobs, token_text)
              if logprobs else None,
              "finish_reason": finish_reason(result, bool(calls)),
              **_ids_fields(prompt_ids, result)}
    if parsed is not None and parsed.errors:
        choice["tool_call_errors"] = [str(e) for e in parsed.errors]
    return choice


def completion_choice(index: int, result: GenerateResult, text: str,
                      prompt_ids: Sequence[int], logprobs: bool = False,
                      token_text: Optional[Callable[[int], str]] = None) -> dict:
    return {"index": index, "text": text,
            "logprobs": completion_logprobs(result.output_ids, result.logprobs, token_text)
            if logprobs else None,
            "finish_reason": finish_reason(result), **_ids_fields(prompt_ids, result)}


def usage(prompt_lengths: Sequence[int], results: Sequence[GenerateResult]) -> dict:
    """OpenAI's usage: each prompt counted once (not once per sample), every completion."""
    prompt = sum(prompt_lengths)
    completion = sum(len(r.output_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def chat_response(request_id: str, model: str, created: int, choices: list[dict],
                  usage_: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def completion_response(request_id: str, model: str, created: int, choices: list[dict],
                        usage_: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_chunk(request_id: str, model: str, created: int, choices: list[dict],
               usage_: Optional[dict] = None) -> dict:
    """A chat stream chunk; each choice is {"index", "delta", "logprobs", "finish_reason"}."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def completion_chunk(request_id: str, model: str, created: int, choices: list[dict],
                     usage_: Optional[dict] = None) -> dict:
    """A completions stream chunk; each choice is {"index", "text", "logprobs",
    "finish_reason"} (OpenAI streams completions as text_completion objects)."""
    chunk = {"id": request_id, "object": "text_completion", "created": created,
             "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def models_list(model: str, created: int) -> dict:
    """GET /v1/models: the one served model."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "rl_tpu", "root": model}]}


def sse(payload: Union[dict, str]) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`) and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
