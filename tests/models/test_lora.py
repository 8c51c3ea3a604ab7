"""LoRA adapters (rl_tpu/models/lora.py): the low-rank path, PEFT's scale and init, merging,
and the param-tree helpers the trainer and sampler build on."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.models import lora
from rl_tpu.models.transformer import ModelConfig, Transformer

CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
TOKENS = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 64


def init(cfg, seed=0):
    return nn.meta.unbox(Transformer(cfg).init(jax.random.key(seed), TOKENS))["params"]


def with_random_b(params, scale=0.3):
    """B is zero at init (the adapter starts as the base); give it values so it matters."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: (scale * jax.random.normal(jax.random.key(len(str(kp))), x.shape)
                       if kp[-1].key == "lora_b" else x), params)


def test_the_low_rank_path_by_hand():
    """x = [1, 2], W = 0, A = [[1], [1]], B = [[2, 3]], alpha 2, rank 1: scale 2, and
    y = scale * (x A) B = 2 * 3 * [2, 3] = [12, 18]; rsLoRA at rank 1 scales alike."""
    for rslora in (False, True):
        layer = lora.LoraDenseGeneral(features=2, use_bias=False, kernel_axes=("a", "b"),
                                      lora=lora.LoraConfig(rank=1, alpha=2.0, rslora=rslora))
        params = {"kernel": jnp.zeros((2, 2)), "lora_a": jnp.ones((2, 1)),
                  "lora_b": jnp.asarray([[2.0, 3.0]])}
        out = layer.apply({"params": params}, jnp.asarray([[1.0, 2.0]]))
        np.testing.assert_allclose(np.asarray(out), [[12.0, 18.0]])


def test_scale_is_alpha_over_rank_or_its_square_root():
    assert lora.LoraConfig(rank=8, alpha=16).scale == 2.0
    assert lora.LoraConfig(rank=4, alpha=8, rslora=True).scale == 4.0  # 8 / sqrt(4)


def test_init_is_peft_kaiming_uniform_and_zero_b():
    """PEFT's default A: kaiming-uniform with a = sqrt(5) over fan_in = 32 (D) or 32 = N*H
    (o_proj): bound 1/sqrt(32) = 0.1768, variance bound^2 / 3 = 1/96; "gaussian": N(0, 1/r)."""
    params = init(CFG.replace(lora=lora.LoraConfig(rank=8, alpha=8)))
    for name in ("q_proj", "o_proj"):
        a = np.asarray(params["layers_0"]["attn"][name]["lora_a"])
        assert np.abs(a).max() <= 1 / np.sqrt(32) + 1e-7
        assert np.abs(a).max() > 0.9 / np.sqrt(32)  # 256 draws reach near the bound
        assert abs(a.var() - 1 / 96) < 0.25 / 96
        assert not np.asarray(params["layers_0"]["attn"][name]["lora_b"]).any()
    down = np.asarray(params["layers_0"]["mlp"]["down_proj"]["lora_a"])  # fan_in F = 64
    assert np.abs(down).max() <= 1 / 8 + 1e-7
    gauss = init(CFG.replace(lora=lora.LoraConfig(rank=4, init="gaussian")))
    a = np.asarray(gauss["layers_0"]["mlp"]["up_proj"]["lora_a"])
    assert abs(a.std() - 0.25) < 0.04  # std 1/r


def test_a_fresh_adapter_is_the_base_and_a_trained_one_is_its_merge():
    base_cfg, lora_cfg = CFG, CFG.replace(lora=lora.LoraConfig(rank=4, alpha=8))
    base, params = init(base_cfg), init(lora_cfg)
    plain = Transformer(base_cfg).apply({"params": base}, TOKENS)
    # the base leaves are the same draws (adapters take their own rng streams)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, lora.without_adapters(params), base))
    np.testing.assert_array_equal(Transformer(lora_cfg).apply({"params": params}, TOKENS), plain)
    trained = with_random_b(params)
    adapted = Transformer(lora_cfg).apply({"params": trained}, TOKENS)
    assert np.abs(np.asarray(adapted - plain)).max() > 0.05  # the adapter matters
    merged = lora.merge(trained, lora_cfg.lora)
    assert not lora.has_adapters(merged)
    np.testing.assert_allclose(Transformer(base_cfg).apply({"params": merged}, TOKENS), adapted,
                               atol=2e-6)


