"""Jitted pure update steps: policy, value, SFT and preference, with gradient accumulation.

Every step is `step(state, batch) -> (state, metrics)`. A `make_*_step` factory closes over the
static configuration (model, loss config, micro-batches) and `compile_step` jits it once with
explicit in/out shardings and the state donated; a new batch *shape* (a new length bucket)
compiles again, nothing else does.

Batches are dicts of arrays, `[B, T]` (tokens, positions, segment_ids, loss_mask, old_logprobs,
behaviour_logprobs, ref_logprobs, advantages, returns, values) or `[B]`, sharded on the batch
dim over the data-parallel mesh axes.

Gradient accumulation is exact: micro-batch k's loss is weighted by its share of the whole
batch's normaliser (its masked tokens for a token mean, its sequences for a sequence mean), so
M micro-batches give the gradient of the one big batch. A step whose loss or gradient norm is
not finite leaves the state untouched and reports `skipped = 1`.

Shape letters: B batch, M micro-batches, T length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_tpu import parallel
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.transformer import Transformer
from rl_tpu.models.value import ValueModel
from rl_tpu.rl.bapo import adapt_clip_bounds
from rl_tpu.rl.losses import PolicyLossConfig, aggregate, policy_loss, value_loss
from rl_tpu.rl.preference import PREFERENCE_LOSSES
from rl_tpu.train.state import TrainState, shardings_of


@dataclasses.dataclass(frozen=True)
class StepConfig:
    micro_batches: int = 1  # gradient accumulation steps inside one update
    logprob_chunk: int = 128  # positions per logits chunk (memory [B/M, chunk, V])
    temperature: float = 1.0  # the sampling temperature: logprobs of the sampled policy


# ----------------------------------------------------------------------------- accumulation


def split_micro_batches(batch, m: int):
    """[B, ...] -> [M, B/M, ...]; micro-batch k takes rows k, k+M, k+2M...

    Strided rows keep each device's rows on that device: a batch sharded on its leading dim
    reshapes to [B/M, M] with no data movement, then the axes swap.
    """
    def one(x):
        if x.shape[0] % m:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by micro_batches={m}")
        return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    return jax.tree.map(one, batch)


# Metrics that are the aggregated loss itself (weighted like the loss); every other metric is
# a masked mean over tokens (clip fractions, ratios, KL, entropy), weighted by token counts.
LOSS_METRICS = ("loss", "pg_loss", "value_loss", "nll")


def _combine_metrics(metrics, loss_shares, token_shares):
    """Per-micro-batch metrics [M] -> scalars: weighted means, but max/min for extremes."""
    out = {}
    for key, values in metrics.items():
        if key.endswith("_max"):
            out[key] = jnp.max(values)
        elif key.endswith("_min"):
            out[key] = jnp.min(values)
        else:
            shares = loss_shares if key in LOSS_METRICS else token_shares
            out[key] = jnp.sum(values * shares)
    return out


def accumulate(loss_fn: Callable, params, batch, micro_batches: int, weight_fn: Callable,
               metric_weight_fn: Callable | None = None):
    """(loss, grads, metrics) of the whole batch, summed over micro-batches in a `lax.scan`.

    loss_fn(params, micro) -> (loss, metrics); weight_fn(batch) -> the normaliser the loss's
    aggregation divides by, so that sum_k weight_k / weight_total * loss_k is the batch loss.
    metric_weight_fn (default weight_fn) weights the metrics not in LOSS_METRICS.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if micro_batches == 1:
        (loss, metrics), grads = grad_fn(params, batch)
        return loss, grads, metrics
    metric_weight_fn = metric_weight_fn or weight_fn
    total = jnp.maximum(weight_fn(batch), 1e-9)
    metric_total = jnp.maximum(metric_weight_fn(batch), 1e-9)

    def body(carry, micro):
        grads_sum, loss_sum = carry
        share = weight_fn(micro) / total
        (loss, metrics), grads = grad_fn(params, micro)
        grads_sum = jax.tree.map(lambda a, g: a + share * g.astype(a.dtype), grads_sum, grads)
        return (grads_sum, loss_sum + share * loss), (metrics, share,
                                                      metric_weight_fn(micro) / metric_total)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (grads, loss), (metrics, shares, metric_shares) = jax.lax.scan(
        body, (zeros, jnp.zeros((), jnp.float32)), split_micro_batches(batch, micro_batches))
    return loss, grads, _combine_metrics(metrics, shares, metric_shares)


