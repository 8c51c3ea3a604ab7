"""Several LoRA adapters served side by side (rl_tpu/rollout/adapter_slots.py): each row samples
with its own slot exactly as a model of that adapter alone, the prefix cache never hands K/V
across adapters, a slot stays its adapter's while a request holds it, and rl_tpu's own server
speaks SGLang's LoRA endpoints."""

import dataclasses
import json
import urllib.error
import urllib.request

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import lora, peft_format
from rl_tpu.models.transformer import ModelConfig, Transformer
from rl_tpu.rollout.adapter_slots import AdapterSlotsError, slot_config
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, serve

CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
                  max_position_embeddings=256)
TOKENS = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
PROMPT = list(range(1, 20))  # longer than a 16-token page: reusable


def _params(cfg, seed):
    return nn.meta.unbox(Transformer(cfg).init(jax.random.key(seed), TOKENS))["params"]


BASE = _params(CFG, 0)


def _adapter(rank, alpha, seed, targets=lora.TARGETS, rslora=False):
    """(config, base + adapters with a random nonzero B)."""
    cfg = CFG.replace(lora=lora.LoraConfig(rank=rank, alpha=alpha, targets=targets,
                                           rslora=rslora))
    adapters = jax.tree_util.tree_map_with_path(
        lambda kp, x: 0.3 * jax.random.normal(jax.random.key(seed + len(str(kp))), x.shape)
        if kp[-1].key == "lora_b" else x, lora.adapters(_params(cfg, seed)))
    return cfg, lora.with_adapters(BASE, adapters)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two PEFT dirs unlike each other and the server's most rank: a (rank 4, every target)
    and b (rank 2, rsLoRA, q and v only)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, spec in (("a", (4, 8.0, 1)), ("b", (2, 3.0, 2, ("q_proj", "v_proj"), True))):
        cfg, params = _adapter(*spec)
        peft_format.save_adapter(str(root / name), cfg, params)
        out[name] = (str(root / name), cfg, params)
    return out


def _alone(cfg, params, sampling):
    """What a sampler of that one model (its adapter, if any, applied as is) gives for
    PROMPT."""
    if lora.is_on(cfg):
        cfg = cfg.replace(lora=dataclasses.replace(cfg.lora, sampler="lowrank"))
    sampler = JaxSampler(cfg, params, prefix_cache_tokens=0)
    return sampler.generate([GenerateRequest(PROMPT, sampling, "alone")])[0]


def test_a_slot_row_computes_its_own_adapter_by_hand():
    """One projection, x = [1, 2], W = 0, rank 1, three slots: A_k = [[1], [1]] (x A = 3) and
    B_1 = [[2, 3]], B_2 = [[-1, 5]], slot 0 zeros: rows at slots [2, 0, 1] give
    [-3, 15], [0, 0], [6, 9]; a nan in another slot's B never reaches a row."""
    layer = lora.LoraDenseGeneral(features=2, use_bias=False, kernel_axes=("a", "b"),
                                  lora=lora.LoraConfig(rank=1, alpha=1.0, slots=3))
    b = jnp.asarray([[[0.0, 0.0]], [[2.0, 3.0]], [[-1.0, 5.0]]])
    params = {"kernel": jnp.zeros((2, 2)), "lora_a": jnp.ones((3, 2, 1)), "lora_b": b}
    x = jnp.asarray([[1.0, 2.0]] * 3)
    out = layer.apply({"params": params}, x, jnp.asarray([2, 0, 1]))
    np.testing.assert_allclose(np.asarray(out), [[-3.0, 15.0], [0.0, 0.0], [6.0, 9.0]])
    params["lora_a"] = params["lora_a"].at[2].set(jnp.nan)
    out = layer.apply({"params": params}, x[:2], jnp.asarray([1, 0]))
    np.testing.assert_allclose(np.asarray(out), [[6.0, 9.0], [0.0, 0.0]])


