"""Reductions over the tokens a mask selects: the statistics RL math and losses share.

Shape letters: B batch, T length. A mask is bool or float and broadcasts against `x`; it is 1
exactly on the entries that count (in RL, the policy's own tokens). Every function is a pure
jnp function, safe under `jax.jit`, and an all-zero mask gives 0 rather than NaN, so a
padded-out batch row or an empty shard never poisons a step.

Statistics are population ones (divide by the count, not count - 1): they stay defined for a
single element, and the estimators that build on them document the choice once here.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

Array = jax.Array
Axis = Optional[Union[int, Sequence[int]]]


def _as_weights(x: Array, mask: Array) -> Array:
    # Bool masks become 0/1 in x's float dtype so sums stay in that precision.
    dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    return jnp.broadcast_to(jnp.asarray(mask, dtype), x.shape)


def masked_sum(x: Array, mask: Array, axis: Axis = None) -> Array:
    """Sum of `x` [B, T] (or any shape `mask` broadcasts to) over the entries where mask is set."""
    w = _as_weights(x, mask)
    # `where` rather than `x * w`: a NaN/inf in a masked-out entry (e.g. padding) must not leak.
    return jnp.sum(jnp.where(w != 0, x * w, 0.0), axis=axis)


def masked_count(x: Array, mask: Array, axis: Axis = None) -> Array:
    """How many entries (sum of mask weights) `masked_mean` divides by."""
    return jnp.sum(_as_weights(x, mask), axis=axis)


def masked_mean(x: Array, mask: Array, axis: Axis = None) -> Array:
    """Mean of `x` over the masked entries; 0 where the mask selects nothing.

    x: [B, T] (any shape); mask: broadcastable to x; axis: None for one scalar over everything,
    or the axes to reduce (e.g. -1 for a per-sequence mean [B]).
    """
    total = masked_sum(x, mask, axis)
    count = masked_count(x, mask, axis)
    # max(count, 1): an empty selection yields 0/1 = 0 instead of 0/0 = NaN.
    return total / jnp.maximum(count, 1.0)


def masked_var(x: Array, mask: Array, axis: Axis = None) -> Array:
    """Population variance of `x` over the masked entries (0 for an empty selection)."""
    mean = masked_mean(x, mask, axis)
    if axis is not None:
        mean = jnp.expand_dims(mean, axis)
    return masked_mean(jnp.square(x - mean), mask, axis)


def masked_whiten(x: Array, mask: Array, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """(x - mean) / sqrt(var + eps) with mean and variance over ALL masked entries of x.

    x: [B, T]; mask: [B, T]. Returns [B, T], zero outside the mask. `shift_mean=False` only
    rescales (keeps the sign of every entry), as some estimators prefer.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    centred = x - mean if shift_mean else x
    out = centred * jax.lax.rsqrt(var + eps)
    return jnp.where(_as_weights(x, mask) != 0, out, 0.0)
