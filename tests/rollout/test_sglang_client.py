"""SGLangEngine against live servers on loopback: real SGLang 0.5.23 on CPU ("sglang") and
rl_tpu's own SGLang-compatible JAX server ("jax"), one suite for both.

The first run installs SGLang into a cached venv (~4 min, ~11 GB; see sglang_server.py). One
SGLang server takes ~3.5 GB and ~40 s to start, so each backend starts one module-wide server;
only the crash test starts (and kills) a second. References come from transformers running the
same HF dirs: greedy tokens and teacher-forced logprobs (log softmax of logits / temperature),
and from rl_tpu's own model code where the question is what the trainer recomputes.
"""

import functools
import math
import os
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rl_tpu.core.engine import GenerateRequest, SamplingParams  # noqa: E402
from rl_tpu.core.engine import RolloutError  # noqa: E402
from rl_tpu.models import hf  # noqa: E402
from rl_tpu.models.logprobs import logits_from_hidden, token_logprobs  # noqa: E402
from rl_tpu.models.tiny import write_tiny_model  # noqa: E402
from rl_tpu.models.transformer import Transformer  # noqa: E402
from rl_tpu.rollout.sglang import SGLangEngine  # noqa: E402

from sglang_server import (REPO, free_port, start_rollout_server,  # noqa: E402
                           start_sglang_server)

# With `pytest -n 2 --dist loadgroup` this keeps the module on one worker (one server at a time).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rollout_servers")]

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 300, 9, 11]]
LOGPROB_ATOL = 1e-4  # float32 end to end; measured differences are ~1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF dirs: "a" served at start, "b" same shapes other seed, "deep"/"wide" other shapes."""
    root = tmp_path_factory.mktemp("models")
    variants = {"a": dict(seed=0), "b": dict(seed=1), "deep": dict(seed=2, num_layers=3),
                "wide": dict(seed=3, hidden_size=32)}
    out = {}
    for name, kwargs in variants.items():
        path = str(root / name)
        write_tiny_model(path, "qwen2", **kwargs)
        out[name] = path
    return out


def _start(backend, model_dir):
    return (start_sglang_server if backend == "sglang" else start_rollout_server)(model_dir)


@pytest.fixture(scope="module", params=[pytest.param("sglang", marks=pytest.mark.sglang_venv),
                                        "jax"])
def backend(request):
    launcher = os.path.join(REPO, "launch", "serve_rollout.py")
    if request.param == "jax" and not os.path.exists(launcher):
        pytest.skip("launch.serve_rollout not available yet")
    return request.param


@pytest.fixture(scope="module")
def server(backend, models):
    proc = _start(backend, models["a"])
    yield proc
    proc.stop()


@pytest.fixture
def engine(server, models, tmp_path):
    cfg = hf.read_config(models["a"])
    eng = SGLangEngine([server.url], weights_dir=str(tmp_path / "weights"), model_config=cfg,
                       request_timeout_s=120, connect_retries=2, backoff_s=0.2)
    eng.wait_healthy(timeout=60)
    yield eng
    eng.close()


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logprobs(model_dir, prompt, output, temperature=1.0):
    """Teacher-forced log softmax(logits / temperature) of `output` after `prompt`."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([list(prompt) + list(output)])).logits[0]
    logprobs = torch.log_softmax(logits.double() / temperature, dim=-1)
    return np.array([logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)])


@functools.lru_cache(maxsize=None)
def _rl_tpu_model(model_dir):
    cfg, params = hf.load(model_dir)
    return Transformer(cfg), params


def rl_tpu_scores(model_dir, prompt, output, temperature, top_p, top_k):
    """Per output token, by rl_tpu's own model code, what the trainer recomputes: `full` =
    log softmax(logits / T) of the token (`token_logprobs`), and `log_kept` = log of the mass
    SGLang's sampler keeps (rank < top_k and mass before the token <= top_p; sampler.py
    `top_k_top_p_min_p_sampling_from_probs_torch`). The "truncated" convention would report
    full - log_kept."""
    model, params = _rl_tpu_model(model_dir)
    tokens = jnp.asarray([list(prompt) + list(output)], jnp.int32)
    full, _ = token_logprobs(model, params, {"tokens": tokens}, temperature=temperature,
                             with_entropy=False)
    hidden = model.apply({"params": params}, tokens, None, None, return_hidden=True)
    logits = logits_from_hidden(model.cfg, params, hidden[0, len(prompt) - 1:-1], temperature)
    z = np.asarray(logits, np.float64)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs = -np.sort(-probs / probs.sum(-1, keepdims=True), axis=-1)  # descending
    before = np.cumsum(probs, axis=-1) - probs
    keep = (np.arange(probs.shape[-1]) < top_k) & (before <= top_p)
    return np.asarray(full[0, len(prompt):], np.float64), np.log((probs * keep).sum(-1))


def reference_greedy(model_dir, prompt, max_new_tokens):
    """Greedy continuation by transformers (no stop), with its logprobs."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(_hf_model(model_dir)(torch.tensor([ids])).logits[0, -1].argmax()))
    output = ids[len(prompt):]
    return output, reference_logprobs(model_dir, prompt, output)


