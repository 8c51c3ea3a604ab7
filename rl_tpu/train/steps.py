"""Jitted pure update steps: policy, value, SFT, preference and reward model, with gradient
accumulation.

Every step is `step(state, batch) -> (state, metrics)`. A `make_*_step` factory closes over the
static configuration (model, loss config, micro-batches) and `compile_step` jits it once with
explicit in/out shardings and the state donated; a new batch *shape* (a new length bucket)
compiles again, nothing else does.

Batches are mappings of arrays read by name, sharded on the batch dim over the data-parallel
mesh axes: the RL steps get a `RolloutBatch` (rl_tpu/core/batch.py declares its fields, their
dtypes and shapes, and which of them the policy and value steps read), the SFT, preference and
reward-model steps dicts of their own arrays.

Gradient accumulation is exact: micro-batch k's loss is weighted by its share of the whole
batch's normaliser (its masked tokens for a token mean, its sequences for a sequence mean), so
M micro-batches give the gradient of the one big batch. A policy loss that needs a statistic
of the whole batch (its registry entry declares `batch_statistics`, e.g. BAPO's clip bounds)
gets it from one forward-only scoring pass over the batch, shared by every micro-batch.

A step whose loss or gradient norm is not finite leaves the state untouched (params, optimizer
moments, step counter; only the lr schedule's count moves on, so later updates keep their lr)
and reports `skipped = 1`; log-ratios are clamped before every exp, so a
single extreme token no longer makes a NaN gradient.

Metrics. Losses report `Metric`s (rl_tpu.rl.masked): a value, a weight and a reduction tag,
"mean" (weighted: by masked tokens for per-token means, by the loss's normaliser for the loss,
1 for per-batch numbers), "sum" (e.g. `skipped`), "max", "min", "last". Micro-batches combine
by each metric's own tag. A step returns them as a flat {name: scalar array} by default; with
`StepConfig(tagged_metrics=True)` it returns the {name: Metric} dict itself, for a trainer that
combines minibatches and epochs the same way:

    parts = [step(state, mb)[1] for mb in minibatches]        # or a scan's stacked output:
    whole = combine_metrics(parts)                             #   combine_stacked(stacked)
    log(metric_values(whole))                                  # {name: scalar}

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
from rl_tpu.core.batch import MODEL_INPUTS, ROUTING_INPUT
from rl_tpu.models.logprobs import token_logprobs, token_logprobs_and_routing
from rl_tpu.models.moe import load_balancing_loss, routing_mismatch
from rl_tpu.models.reward_model import sequence_scores
from rl_tpu.models.transformer import Transformer
from rl_tpu.models.value import ValueModel
from rl_tpu.rl.losses import (POLICY_LOSSES, PolicyLossConfig, aggregate, loss_weight,
                              policy_loss, value_loss)
from rl_tpu.rl.masked import (Metric, combine_metrics, combine_stacked,  # noqa: F401 (API)
                              metric_values)
from rl_tpu.rl.preference import PREFERENCE_LOSSES
from rl_tpu.rl.reward_losses import bradley_terry_loss
from rl_tpu.train.state import TrainState, advance_schedule, shardings_of


@dataclasses.dataclass(frozen=True)
class StepConfig:
    micro_batches: int = 1  # gradient accumulation steps inside one update
    logprob_chunk: int = 128  # positions per logits chunk (memory [B/M, chunk, V])
    temperature: float = 1.0  # the sampling temperature: logprobs of the sampled policy
    tagged_metrics: bool = False  # metrics as {name: Metric} (for combine_metrics), not flat
    # The policy step's own log-probs (stop-gradient) as the proximal ones, in place of the
    # batch's old_logprobs: exact when the step's params are those a score pass would have
    # used, i.e. one epoch of one minibatch (Learner.proximal_from_step).
    proximal_from_step: bool = False
    # A mixture of experts' forward passes replay the batch's routed_experts (the sampler's
    # choice) instead of routing each token themselves (algo.routing_replay="rollout").
    routing_replay: bool = False


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


def micro_batches_for(rows: int, length: int, tokens_per_device: int) -> int:
    """The fewest micro-batches M that split one device's `rows` (of `length` tokens) into
    micro-batches of at most `tokens_per_device` tokens: the smallest divisor M of rows with
    rows / M x length <= the budget, or one row a micro-batch when a single row is over it.

    >>> micro_batches_for(16, 8192, 16384)   # 2 rows of 8192 a micro-batch
    8
    >>> micro_batches_for(6, 1024, 4096)     # 4 rows would fit, but 4 does not divide 6: 3
    2
    """
    if rows < 1 or length < 1 or tokens_per_device < 1:
        raise ValueError(f"micro_batches_for(rows={rows}, length={length}, "
                         f"tokens_per_device={tokens_per_device}): all must be >= 1")
    return next(m for m in range(1, rows + 1)
                if rows % m == 0 and (rows // m * length <= tokens_per_device or m == rows))


def _tagged(metrics, weight) -> dict[str, Metric]:
    """A loss's metrics as Metrics; a bare array is a mean weighted like the loss."""
    return {k: (m if isinstance(m, Metric) else Metric.of(m, "mean", weight))
            for k, m in metrics.items()}


