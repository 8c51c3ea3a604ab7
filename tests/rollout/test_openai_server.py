"""The rollout server's OpenAI API (rl_tpu/rollout/openai_routes.py) driven by the real `openai`
client, in-process over loopback HTTP on a tiny model: each reply's numbers are checked
against the server's native /generate for the same prompt ids (greedy, so they must agree),
and a stream must stream (several chunks whose text adds up to the plain reply)."""

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from rl_tpu.models import hf, tiny
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rollout.continuous import ContinuousBatcher
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, serve

USER = [{"role": "user", "content": "hello"}]
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("openai") / "m")
    tiny.write_tiny_model(root, "qwen2", vocab_size=320, seed=0)
    cfg, params = hf.load(root)
    tok = load_tokenizer(root)
    sampler = JaxSampler(cfg, params, tokenizer=tok)
    # decode_chunk 4: a 24-token reply takes several chunks, so a stream has several events
    batcher = ContinuousBatcher(sampler, slots=8, slot_tokens=512, decode_chunk=4)
    service = RolloutService(sampler, root, tok, batcher=batcher, served_model_name="tiny")
    http = serve(service, "127.0.0.1", 0)
    http.start()
    client = openai.OpenAI(base_url=http.url + "/v1", api_key="unused", max_retries=0)
    yield dict(url=http.url, tok=tok, service=service, client=client)
    http.shutdown()
    batcher.close()


