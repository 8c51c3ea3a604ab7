"""SGLangEngine without a real server: a scripted stdlib HTTP server on loopback stands in for
SGLang (same routes and reply shapes), to pin retries, backoff, fail-over, timeouts, batching,
parsing, error messages, the weight-sync protocol and the logprob-convention probe (the fake
answers the probe from a fixed 5-token distribution, in any of the conventions a server may
use)."""

import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.core.engine import RolloutError
from rl_tpu.models import hf
from rl_tpu.models.tiny import tiny_config
from rl_tpu.rollout import http_transport, logprob_probe, weight_sync
from rl_tpu.rollout.logprob_probe import ServerLogprobs
from rl_tpu.rollout.sglang import SGLangEngine

from sglang_server import SGL_KERNEL_STUB, free_port  # noqa: E402  (tests/rollout is on sys.path)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that timed out and left: the late reply's broken pipe is expected


class FakeSGLang:
    """Answers like SGLang. `script` is consumed one action per POST /generate: "ok", "500",
    "400", "close" (drop the connection without a reply), "hang" (reply after `hang_s`)."""

    def __init__(self, script=(), model_path="/nonexistent", hang_s=2.0):
        self.script = list(script)
        self.requests = []  # (method, path, headers, body)
        self.model_path, self.version, self.hang_s = model_path, "default", hang_s
        self.health = []  # statuses for successive /health_generate; 200 once empty
        self.report_version = True
        self.flush_busy = 0  # how many /flush_cache calls answer 400 ("requests running")
        self.logprob_mode = "full"  # how one_token() answers the logprob probe
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append(("GET", self.path, dict(self.headers), None))
                if self.path == "/health_generate":
                    status = fake.health.pop(0) if fake.health else 200
                    self._reply(status, {})
                elif self.path == "/plain":  # as sglang-router answers its health checks
                    self.send_response(200)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"OK")
                elif self.path == "/model_info":
                    self._reply(200, {"model_path": fake.model_path, "weight_version":
                                      fake.version if fake.report_version else "default"})
                else:
                    self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else None
                fake.requests.append(("POST", self.path, dict(self.headers), body))
                if self.path == "/flush_cache":
                    if fake.flush_busy:
                        fake.flush_busy -= 1
                        return self._reply(400, {"error": {"message": "Flush cache failed."}})
                    return self._reply(200, {})
                if self.path == "/generate":
                    action = fake.script.pop(0) if fake.script else "ok"
                    if action == "close":
                        self.close_connection = True
                        return
                    if action == "hang":
                        time.sleep(fake.hang_s)
                    if action == "500":
                        return self._reply(500, {"error": {"message": "scheduler exploded"}})
                    if action == "400":
                        return self._reply(400, {"error": {"message": "input_ids cannot be "
                                                                  "empty."}})
                    return self._reply(200, fake.generate(body))
                if self.path == "/update_weights_from_disk":
                    if not os.path.isdir(body["model_path"]):
                        return self._reply(400, {"success": False, "message": "no such dir"})
                    fake.version = body["weight_version"]
                    return self._reply(200, {"success": True, "message": "ok",
                                             "num_paused_requests": 0})
                if self.path == "/abort_request":
                    return self._reply(200, {})
                self._reply(404, {"detail": "Not Found"})

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def generate(self, body):
        """Sample j of prompt p: tokens p[0]+100*j+t, logprob -(t+1)/10, finish length."""
        if "top_logprobs_num" in body:
            return self.one_token(body)
        prompts, params = body["input_ids"], body["sampling_params"]
        assert len({sp["n"] for sp in params}) == 1, "SGLang wants one n per batch"
        out = []
        for prompt, sp in zip(prompts, params):
            for j in range(sp["n"]):
                ids = [prompt[0] + 100 * j + t for t in range(sp["max_new_tokens"])]
                out.append({"text": "", "output_ids": ids, "meta_info": {
                    "id": f"r{len(out)}", "prompt_tokens": len(prompt),
                    "finish_reason": {"type": "length", "length": len(ids)},
                    "weight_version": self.version,
                    "output_token_logprobs": [[-(t + 1) / 10, i, None]
                                              for t, i in enumerate(ids)]}})
        return out

    # Next-token logits (token ids 0-4) after any prompt; softmax: .563 .207 .126 .076 .028.
    LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0])

    def one_token(self, body):
        """One greedy token per prompt with its top logprobs, in `logprob_mode`: "full" (log
        softmax(z / T), SGLang 0.5.23), "truncated" (renormalised over the top-k/top-p set,
        kept as SGLang does: rank < k and exclusive cumsum <= p), "unscaled" (log softmax(z),
        SGLANG_RETURN_ORIGINAL_LOGPROB=1), "none" (no top logprobs, like rl_tpu's server)."""
        out = []
        for sp in body["sampling_params"]:
            z = self.LOGITS / (1.0 if self.logprob_mode == "unscaled" else sp["temperature"])
            probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            if self.logprob_mode == "truncated":
                order = np.argsort(-probs)
                before = np.cumsum(probs[order]) - probs[order]
                k = sp["top_k"] if sp["top_k"] >= 1 else len(probs)
                keep = order[(np.arange(len(probs)) < k) & (before <= sp["top_p"])]
                kept = np.zeros_like(probs)
                kept[keep] = probs[keep]
                probs = kept / kept.sum()
            with np.errstate(divide="ignore"):
                logprobs = np.log(probs)
            top = [[None if np.isinf(logprobs[i]) else float(logprobs[i]), int(i), None]
                   for i in np.argsort(-logprobs)[:body["top_logprobs_num"]]]
            meta = {"id": f"p{len(out)}", "prompt_tokens": 3, "weight_version": self.version,
                    "finish_reason": {"type": "length", "length": 1},
                    "output_token_logprobs": [top[0]]}
            if self.logprob_mode != "none":
                meta["output_top_logprobs"] = [top]
            out.append({"text": "", "output_ids": [top[0][1]], "meta_info": meta})
        return out

    def probes(self):
        return [r for r in self.posts("/generate") if "top_logprobs_num" in r[3]]

    def posts(self, path):
        return [r for r in self.requests if r[0] == "POST" and r[1] == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


def _engine(urls, **kwargs):
    # "full" declared: no probe request, so the scripted replies go to the requests under test
    kwargs = {"request_timeout_s": 5.0, "connect_retries": 3, "backoff_s": 0.01,
              "logprob_convention": "full", **kwargs}
    return SGLangEngine(urls if isinstance(urls, list) else [urls], **kwargs)


def _req(first, n=1, max_new_tokens=3, **kw):
    return GenerateRequest([first, 7, 8], SamplingParams(max_new_tokens=max_new_tokens, n=n, **kw))


def _dead_url():
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


# ----------------------------------------------------------------------------- generate


def test_generate_maps_sampling_params_and_parses_results(fake):
    engine = _engine(fake.url)
    sp = SamplingParams(max_new_tokens=2, min_new_tokens=1, temperature=0.7, top_p=0.9,
                        top_k=20, stop_token_ids=(5,), stop=("\n",), ignore_eos=True, seed=3)
    [result] = engine.generate([GenerateRequest([11, 12], sp)])
    body = fake.posts("/generate")[0][3]
    assert body["input_ids"] == [[11, 12]]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["sampling_params"] == [{
        "max_new_tokens": 2, "min_new_tokens": 1, "temperature": 0.7, "top_p": 0.9,
        "top_k": 20, "n": 1, "ignore_eos": True, "stop": ["\n"], "stop_token_ids": [5],
        "sampling_seed": 3}]
    assert result.output_ids == [11, 12]
    assert result.logprobs == [-0.1, -0.2]
    assert result.finish_reason == "length" and result.weight_version == "default"
    assert result.prompt_tokens == 2 and result.info["url"] == fake.url


def test_generate_batches_by_n_and_keeps_request_major_order(fake):
    engine = _engine(fake.url, batch_size=2, max_concurrency=3)
    ns = [1, 2, 1, 2, 1]
    results = engine.generate([_req(10 * (k + 1), n=n) for k, n in enumerate(ns)])
    expected = [(10 * (k + 1)) + 100 * j for k, n in enumerate(ns) for j in range(n)]
    assert [r.output_ids[0] for r in results] == expected
    batches = [len(r[3]["input_ids"]) for r in fake.posts("/generate")]
    assert sorted(batches) == [1, 2, 2]  # n=1: 2 + 1 prompts, n=2: 2 prompts


def test_request_ids_are_sent_as_rid(fake):
    engine = _engine(fake.url)
    engine.generate([GenerateRequest([1, 2], SamplingParams(max_new_tokens=1), request_id="a"),
                     GenerateRequest([3, 4], SamplingParams(max_new_tokens=1), request_id="b")])
    assert fake.posts("/generate")[0][3]["rid"] == ["a", "b"]


def test_out_of_vocab_and_empty_prompts_are_refused_before_sending(fake):
    engine = _engine(fake.url, model_config=tiny_config("qwen2", vocab_size=64))
    with pytest.raises(ValueError, match="token id 64 is outside the vocabulary"):
        engine.generate([GenerateRequest([1, 64])])
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([GenerateRequest([])])
    assert not fake.posts("/generate")


def test_malformed_reply_is_a_rollout_error():
    bad = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "exploded"},
                                           "output_token_logprobs": [[-1.0, 1, None]]}}
    with pytest.raises(RolloutError, match="unknown finish_reason"):
        SGLangEngine.parse_sample(bad, "http://x:1")
    no_logprobs = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}}
    with pytest.raises(RolloutError, match="output_token_logprobs"):
        SGLangEngine.parse_sample(no_logprobs, "http://x:1")


