"""rl_tpu's SGLang-compatible server, in-process over loopback HTTP: shapes, errors, control."""

import json
import threading
import urllib.error
import urllib.request

import pytest

from rl_tpu.models import hf, tiny
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, serve


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    tiny.write_tiny_model(str(root / "a"), "qwen2", vocab_size=320, seed=0)
    tiny.write_tiny_model(str(root / "b"), "qwen2", vocab_size=320, seed=1)
    tiny.write_tiny_model(str(root / "deep"), "qwen2", vocab_size=320, num_layers=3)
    cfg, params = hf.load(str(root / "a"))
    tok = load_tokenizer(str(root / "a"))
    service = RolloutService(JaxSampler(cfg, params, tokenizer=tok), str(root / "a"), tok)
    http = serve(service, "127.0.0.1", 0, api_key="secret")
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield dict(url=f"http://127.0.0.1:{http.server_address[1]}", root=root, tok=tok)
    http.shutdown()


def call(server, path, body=None, key="secret", raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(server["url"] + path, data=data,
                                 headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            return resp.status, (json.loads(text) if text.startswith(("{", "[")) else text)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())


def test_generate_reply_shapes(server):
    status, reply = call(server, "/generate", {
        "input_ids": [[5, 6, 7], [8, 9]], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2, "ignore_eos": True}})
    assert status == 200 and isinstance(reply, list) and len(reply) == 4  # p0s0 p0s1 p1s0 p1s1
    assert [r["meta_info"]["prompt_tokens"] for r in reply] == [3, 3, 2, 2]
    meta = reply[0]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["completion_tokens"] == 4 and meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 4}]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == reply[0]["output_ids"]
    assert all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    status, one = call(server, "/generate", {"text": "hello there", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    assert status == 200 and isinstance(one, dict) and len(one["output_ids"]) == 3
    assert one["text"] == server["tok"].decode(one["output_ids"], skip_special_tokens=True)


def test_bad_requests_get_400_and_the_server_lives(server):
    assert call(server, "/generate", {})[0] == 400
    status, reply = call(server, "/generate", raw=b"{nope")
    assert status == 400 and "not JSON" in reply["error"]["message"]
    status, reply = call(server, "/generate", {"input_ids": [1, 2], "sampling_params": {
        "top_p": 3}})
    assert status == 400 and "top_p" in reply["error"]["message"]
    status, reply = call(server, "/generate", {"input_ids": [1, 99999]})
    assert status == 400 and "outside the vocab" in reply["error"]["message"]
    assert call(server, "/generate", {"input_ids": [1]}, key="wrong")[0] == 401
    assert call(server, "/nowhere", {})[0] == 404
    assert call(server, "/health_generate")[0] == 200


@pytest.mark.parametrize("params,limit", [
    ({"n": 1_000_000_000}, "n=1000000000 is over this server's limit of 64 samples a prompt"),
    ({"max_new_tokens": 1e9}, "max_new_tokens=1000000000 is over the context length of 2048"),
    ({"max_new_tokens": 1e12}, "max_new_tokens=1000000000000 is over the context length"),
    ({"max_new_tokens": float("inf")}, "bad sampling_params: cannot convert float infinity"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"n": 64}, "2560 rows (prompts x n) are over this server's limit of 1024 a request"),
])
def test_requests_over_a_limit_get_400_naming_it_and_the_next_one_is_served(server, params,
                                                                            limit):
    # 40 prompts of n=64: 2,560 rows
    prompts = [[5, 6, 7]] * (40 if params.get("n") == 64 else 1)
    body = json.dumps({"input_ids": prompts, "sampling_params": params})
    # json.dumps writes NaN and Infinity, as Python's and SGLang's JSON readers accept them
    status, reply = call(server, "/generate", raw=body.encode())
    assert status == 400, reply
    assert limit in reply["error"]["message"]
    status, reply = call(server, "/generate", {"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert status == 200 and len(reply["output_ids"]) == 2


def test_limits_of_rows_context_and_tokens():
    from rl_tpu.rollout.engine import SamplingParams
    from rl_tpu.rollout.server import BadRequest, ServerLimits
    limits = ServerLimits(max_n=8, max_rows=10, max_context_tokens=16)
    limits.check([[1, 2]] * 2, [SamplingParams(max_new_tokens=14, n=5)] * 2, context=2048)
    with pytest.raises(BadRequest, match=r"11 rows \(prompts x n\) are over .* 10 a request"):
        limits.check([[1]] * 11, [SamplingParams(max_new_tokens=1)] * 11, context=2048)
    with pytest.raises(BadRequest, match="over the context length of 16 tokens"):
        limits.check([[1, 2]], [SamplingParams(max_new_tokens=15)], context=2048)
    with pytest.raises(BadRequest, match="over the context length of 8 tokens"):
        limits.check([[1, 2]], [SamplingParams(max_new_tokens=7)], context=8)  # the model's
    tokens = ServerLimits(max_request_tokens=100)
    tokens.check([[1] * 10], [SamplingParams(max_new_tokens=10, n=5)], context=2048)  # 100
    with pytest.raises(BadRequest, match=r"101 tokens .* over this server's limit of 100"):
        tokens.check([[1] * 10, [1]], [SamplingParams(max_new_tokens=10, n=5),
                                       SamplingParams(max_new_tokens=0)], context=2048)


def test_update_weights_from_disk(server):
    status, reply = call(server, "/update_weights_from_disk",
                         {"model_path": str(server["root"] / "deep"), "weight_version": "x"})
    assert status == 400 and not reply["success"] and "different architecture" in reply["message"]
    status, reply = call(server, "/update_weights_from_disk",
                         {"model_path": "/no/such/dir", "weight_version": "x"})
    assert status == 400 and "no config.json" in reply["message"]
    status, reply = call(server, "/update_weights_from_disk",
                         {"model_path": str(server["root"] / "b"), "weight_version": "v7"})
    assert status == 200 and reply["success"]
    assert call(server, "/model_info")[1]["weight_version"] == "v7"
    assert call(server, "/get_model_info")[1]["model_path"].endswith("b")
    _, out = call(server, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}})
    assert out["meta_info"]["weight_version"] == "v7"


def test_pause_continue_and_abort(server):
    assert call(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    result = {}
    worker = threading.Thread(target=lambda: result.update(reply=call(server, "/generate", {
        "input_ids": [5], "sampling_params": {"max_new_tokens": 2}})))
    worker.start()
    worker.join(timeout=1.0)
    assert worker.is_alive()  # held while paused
    assert call(server, "/continue_generation", {})[0] == 200
    worker.join(timeout=60)
    assert result["reply"][0] == 200
    assert call(server, "/abort_request", {})[0] == 400
    assert call(server, "/abort_request", {"abort_all": True})[0] == 200
    assert call(server, "/flush_cache", {})[0] == 200


def test_min_new_tokens_is_honoured(server):
    """Half the vocab stops a sample: without min_new_tokens samples end within a few tokens;
    with it, none ends (or samples a stop id) before the minimum, as SGLang's penalizer."""
    stops = list(range(0, 320, 2))

    def body(**extra):
        return {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 10, "temperature": 1.0, "n": 6, "sampling_seed": 1,
            "stop_token_ids": stops, **extra}}

    status, free = call(server, "/generate", body())
    assert status == 200 and min(r["meta_info"]["completion_tokens"] for r in free) < 5
    status, held = call(server, "/generate", body(min_new_tokens=5))
    assert status == 200 and len(held) == 6
    for reply in held:
        assert reply["meta_info"]["completion_tokens"] >= 5
        assert not set(stops) & set(reply["output_ids"][:5])
    status, reply = call(server, "/generate", body(min_new_tokens=11))
    assert status == 400 and "min_new_tokens" in reply["error"]["message"]