def greedy(max_new_tokens=12, **kw):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kw)


def _assert_greedy_matches(engine, model_dir, version=None):
    results = engine.generate([GenerateRequest(p, greedy()) for p in PROMPTS])
    assert len(results) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        tokens, logprobs = reference_greedy(model_dir, prompt, 12)
        assert result.output_ids == tokens
        np.testing.assert_allclose(result.logprobs, logprobs, atol=LOGPROB_ATOL)
        assert result.finish_reason == "length" and result.prompt_tokens == len(prompt)
        if version is not None:
            assert result.weight_version == version
    return results


# ----------------------------------------------------------------------------- generation


def test_greedy_generation_matches_transformers(engine, models):
    assert engine.health()
    _assert_greedy_matches(engine, models["a"], version=engine.weight_version)


def test_sampled_logprobs_are_temperature_scaled_and_n_is_prompt_major(engine, models):
    prompts = [PROMPTS[1], PROMPTS[2]]  # lengths 3 and 5
    sampling = [SamplingParams(max_new_tokens=4, temperature=0.7, top_k=20, n=3, ignore_eos=True),
                SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, n=3, ignore_eos=True)]
    results = engine.generate([GenerateRequest(p, s) for p, s in zip(prompts, sampling)])
    assert len(results) == 6
    for k, result in enumerate(results):
        prompt = prompts[k // 3]  # p0s0, p0s1, p0s2, p1s0, ...
        assert result.prompt_tokens == len(prompt)
        assert len(result.output_ids) == len(result.logprobs) == (4, 6)[k // 3]
        assert result.finish_reason == "length"
        assert all(math.isfinite(x) and x <= 0 for x in result.logprobs)
        # log softmax(logits / T) before top-k/top-p truncation, as GenerateResult documents
        np.testing.assert_allclose(
            result.logprobs, reference_logprobs(models["a"], prompt, result.output_ids, 0.7),
            atol=LOGPROB_ATOL)
        assert result.logprob_convention == "full"


def test_top_p_top_k_logprobs_are_full_not_truncated(engine, server, backend, models):
    """Issue 8: at top_p 0.8, top_k 20, T 1 the reported logprobs are rl_tpu's own log
    softmax(logits) of the sampled tokens ("full"), not the renormalised top-p/top-k ones,
    which would be -log(kept mass) higher (SGLang 0.5.23: sglang.py's module doc)."""
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.8, top_k=20, n=4,
                              ignore_eos=True)
    prompts = PROMPTS[:2]
    results = engine.generate([GenerateRequest(p, sampling) for p in prompts])
    assert len(results) == 8
    truncation_gaps = []
    for k, result in enumerate(results):
        full, log_kept = rl_tpu_scores(models["a"], prompts[k // 4], result.output_ids, 1.0,
                                       0.8, 20)
        np.testing.assert_allclose(result.logprobs, full, atol=LOGPROB_ATOL)
        assert result.logprob_convention == "full"
        truncation_gaps.extend(-log_kept)
    # the "truncated" numbers would be this far off: far outside the tolerance
    assert np.mean(truncation_gaps) > 100 * LOGPROB_ATOL
    meaning = engine.server_logprobs(server.url)  # what the engine's probe found
    assert (meaning.top_p, meaning.top_k, meaning.temperature_scaled) == ("full", "full", True)
    # real SGLang answers the probe; rl_tpu's server has no top logprobs and is "full" by
    # contract (its sampler reports logprobs before truncation)
    assert meaning.source == ("probed" if backend == "sglang" else "assumed")


def test_return_original_logprob_switch_is_detected_and_guarded(backend, models):
    """SGLANG_RETURN_ORIGINAL_LOGPROB=1 makes SGLang 0.5.23 report log_softmax(logits) before
    temperature (and truncation): the engine's probe finds it and refuses temperatures != 1,
    whose logprobs the trainer would misread."""
    if backend != "sglang":
        pytest.skip("an SGLang launch switch")
    with start_sglang_server(models["a"], env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}) as server:
        engine = SGLangEngine([server.url], request_timeout_s=120)
        engine.wait_healthy(timeout=60)
        meaning = engine.server_logprobs(server.url)
        assert (meaning.temperature_scaled, meaning.source) == (False, "probed")
        assert (meaning.top_p, meaning.top_k) == ("full", "full")
        prompt = PROMPTS[1]
        body = {"input_ids": [prompt], "return_logprob": True, "logprob_start_len": -1,
                "sampling_params": [{"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.8,
                                     "top_k": 20, "ignore_eos": True}]}
        [item] = engine.transport.call("POST", "/generate", body)[1]  # past the engine's guard
        raw = SGLangEngine.parse_sample(item, server.url)
        at_one = reference_logprobs(models["a"], prompt, raw.output_ids, 1.0)
        np.testing.assert_allclose(raw.logprobs, at_one, atol=LOGPROB_ATOL)
        at_t = reference_logprobs(models["a"], prompt, raw.output_ids, 0.7)
        assert np.max(np.abs(np.array(raw.logprobs) - at_t)) > 100 * LOGPROB_ATOL
        with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
            engine.generate([GenerateRequest(prompt, SamplingParams(temperature=0.7))])
        [ok] = engine.generate([GenerateRequest(prompt, SamplingParams(
            max_new_tokens=6, top_p=0.8, top_k=20, ignore_eos=True))])
        np.testing.assert_allclose(ok.logprobs, reference_logprobs(models["a"], prompt,
                                                                   ok.output_ids),
                                   atol=LOGPROB_ATOL)
        assert ok.logprob_convention == "full"
        engine.close()


def test_stop_token_ids_and_max_new_tokens(engine, models):
    prompt = PROMPTS[0]
    eos = set(hf.read_config(models["a"]).eos_token_ids)
    tokens, _ = reference_greedy(models["a"], prompt, 12)
    k = next(i for i in range(1, 12) if tokens[i] not in tokens[:i] and not eos & {*tokens[:i + 1]})
    stop_at_k = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tokens[k],))
    [stopped] = engine.generate([GenerateRequest(prompt, stop_at_k)])
    assert stopped.output_ids == tokens[:k + 1]  # the stop token is part of the output
    assert len(stopped.logprobs) == k + 1
    assert stopped.finish_reason == "stop" and stopped.matched_stop == tokens[k]
    [short] = engine.generate([GenerateRequest(prompt, greedy(max_new_tokens=3))])
    assert short.output_ids == tokens[:3] and short.finish_reason == "length"