def test_stop_and_abort_finish_reasons_are_parsed():
    item = {"output_ids": [4, 2], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 2},
        "output_token_logprobs": [[-0.5, 4, None], [-1.5, 2, None]]}}
    result = SGLangEngine.parse_sample(item)
    assert result.finish_reason == "stop" and result.matched_stop == 2
    item["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted"}
    result = SGLangEngine.parse_sample(item)
    assert result.finish_reason == "abort" and result.info["message"] == "Aborted"


# ----------------------------------------------------------------------------- failures


def test_5xx_is_retried_with_exponential_backoff(fake, monkeypatch):
    delays = []
    monkeypatch.setattr(http_transport.time, "sleep", delays.append)
    fake.script = ["500", "500", "ok"]
    [result] = _engine(fake.url, backoff_s=0.25).generate([_req(5)])
    assert result.output_ids == [5, 6, 7]
    assert len(fake.posts("/generate")) == 3
    assert delays == [0.25, 0.5]


def test_5xx_gives_up_after_retries_naming_server_and_message(fake):
    fake.script = ["500"] * 10
    with pytest.raises(RolloutError) as err:
        _engine(fake.url, connect_retries=2).generate([_req(5)])
    message = str(err.value)
    assert fake.url in message and "HTTP 500" in message and "scheduler exploded" in message
    assert "after 3 attempts" in message
    assert len(fake.posts("/generate")) == 3


