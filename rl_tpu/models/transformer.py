"""One decoder for the Llama 3, Qwen2/2.5, Qwen3 and Qwen3-MoE families, in Flax Linen.

The families differ only in switches of `ModelConfig`: QKV bias (Qwen2), per-head RMSNorm
of q and k before RoPE (Qwen3), RoPE scaling (Llama 3.1+), tied embeddings (small Qwens), and
mixture-of-experts feed-forward layers (Qwen3-MoE: `moe`, moe.py).

Shape letters used in names, comments and einsums:
  B batch, T query length, S key/value length (KV-cache slots), D model width,
  N query heads, K kv heads, G = N // K query heads per kv head, H head dim,
  F mlp width, V vocab, L layers.

Two call modes, one code path:
  * full sequence (training, scoring): `segment_ids` [B, T] separate packed sequences (0 marks
    padding), attention is causal within a segment;
  * cached (sampling): `cache` holds K/V for S slots per row; the token at position p is written
    to slot p and attends to slots <= p, so prompts of mixed length are right-padded and each
    row decodes at its own position.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rl_tpu import parallel
from rl_tpu.models.blocked_attention import segment_causal_attention
from rl_tpu.models.dense import dense_dot_general
from rl_tpu.models.fused_attention import ATTENTION_IMPLS, segment_attention
from rl_tpu.models.lora import LoraConfig, LoraDenseGeneral, is_on as lora_is_on
from rl_tpu.models.moe import MoeConfig, MoeMLP
from rl_tpu.models.recompute import after

Array = jax.Array

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")
REMAT_POLICIES = ("none", "full", "dots")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` / `rope_parameters` beyond the base frequency."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture plus numerics. Hashable, so it can be a static Linen attribute."""

    arch: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5 (and Llama with attention_bias=True)
    qk_norm: bool = False  # Qwen3
    max_position_embeddings: int = 4096
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    scan_layers: bool = False
    remat: str = "none"  # none | full | dots (save matmul outputs, recompute the rest)
    # Query block of attention (0 = one block). Without a cache (training, scoring; see
    # blocked_attention.py) block i attends only to the keys up to its own end, skipping the
    # all-masked rest; with one (a sampler's prefill) each block attends to every slot,
    # holding a block's logits. XLA:CPU, 8 rows of the peer shape: 256 the fastest at 384
    # tokens, 128 8% faster at 1536 (docs/scaling.md).
    attention_block: int = 256
    # The full-sequence path's kernel: xla (blocked_attention.py, any device), dot_product
    # (cuDNN flash attention on GPU) or splash (TPU Pallas); see fused_attention.py. Caches
    # always use xla.
    attention_impl: str = "xla"
    # The KV cache's dtype ("" = the compute dtype). A bfloat16 cache under fp32 weights halves
    # decode's largest buffer; keys and values are cast back to the compute dtype when read.
    cache_dtype: str = ""
    # Low-rank adapters on the projections `lora.targets` names (lora.py); None: no adapters.
    lora: Optional[LoraConfig] = None
    # Mixture-of-experts feed-forward layers (arch qwen3_moe; moe.py); None: every layer dense.
    moe: Optional[MoeConfig] = None

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown arch {self.arch!r}; supported: {ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r}; choose one of "
                             f"{ATTENTION_IMPLS}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        if (self.arch == "qwen3_moe") != (self.moe is not None):
            raise ValueError(f"arch={self.arch!r} with moe={self.moe}: arch qwen3_moe needs a "
                             "MoeConfig, and only it takes one")
        if (self.moe is not None and self.scan_layers
                and len(self.moe.sparse_layers(self.num_layers)) != self.num_layers):
            raise ValueError(  # a scan repeats one block: every layer must be the same kind
                "scan_layers=True needs every layer of a mixture of experts sparse (as Qwen3-MoE "
                f"releases have); this one has dense layers {self._dense_layers()} "
                "(mlp_only_layers, decoder_sparse_step): set model.scan_layers=False")
        if self.moe is not None and self.lora is not None:
            raise ValueError("LoRA on a mixture of experts is not supported yet: train it "
                             "fully (model.lora.rank=0)")
        if self.rope_scaling.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_scaling.rope_type!r} is not supported; "
                f"supported: {ROPE_TYPES}"
            )
        for name in ("dtype", "param_dtype", "cache_dtype"):
            value = getattr(self, name)
            if value not in ("float32", "bfloat16", "float16") and not (
                    name == "cache_dtype" and value == ""):
                raise ValueError(f"{name}={value!r}; use float32 or bfloat16")

    def replace(self, **kwargs) -> "ModelConfig":
        return dataclasses.replace(self, **kwargs)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def kv_dtype(self):
        return jnp.dtype(self.cache_dtype or self.dtype)

    def _dense_layers(self) -> list[int]:
        sparse = set(self.moe.sparse_layers(self.num_layers)) if self.moe else set()
        return [i for i in range(self.num_layers) if i not in sparse]

    def num_params(self) -> int:
        """Parameter count, for MFU and memory estimates."""
        d, f, n, k, h, v = (self.hidden_size, self.intermediate_size, self.num_heads,
                            self.num_kv_heads, self.head_dim, self.vocab_size)
        attn = d * (n + 2 * k) * h + n * h * d
        if self.qkv_bias:
            attn += (n + 2 * k) * h
        if self.qk_norm:
            attn += 2 * h
        layers = self.num_layers * (attn + 3 * d * f + 2 * d)
        if self.moe is not None:  # a sparse layer's router and experts in place of its MLP
            m = self.moe
            sparse = len(m.sparse_layers(self.num_layers))
            layers += sparse * (d * m.num_experts + m.num_experts * 3 * d * m.intermediate_size
                                - 3 * d * f)
        embed = v * d * (1 if self.tie_word_embeddings else 2)
        return layers + embed + d

    def num_active_params(self) -> int:
        """Parameters one token passes through (a mixture of experts' top-k of E experts per
        sparse layer): the count a token's FLOPs follow. num_params() for a dense model."""
        if self.moe is None:
            return self.num_params()
        m = self.moe
        unused = (len(m.sparse_layers(self.num_layers)) * (m.num_experts - m.top_k)
                  * 3 * self.hidden_size * m.intermediate_size)
        return self.num_params() - unused