def test_rows_of_different_adapters_sample_as_each_adapter_alone(adapters):
    """One batch of three rows (adapter a, the base, adapter b; greedy and sampled): tokens
    equal and log-probs within 1e-5 of a sampler holding that one model. Asked again, each row
    reuses its own prompt's K/V (the prefix cache keyed by adapter) and gives the same."""
    sampler = JaxSampler(slot_config(CFG, 8, 2), BASE, prefix_cache_tokens=4096)
    for name in ("a", "b"):
        sampler.load_adapter(name, adapters[name][0])
    slots = sampler.adapter_slots
    a, b = slots.acquire("a"), slots.acquire("b")
    assert sorted((a, b)) == [1, 2]
    # the base's K/V of PROMPT is cached; adapter a's row must not take it
    sampler.generate([GenerateRequest(PROMPT, GREEDY, "base first")])
    alone = sampler.generate([GenerateRequest(PROMPT, GREEDY, "a then", lora_slot=a)])[0]
    assert sampler.stats()["reused_tokens"] == 0
    assert alone.output_ids == _alone(*adapters["a"][1:], GREEDY).output_ids
    for sampling in (GREEDY, SAMPLED):
        requests = [GenerateRequest(PROMPT, sampling, "a", lora_slot=a),
                    GenerateRequest(PROMPT, sampling, "base"),
                    GenerateRequest(PROMPT, sampling, "b", lora_slot=b)]
        first = sampler.generate(requests)
        for got, (cfg, params) in zip(first, [adapters["a"][1:], (CFG, BASE),
                                               adapters["b"][1:]]):
            want = _alone(cfg, params, sampling)
            assert got.output_ids == want.output_ids
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
        reused = sampler.stats()["reused_tokens"]
        again = sampler.generate(requests)
        assert sampler.stats()["reused_tokens"] - reused == 3 * 18  # all but one token, its own
        for x, y in zip(first, again):
            assert x.output_ids == y.output_ids
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    assert sorted(slots.loaded()) == ["a", "b"]


def test_a_held_slot_outlives_its_unload_and_refusals_name_the_fix(adapters):
    sampler = JaxSampler(slot_config(CFG, 4, 2, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj")), BASE,
                         prefix_cache_tokens=0)
    slots = sampler.adapter_slots
    sampler.load_adapter("a", adapters["a"][0])
    held = slots.acquire("a")
    slots.unload("a")
    with pytest.raises(AdapterSlotsError, match="'a' in lora_path is not loaded"):
        slots.acquire("a")
    sampler.load_adapter("b", adapters["b"][0])  # the other slot: a's is still held
    assert slots.acquire("b") != held
    with pytest.raises(AdapterSlotsError, match="larger --max_loaded_loras"):
        sampler.load_adapter("a2", adapters["a"][0])
    # the held row still computes adapter a's values
    result = sampler.generate([GenerateRequest(PROMPT, GREEDY, "held", lora_slot=held)])[0]
    assert result.output_ids == _alone(*adapters["a"][1:], GREEDY).output_ids
    slots.release(held)
    sampler.load_adapter("a2", adapters["a"][0])  # now free
    with pytest.raises(AdapterSlotsError, match="loaded already"):
        sampler.load_adapter("a2", adapters["a"][0])
    narrow = JaxSampler(slot_config(CFG, 2, 1, ("q_proj", "v_proj")), BASE,
                        prefix_cache_tokens=0)
    with pytest.raises(AdapterSlotsError, match="rank 4, over this server's --max_lora_rank 2"):
        narrow.load_adapter("a", adapters["a"][0])
    with pytest.raises(AdapterSlotsError, match="cannot load the LoRA adapter /nowhere"):
        narrow.load_adapter("x", "/nowhere")
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        JaxSampler(CFG, BASE, prefix_cache_tokens=0).load_adapter("a", adapters["a"][0])


def _call(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=data),
                                    timeout=120) as resp:
            return resp.status, json.loads(resp.read().decode())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())