def test_dropped_connection_is_retried(fake):
    fake.script = ["close", "ok"]
    [result] = _engine(fake.url).generate([_req(5)])
    assert result.output_ids == [5, 6, 7]


def test_4xx_is_raised_at_once_with_the_servers_message(fake):
    fake.script = ["400"]
    with pytest.raises(RolloutError, match="HTTP 400: input_ids cannot be empty") as err:
        _engine(fake.url).generate([_req(5)])
    assert err.value.status == 400 and err.value.url == fake.url
    assert len(fake.posts("/generate")) == 1


def test_a_plain_text_reply_is_read_only_where_text_is_expected(fake):
    transport = http_transport.HttpTransport([fake.url], connect_retries=0)
    with pytest.raises(RolloutError, match="HTTP 200 with a reply that is not JSON: b'OK'"):
        transport.call_one(fake.url, "GET", "/plain")
    assert transport.call_one(fake.url, "GET", "/plain", text_ok=True) == "OK"
    transport.close()


def test_unreachable_server_raises_quickly_naming_it():
    url = _dead_url()
    start = time.monotonic()
    with pytest.raises(RolloutError, match="cannot connect") as err:
        _engine(url, connect_retries=2).generate([_req(5)])
    assert url in str(err.value) and err.value.url == url
    assert time.monotonic() - start < 5


def test_fail_over_from_an_unreachable_server(fake):
    engine = _engine([_dead_url(), fake.url], connect_retries=1)
    results = engine.generate([_req(k) for k in range(1, 7)])
    assert [r.output_ids[0] for r in results] == list(range(1, 7))
    assert {r.info["url"] for r in results} == {fake.url}


def test_batches_spread_over_servers():
    first, second = FakeSGLang(), FakeSGLang()
    try:
        engine = _engine([first.url, second.url], batch_size=1, max_concurrency=2)
        results = engine.generate([_req(k) for k in range(1, 9)])
        assert [r.output_ids[0] for r in results] == list(range(1, 9))
        assert first.posts("/generate") and second.posts("/generate")
    finally:
        first.close()
        second.close()