def test_min_new_tokens_holds_back_stop_ids(engine, models):
    """min_new_tokens reaches the server: SGLang's MinNewTokensPenalizer sets the logits of
    the stop ids and eos to -inf until that many tokens exist, so the greedy path goes on
    past the stop id, and the logprob reported there is that of the penalised distribution
    (what rl_tpu's own sampler mirrors)."""
    prompt = PROMPTS[0]
    cfg = hf.read_config(models["a"])
    eos = set(cfg.eos_token_ids)
    tokens, _ = reference_greedy(models["a"], prompt, 12)
    k = next(i for i in range(1, 8) if tokens[i] not in tokens[:i] and not eos & {*tokens[:i + 1]})
    stop = tokens[k]
    base = dict(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    [early] = engine.generate([GenerateRequest(prompt, SamplingParams(**base))])
    assert early.output_ids == tokens[:k + 1] and early.finish_reason == "stop"
    [held] = engine.generate([GenerateRequest(prompt, SamplingParams(min_new_tokens=k + 2,
                                                                     **base))])
    assert held.output_ids[:k] == tokens[:k]
    assert len(held.output_ids) >= k + 2
    assert not ({stop} | eos) & set(held.output_ids[:k + 2])
    with torch.no_grad():
        logits = _hf_model(models["a"])(torch.tensor([list(prompt) + tokens[:k]])).logits[0, -1]
    banned = logits.double().clone()
    banned[sorted({stop} | eos)] = -math.inf
    penalised = torch.log_softmax(banned, -1)[held.output_ids[k]].item()
    assert held.output_ids[k] == int(banned.argmax())
    assert held.logprobs[k] == pytest.approx(penalised, abs=LOGPROB_ATOL)


def test_ignore_eos_also_turns_off_stop_token_ids(engine, models):
    """SGLang 0.5.23 semantics (Req._check_token_based_finish returns early on ignore_eos):
    with ignore_eos, stop_token_ids are not checked either; stop strings still are."""
    tokens, _ = reference_greedy(models["a"], PROMPTS[0], 12)
    [result] = engine.generate([GenerateRequest(PROMPTS[0], greedy(stop_token_ids=(tokens[1],)))])
    assert result.output_ids == tokens and result.finish_reason == "length"


def test_abort_all_returns_partial_samples(engine):
    out = {}
    request = GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=1800, ignore_eos=True))
    thread = threading.Thread(target=lambda: out.update(r=engine.generate([request])))
    thread.start()
    time.sleep(0.5)
    assert engine.abort_all() == []
    thread.join(timeout=60)
    [result] = out["r"]
    assert result.finish_reason == "abort"
    assert 0 < len(result.output_ids) < 1800 and len(result.logprobs) == len(result.output_ids)