def rope_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[H/2] inverse frequencies, with the HF scaling rules of these families (float64 math)."""
    h = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        old_len = rs.original_max_position_embeddings
        low_freq_wavelen = old_len / rs.low_freq_factor
        high_freq_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotates x [B, T, heads, H] by positions [B, T] (HF's rotate-half layout)."""
    angles = positions[:, :, None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> dict:
    """Empty KV cache with S = max_len slots: {'k', 'v'}, each a tuple of L arrays
    [B, K, S, H], or one stacked [L, B, K, S, H] array when the layers are scanned.

    Heads before slots: the attention dots batch over (B, K), so this layout feeds them
    without a transposed copy. One array per layer (unscanned) lets each decode step update
    its slots in place; slicing a layer out of a stacked array and writing it back would copy
    the whole cache every step.
    """
    shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
    dtype = dtype or cfg.kv_dtype
    if cfg.scan_layers:
        return {n: jnp.zeros((cfg.num_layers,) + shape, dtype) for n in ("k", "v")}
    return {n: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)) for n in ("k", "v")}


def cache_slots(cache: dict) -> int:
    """S, the number of slots per row of a cache from `init_cache`."""
    k = cache["k"]
    return (k[0] if isinstance(k, (tuple, list)) else k).shape[-2]


def attention_mask(segment_ids: Array) -> Array:
    """[B, T, T] bool: causal (by array order) and within the same packed segment."""
    t = segment_ids.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_segment


def cache_attention_mask(positions: Array, num_slots: int) -> Array:
    """[B, T, S] bool: the query at position p sees cache slots 0..p."""
    return jnp.arange(num_slots)[None, None, :] <= positions[:, :, None]


def _write_cache(cache: Array, new: Array, positions: Array) -> Array:
    """cache [B, K, S, H] with new [B, T, K, H] written at slots positions [B, T]."""
    new = new.astype(cache.dtype)
    if new.shape[1] == 1:
        # Decode: one [K, 1, H] slice per row, updated in place; touches O(B K H), where a
        # masked select over all slots would rewrite the whole cache every step.
        write = lambda c, n, p: jax.lax.dynamic_update_slice(c, n, (0, p, 0))  # noqa: E731
        return jax.vmap(write)(cache, new.transpose(0, 2, 1, 3), positions[:, 0])
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, :, positions].set(new)