def test_hung_server_times_out_and_fails_over():
    hung, good = FakeSGLang(["hang"] * 5), FakeSGLang()
    try:
        start = time.monotonic()
        with pytest.raises(RolloutError, match="no reply within 0.3s"):
            _engine(hung.url, request_timeout_s=0.3).generate([_req(5)])
        assert time.monotonic() - start < 1.5  # a timeout is not retried on the same server
        engine = _engine([hung.url, good.url], request_timeout_s=0.3, batch_size=1)
        results = engine.generate([_req(k) for k in (1, 2)])
        assert [r.info["url"] for r in results] == [good.url, good.url]
    finally:
        hung.close()
        good.close()


def test_wait_healthy_polls_until_ready_and_reports_version(fake):
    fake.health = [503, 503]
    engine = _engine(fake.url)
    engine.wait_healthy(timeout=10, poll_s=0.01)
    assert engine.weight_version == "default"
    assert engine.health()
    with pytest.raises(RolloutError, match="not healthy after") as err:
        _engine(_dead_url()).wait_healthy(timeout=0.2, poll_s=0.05)
    assert "cannot connect" in str(err.value)


def test_api_key_is_sent_and_abort_all_is_best_effort(fake):
    engine = _engine([fake.url, _dead_url()], api_key="secret", connect_retries=0)
    assert engine.abort_all() == [engine.urls[1]]
    method, path, headers, body = fake.posts("/abort_request")[0]
    assert body == {"abort_all": True} and headers["Authorization"] == "Bearer secret"


# ----------------------------------------------------------------------------- weight sync


def _zeros_params(cfg):
    """A params pytree of the right shapes, without initialising a model."""
    params = {}
    for rule in hf.active_rules(cfg):
        layers = [f"layers_{i}" for i in range(cfg.num_layers)] if rule.per_layer else [None]
        for layer in layers:
            node = params.setdefault(layer, {}) if layer else params
            *parents, leaf = rule.path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = np.full(hf.table_dims(rule.our_dims, cfg), 0.01, np.float32)
    return params


@pytest.fixture
def served(tmp_path, fake):
    """The fake serves a model dir (config.json only) of the tiny qwen2 shapes."""
    cfg = tiny_config("qwen2", vocab_size=64, eos_token_ids=(2,))
    model_dir = tmp_path / "served"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf.config_to_hf(cfg, "float32")))
    fake.model_path = str(model_dir)
    return cfg


def test_update_weights_exports_loads_verifies_and_cleans_up(fake, served, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "mine").mkdir()  # not an export of ours: must survive the clean-up
    engine = _engine(fake.url, model_config=served, weights_dir=str(weights))
    engine.wait_healthy(timeout=10)
    engine.update_weights(_zeros_params(served), "step-1")
    body = fake.posts("/update_weights_from_disk")[0][3]
    assert body == {"model_path": str(weights / "step-1"), "weight_version": "step-1",
                    "flush_cache": True}
    assert {"config.json", "model.safetensors"} <= set(os.listdir(weights / "step-1"))
    assert hf.read_config(str(weights / "step-1")).num_layers == served.num_layers
    assert engine.weight_version == "step-1"
    engine.update_weights(_zeros_params(served), "step-2")
    assert sorted(os.listdir(weights)) == ["mine", "step-2"]
    [result] = engine.generate([_req(5)])
    assert result.weight_version == "step-2"


def test_other_hosts_hand_their_own_copy_to_process_0_and_touch_no_disk(fake, served, tmp_path,
                                                                        monkeypatch):
    """Process 1 of a multi-host trainer, given its host's own copy (host-local arrays, as
    parallel.host_copies gives): no export, no request; process 0 writes and loads."""
    weights = tmp_path / "weights"
    engine = _engine(fake.url, model_config=served, weights_dir=str(weights))
    engine.wait_healthy(timeout=10)
    monkeypatch.setattr(weight_sync.jax, "process_index", lambda: 1)
    engine.weight_sync.update(_zeros_params(served), "step-1")
    assert not weights.exists() and not fake.posts("/update_weights_from_disk")


@pytest.mark.parametrize("change", [{"num_layers": 3}, {"hidden_size": 32}])
def test_update_weights_refuses_other_shapes_before_any_update_request(fake, served, tmp_path,
                                                                       change):
    other = served.replace(**change)
    engine = _engine(fake.url, model_config=other, weights_dir=str(tmp_path / "w"))
    with pytest.raises(RolloutError, match="refusing to update") as err:
        engine.update_weights(_zeros_params(other), "v1")
    assert fake.url in str(err.value) and "served" in str(err.value)
    assert not fake.posts("/update_weights_from_disk")
    assert not os.path.exists(tmp_path / "w" / "v1")
    assert engine.weight_version is None


