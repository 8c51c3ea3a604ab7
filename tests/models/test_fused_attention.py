"""Fused attention (rl_tpu/models/fused_attention.py) against the blocked einsum: splash (its TPU
kernel run by Pallas' interpreter on CPU) and jax.nn.dot_product_attention, forward and
gradients, over packed segments and padding; and through the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.models import tiny
from rl_tpu.models.fused_attention import segment_attention
from rl_tpu.models.transformer import Transformer, attention_mask, causal_attention

B, T, N, K, H = 2, 256, 4, 2, 128  # two 128-token splash blocks; GQA with 2 queries a kv head


def _inputs():
    rng = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rng.randn(B, T, n, H).astype(np.float32)) for n in (N, K, K))
    # row 0: two packed sequences then padding; row 1: one sequence over the whole row
    segments = np.ones((B, T), np.int32)
    segments[0, 100:200], segments[0, 200:] = 2, 0
    return q, k, v, jnp.asarray(segments)


def _reference(q, k, v, segments):
    mask = attention_mask(segments)
    return causal_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, 0)


@pytest.mark.parametrize("impl", ["splash", "dot_product"])
def test_fused_attention_equals_the_einsum_forward_and_backward(impl):
    q, k, v, segments = _inputs()
    fused = lambda q, k, v: segment_attention(q, k, v, segments, impl, interpret=True)  # noqa
    reference = lambda q, k, v: _reference(q, k, v, segments)  # noqa: E731
    np.testing.assert_allclose(fused(q, k, v), reference(q, k, v), atol=2e-5, rtol=0)
    weights = jnp.asarray(np.random.RandomState(1).randn(B, T, N, H).astype(np.float32))
    loss = lambda fn: lambda *x: jnp.sum(fn(*x) * weights)  # noqa: E731
    fused_grads = jax.grad(loss(fused), argnums=(0, 1, 2))(q, k, v)
    reference_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", fused_grads, reference_grads):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=f"d{name}")


def test_splash_refuses_a_length_off_its_block():
    q, k, v, segments = _inputs()
    with pytest.raises(ValueError, match="multiple of 128, got 200"):
        segment_attention(q[:, :200], k[:, :200], v[:, :200], segments[:, :200], "splash",
                          interpret=True)


def test_the_model_gives_the_same_logits_with_every_impl():
    base = tiny.tiny_config("qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
                            num_layers=2, head_dim=16)
    params = tiny.random_params(base, seed=0, scale=0.2)
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, 128, (B, 64)).astype(np.int32))
    segments = np.ones((B, 64), np.int32)
    segments[0, 30:50], segments[0, 50:] = 2, 0
    logits = {impl: Transformer(base.replace(attention_impl=impl)).apply(
        {"params": params}, tokens, segment_ids=jnp.asarray(segments))
        for impl in ("xla", "dot_product", "splash")}
    np.testing.assert_allclose(logits["dot_product"], logits["xla"], atol=1e-5, rtol=0)
    # splash is a TPU kernel: on CPU the model runs the einsum, the same function
    np.testing.assert_array_equal(logits["splash"], logits["xla"])
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        base.replace(attention_impl="flash")