def accumulate(loss_fn: Callable, state: TrainState, batch, micro_batches: int,
               weight_fn: Callable, dropout: bool = False):
    """(loss, grads, {name: Metric}) of the whole batch, summed over micro-batches in a scan;
    the gradient is of `state.trained()` only (all params, or e.g. LoRA's adapters), so XLA
    computes no gradient of a frozen weight.

    loss_fn(params, micro) -> (loss, {name: Metric or array}), params the full tree;
    weight_fn(batch) -> the normaliser the loss's aggregation divides by, so that sum_k
    weight_k / weight_total * loss_k is the batch loss. Metrics combine by their own reduction
    tags (bare arrays as means weighted by weight_fn). `dropout` (a model with LoRA
    dropout): each micro-batch gets a key, `dropout_rng`, fold_in(key(0), step) folded with
    its index, so a resumed run draws the same masks.
    """
    grad_fn = jax.value_and_grad(lambda t, mb: loss_fn(state.with_trained(t), mb), has_aux=True)
    trained = state.trained()
    dropout = jax.random.fold_in(jax.random.key(0), state.step) if dropout else None
    if micro_batches == 1:
        if dropout is not None:
            batch = {**batch, "dropout_rng": dropout}
        (loss, metrics), grads = grad_fn(trained, batch)
        return loss, grads, _tagged(metrics, weight_fn(batch))
    total = jnp.maximum(weight_fn(batch), 1e-9)

    def body(carry, micro):
        grads_sum, loss_sum, index = carry
        weight = weight_fn(micro)
        share = weight / total
        if dropout is not None:
            micro = {**micro, "dropout_rng": jax.random.fold_in(dropout, index)}
        (loss, metrics), grads = grad_fn(trained, micro)
        grads_sum = jax.tree.map(lambda a, g: a + share * g.astype(a.dtype), grads_sum, grads)
        return (grads_sum, loss_sum + share * loss, index + 1), _tagged(metrics, weight)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trained)
    (grads, loss, _), metrics = jax.lax.scan(
        body, (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)),
        split_micro_batches(batch, micro_batches))
    return loss, grads, combine_stacked(metrics)


def lora_dropout(model) -> bool:
    """Whether `model` (a Transformer, or a head model over one as `.trunk`) applies LoRA
    dropout in training, so its steps must hand it a key."""
    cfg = getattr(model, "cfg", None)
    lora_cfg = getattr(cfg, "lora", None)
    return lora_cfg is not None and lora_cfg.dropout > 0


def aggregation_weight(mode: str) -> Callable:
    """The denominator of each aggregation mode, as a function of a (micro-)batch."""
    return lambda batch: loss_weight(batch["loss_mask"], mode)


def apply_update(state: TrainState, loss, grads, metrics, mesh=None):
    """Optimizer update, or, when the loss or gradient is not finite, no change but the lr
    schedule's count (`advance_schedule`: later updates keep the lr they would have had).

    Adds grad_norm (mean over updates) and skipped (1 when the update was dropped; a count
    over updates) to `metrics` ({name: Metric}). `mesh`: the model's, whose platform picks
    how the update is skipped (below).
    """
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    skip = lambda s: s.replace(opt_state=advance_schedule(s.opt_state))  # noqa: E731
    if parallel.platform(mesh) == "cpu":
        # A cond: XLA:CPU then writes the donated buffers in place, where a select of the
        # new state against the old keeps both and copies every optimizer moment (the rl_step
        # update: 55 copies, 0.35 -> 0.33 s). XLA:TPU is the other way round: the select
        # updates in place and the cond holds a second state (Qwen2.5-1.5B's update on a v5e
        # chip: 5.45 GiB with the select, 5.95 with the cond).
        state = jax.lax.cond(ok, lambda s: s.apply_gradients(grads), skip, state)
    else:
        safe_grads = jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)
        updated = state.apply_gradients(safe_grads)
        state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), updated, skip(state))
    metrics = dict(metrics, grad_norm=Metric.of(grad_norm),
                   skipped=Metric.of(1.0 - ok.astype(jnp.float32), "sum"))
    return state, metrics