def test_targets_choose_the_projections():
    cfg = CFG.replace(lora=lora.LoraConfig(rank=2, targets=("q_proj", "v_proj")))
    layer = init(cfg)["layers_1"]
    assert set(layer["attn"]["q_proj"]) == {"kernel", "bias", "lora_a", "lora_b"}
    assert "lora_a" not in layer["attn"]["k_proj"] and "lora_a" not in layer["mlp"]["up_proj"]
    # q: [D, r] and [r, N, H]; count: 2 layers x (q: 32*2 + 2*32, v: 32*2 + 2*16)
    assert layer["attn"]["q_proj"]["lora_b"].shape == (2, 4, 8)
    assert lora.adapter_count(init(cfg)) == 2 * (64 + 64 + 64 + 32)


def test_scanned_layers_stack_adapters_and_merge_alike():
    cfg = CFG.replace(lora=lora.LoraConfig(rank=4, alpha=8), scan_layers=True)
    params = with_random_b(init(cfg))
    assert params["layers"]["attn"]["o_proj"]["lora_a"].shape == (2, 4, 8, 4)
    out = Transformer(cfg).apply({"params": params}, TOKENS)
    merged = lora.merge(params, cfg.lora)
    np.testing.assert_allclose(
        Transformer(cfg.replace(lora=None)).apply({"params": merged}, TOKENS), out, atol=2e-6)


def test_dropout_only_where_a_key_is_given():
    cfg = CFG.replace(lora=lora.LoraConfig(rank=4, dropout=0.5))
    params = with_random_b(init(cfg))
    model = Transformer(cfg)
    plain = model.apply({"params": params}, TOKENS)
    np.testing.assert_array_equal(model.apply({"params": params}, TOKENS), plain)
    dropped = model.apply({"params": params}, TOKENS, rngs={"dropout": jax.random.key(1)})
    again = model.apply({"params": params}, TOKENS, rngs={"dropout": jax.random.key(1)})
    assert np.abs(np.asarray(dropped - plain)).max() > 1e-3
    np.testing.assert_array_equal(dropped, again)  # a key is a mask: reproducible


def test_bf16_base_keeps_fp32_adapters():
    cfg = CFG.replace(lora=lora.LoraConfig(rank=4), dtype="bfloat16", param_dtype="bfloat16")
    params = init(cfg)
    assert params["layers_0"]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    assert params["layers_0"]["attn"]["q_proj"]["lora_a"].dtype == jnp.float32
    assert Transformer(cfg).apply({"params": params}, TOKENS).dtype == jnp.float32


def test_select_and_merge_into_round_trip():
    params = init(CFG.replace(lora=lora.LoraConfig(rank=2)))
    sub = lora.select(params, frozenset(lora.ADAPTER_KEYS))
    assert all(lora.is_adapter_path(tuple(k.key for k in kp))
               for kp, _ in jax.tree_util.tree_flatten_with_path(sub)[0])
    doubled = jax.tree.map(lambda x: 2 * x, sub)
    back = lora.merge_into(params, doubled)
    np.testing.assert_array_equal(back["layers_0"]["attn"]["q_proj"]["lora_a"],
                                  2 * params["layers_0"]["attn"]["q_proj"]["lora_a"])
    np.testing.assert_array_equal(back["layers_0"]["attn"]["q_proj"]["kernel"],
                                  params["layers_0"]["attn"]["q_proj"]["kernel"])
    with pytest.raises(KeyError, match="value_head/kernel"):
        lora.merge_into(params, {"value_head": {"kernel": jnp.zeros(())}})


@pytest.mark.parametrize("kwargs,named", [
    (dict(rank=0), "rank"), (dict(dropout=1.0), "dropout"),
    (dict(targets=("q_proj", "qkv")), "qkv"), (dict(targets=()), "none given"),
    (dict(init="pissa"), "init"),
])
def test_bad_lora_configs_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        lora.LoraConfig(**kwargs)
