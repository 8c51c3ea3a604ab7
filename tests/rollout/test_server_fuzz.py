"""The rollout server fuzzed over loopback (a tiny model, one server for the module): every
field of every endpoint sent wrong (wrong types, NaN and inf, negative and huge numbers, ids
beyond the vocab, empty prompts, JSON nested 100,000 deep, a 5,000-digit integer, a truncated
checkpoint), then a seeded random mutation of valid bodies. Not one answer is a 500; every
4xx is `{"error": {"message"}}` naming the field (the weight loader's own failures keep
SGLang's `{"success": false, "message"}`); afterwards the server is healthy and its greedy
output for a fixed prompt is bit-identical to what it was before."""

import copy
import json
import os
import random
import re
import shutil

import pytest

import http_client

from rl_tpu.models import hf, tiny
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rollout.continuous import ContinuousBatcher
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, ServerLimits, serve

VOCAB = 320
GREEDY = {"input_ids": [5, 6, 7], "return_logprob": True,
          "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    tiny.write_tiny_model(str(root / "a"), "qwen2", vocab_size=VOCAB, seed=0)
    cfg, params = hf.load(str(root / "a"))
    tok = load_tokenizer(str(root / "a"))
    sampler = JaxSampler(cfg, params, tokenizer=tok)
    # a small pool and limits: whatever a mutation makes valid runs in a few program shapes
    service = RolloutService(sampler, str(root / "a"), tok,
                             ServerLimits(max_n=2, max_rows=4, max_context_tokens=32),
                             batcher=ContinuousBatcher(sampler, slots=4, slot_tokens=32))
    http = serve(service, "127.0.0.1", 0)
    http.start()
    srv = dict(address=http.server_address, root=root, service=service)
    status, reply = send(srv, "POST", "/generate", GREEDY)
    assert status == 200, reply
    srv["greedy"] = (reply["output_ids"], [lp for lp, _, _ in
                                           reply["meta_info"]["output_token_logprobs"]])
    yield srv
    http.shutdown()
    service.batcher.close()


def send(server, method, path, body=None, raw=None):
    return http_client.send(server["address"], method, path, body, raw)


def sp(**params):
    """A /generate body with sampling_params `params` over small, valid ones."""
    return {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, **params}}


