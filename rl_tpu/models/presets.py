"""The architectures of public checkpoints, as their config.json files give them, without the
weights: what `launch.compile_check --model NAME` plans a run for on a machine that has no
model hub (the shapes decide memory and speed; the values do not).

Only the fields `hf.config_from_hf` reads are kept. A real checkpoint dir (`model.path`)
always wins over a preset: its own config.json is read instead.
"""

from __future__ import annotations

from rl_tpu.models import hf
from rl_tpu.models.transformer import ModelConfig

_QWEN25 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
               rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
               bos_token_id=151643, eos_token_id=151645)

_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  hidden_act="silu", vocab_size=151936, head_dim=128, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, max_position_embeddings=40960,
                  tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)

PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "qwen2.5-3b": dict(_QWEN25, vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                     vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, tie_word_embeddings=False,
                     bos_token_id=151643, eos_token_id=151645),
    "qwen3-1.7b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                       hidden_act="silu", vocab_size=151936, hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=40960,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    # Mixtures of experts: every layer sparse (decoder_sparse_step 1, no mlp_only_layers)
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                         hidden_act="silu", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         max_position_embeddings=131072, tie_word_embeddings=False,
                         bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
}


def preset_config(name: str, **overrides) -> ModelConfig:
    """ModelConfig of a preset (`PRESETS`), with ModelConfig fields overridden (dtype, remat,
    scan_layers, ...)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} or "
                         "point model.path at an HF model dir")
    return hf.config_from_hf(PRESETS[key], source=f"preset {key}", **overrides)