def _output(result, cfg: StepConfig):
    state, metrics = result
    return state, (dict(metrics) if cfg.tagged_metrics else metric_values(metrics))


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
                                  with_entropy, cfg.routing_replay)
        micro = split_micro_batches(_model_inputs(batch, cfg), cfg.micro_batches)
        lp, ent = jax.lax.map(lambda mb: token_logprobs(
            model, params, mb, cfg.logprob_chunk, cfg.temperature, with_entropy,
            cfg.routing_replay), micro)
        unsplit = lambda x: x.swapaxes(0, 1).reshape(-1, x.shape[-1])  # noqa: E731
        return unsplit(lp), (None if ent is None else unsplit(ent))
    return fn


def _model_inputs(batch, cfg: StepConfig):
    names = MODEL_INPUTS + ((ROUTING_INPUT,) if cfg.routing_replay else ())
    return {k: batch[k] for k in names if k in batch}


def _routing_terms(model: Transformer, routing, micro) -> tuple[Any, dict[str, Metric]]:
    """A mixture of experts' additions to the policy loss and its metrics: the routers'
    load-balancing loss (times the checkpoint's router_aux_loss_coef, as transformers adds it
    to the LM loss) over the real tokens; and, when the batch carries the sampler's routing,
    routing_mismatch: the share of token-layer routings (the policy's tokens) where this
    forward's own router picks other experts than the sampler did."""
    moe_cfg = model.cfg.moe
    router_logits, _ = routing
    real = micro["segment_ids"] > 0 if "segment_ids" in micro else None
    aux = load_balancing_loss(router_logits, moe_cfg.top_k, real)
    metrics = {"router_aux_loss": Metric.of(aux)}
    if ROUTING_INPUT in micro:
        share, count = routing_mismatch(router_logits, micro[ROUTING_INPUT], moe_cfg.top_k,
                                        micro["loss_mask"])
        metrics["routing_mismatch"] = Metric.of(share, weight=count)
    return moe_cfg.router_aux_loss_coef * aux, metrics


def make_policy_step(model: Transformer, loss_cfg: PolicyLossConfig,
                     cfg: StepConfig = StepConfig()):
    """Clipped policy-gradient update (PPO / GSPO / BAPO, per `loss_cfg`).

    batch: tokens, loss_mask, old_logprobs, advantages ([B, T] or [B]); optionally positions,
    segment_ids, behaviour_logprobs (engine log-probs: truncated IS, and BAPO's pi_rollout
    weights of Eq. 8), ref_logprobs (KL), length_normalizer ([B] float: fixed_normalizer's
    divisor per row, e.g. the step's generation budget; an array, so it never recompiles).
    """
    kind = POLICY_LOSSES.get(loss_cfg.kind)

    def loss_fn(params, micro, batch_stats):
        lp, entropy, routing = token_logprobs_and_routing(
            model, params, micro, cfg.logprob_chunk, cfg.temperature,
            routing_replay=cfg.routing_replay)
        old = jax.lax.stop_gradient(lp) if cfg.proximal_from_step else micro["old_logprobs"]
        loss, metrics = policy_loss(
            lp, old, micro["advantages"], micro["loss_mask"], loss_cfg,
            behaviour_logprobs=micro.get("behaviour_logprobs"),
            ref_logprobs=micro.get("ref_logprobs"), entropy=entropy, batch_stats=batch_stats,
            normalizer=micro.get("length_normalizer"))  # [B]: a budget schedule's, traced
        if routing is None:
            return loss, metrics
        router_loss, router_metrics = _routing_terms(model, routing, micro)
        return loss + router_loss, {**metrics, **router_metrics}

    def step(state: TrainState, batch):
        _require(batch, ["tokens", "loss_mask", "advantages"]
                 + ([] if cfg.proximal_from_step else ["old_logprobs"]), "policy_step")
        batch_stats, stat_metrics = None, {}
        if kind.batch_statistics is not None and cfg.micro_batches > 1:
            # The loss needs a statistic of the whole batch but each micro-batch sees a part:
            # score the batch once (forward only) and hand every micro-batch the same one.
            # With one micro-batch the loss takes it from its own log-probs, no extra pass.
            lp, _ = make_logprob_fn(model, cfg)(state.params, batch)
            batch_stats, stat_metrics = kind.batch_statistics(
                jax.lax.stop_gradient(lp), batch, loss_cfg)
        loss, grads, metrics = accumulate(
            lambda p, mb: loss_fn(p, mb, batch_stats), state, batch, cfg.micro_batches,
            aggregation_weight(loss_cfg.aggregation), lora_dropout(model))
        return _output(apply_update(state, loss, grads, {**metrics, **stat_metrics},
                                    model.mesh), cfg)

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
        loss, grads, metrics = accumulate(loss_fn, state, batch, cfg.micro_batches,
                                          aggregation_weight(aggregation))
        return _output(apply_update(state, loss, grads, metrics, model.mesh), cfg)

    return step


