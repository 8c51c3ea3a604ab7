"""OpenAI request/reply codec (rl_tpu/rollout/openai_api.py) as pure functions: bodies checked
and mapped field by field, refusals that name the field, reply shapes with hand-counted
usage, offsets and tool calls."""

import json

import pytest

from rl_tpu.core.engine import GenerateResult
from rl_tpu.rollout import openai_api as api
from rl_tpu.serving import BadRequest
from rl_tpu.tools.calls import parse_tool_calls

USER = [{"role": "user", "content": "hi"}]


def test_chat_body_maps_every_sampling_field():
    req = api.parse_chat_request({
        "model": "m", "messages": USER, "n": 3, "max_completion_tokens": 7, "temperature": 0.5,
        "top_p": 0.9, "seed": 11, "stop": "END", "logprobs": True, "top_logprobs": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
        "top_k": 4, "min_tokens": 2, "stop_token_ids": [9], "user": "ignored"})
    s = req.sampling
    assert (s.n, s.max_new_tokens, s.temperature, s.top_p, s.seed) == (3, 7, 0.5, 0.9, 11)
    assert (s.stop, s.ignore_eos, s.top_k, s.min_new_tokens, s.stop_token_ids) == \
        (("END",), True, 4, 2, (9,))
    assert req.max_tokens == 7 and req.logprobs and req.stream and req.include_usage
    assert req.tools is None
    # the defaults: one sample at temperature 1, no budget yet (the server fills the room)
    plain = api.parse_chat_request({"messages": USER})
    assert (plain.sampling.n, plain.sampling.temperature, plain.max_tokens) == (1, 1.0, None)
    assert api.with_max_tokens(plain.sampling, 5).max_new_tokens == 5


def test_chat_messages_become_template_messages():
    req = api.parse_chat_request({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "},
                                          {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]})
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.messages[2]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "add",
                                                      "arguments": {"a": 1, "b": 2}}}]
    assert req.messages[3] == {"role": "tool", "content": "3", "tool_call_id": "c1"}


