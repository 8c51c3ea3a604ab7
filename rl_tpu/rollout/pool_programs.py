"""The programs of a continuous batcher's pool (continuous.py) and the ladders of sizes its
shapes take.

A pool is one `DecodeState` of B rows x S cache slots. Its programs (make, grow, scatter
prefilled rows in, read finished rows out, end rows) and the prefill that feeds it compile once
per shape; `Ladders` keeps those shapes to a few rungs, so that `ContinuousBatcher.warmup` can
compile every one before the first request.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from rl_tpu.models.transformer import Transformer, init_cache
from rl_tpu.rollout.decoding import DecodeState, empty_experts


@functools.partial(jax.jit, static_argnames=("model", "rows", "slots", "width"))
def empty_pool(model: Transformer, rows: int, slots: int, width: int) -> DecodeState:
    """A pool of `rows` free rows of `slots` cache slots, X = width stop ids a row: a pool of
    none, grown (`grow_pool` says what a free row holds)."""
    none = lambda *shape, dtype=jnp.int32: jnp.zeros((0,) + shape, dtype)  # noqa: E731
    f32 = jnp.float32
    return grow_pool(DecodeState(
        step=jnp.int32(1), token=none(), cache=init_cache(model.cfg, 0, slots),
        tokens=none(slots), logprobs=none(slots, dtype=f32), count=none(), done=none(dtype=bool),
        stopped=none(dtype=bool), prompt_lens=none(), max_new=none(), min_new=none(),
        temperature=none(dtype=f32), top_p=none(dtype=f32), top_k=none(),
        stop_ids=none(width), ban_ids=none(width),
        keys=jax.vmap(jax.random.key)(jnp.zeros((0,), jnp.uint32)), adapter=none(),
        experts=empty_experts(model.cfg, 0, slots)),
        rows, slots, width)


@functools.partial(jax.jit, donate_argnames=("pool",))
def scatter_rows(pool: DecodeState, new: DecodeState, rows) -> DecodeState:
    """`pool` with the A prefilled rows of `new` written at pool rows `rows` [A] (a row index
    past the pool, a padding row, is dropped). new's cache has the pool's S slots; its output
    buffer [A, 1] (the first token) is padded to the pool's [B, S]; a mixture of experts'
    routing, [A, S, ...] as the cache, goes in whole (tree.map: a dense model's is None)."""
    put = lambda p, n: p.at[rows].set(n, mode="drop")  # noqa: E731
    out_pad = pool.tokens.shape[1] - new.tokens.shape[1]
    fields = {f.name: jax.tree.map(put, getattr(pool, f.name), getattr(new, f.name))
              for f in dataclasses.fields(DecodeState)
              if f.name not in ("step", "cache", "tokens", "logprobs")}
    return pool.replace(
        cache=jax.tree.map(put, pool.cache, new.cache),
        tokens=put(pool.tokens, jnp.pad(new.tokens, ((0, 0), (0, out_pad)))),
        logprobs=put(pool.logprobs, jnp.pad(new.logprobs, ((0, 0), (0, out_pad)))), **fields)


@jax.jit
def read_rows(pool: DecodeState, rows):
    """(tokens, logprobs [F, S], stopped [F]) of the pool rows `rows` [F], in one program
    (indexing eagerly costs a dispatch and Python work per array)."""
    return pool.tokens[rows], pool.logprobs[rows], pool.stopped[rows]


@jax.jit
def read_experts(pool: DecodeState, rows):
    """A mixture of experts' routing [F, S, sparse layers, k] of the pool rows `rows` [F]: a
    program of its own, read only for rows that ended (`read_rows` also serves every streamed
    chunk, which needs no routing, and this is the pool's largest per-row read)."""
    return pool.experts[rows]


@functools.partial(jax.jit, donate_argnames=("pool",))
def end_rows(pool: DecodeState, ended) -> DecodeState:
    """`pool` with the rows where ended [B] marks done (aborted, or freed)."""
    return pool.replace(done=pool.done | ended)


@functools.partial(jax.jit, static_argnames=("rows", "slots", "width"))
def grow_pool(pool: DecodeState, rows: int, slots: int, width: int) -> DecodeState:
    """`pool` grown to `rows` rows (free: done), `slots` cache slots and output positions a
    row, and `width` stop ids a row; what it held stays where it was."""
    r = rows - pool.tokens.shape[0]
    s = slots - pool.tokens.shape[1]
    x = width - pool.stop_ids.shape[1]

    def pad(a, value=0, cols=0):
        return jnp.pad(a, ((0, r),) + ((0, cols),) * (a.ndim - 1), constant_values=value)

    fresh_keys = jax.vmap(jax.random.key)(jnp.arange(r, dtype=jnp.uint32))
    return pool.replace(
        cache=jax.tree.map(lambda c: jnp.pad(c, ((0, r), (0, 0), (0, s), (0, 0))), pool.cache),
        tokens=pad(pool.tokens, cols=s), logprobs=pad(pool.logprobs, cols=s),
        token=pad(pool.token), count=pad(pool.count, 1), done=pad(pool.done, True),
        stopped=pad(pool.stopped, False), prompt_lens=pad(pool.prompt_lens, 1),
        max_new=pad(pool.max_new, 1), min_new=pad(pool.min_new),
        temperature=pad(pool.temperature), top_p=pad(pool.top_p, 1.0),
        top_k=pad(pool.top_k, -1), stop_ids=pad(pool.stop_ids, -1, x),
        ban_ids=pad(pool.ban_ids, -1, x), keys=jnp.concatenate([pool.keys, fresh_keys]),
        adapter=pad(pool.adapter),
        experts=jax.tree.map(lambda e: jnp.pad(e, ((0, r), (0, s), (0, 0), (0, 0)),
                                               constant_values=-1), pool.experts))


def ladder(low: int, high: int, step: int) -> tuple[int, ...]:
    """low, low * step, low * step^2, ... below high, then high (low is capped at high)."""
    if low < 1 or step < 2:
        raise ValueError(f"a ladder from {low} by x{step}: it needs low >= 1 and step >= 2")
    out, value = [], min(low, high)
    while value < high:
        out.append(value)
        value *= step
    return tuple(out) + (high,)


def fit(sizes: Sequence[int], n: int) -> int:
    """The smallest of `sizes` (ascending) that holds n."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} is over the largest size {sizes[-1]}")


@dataclasses.dataclass(frozen=True)
class Ladders:
    """The few sizes a batcher's shapes take, so that every program can be compiled at start.

    Each is a geometric ladder capped by the pool's bound: a request pads up to the next rung
    (at most `step` times what it needs: more rows or slots computed, no compile). Steps of 8
    for rows and slots keep a short request in a small pool (decode's cost per step grows with
    rows x slots) with 3 x 2 pool shapes for 64 rows of 2048 slots. Prefills are the slowest
    programs to compile (one per rows rung, suffix rung and pool slots), and on a CPU each
    padding row costs about a ms to compute: they take 1 or 4 rows (a lone client's request
    computes one row, rows that join together go 4 at a time).
    """

    rows: tuple[int, ...]  # pool rows
    slots: tuple[int, ...]  # pool slots a row
    join: tuple[int, ...]  # rows one prefill takes (more go in groups of the largest)
    group: tuple[int, ...]  # rows one read or prefix save takes (more go in groups)
    suffix_low: int  # the smallest prompt-suffix bucket (the sampler's prompt bucket)
    suffix_step: int

    @classmethod
    def build(cls, rows: int, slots: int, suffix_low: int, row_step: int = 8,
              slot_step: int = 8, min_slots: int = 256, join: int = 4, group: int = 8,
              suffix_step: int = 4) -> "Ladders":
        return cls(ladder(1, rows, row_step), ladder(min_slots, slots, slot_step),
                   ladder(1, min(join, rows), join), ladder(1, min(group, rows), group),
                   suffix_low, suffix_step)

    def suffixes(self, slots: int) -> tuple[int, ...]:
        """The prompt-suffix buckets a prefill into a pool of `slots` slots takes."""
        return ladder(self.suffix_low, slots, self.suffix_step)

    def shapes(self) -> int:
        """How many (rows, slots) pool shapes there are (each has its decode program)."""
        return len(self.rows) * len(self.slots)
