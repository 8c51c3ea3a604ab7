"""The behaviour/proximal correction of the three-policy loss, and the train/inference gap.

Shape letters: B batch (sequences: one trajectory a row), T tokens; `mask` [B, T] is 1 on the
policy's own tokens. `old_logprobs` are the trainer's proximal log-probs (recomputed at the
start of the update), `behaviour_logprobs` the engine's log-probs of the ids it sampled.

- `behaviour_weights`: the importance weight proximal / behaviour that `policy_loss` puts on
  each token's loss with `behaviour_is` = "truncate" | "mask" (cap `behaviour_is_cap`), at one
  of two levels:
    "token":    w_t = exp(old_t - behaviour_t), one weight per token;
    "sequence": w_b = exp(sum over row b's masked tokens of (old_t - behaviour_t)), the
                likelihood ratio of the whole sampled sequence, the same weight on each of its
                tokens (a sequence-level correction, as GSPO's sequence ratio or MiniMax's and
                verl's sequence-level TIS). A row's log-ratio grows with its length, so the
                cap binds much sooner than per token; its variance is what the token level
                trades away for bias.
  Every log-ratio is clamped to +-MAX_LOG_RATIO before its exp, as every exp of a log-ratio in
  rl_tpu (losses.py), so a wild row gives a finite weight.
- `logprob_gap_metrics`: how far the trainer's log-probs are from the engine's on the same
  ids. On on-policy data at one weight version the two policies are the same weights, so the
  gap is pure numerics (dtype, kernels, batch shapes); on stale data it also holds the
  staleness (the proximal is newer than the behaviour).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_tpu.rl.masked import Metric, masked_count, masked_mean

Array = jax.Array
sg = jax.lax.stop_gradient

BEHAVIOUR_IS_MODES = ("none", "truncate", "mask")
BEHAVIOUR_IS_LEVELS = ("token", "sequence")
MAX_LOG_RATIO = 20.0  # clamp on every log-ratio fed to exp (e^20 ~ 4.9e8 is finite in fp32)
# |old - behaviour| above this many nats counts in train/logprob_gap_frac by default
# (algo.logprob_gap_threshold). 0.1 nats is a probability ratio of e^0.1 = 1.105: about half
# of PPO's clip range [0.8, 1.2] spent on numerics alone, so such a token's clipped gradient
# depends on which engine sampled it. Measured on SmolLM2-135M, SGLang against the trainer
# (benchmarks/sglang_logprob_gap.py, two runs): float32 mean |gap| 9e-6, max 8e-5, so no
# token should cross it, and one that does is a broken sync, chat template or temperature;
# bfloat16 on both sides mean 0.04, max 0.37, 9-10% of tokens above it, what a bf16 run
# should expect.
LOGPROB_GAP_THRESHOLD = 0.1


def clamped_exp(log_ratio: Array) -> Array:
    """exp(clip(log_ratio, -20, 20)): a ratio that is finite, and whose gradient is finite."""
    return jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def _inside(x: Array, m: Array) -> Array:
    """x where the mask is set, 0 elsewhere (padding garbage never reaches an exp)."""
    return jnp.where(m > 0, x, 0.0)


def behaviour_weights(old_logprobs: Array, behaviour_logprobs: Array, mask: Array, mode: str,
                      cap: float, level: str = "token"):
    """(multiplier [B, T] or [B, 1], or None for mode "none"; {name: Metric}).

    mode "truncate": sg(min(w, cap)); "mask": 1 where 1/cap <= w <= cap, else 0; "none": no
    multiplier (the weight is still measured). Metrics: is_weight_mean (mean w) and
    is_truncated_frac (the share above the cap; "mask": outside [1/cap, cap]): over masked
    tokens at level "token", over rows with a masked token at level "sequence".
    """
    m = jnp.asarray(mask, jnp.float32)
    log_ratio = _inside(jnp.asarray(old_logprobs, jnp.float32)
                        - jnp.asarray(behaviour_logprobs, jnp.float32), m)
    if level == "token":
        w, where = clamped_exp(log_ratio), m
    elif level == "sequence":
        w = clamped_exp(jnp.sum(log_ratio, axis=-1, keepdims=True))                 # [B, 1]
        where = (jnp.sum(m, axis=-1, keepdims=True) > 0).astype(jnp.float32)  # rows that count
    else:
        raise ValueError(f"unknown behaviour_is_level {level!r}; choose one of "
                         f"{BEHAVIOUR_IS_LEVELS}")
    count = masked_count(w, where)
    mean = lambda x: Metric.of(masked_mean(x, where), "mean", count)  # noqa: E731
    metrics = {"is_weight_mean": mean(w)}
    if mode == "mask":
        keep = (w <= cap) & (w >= 1.0 / cap)
        metrics["is_truncated_frac"] = mean((~keep).astype(jnp.float32))
        return keep.astype(jnp.float32), metrics
    metrics["is_truncated_frac"] = mean((w > cap).astype(jnp.float32))
    if mode == "truncate":
        return sg(jnp.minimum(w, cap)), metrics
    if mode == "none":
        return None, metrics
    raise ValueError(f"unknown behaviour_is {mode!r}; choose one of {BEHAVIOUR_IS_MODES}")


def logprob_gap_metrics(old_logprobs: Array, behaviour_logprobs: Array, mask: Array,
                        threshold: float = LOGPROB_GAP_THRESHOLD) -> dict[str, Metric]:
    """The trainer/engine log-prob gap d_t = old_t - behaviour_t over the masked tokens:

      logprob_gap_mean   mean |d_t|              (a token mean: parts combine by tokens)
      logprob_gap_max    max |d_t|               (the extreme; a part with no tokens is passed
                                                  over)
      logprob_gap_frac   share with |d_t| > threshold
      logprob_gap_signed mean d_t: > 0 when the trainer puts more mass on the sampled ids than
                         the engine (its mean is the k1 estimate of KL(behaviour || proximal))
    """
    m = jnp.asarray(mask, jnp.float32)
    gap = _inside(sg(jnp.asarray(old_logprobs, jnp.float32))
                  - jnp.asarray(behaviour_logprobs, jnp.float32), m)
    n = masked_count(gap, m)
    mean = lambda x: Metric.of(masked_mean(x, m), "mean", n)  # noqa: E731
    absolute = jnp.abs(gap)
    return {
        "logprob_gap_mean": mean(absolute),
        "logprob_gap_max": Metric.of(jnp.max(jnp.where(m > 0, absolute, 0.0)), "max", n),
        "logprob_gap_frac": mean((absolute > threshold).astype(jnp.float32)),
        "logprob_gap_signed": mean(gap),
    }