def test_update_weights_refuses_params_that_do_not_match_the_config(fake, served, tmp_path):
    params = _zeros_params(served.replace(intermediate_size=64))
    engine = _engine(fake.url, model_config=served, weights_dir=str(tmp_path / "w"))
    with pytest.raises(RolloutError, match="params do not match model_config"):
        engine.update_weights(params, "v1")
    assert not fake.requests


def test_update_weights_needs_a_checkable_served_model(fake, served, tmp_path):
    fake.model_path = "Qwen/Qwen2.5-7B"  # a hub id: no config here to check against
    engine = _engine(fake.url, model_config=served, weights_dir=str(tmp_path / "w"))
    with pytest.raises(RolloutError, match="served_model_path"):
        engine.update_weights(_zeros_params(served), "v1")
    assert not fake.posts("/update_weights_from_disk")


def test_update_weights_fails_when_version_not_reported(fake, served, tmp_path):
    fake.report_version = False
    engine = _engine(fake.url, model_config=served, weights_dir=str(tmp_path / "w"))
    with pytest.raises(RolloutError, match="reports weight_version 'default', not 'v1'"):
        engine.update_weights(_zeros_params(served), "v1")
    assert engine.weight_version is None


def test_update_weights_rejects_version_names_that_are_not_dir_names(fake, served, tmp_path):
    engine = _engine(fake.url, model_config=served, weights_dir=str(tmp_path / "w"))
    with pytest.raises(ValueError, match="names a directory"):
        engine.update_weights(_zeros_params(served), "../evil")


# ----------------------------------------------------------------------------- logprob convention

TRUNCATING = {"plain": SamplingParams(max_new_tokens=2),
              "top_p": SamplingParams(max_new_tokens=2, top_p=0.8),
              "top_k": SamplingParams(max_new_tokens=2, top_k=20),
              "greedy": SamplingParams(max_new_tokens=2, temperature=0.0, top_p=0.8)}


def _conventions(engine):
    results = engine.generate([GenerateRequest([1, 2], sp) for sp in TRUNCATING.values()])
    return dict(zip(TRUNCATING, [r.logprob_convention for r in results]))


@pytest.mark.parametrize("declared", ["full", "truncated"])
def test_declared_convention_labels_only_truncated_samples(fake, declared):
    conventions = _conventions(_engine(fake.url, logprob_convention=declared))
    assert conventions == {"plain": "full", "top_p": declared, "top_k": declared,
                           "greedy": "full"}  # no truncation: both conventions are one number
    assert not fake.probes()
    with pytest.raises(ValueError, match="logprob_convention 'renormalised'"):
        _engine(fake.url, logprob_convention="renormalised")


@pytest.mark.parametrize("mode, expected", [
    ("full", ServerLogprobs("full", "full", True, "probed")),
    ("truncated", ServerLogprobs("truncated", "truncated", True, "probed")),
    ("unscaled", ServerLogprobs("full", "full", False, "probed")),
])
def test_auto_probes_each_server_once_and_labels_by_what_it_found(fake, mode, expected):
    fake.logprob_mode = mode
    engine = _engine(fake.url, logprob_convention="auto")
    engine.wait_healthy(timeout=10)
    assert engine.server_logprobs(fake.url) == expected
    [probe] = fake.probes()
    rows = probe[3]["sampling_params"]
    assert [(r["temperature"], r["top_p"], r["top_k"]) for r in rows] == [
        (1.0, 1.0, -1), (1.0, 0.05, -1), (1.0, 1.0, 2), (0.5, 1.0, -1)]
    assert probe[3]["input_ids"] == [[10, 11, 12]] * 4
    truncated = "truncated" if mode == "truncated" else "full"
    assert _conventions(engine) == {"plain": "full", "top_p": truncated, "top_k": truncated,
                                    "greedy": "full"}  # all at temperature 1 or greedy
    assert len(fake.probes()) == 1  # probed once, at first contact


