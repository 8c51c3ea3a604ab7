"""Per-token log-probabilities from final hidden states, chunked over the sequence.

Shape letters: B batch, T length, C chunk of T, D model width, V vocab.

A fp32 [B, T, V] logits tensor is the largest thing an RL step would hold (B=64, T=8k,
V=152k is 300 GB), so logits are made C positions at a time inside a rematerialised map:
memory is [B, C, V] forward and backward. The sampler and the trainer both use this module,
so the behaviour log-probs a rollout reports and the ones the trainer recomputes share their
numerics exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_tpu.core.batch import ROUTING_INPUT
from rl_tpu.models.dense import dense_dot_general
from rl_tpu.models.moe import sown_routing
from rl_tpu.models.transformer import ModelConfig, Transformer, lm_head_kernel


def logits_from_hidden(cfg: ModelConfig, params, hidden, temperature: float = 1.0):
    """hidden [..., D] (final-normed) -> fp32 logits [..., V] / temperature."""
    kernel = lm_head_kernel(cfg, params).astype(hidden.dtype)
    logits = dense_dot_general(hidden, kernel, (((hidden.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return logits / temperature


def logprobs_of(logits, targets, with_entropy: bool = True):
    """fp32 logits [..., V], targets [...] -> (log p(target) [...], entropy [...] or None)."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z
    if not with_entropy:
        return picked, None
    probs = jnp.exp(logits - log_z[..., None])
    return picked, log_z - jnp.sum(probs * logits, axis=-1)


def token_logprobs(model: Transformer, params, batch, chunk: int = 128, temperature: float = 1.0,
                   with_entropy: bool = True, routing_replay: bool = False):
    """Log-prob (and entropy) of every token given the tokens before it.

    batch: `tokens` [B, T] and optionally `positions`, `segment_ids` [B, T], and
    `dropout_rng` (a training step's key for LoRA dropout; without one, no dropout);
    with `routing_replay` (a mixture of experts) `routed_experts` [B, T, S, k], the experts
    to use instead of the routers' own choice (-1: the router's).
    Returns (logprobs [B, T], entropy [B, T] or None), aligned with the tokens: entry t belongs
    to token t (so a loss mask over generated tokens applies directly); entry 0 is 0.
    """
    lp, ent, _ = token_logprobs_and_routing(model, params, batch, chunk, temperature,
                                            with_entropy, routing_replay)
    return lp, ent


def token_logprobs_and_routing(model: Transformer, params, batch, chunk: int = 128,
                               temperature: float = 1.0, with_entropy: bool = True,
                               routing_replay: bool = False):
    """token_logprobs, and a mixture of experts' routing in that pass: (router logits of each
    sparse layer [B*T, E], experts chosen [B*T, S, k]) as moe.sown_routing gives them, or
    None for a dense model."""
    tokens = batch["tokens"]
    rngs = {"dropout": batch["dropout_rng"]} if "dropout_rng" in batch else None
    inputs = (tokens, batch.get("positions"), batch.get("segment_ids"))
    routing = None
    if model.cfg.moe is None:
        hidden = model.apply({"params": params}, *inputs, return_hidden=True, rngs=rngs)
    else:
        if routing_replay and ROUTING_INPUT not in batch:
            raise ValueError(f"routing replay needs the batch's {ROUTING_INPUT!r} (the "
                             f"sampler's experts); it has {sorted(batch)}")
        hidden, state = model.apply(
            {"params": params}, *inputs, return_hidden=True, rngs=rngs,
            routing_replay=batch[ROUTING_INPUT] if routing_replay else None,
            mutable=["intermediates"])
        routing = sown_routing(state["intermediates"], model.cfg.num_layers)
    b, t, d = hidden.shape  # [B, T, D]
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)

    def one_chunk(h, tgt):
        logits = logits_from_hidden(model.cfg, params, h, temperature)
        lp, ent = logprobs_of(logits, tgt, with_entropy)
        return lp, (ent if with_entropy else jnp.zeros_like(lp))

    if n == 1:
        # One chunk: the forward holds its [B, C, V] logits either way, so recomputing them
        # in the backward would save no memory and cost a head matmul (5% of a 32 x 96 update)
        lp, ent = jax.tree.map(lambda x: x[None], one_chunk(hidden[0], targets[0]))
    else:  # backward recomputes each chunk's logits instead of storing [B, T, V]
        lp, ent = jax.lax.map(lambda xs: jax.checkpoint(one_chunk)(*xs), (hidden, targets))

    def align(x):  # predictions for token t+1 sit at t: shift right by one
        x = x.swapaxes(0, 1).reshape(b, n * c)[:, :t]
        return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)

    return align(lp), (align(ent) if with_entropy else None), routing
