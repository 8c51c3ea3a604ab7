"""The dense layers' dot_general (rl_tpu/models/dense.py): the same forward and gradients as
lax.dot_general for every contraction the model uses, and a CPU backward that no longer
transposes the wide activation gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from rl_tpu.models.dense import dense_dot_general

PLAIN = ((), ())


@pytest.mark.parametrize("x_shape, w_shape, contract", [
    ((4, 5, 6), (6, 7), ((2,), (0,))),          # x @ W, I < O: dot(x, g)
    ((4, 5, 16), (16, 3), ((2,), (0,))),        # I > O: dot(g, x), then transpose
    ((4, 5, 6), (6, 3, 2), ((2,), (0,))),       # q_proj: one input dim, (N, H) out
    ((4, 3, 2, 8), (3, 2, 5), ((1, 2), (0, 1))),  # o_proj: (N, H) in, one out
    ((4, 2, 3, 8), (3, 2, 5), ((2, 1), (0, 1))),  # contracted dims out of order
])
def test_dense_dot_general_has_lax_dot_generals_values_and_gradients(x_shape, w_shape, contract):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    dn = (contract, PLAIN)
    out = lax.dot_general(x, w, dn)
    weights = jax.random.normal(kg, out.shape)
    np.testing.assert_array_equal(dense_dot_general(x, w, dn), out)

    def loss(dot):
        return lambda x, w: jnp.sum(dot(x, w, dn) * weights)
    ours = jax.grad(loss(dense_dot_general), (0, 1))(x, w)
    theirs = jax.grad(loss(lax.dot_general), (0, 1))(x, w)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bf16_weight_gradient_keeps_the_kernels_dtype():
    x = jnp.ones((3, 4), jnp.bfloat16)
    w = jnp.ones((4, 8), jnp.bfloat16)
    dn = (((1,), (0,)), PLAIN)
    dx, dw = jax.grad(lambda x, w: jnp.sum(dense_dot_general(x, w, dn)).astype(jnp.float32),
                      (0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_array_equal(dw, np.full((4, 8), 3.0))  # each weight sees 3 rows of ones
    np.testing.assert_array_equal(dx, np.full((3, 4), 8.0))


def test_batched_contractions_are_lax_dot_general():
    a, b = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))
    dn = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(dense_dot_general(a, b, dn), lax.dot_general(a, b, dn))
    jax.grad(lambda a: jnp.sum(dense_dot_general(a, b, dn)))(a)  # no custom rule: jax's own


def test_swiglu_backward_on_cpu_does_not_transpose_the_wide_gradient():
    """The regression the module exists for: a SwiGLU's weight gradients, compiled for CPU,
    hold no [F, R] copy of the [R, F] activation gradient (R = 4 x 12 rows, F = 64 wide).
    XLA:CPU makes that copy for rows with two leading dims ([B, T, D], as in the model)."""
    b, t, d, f = 4, 12, 16, 64
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (b, t, d))
    gate_w, up_w = (jax.random.normal(k, (d, f)) for k in keys[1:3])
    down_w = jax.random.normal(keys[3], (f, d))
    dn = (((2,), (0,)), PLAIN)

    def mlp(params, x):
        gate_w, up_w, down_w = params
        hidden = jax.nn.silu(dense_dot_general(x, gate_w, dn)) * dense_dot_general(x, up_w, dn)
        return jnp.sum(dense_dot_general(hidden, down_w, dn) ** 2)

    params = (gate_w, up_w, down_w)
    hlo = jax.jit(jax.grad(mlp)).lower(params, x).compile().as_text()
    for transposed in (f"f32[{f},{b * t}]", f"f32[{f},{b},{t}]"):
        assert transposed not in hlo, "the [R, F] gradient is transposed before its matmul"