NAN, INF = float("nan"), float("inf")  # json.dumps writes NaN and Infinity, as clients may
# (path, body, text the 400's message must hold: the field, and what it must be)
GENERATE = [("/generate", body, field) for body, field in [
    ({}, "'text' or 'input_ids'"),
    ({"text": "a", "input_ids": [5]}, "'text' or 'input_ids'"),
    ({"input_ids": []}, "'input_ids' is empty"),
    ({"input_ids": [[]]}, "'input_ids[0]' must be a non-empty list"),
    ({"input_ids": [[5], []]}, "'input_ids[1]' must be a non-empty list"),
    ({"input_ids": [[5], 6]}, "'input_ids[1]' must be a non-empty list"),
    ({"input_ids": "abc"}, "'input_ids'"),
    ({"input_ids": {"a": 1}}, "'input_ids'"),
    ({"input_ids": 5}, "'input_ids'"),
    ({"input_ids": [-1]}, "'input_ids[0]' must be a token id in [0, 320)"),
    ({"input_ids": [5, VOCAB]}, "'input_ids[1]' must be a token id in [0, 320)"),
    ({"input_ids": [5, 10**30]}, "'input_ids[1]' must be a token id in [0, 320)"),
    ({"input_ids": [[5], [2**63]]}, "'input_ids[1][0]' must be a token id"),
    ({"input_ids": [5.5]}, "'input_ids[0]' must be a token id"),
    ({"input_ids": [True]}, "'input_ids[0]' must be a token id"),
    ({"input_ids": ["5"]}, "'input_ids[0]' must be a token id"),
    ({"input_ids": [None]}, "'input_ids[0]' must be a token id"),
    ({"input_ids": [[5, [6]]]}, "'input_ids[0][1]' must be a token id"),
    ({"text": ""}, "'text' encodes to no tokens"),
    ({"text": []}, "'text' must be a string or a non-empty list"),
    ({"text": ["a", ""]}, "'text[1]' encodes to no tokens"),
    ({"text": 5}, "'text"),
    ({"text": ["a", 5]}, "'text[1]' must be a string"),
    ({"text": {"a": "b"}}, "'text"),
    # a lone surrogate (JSON's \ud800) cannot be UTF-8: not tokenized, never echoed back
    ({"text": "a\ud800"}, "'text' is not valid Unicode text: surrogates not allowed"),
    ({"text": ["a", "\udfff"]}, "'text[1]' is not valid Unicode text"),
    ({"input_ids": [5], "rid": "\ud800"}, "'rid' is not valid Unicode text"),
    ({"input_ids": [[5], [6]], "rid": ["a", "\ud800"]}, "'rid' is not valid Unicode text"),
    (sp(stop=["ok", "\ud800"]), "'sampling_params.stop[1]' is not valid Unicode text"),
    ({"input_ids": [5], "rid": 5}, "'rid"),
    ({"input_ids": [5], "rid": [1]}, "'rid"),
    ({"input_ids": [5], "rid": ["a", "b"]}, "'rid': 2 ids for 1 prompts"),
    ({"input_ids": [5], "rid": {"a": 1}}, "'rid"),
    ({"input_ids": [5], "return_logprob": "maybe"}, "'return_logprob'"),
    ({"input_ids": [5], "return_logprob": [1]}, "'return_logprob'"),
    ({"input_ids": [5], "return_text_in_logprobs": {}}, "'return_text_in_logprobs'"),
    ({"input_ids": [5], "stream": "often"}, "'stream'"),
    ({"input_ids": [5], "sampling_params": 5}, "'sampling_params"),
    ({"input_ids": [5], "sampling_params": "greedy"}, "'sampling_params"),
    ({"input_ids": [5], "sampling_params": [{}, {}]}, "'sampling_params': 2 objects for 1"),
    ({"input_ids": [[5], [6]], "sampling_params": [{}, 5]}, "'sampling_params[1]' must be"),
    ({"input_ids": [[5], [6]], "sampling_params": [{"max_new_tokens": 2}, {"top_p": 0}]},
     "'sampling_params[1].top_p' must be a finite number in (0, 1]"),
    (sp(stop=5), "'sampling_params.stop' must be a string or a list of strings, got 5"),
    (sp(stop=[1, 2]), "'sampling_params.stop' must be a string or a list of strings"),
    (sp(stop=["a", None]), "'sampling_params.stop' must be a string or a list of strings"),
    (sp(stop={"a": 1}), "'sampling_params.stop' must be a string or a list of strings"),
    (sp(stop=0), "'sampling_params.stop' must be a string or a list of strings, got 0"),
    (sp(stop_token_ids=0), "'sampling_params.stop_token_ids' must be a list of token ids"),
    (sp(stop=[["a"]]), "'sampling_params.stop' must be a string or a list of strings"),
    (sp(stop_token_ids=7), "'sampling_params.stop_token_ids' must be a list of token ids"),
    (sp(stop_token_ids="7"), "'sampling_params.stop_token_ids' must be a list of token ids"),
    (sp(stop_token_ids=[-1]), "'sampling_params.stop_token_ids[0]' must be in [0, "),
    (sp(stop_token_ids=[1, 2**63]), "'sampling_params.stop_token_ids[1]' must be in [0, "),
    (sp(stop_token_ids=[1, "x"]), "'sampling_params.stop_token_ids[1]' must be an integer"),
    (sp(stop_token_ids=[None]), "'sampling_params.stop_token_ids[0]' must be an integer"),
    (sp(stop_token_ids=[1.5]), "'sampling_params.stop_token_ids[0]' must be an integer"),
    (sp(stop_token_ids=[True]), "'sampling_params.stop_token_ids[0]' must be an integer"),
    (sp(ignore_eos="yes"), "'sampling_params.ignore_eos' must be true or false"),
    (sp(ignore_eos=1), "'sampling_params.ignore_eos' must be true or false"),
    (sp(skip_special_tokens="no"), "'sampling_params.skip_special_tokens' must be true or"),
    (sp(no_stop_trim=[]), "'sampling_params.no_stop_trim' must be true or false"),
    (sp(sampling_seed="x"), "'sampling_params.sampling_seed' must be an integer"),
    (sp(sampling_seed=2**64), "'sampling_params.sampling_seed' must be in [-9223372036854775808"),
    (sp(sampling_seed=1.5), "'sampling_params.sampling_seed' must be an integer"),
    (sp(sampling_seed=[1]), "'sampling_params.sampling_seed' must be an integer"),
    (sp(min_new_tokens=3), "'sampling_params.min_new_tokens' must be at most max_new_tokens=2"),
    (sp(min_new_tokens=-1), "'sampling_params.min_new_tokens' must be in [0, "),
    (sp(top_k=0), "'sampling_params.top_k' must be -1 (all tokens) or >= 1, got 0"),
    (sp(top_k=-2), "'sampling_params.top_k' must be in [-1, "),
    (sp(top_k=2**31), "'sampling_params.top_k' must be in [-1, 2147483647]"),
    (sp(top_k="all"), "'sampling_params.top_k' must be an integer, got 'all'"),
    (sp(n=0), "'sampling_params.n' must be in [1, "),
    (sp(n=-3), "'sampling_params.n' must be in [1, "),
    (sp(n=3), "n=3 is over this server's limit of 2 samples a prompt (--max_n)"),
    (sp(n=2**63), "'sampling_params.n' must be in [1, 2147483647]"),
    (sp(n=1.5), "'sampling_params.n' must be an integer"),
    (sp(n=True), "'sampling_params.n' must be an integer"),
    (sp(n=[2]), "'sampling_params.n' must be an integer"),
    (sp(max_new_tokens=-1), "'sampling_params.max_new_tokens' must be in [0, "),
    (sp(max_new_tokens=31), "max_new_tokens=31 is over the context length of 32 tokens"),
    (sp(max_new_tokens=2**31), "'sampling_params.max_new_tokens' must be in [0, 2147483647]"),
    (sp(max_new_tokens=INF), "'sampling_params.max_new_tokens' must be an integer"),
    (sp(max_new_tokens=NAN), "'sampling_params.max_new_tokens' must be an integer"),
    (sp(max_new_tokens="many"), "'sampling_params.max_new_tokens' must be an integer"),
    (sp(max_new_tokens={}), "'sampling_params.max_new_tokens' must be an integer"),
] + [(sp(**{name: value}), f"'sampling_params.{name}' must be a{' finite' if ok else ''} number")
     for name in ("temperature", "top_p")
     for value, ok in ((NAN, 1), (INF, 1), (-INF, 1), (-1, 1), (10**400, 0), ("hot", 0),
                       ([1], 0), ({"a": 1}, 0), (True, 0), ("nan", 1))]
    + [(sp(top_p=value), "'sampling_params.top_p' must be a finite number in (0, 1]")
       for value in (0, 0.0, 1.0001, 2)]
    + [({"input_ids": [[5]] * 3, "sampling_params": {"max_new_tokens": 2, "n": 2}},
        "6 rows (prompts x n) are over this server's limit of 4 a request (--max_rows)")]]

