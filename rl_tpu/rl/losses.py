"""Policy, value, KL and entropy losses over token arrays: pure, jittable, registered by name.

Shape letters: B batch (sequences), T tokens. Every per-token input is [B, T]; `mask` [B, T]
is 1 on the policy's own tokens (prompt, observation and padding tokens are 0). Advantages may
also be given per sequence, [B], and are then broadcast over T.

Conventions
- ratio r = exp(logprobs - old_logprobs), old_logprobs being the trainer's log-probs of the
  sampled tokens at rollout time. Positions outside the mask are zeroed before any exp, so
  garbage in padding never becomes inf/NaN in values or gradients.
- The clipped surrogate per token is  max(-r A, -clip(r, lower, upper) A)  (a loss, lower is
  better); with a dual clip c > 1 (Ye et al. 2020) tokens with A < 0 take
  min(that, -c A), which caps the loss of a negative token whose ratio exploded.
  * "ppo":  lower = 1 - clip_low, upper = 1 + clip_high (DAPO clip-higher: clip_high = 0.28).
  * "bapo": lower, upper = c_low, c_high from `bapo.adapt_clip_bounds` on this batch (ratio
    bounds used directly, gradients stopped).
  * "gspo": the token-level GSPO form. s_i = exp(mean over the sequence's masked tokens of
    log r); each token's ratio is sg(s_i) * exp(logp_t - sg(logp_t)) (value s_i, gradient
    s_i * grad logp_t) clipped to [1 - clip_low, 1 + clip_high] (GSPO: 3e-4, 4e-4).
- Aggregations (registry AGGREGATIONS) turn [B, T] into a scalar; see `aggregate`.
- Metrics are masked means over the whole batch (global under jit on a sharded batch):
  clip_frac_low  = fraction of masked tokens with r < lower and A < 0 (the lower clip binds),
  clip_frac_high = fraction of masked tokens with r > upper and A > 0 (the upper clip binds),
  approx_kl      = masked mean of (r - 1 - log r) with the token ratio r: the non-negative k3
                   estimate of KL(pi_old || pi_theta) from tokens sampled by pi_old.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from rl_tpu.rl.bapo import BapoConfig, adapt_clip_bounds
from rl_tpu.rl.masked import masked_count, masked_mean, masked_sum, masked_var
from rl_tpu.rl.registry import Registry

Array = jax.Array
sg = jax.lax.stop_gradient

AGGREGATIONS: Registry = Registry("loss aggregation")
KL_ESTIMATORS: Registry = Registry("kl estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
BEHAVIOUR_IS_MODES = ("none", "truncate", "mask")

_MAX_LOG_RATIO = 20.0  # clamp on log-ratios fed to exp in KL and IS weights (e^20 ~ 5e8)


def _float_mask(mask: Array, like: Array) -> Array:
    return jnp.broadcast_to(jnp.asarray(mask, jnp.float32), like.shape)


def _inside(x: Array, m: Array) -> Array:
    """x where the mask is set, 0 elsewhere (keeps padding garbage out of exps and grads)."""
    return jnp.where(m > 0, x, 0.0)


def _per_token(adv: Array, like: Array) -> Array:
    adv = jnp.asarray(adv, jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    return jnp.broadcast_to(adv, like.shape)


# ----------------------------------------------------------------------------- aggregation

@AGGREGATIONS.register("token_mean")
def _token_mean(per_token: Array, mask: Array, normalizer=None) -> Array:
    return masked_mean(per_token, mask)


def _seq_has_tokens(per_token: Array, mask: Array) -> Array:
    return (masked_count(per_token, mask, axis=-1) > 0).astype(jnp.float32)


@AGGREGATIONS.register("seq_mean_token_sum")
def _seq_mean_token_sum(per_token: Array, mask: Array, normalizer=None) -> Array:
    seq_sum = masked_sum(per_token, mask, axis=-1)
    return masked_mean(seq_sum, _seq_has_tokens(per_token, mask))


@AGGREGATIONS.register("seq_mean_token_mean")
def _seq_mean_token_mean(per_token: Array, mask: Array, normalizer=None) -> Array:
    seq_mean = masked_mean(per_token, mask, axis=-1)
    return masked_mean(seq_mean, _seq_has_tokens(per_token, mask))


@AGGREGATIONS.register("fixed_normalizer")
def _fixed_normalizer(per_token: Array, mask: Array, normalizer=None) -> Array:
    if normalizer is None:
        raise ValueError(
            "aggregation 'fixed_normalizer' (Dr.GRPO) needs a normalizer: set "
            "fixed_normalizer to the maximum generation length")
    return masked_sum(per_token, mask) / (per_token.shape[0] * float(normalizer))


def aggregate(per_token: Array, mask: Array, mode: str, normalizer: Optional[float] = None
              ) -> Array:
    """Reduce per-token values [B, T] to a scalar over the masked tokens.

    token_mean:          sum over masked tokens / their count (DAPO token-level).
    seq_mean_token_sum:  mean over sequences of each sequence's masked sum.
    seq_mean_token_mean: mean over sequences of each sequence's masked mean (GRPO, GSPO).
    fixed_normalizer:    masked sum / (B * normalizer), normalizer = max generation length
                         (Dr.GRPO); a constant, so padding rows count in B.
    The two seq_mean modes skip sequences with no masked token (e.g. padding rows). An empty
    mask gives 0.
    """
    return AGGREGATIONS.get(mode)(per_token, mask, normalizer)


# ----------------------------------------------------------------------------- KL

@KL_ESTIMATORS.register("k1")
def _kl_k1(log_ratio: Array) -> Array:
    return log_ratio


@KL_ESTIMATORS.register("k2")
def _kl_k2(log_ratio: Array) -> Array:
    return 0.5 * jnp.square(log_ratio)


@KL_ESTIMATORS.register("k3")
def _kl_k3(log_ratio: Array) -> Array:
    # With d = ref - logp: exp(d) - d - 1 >= 0.
    d = jnp.clip(-log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.exp(d) - d - 1.0


def kl_penalty(logprobs: Array, ref_logprobs: Array, estimator: str = "k3") -> Array:
    """Per-token estimate [B, T] of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.

    k1 = logp - ref;  k2 = 0.5 (logp - ref)^2;  k3 = exp(ref - logp) - (ref - logp) - 1
    (k3's exponent is clamped to +-20). Use it as a loss term (`kl_coef` in PolicyLossConfig)
    or fold `-beta * kl_penalty(...)` into per-token rewards; the caller masks it.
    """
    log_ratio = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
    return KL_ESTIMATORS.get(estimator)(log_ratio)


# ----------------------------------------------------------------------------- policy loss

@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """How `policy_loss` clips, weights and reduces. Hashable, so it can be a static jit arg.

    kind: "ppo" | "gspo" | "bapo". clip_low / clip_high: ratio clip epsilons for ppo and gspo
    (ignored by bapo, whose bounds come from `bapo`). dual_clip: c > 1 or None.
    aggregation: a name in AGGREGATIONS; fixed_normalizer: its normalizer (max generation
    length) for "fixed_normalizer". behaviour_is: "none" | "truncate" | "mask" correction for
    the sampler/trainer mismatch with cap `behaviour_is_cap`. entropy_coef, kl_coef,
    kl_estimator: extra loss terms.
    """

    kind: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    aggregation: str = "token_mean"
    fixed_normalizer: Optional[float] = None
    behaviour_is: str = "none"
    behaviour_is_cap: float = 2.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    bapo: BapoConfig = dataclasses.field(default_factory=BapoConfig)

    def __post_init__(self):
        POLICY_LOSSES.get(self.kind)
        AGGREGATIONS.get(self.aggregation)
        KL_ESTIMATORS.get(self.kl_estimator)
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ValueError(
                f"clip_low={self.clip_low} must be in [0, 1) and clip_high={self.clip_high} "
                ">= 0: they are epsilons, the ratio is clipped to [1-clip_low, 1+clip_high]")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip={self.dual_clip} must be > 1 (e.g. 3.0) or None")
        if self.aggregation == "fixed_normalizer" and not self.fixed_normalizer:
            raise ValueError(
                "aggregation='fixed_normalizer' needs fixed_normalizer = the maximum "
                "generation length (Dr.GRPO)")
        if self.behaviour_is not in BEHAVIOUR_IS_MODES:
            raise ValueError(
                f"unknown behaviour_is {self.behaviour_is!r}; choose one of {BEHAVIOUR_IS_MODES}")
        if self.behaviour_is_cap < 1.0:
            raise ValueError(
                f"behaviour_is_cap={self.behaviour_is_cap} must be >= 1 (e.g. 2.0)")


@POLICY_LOSSES.register("ppo")
def _ppo_ratio(logprobs, old_logprobs, advantages, mask, config):
    ratio = jnp.exp(_inside(logprobs - old_logprobs, mask))
    return ratio, 1.0 - config.clip_low, 1.0 + config.clip_high, {}


@POLICY_LOSSES.register("gspo")
def _gspo_ratio(logprobs, old_logprobs, advantages, mask, config):
    seq_log_ratio = masked_mean(logprobs - old_logprobs, mask, axis=-1)        # [B]
    lp = _inside(logprobs, mask)
    ratio = jnp.exp(sg(seq_log_ratio))[:, None] * jnp.exp(lp - sg(lp))          # [B, T]
    return ratio, 1.0 - config.clip_low, 1.0 + config.clip_high, {}


@POLICY_LOSSES.register("bapo")
def _bapo_ratio(logprobs, old_logprobs, advantages, mask, config):
    ratio = jnp.exp(_inside(logprobs - old_logprobs, mask))
    c_low, c_high, stats = adapt_clip_bounds(sg(ratio), advantages, mask, config.bapo)
    extras = {
        "bapo_c_low": c_low,
        "bapo_c_high": c_high,
        "bapo_rho": stats["rho_after"],
        "bapo_rho_before": stats["rho_before"],
        "bapo_iterations": stats["iterations"].astype(jnp.float32),
        "bapo_high_moves": stats["n_high_moves"].astype(jnp.float32),
        "bapo_low_moves": stats["n_low_moves"].astype(jnp.float32),
    }
    return ratio, c_low, c_high, extras


def clipped_surrogate(ratio: Array, advantages: Array, lower, upper,
                      dual_clip: Optional[float] = None) -> Array:
    """Per-token loss max(-r A, -clip(r, lower, upper) A), dual-clipped at -c A when A < 0."""
    loss = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, lower, upper))
    if dual_clip is not None:
        loss = jnp.where(advantages < 0, jnp.minimum(loss, -dual_clip * advantages), loss)
    return loss


def _behaviour_weights(old_logprobs, behaviour_logprobs, mask, config):
    """(per-token multiplier or None, metrics) for the sampler/trainer mismatch."""
    log_w = jnp.clip(_inside(old_logprobs - behaviour_logprobs, mask),
                     -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    w = jnp.exp(log_w)
    cap = config.behaviour_is_cap
    metrics = {"is_weight_mean": masked_mean(w, mask)}
    if config.behaviour_is == "truncate":
        metrics["is_truncated_frac"] = masked_mean((w > cap).astype(jnp.float32), mask)
        return sg(jnp.minimum(w, cap)), metrics
    if config.behaviour_is == "mask":
        keep = (w <= cap) & (w >= 1.0 / cap)
        metrics["is_truncated_frac"] = masked_mean((~keep).astype(jnp.float32), mask)
        return keep.astype(jnp.float32), metrics
    metrics["is_truncated_frac"] = masked_mean((w > cap).astype(jnp.float32), mask)
    return None, metrics


def policy_loss(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array,
                config: PolicyLossConfig, *, behaviour_logprobs: Optional[Array] = None,
                ref_logprobs: Optional[Array] = None, entropy: Optional[Array] = None,
                bapo_bounds: Optional[tuple[Array, Array]] = None
                ) -> tuple[Array, dict[str, Array]]:
    """Clipped policy-gradient loss (+ kl_coef * KL - entropy_coef * entropy) and metrics.

    logprobs [B, T]: current policy (differentiated); old_logprobs [B, T]: trainer log-probs at
    rollout time; advantages [B, T] or [B]; mask [B, T]. Optional [B, T]: behaviour_logprobs
    (the sampling engine's, for `behaviour_is`), ref_logprobs (needed when kl_coef > 0),
    entropy (per-token entropies, needed when entropy_coef != 0). bapo_bounds: (c_low, c_high)
    already adapted on the whole batch, for kind="bapo" over micro-batches.

    Metrics (scalars): loss, pg_loss, clip_frac_low, clip_frac_high, approx_kl, ratio_mean,
    ratio_max, ratio_min; dual_clip_frac with a dual clip; is_weight_mean, is_truncated_frac
    with behaviour_logprobs; kl with ref_logprobs; entropy with entropy; bapo_c_low,
    bapo_c_high, bapo_rho, bapo_rho_before, bapo_iterations, bapo_high_moves, bapo_low_moves
    for kind="bapo".
    """
    logprobs = jnp.asarray(logprobs, jnp.float32)
    old_logprobs = jnp.asarray(old_logprobs, jnp.float32)
    m = _float_mask(mask, logprobs)
    adv = _inside(_per_token(advantages, logprobs), m)
    agg = lambda x: aggregate(x, m, config.aggregation, config.fixed_normalizer)  # noqa: E731

    if bapo_bounds is not None:
        # Bounds adapted once over a batch larger than this call sees (accumulated
        # micro-batches): every part of the batch must be clipped the same way.
        if config.kind != "bapo":
            raise ValueError(f"bapo_bounds given for policy loss kind {config.kind!r}")
        ratio = jnp.exp(_inside(logprobs - old_logprobs, m))
        lower, upper = bapo_bounds
        metrics = {"bapo_c_low": lower, "bapo_c_high": upper}
    else:
        ratio, lower, upper, metrics = POLICY_LOSSES.get(config.kind)(
            logprobs, old_logprobs, adv, m, config)
    per_token = clipped_surrogate(ratio, adv, lower, upper, config.dual_clip)

    if behaviour_logprobs is not None:
        weight, is_metrics = _behaviour_weights(
            old_logprobs, jnp.asarray(behaviour_logprobs, jnp.float32), m, config)
        metrics.update(is_metrics)
        if weight is not None:
            per_token = per_token * weight
    elif config.behaviour_is != "none":
        raise ValueError(
            f"behaviour_is={config.behaviour_is!r} needs behaviour_logprobs (the sampling "
            "engine's per-token log-probs); pass them or set behaviour_is='none'")

    pg_loss = agg(per_token)
    loss = pg_loss

    if ref_logprobs is not None:
        kl = _inside(kl_penalty(logprobs, ref_logprobs, config.kl_estimator), m)
        metrics["kl"] = masked_mean(kl, m)
        if config.kl_coef:
            loss = loss + config.kl_coef * agg(kl)
    elif config.kl_coef:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs; pass them or set 0")

    if entropy is not None:
        ent = _inside(jnp.asarray(entropy, jnp.float32), m)
        metrics["entropy"] = masked_mean(ent, m)
        if config.entropy_coef:
            loss = loss - config.entropy_coef * agg(ent)
    elif config.entropy_coef:
        raise ValueError(
            f"entropy_coef={config.entropy_coef} needs per-token entropy; pass it or set 0")

    r = sg(ratio)
    tok_log_ratio = sg(_inside(logprobs - old_logprobs, m))
    big = jnp.finfo(jnp.float32).max
    has = masked_count(r, m) > 0
    metrics.update({
        "loss": loss,
        "pg_loss": pg_loss,
        "clip_frac_low": masked_mean(((r < lower) & (adv < 0)).astype(jnp.float32), m),
        "clip_frac_high": masked_mean(((r > upper) & (adv > 0)).astype(jnp.float32), m),
        "approx_kl": masked_mean(jnp.expm1(tok_log_ratio) - tok_log_ratio, m),
        "ratio_mean": masked_mean(r, m),
        "ratio_max": jnp.where(has, jnp.max(jnp.where(m > 0, r, -big)), 0.0),
        "ratio_min": jnp.where(has, jnp.min(jnp.where(m > 0, r, big)), 0.0),
    })
    if config.dual_clip is not None:
        undual = jnp.maximum(-adv * r, -adv * jnp.clip(r, lower, upper))
        dual_binds = (adv < 0) & (undual > -config.dual_clip * adv)
        metrics["dual_clip_frac"] = masked_mean(dual_binds.astype(jnp.float32), m)
    return loss, metrics


# ----------------------------------------------------------------------------- value loss

def value_loss(values: Array, old_values: Array, returns: Array, mask: Array,
               clip: Optional[float] = 0.2, aggregation: str = "token_mean",
               normalizer: Optional[float] = None) -> tuple[Array, dict[str, Array]]:
    """Clipped critic loss 0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2).

    values, old_values, returns, mask: [B, T]. clip=None gives the plain 0.5 (v - R)^2.
    Metrics: value_loss; value_clip_frac = fraction of masked tokens where the clipped term is
    strictly larger (its gradient is then 0); explained_variance = 1 - Var(R - v) / Var(R)
    over masked tokens (0 when Var(R) = 0); value_mean; return_mean.
    """
    values = jnp.asarray(values, jnp.float32)
    m = _float_mask(mask, values)
    v = _inside(values, m)
    old = _inside(jnp.asarray(old_values, jnp.float32), m)
    ret = _inside(jnp.asarray(returns, jnp.float32), m)
    unclipped = jnp.square(v - ret)
    if clip is None:
        per_token = 0.5 * unclipped
        clip_frac = jnp.zeros((), jnp.float32)
    else:
        v_clipped = old + jnp.clip(v - old, -clip, clip)
        clipped = jnp.square(v_clipped - ret)
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).astype(jnp.float32), m)
    loss = aggregate(per_token, m, aggregation, normalizer)
    var_ret = masked_var(ret, m)
    var_res = masked_var(sg(ret - v), m)
    explained = jnp.where(var_ret > 0, 1.0 - var_res / jnp.where(var_ret > 0, var_ret, 1.0), 0.0)
    metrics = {
        "value_loss": loss,
        "value_clip_frac": clip_frac,
        "explained_variance": explained,
        "value_mean": masked_mean(sg(v), m),
        "return_mean": masked_mean(ret, m),
    }
    return loss, metrics