def grouped_attention(q: Array, key: Array, value: Array, mask: Array) -> Array:
    """q [B, T, N, H], key/value [B, K, S, H], mask [B, T, S] -> [B, T, N, H].

    The G = N / K query heads of a kv head are folded into the rows of one matmul per (B, K),
    with both operands already in batch-leading layout: no transposed copy of the (cached)
    keys, which on a decode step would cost more than the attention itself.
    """
    b, t, n, h = q.shape
    k = key.shape[1]
    g = n // k
    rows = q.reshape(b, t, k, g, h).transpose(0, 2, 3, 1, 4).reshape(b, k, g * t, h)
    batch = ((0, 1), (0, 1))
    logits = jax.lax.dot_general(rows, key, (((3,), (3,)), batch),
                                 preferred_element_type=jnp.float32)  # [B, K, G*T, S]
    logits = logits.reshape(b, k, g, t, -1) / math.sqrt(h)
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype).reshape(b, k, g * t, -1)
    out = jax.lax.dot_general(weights, value, (((3,), (2,)), batch))  # [B, K, G*T, H]
    return out.reshape(b, k, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def causal_attention(q: Array, key: Array, value: Array, mask: Array, block: int,
                     causal: bool = True) -> Array:
    """`grouped_attention`, one query block of `block` rows at a time, differentiated as
    written (the update's path is blocked_attention.py, whose backward keeps no T x T
    probabilities).

    not causal (a cache's S slots: the sampler's prefill): every block sees all S slots, as
    positions are per row (prefix reuse starts rows at different slots), so nothing is
    skipped, but a prefill of T tokens holds [B, K, G*block, S] logits at a time, not
    [B, K, G*T, S] (Qwen2.5-1.5B's prefill of 16 rows x 8192 tokens on a v5e host: 60.7 ->
    16.2 GiB a chip, launch.compile_check). Decode (T = 1) is one block.

    causal (the mask is causal by array order; the tests' and benchmarks' reference): block i
    sees keys [0, end_i) only, since every later key is masked for it.
    """
    t = q.shape[1]
    if block <= 0 or t <= block:
        return grouped_attention(q, key, value, mask)
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        keys = end if causal else key.shape[2]
        outs.append(grouped_attention(q[:, start:end], key[:, :, :keys], value[:, :, :keys],
                                      mask[:, start:end, :keys]))
    return jnp.concatenate(outs, axis=1)


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in fp32, cast back, then scale."""

    eps: float
    dtype: Any
    param_dtype: Any
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],), self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


def _dense(features, axis, kernel_axes, cfg: ModelConfig, name: str, use_bias=False):
    """DenseGeneral whose kernel dims carry `kernel_axes` (input dims, then output dims); the
    bias, over the output dims, carries the trailing names. A projection `cfg.lora` targets
    (by this name: q_proj, ..., down_proj) gets its adapters (lora.py)."""
    out_dims = len(features) if isinstance(features, tuple) else 1
    lora = cfg.lora if lora_is_on(cfg) and name in cfg.lora.targets else None
    return LoraDenseGeneral(
        features=features, axis=axis, use_bias=use_bias, name=name,
        dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype, dot_general=dense_dot_general,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02),
                                                 kernel_axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, kernel_axes[-out_dims:]),
        lora=lora, kernel_axes=tuple(kernel_axes),
    )


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional QKV bias and q/k norm, optional KV cache.

    `mask`: without a cache the segment ids [B, T] (each path builds its own mask from them,
    or hands them to a fused kernel); with one, the cache mask [B, T, S]."""

    cfg: ModelConfig
    mesh: Any = None
    rules: Any = None

    @nn.compact
    def __call__(self, x: Array, positions: Array, mask: Array, cache: Optional[dict],
                 adapter_rows: Optional[Array] = None):
        cfg = self.cfg
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rows = adapter_rows
        q = _dense((n, h), -1, ("embed", "heads", "kv"), cfg, "q_proj", cfg.qkv_bias)(x, rows)
        key = _dense((k, h), -1, ("embed", "kv_heads", "kv"), cfg, "k_proj",
                     cfg.qkv_bias)(x, rows)
        value = _dense((k, h), -1, ("embed", "kv_heads", "kv"), cfg, "v_proj",
                       cfg.qkv_bias)(x, rows)
        if cfg.qk_norm:
            norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.params_dtype,
                                        "kv", name=name)
            q, key = norm("q_norm")(q), norm("k_norm")(key)
        inv_freq = rope_inverse_frequencies(cfg)
        q, key = apply_rope(q, positions, inv_freq), apply_rope(key, positions, inv_freq)
        q = parallel.constrain(q, ("act_batch", "act_len", "act_heads", None), self.mesh,
                               self.rules)

        new_cache = None
        if cache is not None:
            key, value = (_write_cache(cache[name], new, positions)
                          for name, new in (("k", key), ("v", value)))
            new_cache = {"k": key, "v": value}
            key, value = key.astype(cfg.compute_dtype), value.astype(cfg.compute_dtype)
        impl = "xla" if cache is not None else cfg.attention_impl
        if impl == "splash" and parallel.platform(self.mesh) != "tpu":
            impl = "xla"  # a TPU kernel: elsewhere the blocked einsum, the same function
        if impl != "xla":  # mask: the segment ids [B, T]
            out = segment_attention(q, key, value, mask, impl, self.mesh, self.rules)
        else:
            if cache is None:  # mask: the segment ids; keys and values to [B, K, S, H]
                out = segment_causal_attention(q, key.transpose(0, 2, 1, 3),
                                               value.transpose(0, 2, 1, 3), mask,
                                               cfg.attention_block)
            else:
                out = causal_attention(q, key, value, mask, cfg.attention_block, causal=False)
        out = _dense(cfg.hidden_size, (-2, -1), ("heads", "kv", "embed"), cfg, "o_proj")(out,
                                                                                        rows)
        return out, new_cache