def aggregation_weight(mode: str) -> Callable:
    """The denominator of each aggregation mode, as a function of a (micro-)batch."""
    def weight(batch):
        mask = batch["loss_mask"].astype(jnp.float32)
        if mode == "token_mean":
            return mask.sum()
        if mode in ("seq_mean_token_sum", "seq_mean_token_mean"):
            return (mask.sum(axis=1) > 0).astype(jnp.float32).sum()
        return jnp.asarray(mask.shape[0], jnp.float32)  # fixed_normalizer: every row counts
    return weight


def apply_update(state: TrainState, loss, grads, metrics):
    """Optimizer update, or no change at all when the loss or gradient is not finite."""
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    safe_grads = jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)
    updated = state.apply_gradients(safe_grads)
    state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), updated, state)
    metrics = dict(metrics, grad_norm=grad_norm, skipped=1.0 - ok.astype(jnp.float32))
    return state, metrics


def _require(batch, keys, step: str):
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"{step}: batch lacks {missing}; it has {sorted(batch)}")


# ----------------------------------------------------------------------------- steps


def make_logprob_fn(model: Transformer, cfg: StepConfig = StepConfig(), with_entropy=False):
    """fn(params, batch) -> (logprobs [B, T], entropy [B, T] | None), micro-batched so a
    large rollout batch is scored in bounded memory (old / reference log-probs)."""
    def fn(params, batch):
        if cfg.micro_batches == 1:
            return token_logprobs(model, params, batch, cfg.logprob_chunk, cfg.temperature,
                                  with_entropy)
        micro = split_micro_batches(_model_inputs(batch), cfg.micro_batches)
        lp, ent = jax.lax.map(lambda mb: token_logprobs(
            model, params, mb, cfg.logprob_chunk, cfg.temperature, with_entropy), micro)
        unsplit = lambda x: x.swapaxes(0, 1).reshape(-1, x.shape[-1])  # noqa: E731
        return unsplit(lp), (None if ent is None else unsplit(ent))
    return fn


def _model_inputs(batch):
    return {k: batch[k] for k in ("tokens", "positions", "segment_ids") if k in batch}


def make_policy_step(model: Transformer, loss_cfg: PolicyLossConfig,
                     cfg: StepConfig = StepConfig()):
    """Clipped policy-gradient update (PPO / GSPO / BAPO, per `loss_cfg`).

    batch: tokens, loss_mask, old_logprobs, advantages ([B, T] or [B]); optionally positions,
    segment_ids, behaviour_logprobs (engine log-probs, for truncated IS), ref_logprobs (KL).
    """
    use_behaviour = loss_cfg.behaviour_is != "none"

    def loss_fn(params, micro, bapo_bounds):
        lp, entropy = token_logprobs(model, params, micro, cfg.logprob_chunk, cfg.temperature)
        return policy_loss(
            lp, micro["old_logprobs"], micro["advantages"], micro["loss_mask"], loss_cfg,
            behaviour_logprobs=micro.get("behaviour_logprobs") if use_behaviour else None,
            ref_logprobs=micro.get("ref_logprobs"), entropy=entropy, bapo_bounds=bapo_bounds)

    def step(state: TrainState, batch):
        _require(batch, ["tokens", "loss_mask", "old_logprobs", "advantages"], "policy_step")
        bounds, extra = None, {}
        if loss_cfg.kind == "bapo" and cfg.micro_batches > 1:
            # BAPO's bounds depend on the ratios of the whole batch: score it once (forward
            # only), adapt, then clip every micro-batch with the same bounds.
            lp, _ = make_logprob_fn(model, cfg)(state.params, batch)
            mask = batch["loss_mask"]
            ratio = jnp.exp(jnp.where(mask, lp - batch["old_logprobs"], 0.0))
            c_low, c_high, stats = adapt_clip_bounds(ratio, batch["advantages"], mask,
                                                     loss_cfg.bapo)
            bounds = (jax.lax.stop_gradient(c_low), jax.lax.stop_gradient(c_high))
            extra = {"bapo_rho": stats["rho_after"], "bapo_rho_before": stats["rho_before"],
                     "bapo_iterations": stats["iterations"].astype(jnp.float32)}
        loss, grads, metrics = accumulate(
            lambda p, mb: loss_fn(p, mb, bounds), state.params, batch, cfg.micro_batches,
            aggregation_weight(loss_cfg.aggregation), aggregation_weight("token_mean"))
        return apply_update(state, loss, grads, {**metrics, **extra})

    return step