CONTROL = [
    ("/abort_request", {}, "abort_request needs 'rid' or 'abort_all'"),
    ("/abort_request", {"rid": 5}, "'rid'"),
    ("/abort_request", {"rid": [1]}, "'rid'"),
    ("/abort_request", {"abort_all": "please"}, "'abort_all'"),
    ("/abort_request", {"rid": "\ud800"}, "'rid' is not valid Unicode text"),
    ("/pause_generation", {"mode": 5}, "'mode'"),
    ("/pause_generation", {"mode": "sleep"}, "pause mode 'sleep': use abort, retract or"),
    ("/pause_generation", {"mode": None}, "'mode'"),
    ("/update_weights_from_disk", {}, "'model_path': Field required"),
    ("/update_weights_from_disk", {"model_path": 5}, "'model_path'"),
    ("/update_weights_from_disk", {"model_path": ""}, "update_weights_from_disk needs "
                                                      "'model_path'"),
    ("/update_weights_from_disk", {"model_path": "/m", "weight_version": {}},
     "'weight_version'"),
    ("/update_weights_from_disk", {"model_path": "/m\ud800"}, "'model_path' is not valid"),
    # checked before loading: /model_info and every reply would echo it
    ("/update_weights_from_disk", {"model_path": "/m", "weight_version": "\ud800"},
     "'weight_version' is not valid Unicode text"),
]

RAW = [  # bodies that are not a JSON object, or break a JSON limit
    ("/generate", b"{nope", "not JSON"),
    ("/generate", b"[1, 2]", "must be a JSON object"),
    ("/generate", b'"text"', "must be a JSON object"),
    ("/generate", b"\xff\xfe", "not JSON"),
    ("/abort_request", b"null", "must be a JSON object"),
    ("/generate", b"[" * 100_000 + b"]" * 100_000, "JSON nested deeper than"),
    ("/generate", b'{"input_ids": [' + b"7" * 5000 + b"]}", "a number of 5000 digits"),
    ("/update_weights_from_disk", b'{"model_path": ' + b"1" * 5000 + b"}",
     "a number of 5000 digits"),
    ("/pause_generation", b'{"mode": ' + b"[" * 100_000, "JSON nested deeper than"),
]


@pytest.mark.parametrize("path,body,field", GENERATE + CONTROL,
                         ids=[f"{p}:{json.dumps(b)[:60]}" for p, b, _ in GENERATE + CONTROL])
def test_each_bad_field_is_a_400_naming_it(server, path, body, field):
    # NaN and Infinity go out as json.dumps writes them (Python's and SGLang's readers take
    # them)
    status, reply = send(server, "POST", path, raw=json.dumps(body).encode())
    assert status == 400, reply
    assert field in http_client.error_message(reply)