@jax.custom_vjp
def swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) * up, whose gradient keeps only gate and up. Differentiated as written,
    XLA:CPU kept two more [B, T, F] intermediates of the sigmoid for every layer (0.28 GiB
    of an 8 x 1536 update at F = 768); the backward recomputes them from gate instead."""
    return nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, d_out):
    gate, up = residuals
    gate = after(d_out, gate)  # recomputed now, not kept from the forward (recompute.py)
    sig = jax.nn.sigmoid(gate)
    # d silu(x) / dx = sigmoid(x) (1 + x (1 - sigmoid(x)))
    return d_out * up * (sig * (1 + gate * (1 - sig))), d_out * (gate * sig)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    cfg: ModelConfig
    mesh: Any = None
    rules: Any = None

    @nn.compact
    def __call__(self, x: Array, adapter_rows: Optional[Array] = None) -> Array:
        cfg = self.cfg
        f = cfg.intermediate_size
        gate = _dense(f, -1, ("embed", "mlp"), cfg, "gate_proj")(x, adapter_rows)
        up = _dense(f, -1, ("embed", "mlp"), cfg, "up_proj")(x, adapter_rows)
        hidden = parallel.constrain(swiglu(gate, up), ("act_batch", "act_len", "act_mlp"),
                                    self.mesh, self.rules)
        return _dense(cfg.hidden_size, -1, ("mlp", "embed"), cfg, "down_proj")(hidden,
                                                                               adapter_rows)


class Block(nn.Module):
    """Pre-norm decoder layer. Signature fits `nn.scan`: (carry, *xs) -> (carry, ys).

    `sparse`: the feed-forward is cfg.moe's mixture of experts (moe.py), which sows the
    layer's router logits and chosen experts [B*T, ...] into the "intermediates" collection
    and takes `replay` [B, T, k], experts to use instead of its router's top-k."""

    cfg: ModelConfig
    mesh: Any = None
    rules: Any = None
    sparse: bool = False

    @nn.compact
    def __call__(self, x, positions, mask, cache, adapter_rows=None, replay=None):
        cfg = self.cfg
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.params_dtype, name=name)
        attn_out, new_cache = Attention(cfg, self.mesh, self.rules, name="attn")(
            norm("input_norm")(x), positions, mask, cache, adapter_rows)
        x = x + attn_out
        if self.sparse:
            m = cfg.moe
            out, routing = MoeMLP(m.num_experts, m.top_k, m.intermediate_size, m.norm_topk_prob,
                                  cfg.compute_dtype, cfg.params_dtype, self.mesh, self.rules,
                                  name="mlp")(
                norm("post_attn_norm")(x), replay)
            self.sow("intermediates", "router_logits", routing["router_logits"])
            self.sow("intermediates", "experts", routing["experts"])
            x = x + out
        else:
            x = x + MLP(cfg, self.mesh, self.rules, name="mlp")(norm("post_attn_norm")(x),
                                                                adapter_rows)
        x = parallel.constrain(x, ("act_batch", "act_len", "act_embed"), self.mesh, self.rules)
        return x, new_cache