def make_value_step(model: ValueModel, clip: float | None = 0.2, aggregation="token_mean",
                    cfg: StepConfig = StepConfig()):
    """Clipped value regression. batch: tokens, loss_mask, values (at rollout), returns.

    values[t] is the critic's estimate for token t given the tokens before it, read from the
    hidden state at t-1, the same alignment as log-probs (entry 0 is 0, never in the mask).
    """
    def loss_fn(params, micro):
        out = model.apply({"params": params}, micro["tokens"], micro.get("positions"),
                          micro.get("segment_ids"))
        values = jnp.concatenate([jnp.zeros_like(out[:, :1]), out[:, :-1]], axis=1)
        return value_loss(values, micro["values"], micro["returns"], micro["loss_mask"], clip,
                          aggregation)

    def step(state: TrainState, batch):
        _require(batch, ["tokens", "loss_mask", "values", "returns"], "value_step")
        loss, grads, metrics = accumulate(loss_fn, state.params, batch, cfg.micro_batches,
                                          aggregation_weight(aggregation),
                                          aggregation_weight("token_mean"))
        return apply_update(state, loss, grads, metrics)

    return step


def make_sft_step(model: Transformer, cfg: StepConfig = StepConfig()):
    """Token-mean negative log-likelihood of the masked tokens (RFT, warm-starts)."""
    def loss_fn(params, micro):
        lp, _ = token_logprobs(model, params, micro, cfg.logprob_chunk, with_entropy=False)
        nll = aggregate(-lp, micro["loss_mask"].astype(jnp.float32), "token_mean")
        return nll, {"loss": nll, "nll": nll}

    def step(state: TrainState, batch):
        _require(batch, ["tokens", "loss_mask"], "sft_step")
        loss, grads, metrics = accumulate(loss_fn, state.params, batch, cfg.micro_batches,
                                          aggregation_weight("token_mean"))
        return apply_update(state, loss, grads, metrics)

    return step


PAIR_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def make_preference_step(model: Transformer, loss_name: str = "dpo",
                         cfg: StepConfig = StepConfig(), **loss_kwargs):
    """DPO / IPO / INPO on pairs. batch: chosen_{tokens,loss_mask[,positions,segment_ids]},
    rejected_{...} [B, T]; ref_chosen_logps, ref_rejected_logps [B] (+ prev_* for INPO).
    Chosen and rejected go through the model as one [2B, T] batch."""
    loss = PREFERENCE_LOSSES.get(loss_name)
    extra_keys = [f"{who}_{side}_logps" for who in ("ref",) + (("prev",) if loss_name == "inpo"
                  else ()) for side in ("chosen", "rejected")]

    def sequence_logps(params, micro):
        both = {k: jnp.concatenate([micro[f"chosen_{k}"], micro[f"rejected_{k}"]])
                for k in PAIR_KEYS if f"chosen_{k}" in micro}
        lp, _ = token_logprobs(model, params, both, cfg.logprob_chunk, with_entropy=False)
        seq = jnp.sum(jnp.where(both["loss_mask"], lp, 0.0), axis=1)
        return jnp.split(seq, 2)

    def loss_fn(params, micro):
        chosen, rejected = sequence_logps(params, micro)
        kwargs = {k: micro[k] for k in extra_keys}
        value, metrics = loss(chosen, rejected, **kwargs, **loss_kwargs)
        return value, {**metrics, "loss": value}

    def step(state: TrainState, batch):
        _require(batch, ["chosen_tokens", "chosen_loss_mask", "rejected_tokens",
                         "rejected_loss_mask", *extra_keys], "preference_step")
        rows = lambda b: jnp.asarray(b["chosen_tokens"].shape[0], jnp.float32)  # noqa: E731
        value, grads, metrics = accumulate(loss_fn, state.params, batch, cfg.micro_batches, rows)
        return apply_update(state, value, grads, metrics)

    return step


def compile_step(step: Callable, state: TrainState, mesh: Mesh):
    """jit with the state's own shardings in and out (donated), batch split on its leading dim
    over the data-parallel axes, metrics replicated."""
    state_shardings = shardings_of(state)
    batch_sharding = NamedSharding(mesh, parallel.batch_spec(1))
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)


def compile_logprob_fn(fn: Callable, params: Any, mesh: Mesh):
    """jit for `make_logprob_fn`: params as they are sharded, batch and output on the batch dim."""
    batch_sharding = NamedSharding(mesh, parallel.batch_spec(1))
    return jax.jit(fn, in_shardings=(shardings_of(params), batch_sharding),
                   out_shardings=batch_sharding)
