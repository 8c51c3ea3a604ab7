"""blocked_attention.segment_causal_attention against attention differentiated as written:
forward and gradients over packed segments and padding, at block sizes that do and do not
divide the length; and the compiled backward's memory, which holds no T x T probabilities and
none of the MLP's sigmoid intermediates (rl_tpu/models/recompute.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.models.blocked_attention import segment_causal_attention
from rl_tpu.models.transformer import attention_mask, causal_attention, swiglu

B, T, N, K, H = 2, 37, 4, 2, 8


def _inputs(t=T, h=H, seed=0):
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(B, t, N, h).astype(np.float32))
    k, v = (jnp.asarray(rng.randn(B, K, t, h).astype(np.float32)) for _ in range(2))
    # row 0: two packed sequences then padding (segment 0); row 1: one sequence
    segments = np.ones((B, t), np.int32)
    segments[0, t // 3:2 * t // 3], segments[0, 2 * t // 3:] = 2, 0
    return q, k, v, jnp.asarray(segments)


def _plain(q, k, v, segments):
    """One dense block, differentiated by JAX."""
    return causal_attention(q, k, v, attention_mask(segments), 0)


@pytest.mark.parametrize("block", [0, 8, 16, 64])
def test_forward_and_gradients_equal_plain_attention(block):
    q, k, v, segments = _inputs()
    weights = jnp.asarray(np.random.RandomState(1).randn(B, T, N, H).astype(np.float32))
    ours = lambda q, k, v: segment_causal_attention(q, k, v, segments, block)  # noqa: E731
    plain = lambda q, k, v: _plain(q, k, v, segments)  # noqa: E731
    np.testing.assert_allclose(ours(q, k, v), plain(q, k, v), atol=1e-6, rtol=0)
    loss = lambda fn: lambda *x: jnp.sum(fn(*x) * weights)  # noqa: E731
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=5e-6, rtol=0)


def test_a_token_sees_only_earlier_tokens_of_its_own_segment():
    """Changing token 20's key and value (segment 2, which starts at 12) moves no output of
    segment 1 or of tokens before 20, and does move token 20 onward within segment 2."""
    q, k, v, segments = _inputs()
    base = segment_causal_attention(q, k, v, segments, 8)
    moved = segment_causal_attention(q, k.at[0, :, 20].add(3.0), v.at[0, :, 20].add(3.0),
                                     segments, 8)
    changed = np.abs(np.asarray(moved - base)).max(axis=(2, 3)) > 1e-6  # [B, T]
    assert changed[0].nonzero()[0].tolist() == list(range(20, 24))  # segment 2 is 12..23
    assert not changed[1].any()


def test_swiglu_gradient_equals_autodiff():
    rng = np.random.RandomState(2)
    gate, up, d = (jnp.asarray(rng.randn(3, 5, 7).astype(np.float32) * 3) for _ in range(3))
    plain = lambda g, u: jnp.sum(jax.nn.silu(g) * u * d)  # noqa: E731
    ours = lambda g, u: jnp.sum(swiglu(g, u) * d)  # noqa: E731
    np.testing.assert_allclose(swiglu(gate, up), jax.nn.silu(gate) * up, atol=0, rtol=0)
    for g, w in zip(jax.grad(ours, (0, 1))(gate, up), jax.grad(plain, (0, 1))(gate, up)):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-6)


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_backward_holds_no_probabilities_of_any_layer():
    """Four stacked attention layers over 2 x 1024 tokens: differentiated as written, every
    layer's [T, T] probabilities live until its backward (about 4 x 2 x 4 x 1024^2 x 4 bytes
    / 2 = 64 MiB and more); recomputed, the backward holds one block's scores at a time. If
    XLA hoisted the recomputation into the forward (or merged it with the forward's), the
    two would be alike."""
    q, k, v, segments = _inputs(t=1024, h=16)

    def stack(attend):
        def loss(q, k, v):
            x = q
            for _ in range(4):
                x = attend(x, k, v) + q
            return jnp.sum(x * x)
        return jax.grad(loss, argnums=(0, 1, 2))

    ours = _temp_bytes(stack(lambda x, k, v: segment_causal_attention(x, k, v, segments, 256)),
                       q, k, v)
    plain = _temp_bytes(stack(lambda x, k, v: causal_attention(
        x, k, v, attention_mask(segments), 256)), q, k, v)
    probabilities = 4 * B * N * 1024 * 1024 * 4 // 2
    assert plain > probabilities
    assert ours < plain / 3, (ours, plain)
