"""Shared bits of the benchmarks: model shapes by name, device peak FLOP/s, timing, tables."""

from __future__ import annotations

import jax

from rl_tpu.models.presets import PRESETS, preset_config
from rl_tpu.models.transformer import ModelConfig

# Named CPU-sized shapes with random weights; real models' names (qwen2.5-0.5b, llama-3.1-8b,
# ...) are rl_tpu/models/presets.py's.
SHAPES = {
    "tiny": dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True),
    "small": dict(arch="qwen2", vocab_size=8192, hidden_size=256, intermediate_size=1024,
                  num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, qkv_bias=True),
    # 3.74M params: 2 x (3584 x 256) embedding + head, 2 layers of 0.95M (benchmarks/rl_step.py)
    "rl_step": dict(arch="qwen2", vocab_size=3584, hidden_size=256, intermediate_size=1024,
                    num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, qkv_bias=True),
    # 3.67M params: the shape the peer comparisons use (benchmarks/README.md): 2048 x 256 tied
    # embedding + 4 layers of 0.79M: a random Qwen2 with a small model's proportions (tied, as
    # the small Qwens are), where rl_step's 2 untied layers put more of the cost in the head.
    "peer": dict(arch="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=768,
                 num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, qkv_bias=True,
                 tie_word_embeddings=True),
}

# Dense bf16 peak FLOP/s per chip, by substrings of jax's device_kind.
PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
    "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6": 918e12,
}


def model_config(shape: str, **overrides) -> ModelConfig:
    if shape in SHAPES:
        return ModelConfig(**{**SHAPES[shape], **overrides})
    if shape.lower() in PRESETS:
        return preset_config(shape, **overrides)
    raise SystemExit(f"unknown --shape {shape!r}; choose one of {sorted(SHAPES)} or a model "
                     f"preset {sorted(PRESETS)}")


def peak_flops_per_device(override_tflops: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if override_tflops:
        return override_tflops * 1e12, "given"
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_BF16_FLOPS.items():
        if name.lower() in kind.lower():
            return flops, "spec bf16"
    return measured_matmul_flops(), "measured fp32 matmul"


def measured_matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """What one device sustains on a large fp32 matmul: the practical peak of a CPU, which
    has no published figure that its vector units reach."""
    import time

    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = matmul(a)
    out.block_until_ready()
    return 2 * n ** 3 * repeats / (time.perf_counter() - start)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token: 6 x (matmul params, LM head included)
    + causal attention scores and values (6 x 2 x L x T x N x H / 2 for the causal half)."""
    d, h = cfg.hidden_size, cfg.head_dim
    matmul_params = cfg.num_layers * (d * (cfg.num_heads + 2 * cfg.num_kv_heads) * h
                                      + cfg.num_heads * h * d + 3 * d * cfg.intermediate_size)
    matmul_params += cfg.vocab_size * d  # the LM head (an embedding lookup costs no FLOPs)
    attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * h
    return 6 * matmul_params + attention


def median_ms(fn, repeats: int = 10) -> float:
    """Median wall time of `fn()` in milliseconds, waiting for its device work (jax's dispatch
    is asynchronous); one untimed call first, for compilation and warm caches."""
    import time

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def print_table(header: list[str], rows: list[list]):
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