@pytest.mark.parametrize("path,raw,field", RAW, ids=[f"{p}:{r[:20]!r}" for p, r, _ in RAW])
def test_a_body_that_is_not_a_json_object_is_a_400_saying_so(server, path, raw, field):
    status, reply = send(server, "POST", path, raw=raw)
    assert status == 400, reply
    assert field in http_client.error_message(reply)


def test_a_broken_checkpoint_is_a_400_naming_the_file(server):
    """A truncated safetensors file, a config.json that is not JSON or not an object: 400,
    SGLang's reply naming the file; the served weights stay as they were."""
    root = server["root"]
    cases = {}
    for name in ("truncated", "not_json", "not_object"):
        shutil.copytree(root / "a", root / name)
        cases[name] = root / name
    weights = sorted(f for f in os.listdir(cases["truncated"]) if f.endswith(".safetensors"))
    file = cases["truncated"] / weights[0]
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    (cases["not_json"] / "config.json").write_text("{broken")
    (cases["not_object"] / "config.json").write_text("[1]")
    for name, path in cases.items():
        status, reply = send(server, "POST", "/update_weights_from_disk",
                             {"model_path": str(path), "weight_version": name})
        assert status == 400 and reply["success"] is False, reply
        named = str(file) if name == "truncated" else str(path / "config.json")
        assert reply["message"].startswith(f"failed to load {path}: {named}: "), reply
    assert send(server, "GET", "/model_info")[1]["weight_version"] == "0"


# Values a mutation puts in a field: every JSON type, the edges of the int32 and int64 rows,
# non-finite floats, strings of numbers and of nothing.
HOSTILE = [None, True, False, 0, 1, -1, 2, 3, 31, 2**31 - 1, 2**31, 2**63, -2**63 - 1, 10**40,
           0.5, 1.5, -0.0, 1e308, NAN, INF, -INF, "", "1", "x" * 300, "nan", "\ud800", [], [1],
           [[1]],
           ["a"], [None], {}, {"a": 1}]


def mutate(rng: random.Random, body: dict) -> tuple[dict, str]:
    """A copy of `body` with one field (top level or sampling_params) set to a hostile value,
    deleted, or added; (it, the field's name)."""
    body = copy.deepcopy(body)
    if rng.random() < 0.6:
        target = body["sampling_params"]
        target = rng.choice(target) if isinstance(target, list) else target
        names = list(target) + ["n", "top_k", "top_p", "temperature", "stop", "min_new_tokens",
                                "stop_token_ids", "ignore_eos", "sampling_seed"]
    else:
        target = body
        names = list(target) + ["rid", "return_logprob", "stream"]
    name = rng.choice(names)
    if name in target and rng.random() < 0.15:
        del target[name]
    else:
        target[name] = rng.choice(HOSTILE)
    return body, name


VALID = [
    {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
    {"input_ids": [[5, 6], [7]], "rid": ["r1", "r2"], "sampling_params": {
        "max_new_tokens": 2, "top_p": 0.9, "top_k": 5, "sampling_seed": 3}},
    {"text": "hello", "return_logprob": True, "return_text_in_logprobs": True,
     "sampling_params": {"max_new_tokens": 3, "stop": ["x"], "stop_token_ids": [9]}},
    {"text": ["a", "b"], "stream": True, "sampling_params": [{"max_new_tokens": 2},
                                                              {"max_new_tokens": 1, "n": 2}]},
]


PROMPTS = {"text", "input_ids", "sampling_params", "rid"}  # their counts must agree


def test_random_mutations_of_valid_bodies_never_get_a_500(server):
    rng = random.Random(27)
    answered = {}
    for i in range(240):
        body, name = mutate(rng, VALID[i % len(VALID)])
        status, reply = send(server, "POST", "/generate", raw=json.dumps(body).encode())
        answered[status] = answered.get(status, 0) + 1
        assert status in (200, 400), (body, reply)
        if status == 400:
            message = http_client.error_message(reply)
            # the message names the mutated field, or one it must agree with, or the limit
            names = {name} | (PROMPTS if name in PROMPTS else set()) | (
                {"min_new_tokens"} if name == "max_new_tokens" else set())
            assert any(re.search(rf"\b{n}\b", message) for n in names) or \
                "over this server's limit" in message or "over the context length" in message, \
                (body, message)
    assert answered.get(400, 0) > 100 and answered.get(200, 0) > 10, answered


def test_after_the_fuzzing_the_server_is_healthy_and_its_greedy_output_unchanged(server):
    # named so that it runs after the fuzzing tests of this module (pytest keeps file order)
    assert send(server, "GET", "/health")[0] == 200
    assert send(server, "GET", "/health_generate")[0] == 200
    assert send(server, "GET", "/load")[1]["running_rows"] == 0
    status, reply = send(server, "POST", "/generate", GREEDY)
    assert status == 200
    logprobs = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
    assert (reply["output_ids"], logprobs) == server["greedy"]  # bit-identical