def make_sft_step(model: Transformer, cfg: StepConfig = StepConfig()):
    """Token-mean negative log-likelihood of the masked tokens (RFT, warm-starts)."""
    def loss_fn(params, micro):
        lp, _ = token_logprobs(model, params, micro, cfg.logprob_chunk, with_entropy=False)
        nll = aggregate(-lp, micro["loss_mask"].astype(jnp.float32), "token_mean")
        return nll, {"loss": nll, "nll": nll}

    def step(state: TrainState, batch):
        _require(batch, ["tokens", "loss_mask"], "sft_step")
        loss, grads, metrics = accumulate(loss_fn, state, batch, cfg.micro_batches,
                                          aggregation_weight("token_mean"), lora_dropout(model))
        return _output(apply_update(state, loss, grads, metrics, model.mesh), cfg)

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
        if "dropout_rng" in micro:
            both["dropout_rng"] = micro["dropout_rng"]
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
        value, grads, metrics = accumulate(loss_fn, state, batch, cfg.micro_batches, rows,
                                               lora_dropout(model))
        return _output(apply_update(state, value, grads, metrics, model.mesh), cfg)

    return step


def _pair_rewards(model, params, micro):
    """Chosen and rejected rows through the reward model as one [2B, T] batch: each row's
    first-label score at its last token (rows are right-padded: segment_ids > 0 on the text)."""
    both = {k: jnp.concatenate([micro[f"chosen_{k}"], micro[f"rejected_{k}"]])
            for k in ("tokens", "positions", "segment_ids")}
    rewards = sequence_rewards(model, params, both)
    return jnp.split(rewards, 2)


def sequence_rewards(model, params, batch):
    """[B] a reward model's first-label score at each row's last token (right padding)."""
    scores = model.apply({"params": params}, batch["tokens"], batch.get("positions"),
                         batch.get("segment_ids"))
    lengths = jnp.sum(batch["segment_ids"] > 0, axis=1)
    return sequence_scores(scores, lengths=lengths)[:, 0]


def make_reward_model_step(model, centring: float = 0.0, cfg: StepConfig = StepConfig()):
    """Bradley-Terry on pairs (rl_tpu.rl.reward_losses). batch: chosen_{tokens,positions,
    segment_ids}, rejected_{...} [B, T]; margin [B] (0 = none) and weight [B] (0 = a padding
    pair). Micro-batches are weighted by their pairs' weight, so M of them give the gradient
    of the one big batch."""
    def loss_fn(params, micro):
        chosen, rejected = _pair_rewards(model, params, micro)
        value, metrics = bradley_terry_loss(chosen, rejected, margin=micro["margin"],
                                            weights=micro["weight"], centring=centring)
        pairs = Metric.of(metrics.pop("pairs"), "sum")  # a count: added over micro-batches
        return value, {**metrics, "pairs": pairs, "loss": value}

    def step(state: TrainState, batch):
        _require(batch, ["chosen_tokens", "chosen_segment_ids", "rejected_tokens",
                         "rejected_segment_ids", "margin", "weight"], "reward_model_step")
        weight = lambda b: jnp.sum(b["weight"].astype(jnp.float32))  # noqa: E731
        value, grads, metrics = accumulate(loss_fn, state, batch, cfg.micro_batches,
                                           weight)
        return _output(apply_update(state, value, grads, metrics, model.mesh), cfg)

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
