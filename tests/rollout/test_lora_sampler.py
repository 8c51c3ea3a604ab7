"""The embedded sampler with a LoRA policy (rollout/adapter_weights.py): both modes sample
what the trainer scores, a sync moves the adapters alone once the base is held, and a batch
keeps the adapters it started with. The mode travels with the adapters: the policy's
LoraConfig names it (`sampler`), and the sampler runs what it names."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

import rl_tpu.rollout.sampler as sampler_module
from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import lora
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.transformer import ModelConfig, Transformer
from rl_tpu.rollout.sampler import JaxSampler

BASE = ModelConfig(arch="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
CFG = BASE.replace(lora=lora.LoraConfig(rank=4, alpha=8))
PROMPT = [3, 14, 15, 92, 65]


def adapted(seed: int):
    """A policy whose adapters differ from a fresh one's (B != 0), per seed."""
    params = nn.meta.unbox(Transformer(CFG).init(jax.random.key(0),
                                                 np.zeros((1, 4), np.int32)))["params"]
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: (0.5 * jax.random.normal(jax.random.fold_in(jax.random.key(seed),
                                                                  len(str(kp))), x.shape)
                       if kp[-1].key == "lora_b" else x), params)


def trainer_logprobs(cfg, params, prompt, output):
    tokens = np.asarray([prompt + list(output)], np.int32)
    lp, _ = token_logprobs(Transformer(cfg), params, {"tokens": tokens}, with_entropy=False)
    return np.asarray(lp)[0, len(prompt):]


def in_mode(cfg, mode: str):
    """`cfg` whose adapters the embedded sampler runs in `mode`."""
    return cfg.replace(lora=dataclasses.replace(cfg.lora, sampler=mode))


def request(n=12, seed=5):
    return GenerateRequest(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed))


@pytest.mark.parametrize("mode", ["merge", "lowrank"])
def test_both_modes_sample_the_adapted_policy_and_sync_only_adapters(mode):
    params = adapted(1)
    sampler = JaxSampler(in_mode(CFG, mode), params, prefix_cache_tokens=0)
    # the mode the LoraConfig names: merge runs the plain model, lowrank the adapters
    assert sampler.model.cfg.lora == (None if mode == "merge" else in_mode(CFG, mode).lora)
    full_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(lora.adapters(params)))
    assert sampler.stats()["last_sync_bytes"] == full_bytes  # base + adapters, once
    res = sampler.generate([request()])[0]
    np.testing.assert_allclose(res.logprobs, trainer_logprobs(CFG, params, PROMPT,
                                                              res.output_ids), atol=2e-5)
    base_lp = trainer_logprobs(BASE, lora.without_adapters(params), PROMPT, res.output_ids)
    assert np.abs(base_lp - res.logprobs).max() > 0.05  # the adapters were applied

    other = adapted(2)
    sampler.update_weights(lora.adapters(other), "1")  # the adapters alone will do
    assert sampler.stats()["last_sync_bytes"] == adapter_bytes
    res = sampler.generate([request()])[0]
    assert res.weight_version == "1"
    np.testing.assert_allclose(res.logprobs, trainer_logprobs(CFG, other, PROMPT,
                                                              res.output_ids), atol=2e-5)


def test_a_batch_keeps_the_adapters_it_started_with():
    """An update lands between decode chunks; a LoRA batch goes on under the adapters it was
    admitted with and reports that one version (SGLang's per-request lora_path), and its
    log-probs are that version's."""
    first, second = adapted(1), adapted(2)
    sampler = JaxSampler(in_mode(CFG, "lowrank"), first, prefix_cache_tokens=0,
                         decode_chunk=4, version="a")
    swapped = {}
    real_decode = sampler_module.decode

    def decode_then_swap(*args, **kwargs):
        out = real_decode(*args, **kwargs)
        if not swapped:
            swapped["at"] = int(out.step)
            sampler.update_weights(lora.adapters(second), "b")
        return out

    sampler_module.decode = decode_then_swap
    try:
        res = sampler.generate([request(16)])[0]
    finally:
        sampler_module.decode = real_decode
    assert 0 < swapped["at"] < 16
    assert res.weight_version == "a"
    assert [span["version"] for span in res.info["weight_versions"]] == ["a"]
    np.testing.assert_allclose(res.logprobs, trainer_logprobs(CFG, first, PROMPT,
                                                              res.output_ids), atol=2e-5)
    assert sampler.generate([request(4)])[0].weight_version == "b"  # the next batch


def test_wrong_adapters_and_a_missing_base_are_named():
    params = adapted(1)
    with pytest.raises(ValueError, match="must hold the base"):
        JaxSampler(CFG, lora.adapters(params), prefix_cache_tokens=0)
    sampler = JaxSampler(CFG, params, prefix_cache_tokens=0)
    with pytest.raises(ValueError, match="hold no adapters"):
        sampler.update_weights(lora.without_adapters(params), "1")
    rank8 = nn.meta.unbox(Transformer(BASE.replace(lora=lora.LoraConfig(rank=8))).init(
        jax.random.key(0), np.zeros((1, 4), np.int32)))["params"]
    with pytest.raises(ValueError, match="rank 4"):
        sampler.update_weights(lora.adapters(rank8), "1")
    with pytest.raises(ValueError, match=r"lora sampler='fused'; choose one of \('merge', "
                                         r"'lowrank'\)"):
        in_mode(CFG, "fused")  # refused where the LoraConfig is made, before any sampler
