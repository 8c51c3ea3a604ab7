"""Reductions over the tokens a mask selects: the statistics RL math and losses share.

Shape letters: B batch, T length. A mask is bool or float and broadcasts against `x`; it is 1
exactly on the entries that count (in RL, the policy's own tokens). Every function is a pure
jnp function, safe under `jax.jit`, and an all-zero mask gives 0 rather than NaN, so a
padded-out batch row or an empty shard never poisons a step.

Statistics are population ones (divide by the count, not count - 1): they stay defined for a
single element (the group estimators in advantages.py take their own `ddof`).

Metrics: a loss reports each statistic as a `Metric` (value, weight, reduction tag), so parts
of a batch (micro-batches inside a step, minibatches and epochs in the trainer) combine by what
each statistic IS, not by its name: a token mean is re-weighted by token counts, the loss by
the loss's normaliser, an extreme keeps its extreme, a count adds up. `combine_metrics` does it
for a list of parts, `combine_stacked` for parts stacked on a leading axis (a `lax.scan`'s
output); `metric_values` flattens to {name: scalar} for logging.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from flax import struct

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


# ----------------------------------------------------------------------------- metrics

# How a metric combines over parts of the data it was measured on:
#   mean  weighted mean sum(v w) / sum(w): w is what the value averages over (masked tokens
#         for a per-token mean, the loss's normaliser for the loss, 1 for a per-batch number)
#   sum   a count or total (e.g. skipped updates)
#   max / min  the extreme over the parts that saw anything (weight > 0)
#   last  the latest part's value (a state, e.g. a schedule's current value)
REDUCTIONS = ("mean", "sum", "max", "min", "last")


@struct.dataclass
class Metric:
    """A scalar statistic and how to combine it with the same statistic of other parts.

    value, weight: scalars (or [N] once N parts are stacked); reduce: a name in REDUCTIONS,
    static (not a pytree leaf), so a Metric passes through jit, scan and device_get unchanged.
    Build with `Metric.of`.
    """

    value: jax.Array
    weight: jax.Array
    reduce: str = struct.field(pytree_node=False, default="mean")

    @classmethod
    def of(cls, value, reduce: str = "mean", weight=1.0) -> "Metric":
        if reduce not in REDUCTIONS:
            raise ValueError(f"unknown metric reduction {reduce!r}; choose one of {REDUCTIONS}")
        return cls(jnp.asarray(value, jnp.float32), jnp.asarray(weight, jnp.float32), reduce)


def _reduce_parts(m: Metric) -> Metric:
    """Metric with a leading parts axis [N] -> scalar Metric (weight: the parts' total)."""
    w = m.weight
    total = jnp.sum(w)
    seen = w > 0
    if m.reduce == "mean":
        # `where`: a part with no weight (an empty micro-batch) may hold NaN or 0/0 garbage.
        value = jnp.sum(jnp.where(seen, m.value * w, 0.0)) / jnp.where(total > 0, total, 1.0)
    elif m.reduce == "sum":
        value = jnp.sum(m.value)
    elif m.reduce in ("max", "min"):
        pick, fill = (jnp.max, -jnp.inf) if m.reduce == "max" else (jnp.min, jnp.inf)
        value = jnp.where(jnp.any(seen), pick(jnp.where(seen, m.value, fill)), 0.0)
    else:  # last
        value = m.value[-1]
    return Metric(value, total, m.reduce)


def combine_stacked(stacked: Mapping[str, Metric]) -> dict[str, Metric]:
    """{name: Metric with values [N]} (N parts stacked, e.g. by lax.scan) -> {name: Metric}.

    Jittable; also runs on host arrays (after jax.device_get). The result combines again with
    other results, so micro-batches -> minibatches -> epochs nest.
    """
    return {k: _reduce_parts(m) for k, m in stacked.items()}


def combine_metrics(parts: Sequence[Mapping[str, Metric]]) -> dict[str, Metric]:
    """A list of {name: Metric} (one per part of the data) -> {name: Metric} for the whole.

    A name missing from some parts combines over the parts that have it.
    """
    names = list(dict.fromkeys(k for part in parts for k in part))
    out = {}
    for name in names:
        have = [part[name] for part in parts if name in part]
        tags = {m.reduce for m in have}
        if len(tags) > 1:
            raise ValueError(f"metric {name!r} has different reductions {sorted(tags)} in "
                             "different parts; one statistic must combine one way")
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *have)
        out[name] = _reduce_parts(stacked)
    return out


def metric_values(metrics: Mapping[str, Any]) -> dict[str, jax.Array]:
    """{name: Metric or array} -> {name: value}: the flat form that gets logged."""
    return {k: (m.value if isinstance(m, Metric) else m) for k, m in metrics.items()}