def _block_class(cfg: ModelConfig):
    if cfg.remat == "none":
        return Block
    policy = None
    if cfg.remat == "dots":
        policy = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
    # Under scan, CSE across iterations cannot happen, so prevent_cse only costs there.
    return nn.remat(Block, policy=policy, prevent_cse=not cfg.scan_layers)


class Transformer(nn.Module):
    """Decoder-only LM. `mesh`/`rules` (optional) turn logical activation names into constraints.

    __call__(tokens [B, T], positions [B, T] = arange, segment_ids [B, T] = ones,
             cache = None, return_hidden = False, adapter_rows [B] = None: the adapter slot of
             each row, for a serving model with `lora.slots`)
      -> logits [B, T, V] float32 (or final-normed hidden [B, T, D] with return_hidden),
         plus the updated cache when a cache is given.
    """

    cfg: ModelConfig
    mesh: Any = None
    rules: Any = None

    def setup(self):
        cfg = self.cfg
        self.embed = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.params_dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                        ("vocab", "embed")),
        )
        block = _block_class(cfg)
        if cfg.scan_layers:
            # xs: the cache [L, ...] and a mixture of experts' routing replay [B, T, L, k];
            # what a sparse block sows is stacked [L, ...] as its params are
            self.layers = nn.scan(
                block, variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast, 2), length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, self.mesh, self.rules, sparse=cfg.moe is not None)
        else:
            self.layers = [block(cfg, self.mesh, self.rules, name=f"layers_{i}",
                                 sparse=cfg.moe is not None and cfg.moe.is_sparse(i))
                           for i in range(cfg.num_layers)]
        self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.params_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _dense(cfg.vocab_size, -1, ("embed", "vocab"), cfg, "lm_head")

    def __call__(self, tokens, positions=None, segment_ids=None, cache=None, return_hidden=False,
                 adapter_rows=None, routing_replay=None):
        """`routing_replay` [B, T, sparse layers, k]: a mixture of experts' experts per token
        and sparse layer (in layer order), used instead of each router's own top-k."""
        cfg = self.cfg
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if cache is None:
            if segment_ids is None:
                segment_ids = jnp.ones((b, t), jnp.int32)
            mask = segment_ids  # each layer's attention makes its own mask (or kernel) of them
        else:
            mask = cache_attention_mask(positions, cache_slots(cache))

        x = self.embed(tokens)
        x = parallel.constrain(x, ("act_batch", "act_len", "act_embed"), self.mesh, self.rules)
        if cfg.scan_layers:
            x, new_cache = self.layers(x, positions, mask, cache, adapter_rows, routing_replay)
        else:
            written, sparse_index = [], 0
            for i, layer in enumerate(self.layers):
                layer_cache = None if cache is None else {n: c[i] for n, c in cache.items()}
                if layer.sparse:
                    replay = (None if routing_replay is None
                              else routing_replay[:, :, sparse_index])
                    sparse_index += 1
                    x, layer_cache = layer(x, positions, mask, layer_cache, adapter_rows, replay)
                else:
                    x, layer_cache = layer(x, positions, mask, layer_cache, adapter_rows)
                written.append(layer_cache)
            new_cache = None if cache is None else {
                n: tuple(c[n] for c in written) for n in ("k", "v")}
        x = self.final_norm(x)

        out = x if return_hidden else self.logits(x)
        return out if cache is None else (out, new_cache)

    def logits(self, hidden: Array) -> Array:
        """hidden [B, T, D] (final-normed) -> logits [B, T, V] float32."""
        if self.cfg.tie_word_embeddings:
            logits = self.embed.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = parallel.constrain(logits, ("act_batch", "act_len", "act_vocab"), self.mesh,
                                    self.rules)
        return logits.astype(jnp.float32)


def lm_head_kernel(cfg: ModelConfig, params) -> Array:
    """[D, V] output projection, whether tied to the embedding or not (for chunked logits)."""
    if cfg.tie_word_embeddings:
        return params["embed"]["embedding"].T
    return params["lm_head"]["kernel"]


def unstack_layers(params, num_layers: int) -> dict:
    """Params of scanned layers ('layers': leaves [L, ...]) -> one entry per layer
    ('layers_0'...), the layout of `scan_layers=False`. Other params pass through."""
    if "layers" not in params:
        return params
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
    return out