@pytest.mark.parametrize("body, named", [
    ({"messages": []}, "'messages'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": USER, "max_tokens": 4, "max_completion_tokens": 5}, "disagree"),
    ({"messages": USER, "max_tokens": -1}, "max_tokens"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "n": 0}, "'n'"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": USER, "logit_bias": {"5": 10}}, "logit_bias"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER, "stop": ["ok", ""]}, "'stop'"),
    ({"messages": USER, "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ([1, 2], "'body'"),
])
def test_bad_chat_bodies_are_refused_naming_the_field(body, named):
    with pytest.raises(BadRequest, match=named.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(")):
        api.parse_chat_request(body)


def test_stop_token_ids_are_capped_before_they_are_read_and_deduplicated():
    """A million stop ids are refused by their count (nothing walked, no program compiled for
    them); repeats are sent on once, on the OpenAI routes and on /generate alike."""
    import time

    from rl_tpu.rollout.server_requests import sampling_from_json
    many = list(range(1_000_000))
    start = time.perf_counter()
    with pytest.raises(BadRequest, match="1000000 ids are over this server.s limit of 256"):
        api.parse_chat_request({"messages": USER, "stop_token_ids": many})
    with pytest.raises(BadRequest, match=r"'sampling_params.stop_token_ids': 1000000 ids"):
        sampling_from_json({"stop_token_ids": many})
    assert time.perf_counter() - start < 0.5
    assert api.parse_chat_request({"messages": USER, "stop_token_ids": [7, 9, 7, 7]}
                                  ).sampling.stop_token_ids == (7, 9)
    assert sampling_from_json({"stop_token_ids": [3, 3]}).stop_token_ids == (3,)


def test_tool_choice_none_keeps_tools_from_the_template():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    assert api.parse_chat_request({"messages": USER, "tools": tools}).tools == tools
    assert api.parse_chat_request({"messages": USER, "tools": tools,
                                   "tool_choice": "none"}).tools is None


def test_completion_prompts_in_every_form():
    parse = lambda prompt, **kw: api.parse_completion_request(  # noqa: E731
        dict(prompt=prompt, **kw), vocab_size=10)
    assert parse("a b").prompts == ["a b"]
    assert parse([1, 2, 3]).prompts == [[1, 2, 3]]
    assert parse(["x", [4]]).prompts == ["x", [4]]
    assert parse([[1], [2, 3]]).prompts == [[1], [2, 3]]
    req = parse("a", logprobs=0)
    assert req.logprobs and req.max_tokens == 16 and req.sampling.max_new_tokens == 16
    for prompt, named in [([1, 10], r"prompt\[1\]' must be a token id in \[0, 10\)"),
                          ([], "'prompt'"), ([[1], []], r"prompt\[1\]' is empty"),
                          ([1.5], r"'prompt\[0\]' must be a string or a list of token ids")]:
        with pytest.raises(BadRequest, match=named):
            parse(prompt)
    for extra, named in [({"logprobs": 2}, "logprobs"), ({"best_of": 2}, "best_of"),
                         ({"echo": True}, "echo"), ({"suffix": "z"}, "suffix")]:
        with pytest.raises(BadRequest, match=named):
            parse("a", **extra)


def result(ids, logprobs=None, finish="length", matched=None):
    return GenerateResult(list(ids), list(logprobs or [-0.5] * len(ids)), finish,
                          weight_version="v3", matched_stop=matched)


def test_chat_choice_reads_a_tool_call_from_the_reply():
    text = 'Sure.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    parsed = parse_tool_calls(text, "hermes")
    choice = api.chat_choice(1, result([7, 8], finish="stop", matched=2), text, [4, 5, 6],
                             parsed, call_id_prefix="call_x")
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    call = choice["message"]["tool_calls"][0]
    assert call["id"] == "call_x_1_0" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert (choice["prompt_token_ids"], choice["token_ids"], choice["weight_version"]) == \
        ([4, 5, 6], [7, 8], "v3")
    only_call = parse_tool_calls(text[len("Sure."):], "hermes")
    assert api.chat_choice(0, result([7], finish="stop"), "", [1], only_call
                           )["message"]["content"] is None
    # a reply that ran out of tokens mid-call: no call, the length finish, the error kept
    cut = parse_tool_calls('<tool_call>{"name": "add", "argu', "hermes")
    choice = api.chat_choice(0, result([7]), "", [1], cut)
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["tool_call_errors"] == list(cut.errors) and cut.errors


def test_logprobs_shapes_and_usage_counted_by_hand():
    names = {7: "ab", 8: "c", 9: ""}
    lp = api.chat_logprobs([7, 8], [-0.25, -1.5], names.get)
    assert lp == {"content": [
        {"token": "ab", "logprob": -0.25, "bytes": [97, 98], "top_logprobs": []},
        {"token": "c", "logprob": -1.5, "bytes": [99], "top_logprobs": []}]}
    lp = api.completion_logprobs([7, 8, 9, 7], [-1, -2, -3, -4], names.get, offset=5)
    assert lp["text_offset"] == [5, 7, 8, 8] and lp["tokens"] == ["ab", "c", "", "ab"]
    assert lp["token_logprobs"] == [-1.0, -2.0, -3.0, -4.0] and lp["top_logprobs"] is None
    # two prompts (3 and 2 tokens), two samples each: each prompt is counted once
    assert api.usage([3, 2], [result([1] * 4), result([1]), result([1, 1]), result([])]) == \
        {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    choice = api.completion_choice(2, result([7, 8], finish="stop"), "abc", [1, 2], True,
                                   names.get)
    assert choice["text"] == "abc" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["text_offset"] == [0, 2]
    assert api.finish_reason(result([], finish="abort")) == "abort"


def test_reply_envelopes():
    reply = api.chat_response("chatcmpl-1", "m", 100, [], {"total_tokens": 0})
    assert reply["object"] == "chat.completion" and reply["model"] == "m"
    assert api.completion_response("c", "m", 1, [], {})["object"] == "text_completion"
    chunk = api.chat_chunk("chatcmpl-1", "m", 100, [], usage_={"total_tokens": 3})
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"]["total_tokens"] == 3
    assert "usage" not in api.completion_chunk("c", "m", 1, [])
    assert api.models_list("m", 5)["data"][0]["id"] == "m"
    assert api.sse({"a": 1}) == 'data: {"a": 1}\n\n' and api.sse("[DONE]") == "data: [DONE]\n\n"
    assert api.error_body("bad", "n") == {"error": {
        "message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