def test_auto_probe_at_first_reply_when_wait_healthy_was_not_called(fake):
    fake.logprob_mode = "truncated"
    engine = _engine(fake.url, logprob_convention="auto", max_concurrency=4, batch_size=1)
    results = engine.generate([_req(k, top_p=0.5) for k in range(1, 5)])
    assert [r.logprob_convention for r in results] == ["truncated"] * 4
    assert len(fake.probes()) == 1  # four concurrent batches, one probe


def test_server_reporting_logprobs_before_temperature_refuses_other_temperatures(fake):
    fake.logprob_mode = "unscaled"  # SGLang launched with SGLANG_RETURN_ORIGINAL_LOGPROB=1
    engine = _engine(fake.url, logprob_convention="auto")
    with pytest.raises(RolloutError, match="SGLANG_RETURN_ORIGINAL_LOGPROB") as err:
        engine.generate([_req(5, temperature=0.7)])  # first contact: refused after the probe
    assert fake.url in str(err.value)
    sent = len(fake.posts("/generate"))
    with pytest.raises(ValueError, match="temperature 0.7.*before temperature scaling"):
        engine.generate([_req(5, temperature=0.7)])
    assert len(fake.posts("/generate")) == sent  # known now: refused before sending
    at_one = engine.generate([_req(5), _req(6, temperature=0.0), _req(7, top_p=0.5)])
    assert [r.logprob_convention for r in at_one] == ["full"] * 3


def test_probe_that_cannot_tell_assumes_the_contract(fake):
    fake.logprob_mode = "none"  # rl_tpu's own server returns no top logprobs
    engine = _engine(fake.url, logprob_convention="auto")
    engine.wait_healthy(timeout=10)
    meaning = engine.server_logprobs(fake.url)
    assert (meaning.top_p, meaning.top_k, meaning.temperature_scaled, meaning.source) == (
        "full", "full", True, "assumed")
    assert "top_logprobs_num" in meaning.describe()


def test_probe_reading_needs_effects_larger_than_noise():
    """A next-token distribution with p1 = 0.999 cannot show truncation (-log Z = 0.001 nats):
    undecided, so the contract's "full" stays, and the reason is kept."""
    a = [[math.log(0.999), 7, None], [math.log(0.0009), 8, None]]
    rows = [a, [[0.0, 7, None], [None, 8, None]], [[math.log(0.999 / 0.9999), 7, None],
                                                   [math.log(0.0009 / 0.9999), 8, None]],
            [[-1e-6, 7, None], [-14.02, 8, None]]]
    reply = [{"meta_info": {"output_top_logprobs": [row]}} for row in rows]
    meaning = logprob_probe.read_probe(reply)
    assert (meaning.top_p, meaning.top_k) == ("full", "full")
    # top-2 gap log(0.999 / 0.0009) = 7.01 nats at T = 1, 14.02 at T = 0.5: decided, scaled
    assert meaning.temperature_scaled is True and meaning.source == "probed"
    assert any("too peaked" in note for note in meaning.notes)


# ----------------------------------------------------------------------------- test helpers


def test_sgl_kernel_stand_in():
    namespace = {}
    exec(SGL_KERNEL_STUB, namespace)
    req_to_token = np.zeros((3, 6), np.int64)
    # request in slot 2 gets positions 1..3, request in slot 0 gets position 0
    namespace["assign_req_to_token_pool_cpu"](
        np.array([2, 0]), req_to_token, np.array([1, 0]), np.array([4, 1]),
        np.array([7, 8, 9, 5]), req_to_token.shape[1])
    assert req_to_token[2].tolist() == [0, 7, 8, 9, 0, 0]
    assert req_to_token[0].tolist() == [5, 0, 0, 0, 0, 0]
    missing = namespace["__getattr__"]("copy_all_layer_kv_cache_cpu")  # importable...
    with pytest.raises(RuntimeError, match="only assign_req_to_token_pool_cpu"):
        missing()  # ...but not callable
    with pytest.raises(AttributeError):
        namespace["__getattr__"]("__path__")


def test_flush_cache_waits_out_a_busy_scheduler(fake):
    """SGLang answers /flush_cache 400 while its scheduler still holds a request, which it can
    for a moment after the request's reply: the client retries, then names the worker."""
    engine = _engine(fake.url)
    fake.flush_busy = 3
    engine.flush_cache()
    assert len(fake.posts("/flush_cache")) == 4
    fake.flush_busy = 1000
    with pytest.raises(RolloutError, match="flush_cache failed on 1 of 1 workers.*HTTP 400"):
        engine.flush_cache(busy_wait_s=0.5)