# ----------------------------------------------------------------------------- weight sync


def test_weight_update_serves_the_new_model(engine, server, models, tmp_path):
    _, params_b = hf.load(models["b"])
    _, params_a = hf.load(models["a"])
    weights = tmp_path / "weights"
    try:
        engine.update_weights(params_b, "b-1")
        assert engine.weight_version == "b-1"
        assert engine.model_info(server.url)["weight_version"] == "b-1"
        assert sorted(os.listdir(weights)) == ["b-1"]
        _assert_greedy_matches(engine, models["b"], version="b-1")
    finally:  # the module's other tests expect model "a"
        engine.update_weights(params_a, "a-2")
    assert sorted(os.listdir(weights)) == ["a-2"]  # the older export is gone
    assert engine.model_info(server.url)["weight_version"] == "a-2"
    _assert_greedy_matches(engine, models["a"], version="a-2")


@pytest.mark.parametrize("other", ["deep", "wide"])
def test_weight_update_with_other_shapes_is_refused_by_the_client(engine, server, models, other,
                                                                  tmp_path):
    before = engine.model_info(server.url)["weight_version"]
    cfg, params = hf.load(models[other])
    engine.model_config = cfg
    with pytest.raises(RolloutError, match="refusing to update") as err:
        engine.update_weights(params, "bad-1")
    assert server.url in str(err.value)
    assert not os.path.exists(tmp_path / "weights" / "bad-1")
    assert engine.model_info(server.url)["weight_version"] == before  # server untouched
    assert engine.health()


# ----------------------------------------------------------------------------- failures


def test_fail_over_from_an_unreachable_url(server):
    dead = f"http://127.0.0.1:{free_port()}"
    engine = SGLangEngine([dead, server.url], connect_retries=1, backoff_s=0.05,
                          request_timeout_s=60, batch_size=1)
    results = engine.generate([GenerateRequest(p, greedy(4)) for p in PROMPTS])
    assert [r.info["url"] for r in results] == [server.url] * len(PROMPTS)
    assert engine.health()  # one live server is enough
    engine.close()


def test_server_killed_mid_request_raises_rollout_error(backend, models):
    doomed = _start(backend, models["a"])
    timeout_s = 60.0
    engine = SGLangEngine([doomed.url], request_timeout_s=timeout_s, connect_retries=2,
                          backoff_s=0.2)
    out = {}

    def run():
        try:
            out["results"] = engine.generate([GenerateRequest(
                p, SamplingParams(max_new_tokens=1800, ignore_eos=True)) for p in PROMPTS])
        except Exception as e:  # noqa: BLE001  (the test inspects it)
            out["error"] = e

    try:
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)  # the request is running on the server
        doomed.kill()
        killed = time.monotonic()
        thread.join(timeout=timeout_s)
        assert not thread.is_alive(), "generate hung after the server died"
        assert time.monotonic() - killed < timeout_s
        assert "results" not in out, "the generation finished before the kill; make it longer"
        error = out["error"]
        assert isinstance(error, RolloutError) and doomed.url in str(error)
        assert not engine.health()
    finally:
        doomed.stop()
        engine.close()
