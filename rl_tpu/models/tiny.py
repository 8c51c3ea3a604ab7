"""Small random-weight models in HF format, for tests, demos and benchmarks (no hub needed).

`write_tiny_model(out_dir, arch)` builds a config of the chosen family, creates random params
straight into their shardings, and saves config + safetensors + a locally trained ChatML
tokenizer with `hf.save`, so the directory loads in rl_tpu, transformers and SGLang alike.
"""

from __future__ import annotations

import os
from typing import Sequence

import jax
import numpy as np

from rl_tpu import parallel
from rl_tpu.models import hf
from rl_tpu.models.moe import MoeConfig
from rl_tpu.models.tiny_tokenizer import IM_END, build_tokenizer
from rl_tpu.models.transformer import ModelConfig, RopeScaling, Transformer

# Each family's distinguishing switches at toy size: GQA (4 query heads on 2 kv heads), several
# layers, Llama 3.1 rope scaling for llama, QKV bias for qwen2, q/k norm + tied embeddings for qwen3,
# 8 experts of which each token takes 2 in every layer for qwen3_moe (untied, as Qwen3-30B-A3B).
TINY_SHAPES = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
FAMILY_SWITCHES = {
    "llama": dict(rope_theta=500000.0, rope_scaling=RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256)),
    "qwen2": dict(rope_theta=1000000.0, qkv_bias=True),
    "qwen3": dict(rope_theta=1000000.0, qk_norm=True, tie_word_embeddings=True),
    "qwen3_moe": dict(rope_theta=1000000.0, qk_norm=True, moe=MoeConfig(
        num_experts=8, top_k=2, intermediate_size=32)),
}


def tiny_config(arch: str, vocab_size: int = 512, **overrides) -> ModelConfig:
    if arch not in FAMILY_SWITCHES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(FAMILY_SWITCHES)}")
    kwargs = dict(TINY_SHAPES, arch=arch, vocab_size=vocab_size, **FAMILY_SWITCHES[arch])
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def random_params(cfg: ModelConfig, seed: int = 0, mesh=None, scale: float = 0.5):
    """Random params in their shardings. Matrices get std 0.02 * 25 * `scale` (larger than a
    training init) so that logits differ between tokens and greedy decoding is not one token
    repeated; norms and biases keep their init."""
    mesh = mesh or parallel.make_mesh({}, devices=jax.devices()[:1])
    params = parallel.init_params(Transformer(cfg), mesh, parallel.DEFAULT_RULES,
                                  jax.random.key(seed), np.zeros((1, 1), np.int32))
    boost = 25 * scale
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if "scale" in str(path[-1]) or "bias" in str(path[-1]) else x * boost,
        params)


def write_tiny_model(out_dir: str, arch: str = "qwen2", vocab_size: int = 512, seed: int = 0,
                     dtype: str = "float32", init_scale: float = 0.5, overwrite: bool = False,
                     corpus: Sequence[str] = (), **overrides) -> ModelConfig:
    """Writes a random tiny model + tokenizer as an HF directory; returns its config. An
    existing non-empty `out_dir` is replaced only with `overwrite` (else FileExistsError).
    `corpus`: extra text the tokenizer learns merges on (`build_tokenizer`'s extra_texts)."""
    if not overwrite and os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} exists and is not empty; pick another directory or "
                              "pass overwrite=True to replace it")
    tokenizer = build_tokenizer(vocab_size, corpus)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    cfg = tiny_config(arch, vocab_size, eos_token_ids=(eos,), param_dtype=dtype, dtype=dtype,
                      **overrides)
    hf.save(out_dir, cfg, random_params(cfg, seed, scale=init_scale), tokenizer=tokenizer)
    return cfg


def describe(cfg: ModelConfig) -> str:
    return (f"{cfg.arch}: {cfg.num_layers} layers, D={cfg.hidden_size}, F={cfg.intermediate_size}, "
            f"heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, V={cfg.vocab_size}, "
            f"{cfg.num_params():,} params")