def post(server, path, body):
    req = urllib.request.Request(server["url"] + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def native(server, ids, new, **sampling):
    """/generate's greedy reply for these prompt ids."""
    status, text = post(server, "/generate", {"input_ids": ids, "return_logprob": True,
                                              "sampling_params": dict(
                                                  max_new_tokens=new, temperature=0,
                                                  ignore_eos=True, **sampling)})
    assert status == 200, text
    return json.loads(text)


def test_models_lists_the_served_id(server):
    models = server["client"].models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, text = post(server, "/v1/models", {})
    assert status == 405  # GET only


def test_chat_two_greedy_samples_with_logprobs_match_generate(server):
    reply = server["client"].chat.completions.create(
        model="tiny", messages=USER, n=2, max_tokens=5, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True})
    prompt = server["tok"].apply_chat_template(USER, add_generation_prompt=True)
    ref = native(server, prompt, 5)
    assert reply.object == "chat.completion" and reply.model == "tiny"
    assert len(reply.choices) == 2 and [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt and extra["token_ids"] == ref["output_ids"]
        assert choice.finish_reason == "length" and choice.message.role == "assistant"
        assert choice.message.content == ref["text"] and choice.message.tool_calls is None
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(
            [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
        assert [e.token for e in choice.logprobs.content] == [
            server["tok"].decode([t]) for t in ref["output_ids"]]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens,
            reply.usage.total_tokens) == (len(prompt), 10, len(prompt) + 10)


def test_chat_with_tools_puts_the_schemas_in_the_prompt(server):
    client, tok = server["client"], server["tok"]
    reply = client.chat.completions.create(model="tiny", messages=USER, tools=[ADD],
                                           max_tokens=3, temperature=0)
    prompt = reply.choices[0].model_extra["prompt_token_ids"]
    assert prompt == tok.apply_chat_template(USER, add_generation_prompt=True, tools=[ADD])
    assert '"name": "add"' in tok.decode(prompt)
    # a random model writes no call: plain content, finish by length, no tool_calls
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "length"
    none = client.chat.completions.create(model="tiny", messages=USER, tools=[ADD],
                                          tool_choice="none", max_tokens=3, temperature=0)
    assert none.choices[0].model_extra["prompt_token_ids"] == tok.apply_chat_template(
        USER, add_generation_prompt=True)
    # a tool result in the conversation renders through the template too
    turn = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    again = client.chat.completions.create(model="tiny", messages=turn, tools=[ADD],
                                           max_tokens=2, temperature=0)
    text = tok.decode(again.choices[0].model_extra["prompt_token_ids"])
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' in text


HOSTILE_CALLS = {  # replies whose tool calls once made the routes answer 500 after generating
    "1,200 nested [": "<tool_call>" + "[" * 1200 + "</tool_call>",
    "arguments nested 3,000 deep in a JSON string":
        '<tool_call>{"name": "add", "arguments": ' + json.dumps("[" * 3000) + "}</tool_call>",
    "a 5,000-digit integer":
        '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
    "a lone surrogate escape": '<tool_call>{"name": "add", "arguments": {"a": "\\ud800"}}'
                               "</tool_call>",
    "a good call, then a bad one": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
                                   "</tool_call><tool_call>" + "{" * 2000 + "</tool_call>",
}


@pytest.mark.parametrize("stream", [False, True])
def test_hostile_tool_calls_are_errors_in_a_200_not_a_500(server, monkeypatch, stream):
    """The model really generates; only its decoded text is replaced (a random tiny model
    cannot be made to write these), so the route's own parse and reply run on it."""
    for what, reply in HOSTILE_CALLS.items():
        monkeypatch.setattr(server["service"], "text_of", lambda res, *a, **k: reply)
        status, text = post(server, "/v1/chat/completions", {
            "model": "tiny", "messages": USER, "tools": [ADD], "max_tokens": 3,
            "temperature": 0, "stream": stream})
        assert status == 200, (what, text[:300])
        if stream:
            assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, (what, text)
            events = [json.loads(line[6:]) for line in text.split("\n")
                      if line.startswith("data: {")]
            choice = events[-1]["choices"][0]
            calls = choice["delta"].get("tool_calls") or []
        else:
            choice = json.loads(text)["choices"][0]
            calls = choice["message"].get("tool_calls") or []
            assert choice["tool_call_errors"], what  # the client learns what was wrong
        if what == "a good call, then a bad one":
            assert [c["function"]["arguments"] for c in calls] == ['{"a": 1, "b": 2}']
        else:
            assert calls == [], what


def test_hostile_tool_call_arguments_from_a_client_are_a_400(server):
    """A conversation's earlier call, its arguments a JSON string as OpenAI sends them: past
    the call bounds it is the request's fault (a 400 naming the field), never a 500."""
    for arguments, message in [("[" * 3000, "nests more than 64 levels"),
                               ('{"a": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
                               ("{oops", "is not JSON")]:
        turn = USER + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": arguments}}]}]
        status, text = post(server, "/v1/chat/completions", {
            "model": "tiny", "messages": turn, "tools": [ADD], "max_tokens": 1})
        assert status == 400, text[:300]
        assert "messages[1].tool_calls[0].function.arguments" in text and message in text


def test_completions_from_text_and_ids_with_logprobs(server):
    client, tok = server["client"], server["tok"]
    reply = client.completions.create(model="tiny", prompt=[[5, 6, 7], "hello"], n=2,
                                      max_tokens=4, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and len(reply.choices) == 4
    for i, choice in enumerate(reply.choices):  # prompt-major: p0s0 p0s1 p1s0 p1s1
        prompt = [5, 6, 7] if i < 2 else tok.encode("hello")
        ref = native(server, prompt, 4)
        assert choice.index == i and choice.model_extra["prompt_token_ids"] == prompt
        assert choice.text == ref["text"] and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx(
            [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert reply.usage.prompt_tokens == 3 + len(tok.encode("hello"))
    assert reply.usage.completion_tokens == 16


def stream_chat(server, **kw):
    return list(server["client"].chat.completions.create(
        model="tiny", messages=USER, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, **kw))


def test_chat_stream_streams_the_plain_reply(server):
    chunks = stream_chat(server, max_tokens=24, logprobs=True,
                         stream_options={"include_usage": True})
    plain = server["client"].chat.completions.create(
        model="tiny", messages=USER, temperature=0, max_tokens=24, logprobs=True,
        extra_body={"ignore_eos": True}).choices[0]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices
              and c.choices[0].delta.content]
    assert len(pieces) >= 3  # 24 tokens in chunks of 4: not one event at the end
    assert "".join(pieces) == plain.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    logprobs = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert logprobs == pytest.approx([e.logprob for e in plain.logprobs.content], abs=1e-5)
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "length"
    assert last.model_extra["token_ids"] == plain.model_extra["token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_a_stream_holds_back_a_stop_string_and_ends_before_it(server):
    plain = server["client"].chat.completions.create(
        model="tiny", messages=USER, temperature=0, max_tokens=24,
        extra_body={"ignore_eos": True}).choices[0].message.content
    # two printable characters from the middle of the greedy reply: it must end there
    at = next(i for i in range(6, len(plain) - 1) if plain[i:i + 2].isprintable()
              and "\ufffd" not in plain[i:i + 2])
    stop = plain[at:at + 2]
    chunks = stream_chat(server, max_tokens=24, stop=[stop])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain[:plain.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_stream_with_logprobs_adds_up(server):
    client = server["client"]
    kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=20, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert len([c for c in chunks if c.choices[0].text]) >= 3
    assert "".join(c.choices[0].text for c in chunks) == plain.text
    streamed = [lp for c in chunks if c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == plain.logprobs.text_offset


def test_generate_stream_is_cumulative_and_ends_with_the_reply(server):
    status, text = post(server, "/generate", {"input_ids": [5, 6, 7], "stream": True,
                                              "sampling_params": {"max_new_tokens": 20,
                                                                  "temperature": 0,
                                                                  "ignore_eos": True}})
    events = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ref = native(server, [5, 6, 7], 20)
    assert len(chunks) >= 3 and chunks[-1]["output_ids"] == ref["output_ids"]
    assert chunks[-1]["text"] == ref["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    for before, after in zip(chunks, chunks[1:]):  # each chunk extends the one before
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
    assert chunks[0]["meta_info"]["finish_reason"] is None
    assert chunks[0]["meta_info"]["completion_tokens"] == len(chunks[0]["output_ids"]) < 20


def test_bad_bodies_get_openai_errors(server):
    client = server["client"]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=USER, logprobs=True,
                                       top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny", messages=USER, tools=[ADD],
                                       tool_choice="required")
    with pytest.raises(openai.BadRequestError, match=r"over the context length"):
        client.completions.create(model="tiny", prompt=[5], max_tokens=10_000)
    for path, body, named in [
            ("/v1/chat/completions", {"messages": "hi"}, "'messages'"),
            ("/v1/completions", {"prompt": [5, 999]}, "must be a token id in [0, 320)"),
            ("/v1/completions", {"prompt": [5], "n": 100}, "--max_n")]:
        status, text = post(server, path, body)
        error = json.loads(text)["error"]
        assert status == 400 and named in error["message"], text
        assert error["type"] == "invalid_request_error"
    status, text = post(server, "/v1/chat/completions", [1])
    assert status == 400 and "JSON object" in json.loads(text)["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": [5], "max_tokens": 2})[0] == 200


def test_a_client_leaving_mid_stream_aborts_its_rows(server, caplog):
    body = {"model": "tiny", "messages": USER, "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(server["url"] + "/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with caplog.at_level("INFO", logger="rl_tpu.rollout.streaming"):
        with urllib.request.urlopen(req, timeout=120) as resp:
            first = resp.readline().decode()
            assert first.startswith("data: {")
        # the connection is closed with 480 tokens asked for: the rows end, not decode on
        deadline = time.monotonic() + 60
        while server["service"].batcher.load()["running_rows"] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert server["service"].batcher.load()["running_rows"] == 0
    assert any("aborting its rows" in r.getMessage() for r in caplog.records)
