"""Greedy KV-cache decoding: the reference decode for tests and the smoke demo.

The rollout sampler (rl_tpu/rollout/sampler.py) is the production path (sampling params,
stop handling, logprobs, bucketing); this is the minimal loop that shows the cache contract:
right-padded prompts, slot = position, one compiled prefill and one compiled decode loop.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from rl_tpu.models.transformer import Transformer, init_cache


@partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def greedy_decode(model: Transformer, params, prompt_ids, prompt_lens, max_new_tokens: int):
    """prompt_ids [B, P] right-padded, prompt_lens [B] -> new token ids [B, max_new_tokens].

    Every row decodes at its own position, so mixed prompt lengths need no left padding.
    """
    b, p = prompt_ids.shape
    cache = init_cache(model.cfg, b, p + max_new_tokens)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, cache = model.apply({"params": params}, prompt_ids, positions, cache=cache)
    last = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)

    def step(carry, _):
        token, pos, cache = carry
        logits, cache = model.apply({"params": params}, token[:, None], pos[:, None], cache=cache)
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (nxt, pos + 1, cache), token

    _, tokens = jax.lax.scan(step, (first, prompt_lens.astype(jnp.int32), cache), None,
                             length=max_new_tokens)
    return tokens.T


def right_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (ids [B, P] right-padded, lengths [B])."""
    lens = np.array([len(p) for p in prompts], np.int32)
    ids = np.full((len(prompts), int(lens.max())), pad_id, np.int32)
    for row, p in zip(ids, prompts):
        row[: len(p)] = p
    return ids, lens
