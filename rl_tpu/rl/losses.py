"""Policy, value, KL and entropy losses over token arrays: pure, jittable, registered by name.

Shape letters: B batch (sequences), T tokens. Every per-token input is [B, T]; `mask` [B, T]
is 1 on the policy's own tokens (prompt, observation and padding tokens are 0). Advantages may
also be given per sequence, [B], and are then broadcast over T.

Conventions
- Three policies (decoupled PPO): behaviour (the engine that sampled each token; its reported
  log-probs), proximal (`old_logprobs`: the trainer's recomputed log-probs at the start of
  this update) and current (`logprobs`, differentiated). The ratio's denominator is chosen by
  `ratio_against`: "proximal" (PPO, GRPO...; staleness is then corrected by the truncated
  proximal / behaviour weight of `behaviour_is`) or "behaviour" (BAPO's r = pi_theta /
  pi_rollout, so the ratio sees the staleness; no separate IS weight).
- ratio r = exp(logprobs - denominator). Positions outside the mask are zeroed before any exp, and
  every log-ratio is clamped to +-MAX_LOG_RATIO (20, as verl) before its exp: a token whose
  log-ratio is 95 would otherwise give exp = inf, a finite clipped loss but a NaN gradient
  (0 * inf), and the whole update would be skipped. Clamped, its gradient is 0 (the clip
  binds) or finite.
- A kind owns its per-token surrogate (a loss, lower is better). The default, the clipped
  one, is  max(-r A, -clip(r, lower, upper) A); with a dual clip c > 1 (Ye et al. 2020)
  tokens with A < 0 take min(that, -c A), which caps the loss of a negative token whose
  ratio exploded.
- Policy losses are registered as `PolicyLossKind`s in POLICY_LOSSES:
  * "ppo":  lower = 1 - clip_low, upper = 1 + clip_high (DAPO clip-higher: clip_high = 0.28).
  * "bapo": lower, upper = c_low, c_high from `bapo.adapt_clip_bounds` on the whole batch
    (ratio bounds used directly, gradients stopped); a user of the batch-statistics hook.
  * "gspo": the token-level GSPO form. s_i = exp(mean over the sequence's masked tokens of
    log r); each token's ratio is sg(s_i) * exp(logp_t - sg(logp_t)) (value s_i, gradient
    s_i * grad logp_t) clipped to [1 - clip_low, 1 + clip_high] (GSPO: 3e-4, 4e-4). Its
    aggregation defaults to GSPO's own sequence mean of token means.
  * "cispo" (MiniMax-M1, 2025): REINFORCE with a clipped, stopped importance weight,
    per token  -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi  with PPO's token ratio.
    Its gradient is -clip(r) A grad log pi on EVERY token: a token outside the clip range is
    scaled by the bound, where PPO's clip would zero it. clip_low = 1 (lower bound 0) turns
    the lower clip off; no dual clip (the weight is bounded already).
- Batch statistics: a kind may declare `batch_statistics(logprobs, batch, config) -> (stats,
  metrics)`, a number the loss needs over the WHOLE batch (BAPO's bounds). `policy_loss`
  computes it from what it is given; a step that splits the batch into micro-batches computes
  it once from a forward-only scoring pass and passes the same `batch_stats` to every part.
- Aggregations (registry AGGREGATIONS) turn [B, T] into a scalar; see `aggregate`.
- Metrics come back as `Metric`s (rl_tpu.rl.masked): value, weight and reduction, so parts of
  a batch combine exactly (`combine_metrics`). Per-token means are weighted by masked tokens:
  clip_frac_low  = fraction of masked tokens with r < lower and A < 0 (the lower clip binds),
  clip_frac_high = fraction of masked tokens with r > upper and A > 0 (the upper clip binds),
  approx_kl      = masked mean of (r - 1 - log r) with the token ratio r: the non-negative k3
                   estimate of KL(pi_old || pi_theta) from tokens sampled by pi_old;
  loss and pg_loss are weighted by the aggregation's normaliser (`loss_weight`), ratio_max /
  ratio_min reduce by max / min.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from rl_tpu.rl.bapo import BapoConfig, adapt_clip_bounds
from rl_tpu.rl.importance import (BEHAVIOUR_IS_LEVELS, BEHAVIOUR_IS_MODES,
                                  LOGPROB_GAP_THRESHOLD, MAX_LOG_RATIO, behaviour_weights,
                                  clamped_exp, logprob_gap_metrics)
from rl_tpu.rl.masked import Metric, masked_count, masked_mean, masked_sum, masked_var
from rl_tpu.rl.registry import Registry

Array = jax.Array
sg = jax.lax.stop_gradient

AGGREGATIONS: Registry = Registry("loss aggregation")
KL_ESTIMATORS: Registry = Registry("kl estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
RATIO_DENOMINATORS = ("proximal", "behaviour")


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


def token_ratio(logprobs: Array, old_logprobs: Array, mask: Array) -> Array:
    """r = exp(logprobs - old_logprobs) [B, T], log-ratio clamped to +-20, 1 off the mask."""
    m = _float_mask(mask, logprobs)
    return clamped_exp(_inside(jnp.asarray(logprobs, jnp.float32)
                               - jnp.asarray(old_logprobs, jnp.float32), m))


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
    # Each row's sum over its own normaliser, averaged over rows: with one normaliser L for
    # all rows this is sum / (B L). `normalizer` may be a traced scalar or [B] array (a
    # budget schedule changes it every step, SIRI), so it is never a compile-time constant.
    row_sums = masked_sum(per_token, mask, axis=-1)                                 # [B]
    return jnp.sum(row_sums / jnp.asarray(normalizer, jnp.float32)) / per_token.shape[0]


def aggregate(per_token: Array, mask: Array, mode: str, normalizer: Optional[float] = None
              ) -> Array:
    """Reduce per-token values [B, T] to a scalar over the masked tokens.

    token_mean:          sum over masked tokens / their count (DAPO token-level).
    seq_mean_token_sum:  mean over sequences of each sequence's masked sum.
    seq_mean_token_mean: mean over sequences of each sequence's masked mean (GRPO, GSPO).
    fixed_normalizer:    masked sum / (B * normalizer), normalizer = max generation length
                         (Dr.GRPO); a constant, so padding rows count in B. A number, or
                         a scalar / [B] array (per-row normalisers: mean of row sum / L_b).
    The two seq_mean modes skip sequences with no masked token (e.g. padding rows). An empty
    mask gives 0.
    """
    return AGGREGATIONS.get(mode)(per_token, mask, normalizer)


def loss_weight(mask: Array, mode: str) -> Array:
    """What a part of a batch weighs when `aggregate`d losses of parts are averaged into the
    loss of the whole: proportional to the aggregation's divisor. Masked tokens (token_mean),
    sequences with a masked token (seq_mean_*), rows (fixed_normalizer). mask [B, T]; scalar.
    """
    m = jnp.asarray(mask, jnp.float32)
    if mode == "token_mean":
        return jnp.sum(m)
    if mode in ("seq_mean_token_sum", "seq_mean_token_mean"):
        return jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.float32))
    AGGREGATIONS.get(mode)  # an unknown name fails here, by name
    return jnp.asarray(m.shape[0], jnp.float32)  # fixed_normalizer: every row counts


# ----------------------------------------------------------------------------- KL

@KL_ESTIMATORS.register("k1")
def _kl_k1(log_ratio: Array) -> Array:
    return log_ratio


@KL_ESTIMATORS.register("k2")
def _kl_k2(log_ratio: Array) -> Array:
    return 0.5 * jnp.square(log_ratio)


# k3 grows like exp(ref - logp): one token the policy has all but abandoned (logp -5 against the
# reference's -1 gives 49.6, gradient -53.6) would dominate a step. Bounded to [0, 10] as verl's
# `low_var_kl` clamps it to [-10, 10] (k3 >= 0): beyond the bound the value is 10, gradient 0.
K3_BOUND = 10.0


@KL_ESTIMATORS.register("k3")
def _kl_k3(log_ratio: Array) -> Array:
    # With d = ref - logp: exp(d) - d - 1 >= 0, clamped to K3_BOUND.
    d = jnp.clip(-log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return jnp.minimum(jnp.exp(d) - d - 1.0, K3_BOUND)


def kl_penalty(logprobs: Array, ref_logprobs: Array, estimator: str = "k3") -> Array:
    """Per-token estimate [B, T] of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.

    k1 = logp - ref;  k2 = 0.5 (logp - ref)^2;  k3 = exp(ref - logp) - (ref - logp) - 1
    (k3's exponent is clamped to +-20 and its value to at most K3_BOUND = 10, as verl's
    low_var_kl). Use it as a loss term (`kl_coef` in PolicyLossConfig)
    or fold `-beta * kl_penalty(...)` into per-token rewards; the caller masks it.
    """
    log_ratio = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
    return KL_ESTIMATORS.get(estimator)(log_ratio)


# ----------------------------------------------------------------------------- policy loss

@dataclasses.dataclass(frozen=True)
class PolicyLossKind:
    """A registered policy loss: how it forms its ratio and bounds, and what it needs.

    ratio(logprobs, old_logprobs, advantages, mask, config, stats) -> (ratio [B, T], lower,
        upper, metrics): the ratio the clipped surrogate uses and its clip bounds (ratio
        values); `stats` is what `batch_statistics` returned (None for kinds without it).
    defaults(config) -> {field: value} for the PolicyLossConfig fields left None
        (aggregation, dual_clip): the kind's own conventions.
    batch_statistics(logprobs, batch, config) -> (stats pytree, {name: Metric}), or None: a
        statistic of the WHOLE batch, from gradient-stopped log-probs [B, T] and a batch dict
        holding old_logprobs, advantages, loss_mask and, when known, behaviour_logprobs.
    surrogate(ratio, logprobs, advantages, lower, upper, config) -> per-token loss [B, T]:
        the whole per-token policy-gradient term from `ratio`'s output, the current log-probs
        (0 off the mask) and the advantages (0 off the mask); the default is PPO's
        `clipped_surrogate` (with the config's dual clip).
    check(config) -> None, or None: the kind's own refusals of a PolicyLossConfig (a clear
        ValueError), run at construction.
    """

    ratio: Callable[..., tuple[Array, Any, Any, dict[str, Metric]]]
    defaults: Callable[[Any], dict[str, Any]] = lambda config: {"aggregation": "token_mean"}
    batch_statistics: Optional[Callable[..., tuple[Any, dict[str, Metric]]]] = None
    surrogate: Callable[..., Array] = (
        lambda ratio, logprobs, advantages, lower, upper, config: clipped_surrogate(
            ratio, advantages, lower, upper, config.dual_clip))
    check: Optional[Callable[[Any], None]] = None


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """How `policy_loss` clips, weights and reduces. Hashable, so it can be a static jit arg.

    kind: a name in POLICY_LOSSES ("ppo" | "gspo" | "bapo" | "cispo"). clip_low / clip_high:
    ratio clip epsilons for ppo, gspo and cispo (ignored by bapo, whose bounds come from
    `bapo`); clip_low = 1 puts the lower bound at 0, i.e. no lower clip. dual_clip:
    c > 1, or None (off; the kind's default: 3.0 for bapo with bapo.variant="verl", as that
    recipe). aggregation: a name in AGGREGATIONS, or None for the kind's own (token_mean for
    ppo and bapo, seq_mean_token_mean for gspo); fixed_normalizer: its normalizer (max
    generation length) for "fixed_normalizer". behaviour_is: "none" | "truncate" | "mask"
    correction for the sampler/trainer mismatch with cap `behaviour_is_cap`, per token or per
    sequence (`behaviour_is_level`, rl_tpu.rl.importance). logprob_gap_threshold: the
    |proximal - behaviour| (nats) above which a token counts in logprob_gap_frac. entropy_coef,
    kl_coef, kl_estimator: extra loss terms. Fields left None are resolved at construction,
    so the config read back always holds the values in use.
    """

    kind: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    aggregation: Optional[str] = None
    fixed_normalizer: Optional[float] = None
    behaviour_is: str = "none"
    behaviour_is_cap: float = 2.0
    behaviour_is_level: str = "token"  # "token" | "sequence": one weight a token, or a row
    logprob_gap_threshold: float = LOGPROB_GAP_THRESHOLD  # nats, train/logprob_gap_frac's
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    bapo: BapoConfig = dataclasses.field(default_factory=BapoConfig)
    ratio_against: str = "proximal"  # the ratio's denominator: "proximal" | "behaviour"
    # log where the clipped surrogate's gradient comes from (`clip_mechanism_metrics`)
    mechanism_metrics: bool = False

    def __post_init__(self):
        kind = POLICY_LOSSES.get(self.kind)
        for name, value in kind.defaults(self).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: resolve once, here
        AGGREGATIONS.get(self.aggregation)
        KL_ESTIMATORS.get(self.kl_estimator)
        if not (0.0 <= self.clip_low <= 1.0 and self.clip_high >= 0.0):
            raise ValueError(
                f"clip_low={self.clip_low} must be in [0, 1] and clip_high={self.clip_high} "
                ">= 0: they are epsilons, the ratio is clipped to [1-clip_low, 1+clip_high] "
                "(clip_low = 1: no lower clip)")
        if kind.check is not None:
            kind.check(self)
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
        if self.behaviour_is_level not in BEHAVIOUR_IS_LEVELS:
            raise ValueError(f"unknown behaviour_is_level {self.behaviour_is_level!r}; choose "
                             f"one of {BEHAVIOUR_IS_LEVELS}")
        if not self.logprob_gap_threshold > 0.0:
            raise ValueError(f"logprob_gap_threshold={self.logprob_gap_threshold} must be > 0 "
                             "(nats, e.g. 0.1)")
        if self.ratio_against not in RATIO_DENOMINATORS:
            raise ValueError(f"ratio_against={self.ratio_against!r}; choose one of "
                             f"{RATIO_DENOMINATORS}")
        if self.ratio_against == "behaviour" and self.behaviour_is != "none":
            raise ValueError(
                f"ratio_against='behaviour' already divides by the behaviour policy; "
                f"behaviour_is={self.behaviour_is!r} (a proximal / behaviour weight) would "
                "correct twice: set behaviour_is='none' or ratio_against='proximal'")


def ratio_denominator(batch, config: PolicyLossConfig) -> Array:
    """The log-probs the ratio divides by: `old_logprobs` (proximal) or `behaviour_logprobs`."""
    if config.ratio_against == "proximal":
        return batch["old_logprobs"]
    if batch.get("behaviour_logprobs") is None:
        raise ValueError("ratio_against='behaviour' needs behaviour_logprobs (the sampling "
                         "engine's per-token log-probs of the full distribution)")
    return jnp.asarray(batch["behaviour_logprobs"], jnp.float32)


def _ppo_ratio(logprobs, old_logprobs, advantages, mask, config, stats):
    ratio = token_ratio(logprobs, old_logprobs, mask)
    return ratio, 1.0 - config.clip_low, 1.0 + config.clip_high, {}


def _gspo_ratio(logprobs, old_logprobs, advantages, mask, config, stats):
    seq_log_ratio = masked_mean(logprobs - old_logprobs, mask, axis=-1)          # [B]
    lp = _inside(logprobs, mask)
    ratio = clamped_exp(sg(seq_log_ratio))[:, None] * jnp.exp(lp - sg(lp))        # [B, T]
    return ratio, 1.0 - config.clip_low, 1.0 + config.clip_high, {}


def _bapo_statistics(logprobs, batch, config):
    """BAPO's clip bounds, adapted on the whole batch (the paper's sums are global)."""
    mask = jnp.asarray(batch["loss_mask"], jnp.float32)
    ratio = token_ratio(sg(logprobs), ratio_denominator(batch, config), mask)
    c_low, c_high, info = adapt_clip_bounds(ratio, batch["advantages"], mask, config.bapo,
                                            rollout_logprobs=batch.get("behaviour_logprobs"))
    # Per-batch numbers: across minibatches the trainer averages them unweighted.
    metrics = {
        "bapo_c_low": Metric.of(c_low),
        "bapo_c_high": Metric.of(c_high),
        "bapo_rho": Metric.of(info["rho_after"]),
        "bapo_rho_before": Metric.of(info["rho_before"]),
        "bapo_iterations": Metric.of(info["iterations"]),
        "bapo_high_moves": Metric.of(info["n_high_moves"]),
        "bapo_low_moves": Metric.of(info["n_low_moves"]),
    }
    return {"c_low": c_low, "c_high": c_high}, metrics


def _bapo_ratio(logprobs, old_logprobs, advantages, mask, config, stats):
    return token_ratio(logprobs, old_logprobs, mask), stats["c_low"], stats["c_high"], {}


def _bapo_defaults(config):
    return {"aggregation": "token_mean",
            "dual_clip": 3.0 if config.bapo.variant == "verl" else None}


def _cispo_surrogate(ratio, logprobs, advantages, lower, upper, config):
    # The weight is stopped: the gradient is -clip(r) A d(log pi), never zeroed by the clip.
    return -sg(jnp.clip(ratio, lower, upper)) * advantages * logprobs


def _cispo_check(config):
    if config.dual_clip is not None:
        raise ValueError(f"dual_clip={config.dual_clip}: kind='cispo' bounds its weight by "
                         "clip_high already and has no PPO surrogate to dual-clip; set None")


POLICY_LOSSES.register("ppo")(PolicyLossKind(_ppo_ratio))
POLICY_LOSSES.register("gspo")(PolicyLossKind(
    _gspo_ratio, defaults=lambda config: {"aggregation": "seq_mean_token_mean"}))
POLICY_LOSSES.register("bapo")(PolicyLossKind(
    _bapo_ratio, defaults=_bapo_defaults, batch_statistics=_bapo_statistics))
POLICY_LOSSES.register("cispo")(PolicyLossKind(
    _ppo_ratio, surrogate=_cispo_surrogate, check=_cispo_check))


def clipped_surrogate(ratio: Array, advantages: Array, lower, upper,
                      dual_clip: Optional[float] = None) -> Array:
    """Per-token loss max(-r A, -clip(r, lower, upper) A), dual-clipped at -c A when A < 0."""
    loss = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, lower, upper))
    if dual_clip is not None:
        loss = jnp.where(advantages < 0, jnp.minimum(loss, -dual_clip * advantages), loss)
    return loss


def policy_loss(logprobs: Array, old_logprobs: Array, advantages: Array, mask: Array,
                config: PolicyLossConfig, *, behaviour_logprobs: Optional[Array] = None,
                ref_logprobs: Optional[Array] = None, entropy: Optional[Array] = None,
                batch_stats: Any = None, normalizer: Optional[Array] = None
                ) -> tuple[Array, dict[str, Metric]]:
    """The kind's policy-gradient loss (+ kl_coef * KL - entropy_coef * entropy) and metrics.

    logprobs [B, T]: current policy (differentiated); old_logprobs [B, T]: trainer log-probs at
    rollout time; advantages [B, T] or [B]; mask [B, T]. Optional [B, T]: behaviour_logprobs
    (the sampling engine's: `behaviour_is` weights, and BAPO's pi_rollout weights),
    ref_logprobs (needed when kl_coef > 0), entropy (per-token entropies, needed when
    entropy_coef != 0). batch_stats: the kind's `batch_statistics` computed on a larger batch
    this call is a part of (micro-batches); None computes them here, from these arrays, and
    adds their metrics (given, their metrics stay with whoever computed them). normalizer:
    fixed_normalizer's divisor as an array (scalar or [B], a traced value: the step's
    generation budget under a SIRI schedule), in place of config.fixed_normalizer.

    Metrics ({name: Metric}): loss, pg_loss, clip_frac_low, clip_frac_high, approx_kl,
    ratio_mean, ratio_max, ratio_min; dual_clip_frac with a dual clip; logprob_gap_mean,
    logprob_gap_max, logprob_gap_frac, logprob_gap_signed with behaviour_logprobs (the
    proximal / behaviour gap, rl_tpu.rl.importance); is_weight_mean, is_truncated_frac with
    them and ratio_against="proximal" (per row at behaviour_is_level="sequence"); kl with
    ref_logprobs; entropy with entropy;
    bapo_c_low, bapo_c_high, bapo_rho, bapo_rho_before, bapo_iterations, bapo_high_moves,
    bapo_low_moves for kind="bapo" (unless batch_stats are given).
    """
    logprobs = jnp.asarray(logprobs, jnp.float32)
    proximal = jnp.asarray(old_logprobs, jnp.float32)
    # From here on `old_logprobs` is the ratio's denominator (proximal or behaviour).
    old_logprobs = ratio_denominator(
        {"old_logprobs": proximal, "behaviour_logprobs": behaviour_logprobs}, config)
    m = _float_mask(mask, logprobs)
    adv = _inside(_per_token(advantages, logprobs), m)
    if normalizer is None:
        normalizer = config.fixed_normalizer
    agg = lambda x: aggregate(x, m, config.aggregation, normalizer)  # noqa: E731
    n_tokens = masked_count(logprobs, m)
    per_token = lambda x: Metric.of(masked_mean(x, m), "mean", n_tokens)  # noqa: E731
    kind = POLICY_LOSSES.get(config.kind)

    metrics: dict[str, Metric] = {}
    if kind.batch_statistics is not None and batch_stats is None:
        # No larger batch around this call: the statistic is taken over what it sees.
        part = {"old_logprobs": proximal, "advantages": adv, "loss_mask": m}
        if behaviour_logprobs is not None:
            part["behaviour_logprobs"] = behaviour_logprobs
        batch_stats, metrics = kind.batch_statistics(sg(logprobs), part, config)
    ratio, lower, upper, extra = kind.ratio(logprobs, old_logprobs, adv, m, config, batch_stats)
    metrics.update(extra)
    per_token_loss = kind.surrogate(ratio, _inside(logprobs, m), adv, lower, upper, config)

    if behaviour_logprobs is not None:
        # The train/inference gap, whichever policy the ratio divides by.
        metrics.update(logprob_gap_metrics(proximal, behaviour_logprobs, m,
                                           config.logprob_gap_threshold))
    if behaviour_logprobs is not None and config.ratio_against == "proximal":
        weight, is_metrics = behaviour_weights(
            proximal, behaviour_logprobs, m, config.behaviour_is, config.behaviour_is_cap,
            config.behaviour_is_level)
        metrics.update(is_metrics)
        if weight is not None:
            per_token_loss = per_token_loss * weight
    elif config.behaviour_is != "none":
        raise ValueError(
            f"behaviour_is={config.behaviour_is!r} needs behaviour_logprobs (the sampling "
            "engine's per-token log-probs); pass them or set behaviour_is='none'")

    pg_loss = agg(per_token_loss)
    loss = pg_loss

    if ref_logprobs is not None:
        kl = _inside(kl_penalty(logprobs, ref_logprobs, config.kl_estimator), m)
        metrics["kl"] = per_token(kl)
        if config.kl_coef:
            loss = loss + config.kl_coef * agg(kl)
    elif config.kl_coef:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs; pass them or set 0")

    if entropy is not None:
        ent = _inside(jnp.asarray(entropy, jnp.float32), m)
        metrics["entropy"] = per_token(ent)
        if config.entropy_coef:
            loss = loss - config.entropy_coef * agg(ent)
    elif config.entropy_coef:
        raise ValueError(
            f"entropy_coef={config.entropy_coef} needs per-token entropy; pass it or set 0")

    r = sg(ratio)
    tok_log_ratio = jnp.clip(sg(_inside(logprobs - old_logprobs, m)),
                             -MAX_LOG_RATIO, MAX_LOG_RATIO)
    big = jnp.finfo(jnp.float32).max
    weight = loss_weight(m, config.aggregation)
    metrics.update({
        "loss": Metric.of(loss, "mean", weight),
        "pg_loss": Metric.of(pg_loss, "mean", weight),
        "clip_frac_low": per_token(((r < lower) & (adv < 0)).astype(jnp.float32)),
        "clip_frac_high": per_token(((r > upper) & (adv > 0)).astype(jnp.float32)),
        "approx_kl": per_token(jnp.expm1(tok_log_ratio) - tok_log_ratio),
        "ratio_mean": per_token(r),
        # Extremes over the masked tokens; a part with none has weight 0 and is passed over.
        "ratio_max": Metric.of(jnp.where(n_tokens > 0, jnp.max(jnp.where(m > 0, r, -big)), 0.0),
                               "max", n_tokens),
        "ratio_min": Metric.of(jnp.where(n_tokens > 0, jnp.min(jnp.where(m > 0, r, big)), 0.0),
                               "min", n_tokens),
    })
    dual_binds = None
    if config.dual_clip is not None:
        undual = jnp.maximum(-adv * r, -adv * jnp.clip(r, lower, upper))
        dual_binds = (adv < 0) & (undual > -config.dual_clip * adv)
        metrics["dual_clip_frac"] = per_token(dual_binds.astype(jnp.float32))
    if config.mechanism_metrics:
        metrics.update(clip_mechanism_metrics(r, adv, lower, upper, old_logprobs, per_token,
                                              dual_binds))
    return loss, metrics


# the behaviour (or proximal) probability buckets of `clip_mechanism_metrics`: [0, 0.1),
# [0.1, 0.5), [0.5, 1]
PROB_BUCKETS = (("plow", 0.0, 0.1), ("pmid", 0.1, 0.5), ("phigh", 0.5, 1.01))


def clip_mechanism_metrics(r, adv, lower, upper, denominator_logprobs, per_token,
                           dual_binds=None) -> dict:
    """Where a clipped surrogate's policy gradient comes from, as BAPO's analysis reads it
    (all per-token means over the masked tokens, so that ratios of them are exact after the
    micro-batch reduction):

      pg_weight_pos / pg_weight_neg: |r A| over tokens whose term still has a gradient
        (not clipped: r <= upper for A > 0, r >= lower and no dual clip for A < 0), of
        positive / negative advantage. d(-r A)/d log pi = -r A, so the negative tokens' share
        of the gradient is pg_weight_neg / (pg_weight_pos + pg_weight_neg);
      tokens_{pos,neg}_{bucket} and clipped_{pos,neg}_{bucket}: the fraction of tokens of that
        advantage sign whose probability under the ratio's denominator (the behaviour policy
        for BAPO) lies in the bucket (PROB_BUCKETS), and of those the fraction clipped; their
        ratio is the clip rate by sign and bucket (clip-higher's and BAPO's case: low-
        probability positive tokens clipped by a fixed upper bound)."""
    pos, neg = adv > 0, adv < 0
    clipped_pos = pos & (r > upper)
    clipped_neg = neg & (r < lower)
    if dual_binds is not None:
        clipped_neg = clipped_neg | dual_binds
    grad = jnp.abs(r * adv)
    out = {"pg_weight_pos": per_token(jnp.where(pos & ~clipped_pos, grad, 0.0)),
           "pg_weight_neg": per_token(jnp.where(neg & ~clipped_neg, grad, 0.0))}
    prob = jnp.exp(jnp.minimum(sg(denominator_logprobs), 0.0))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for name, low, high in PROB_BUCKETS:
        inside = (prob >= low) & (prob < high)
        for sign, where, clipped in (("pos", pos, clipped_pos), ("neg", neg, clipped_neg)):
            out[f"tokens_{sign}_{name}"] = per_token(f32(where & inside))
            out[f"clipped_{sign}_{name}"] = per_token(f32(clipped & inside))
    return out


# ----------------------------------------------------------------------------- value loss

def value_loss(values: Array, old_values: Array, returns: Array, mask: Array,
               clip: Optional[float] = 0.2, aggregation: str = "token_mean",
               normalizer: Optional[float] = None) -> tuple[Array, dict[str, Metric]]:
    """Clipped critic loss 0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2).

    values, old_values, returns, mask: [B, T]. clip=None gives the plain 0.5 (v - R)^2.
    Metrics ({name: Metric}): value_loss; value_clip_frac = fraction of masked tokens where
    the clipped term is strictly larger (its gradient is then 0); explained_variance =
    1 - Var(R - v) / Var(R) over masked tokens (0 when Var(R) = 0); value_mean; return_mean.
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
    n_tokens = masked_count(v, m)
    metrics = {
        "value_loss": Metric.of(loss, "mean", loss_weight(m, aggregation)),
        "value_clip_frac": Metric.of(clip_frac, "mean", n_tokens),
        # A ratio of variances, not a mean: weighting parts by tokens approximates the
        # whole batch's value (exact when the parts' statistics agree).
        "explained_variance": Metric.of(explained, "mean", n_tokens),
        "value_mean": Metric.of(masked_mean(sg(v), m), "mean", n_tokens),
        "return_mean": Metric.of(masked_mean(ret, m), "mean", n_tokens),
    }
    return loss, metrics