def test_the_server_speaks_sglangs_lora_endpoints(adapters, tmp_path):
    """/load_lora_adapter, /generate with lora_path (one name, or one a prompt),
    /unload_lora_adapter and /server_info over loopback HTTP, as the SGLang client reads them."""
    sampler = JaxSampler(slot_config(CFG, 8, 2), BASE, prefix_cache_tokens=4096)
    service = RolloutService(sampler, "tiny", None)
    http = serve(service, "127.0.0.1", 0)
    url = http.start()
    try:
        status, info = _call(url, "/server_info")
        assert status == 200 and info["enable_lora"] and info["max_lora_rank"] == 8
        assert info["max_loaded_loras"] == 2 and "q_proj" in info["lora_target_modules"]
        for name in ("a", "b"):
            status, reply = _call(url, "/load_lora_adapter",
                                  {"lora_name": name, "lora_path": adapters[name][0]})
            assert status == 200 and reply["success"], reply
        assert set(reply["loaded_adapters"]) == {"a", "b"}
        body = {"input_ids": [PROMPT, PROMPT], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        status, out = _call(url, "/generate", dict(body, lora_path=["b", None]))
        assert status == 200, out
        for got, (cfg, params) in zip(out, [adapters["b"][1:], (CFG, BASE)]):
            want = _alone(cfg, params, GREEDY)
            assert got["output_ids"] == want.output_ids
            np.testing.assert_allclose([lp for lp, _, _ in got["meta_info"][
                "output_token_logprobs"]], want.logprobs, atol=1e-5)
        status, out = _call(url, "/generate", dict(body, lora_path="a"))
        assert [r["output_ids"] for r in out] == [_alone(*adapters["a"][1:], GREEDY)
                                                  .output_ids] * 2
        # the OpenAI routes pick an adapter as SGLang's do: "model": "<served>:<adapter>",
        # or lora_path beside the fields (the openai client's extra_body)
        import openai
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for model, extra in (("tiny:b", None), ("tiny", {"lora_path": "b"}), ("tiny", None)):
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                              temperature=0.0, extra_body=extra)
            want = _alone(*(adapters["b"][1:] if model != "tiny" or extra else (CFG, BASE)),
                          GREEDY)
            assert reply.choices[0].model_extra["token_ids"] == want.output_ids, (model, extra)
        status, reply = _call(url, "/v1/completions", {"model": "tiny:nope", "prompt": PROMPT,
                                                        "max_tokens": 2})
        assert status == 400 and "'nope'" in reply["error"]["message"]
        status, reply = _call(url, "/unload_lora_adapter", {"lora_name": "a"})
        assert status == 200 and set(reply["loaded_adapters"]) == {"b"}
        status, reply = _call(url, "/generate", dict(body, lora_path="a"))
        assert status == 400 and "LoRA adapter 'a'" in reply["error"]["message"]
        status, reply = _call(url, "/unload_lora_adapter", {"lora_name": "a"})
        assert status == 400 and not reply["success"] and "'a'" in reply["error_message"]
        status, reply = _call(url, "/load_lora_adapter", {"lora_name": "c",
                                                          "lora_path": str(tmp_path)})
        assert status == 400 and "cannot load the LoRA adapter" in reply["error_message"]
        assert sampler.adapter_slots._refs == [0, 0, 0]  # every request let its slot go
    finally:
        http.shutdown()
        service.batcher.close()
    plain = RolloutService(JaxSampler(CFG, BASE, prefix_cache_tokens=0), "tiny", None)
    http = serve(plain, "127.0.0.1", 0)
    url = http.start()
    try:
        assert _call(url, "/server_info")[1]["enable_lora"] is False
        status, reply = _call(url, "/load_lora_adapter", {"lora_name": "a",
                                                          "lora_path": adapters["a"][0]})
        assert status == 400 and "--enable_lora" in reply["error_message"]
        status, reply = _call(url, "/generate", {"input_ids": PROMPT, "lora_path": "a"})
        assert status == 400 and "--enable_lora" in reply["error"]["message"]
        status, reply = _call(url, "/v1/completions", {"model": "tiny:a", "prompt": PROMPT})
        assert status == 400 and "--enable_lora" in reply["error"]["message"]
    finally:
        http.shutdown()
        plain.batcher.close()
