"""BAPO adaptive clipping bounds (Xi et al. 2025, arXiv 2510.18927, Algorithm 1).

Shape letters: B batch (sequences), T tokens. Inputs are [B, T] arrays; `mask` is 1 on the
policy's own tokens.

Off-policy updates are dominated by negative-advantage tokens. Before each mini-update BAPO
widens the clip window until the positive tokens' share of the clipped surrogate reaches a
target. The ratio r = pi_theta / pi_rollout is clipped DIRECTLY to [c_low, c_high] (these are
ratio bounds, not epsilons), starting from c_low = a_minus, c_high = a_plus. The caller builds
r from log-ratios clamped to +-20 (`losses.token_ratio`), so no sum here meets an inf.

Two variants (`BapoConfig.variant`):

"paper" (default): Eq. 8 of the paper as written, every token weighted by the rollout policy's
probability of it, w_t = pi_rollout(y_t) = exp(rollout_logprobs_t) (w_t = 1 when those
log-probs are not given):

    rho(c_low, c_high) = sum_{mask, A>0} w_t |min(r A, clip(r, 0, c_high) A)|
                         / sum_{mask}    w_t |min(r A, clip(r, c_low, c_high) A)|

    c_low, c_high = a_minus, a_plus
    while rho(c_low, c_high) < rho0 and c_low + delta2 <= b_minus:
        if c_high + delta1 <= b_plus: c_high += delta1
        else:                         c_low  += delta2

  The typeset equation puts bars around the sums; read per token (as here) the signed
  negative terms cannot cancel positive ones. With r >= 0 the numerator is
  sum_{A>0} w A min(r, c_high) and the denominator is that plus sum_{A<0} w |A| max(r, c_low).
  So raising c_high can only raise rho, and raising c_low can only LOWER it (a clipped
  negative token's term grows with c_low): once c_high reaches b_plus with rho still short of
  rho0, the loop runs c_low all the way to b_minus. The paper's text says raising c_low
  filters out low-probability negative tokens (their gradient is clipped away, which is true
  of the loss), while its Eq. 8 value falls; this module implements Eq. 8 as written.

"verl": the authors' released verl recipe. No w_t; a positive/negative *ratio*

    R(c_low, c_high) = sum_{A>0} A min(r, c_high) / sum_{A<0} |A| max(r, c_low)
                       (inf when the negative sum is 0: nothing to balance)

  against `target` (0.5 in their README). c_low is raised first (by delta2, the last step
  clamped to b_minus) while R < target, then c_high (by delta1, clamped to b_plus). Since R
  too can only fall as c_low rises, the c_low phase, once entered, always ends at b_minus.
  The recipe's loss also uses a dual clip of 3.0 (`PolicyLossConfig` defaults to it for this
  variant) and clamps log-ratios to +-20.

A batch with no signal counts as balanced (rho = 1 for "paper", R = inf for "verl").

Numerics: bounds are a + k * delta from integer step counts (no float drift), the `<=` limits
turned into maximal step counts in Python with a small tolerance, so 1.2 + 36 * 0.05 <= 3.0
holds. The search is a `jax.lax.while_loop` of at most `max_iters` steps, so it is jittable.
All sums run over the whole array: under `jit` with inputs sharded over a mesh, jnp
reductions are global, so every shard sees the same bounds without an explicit collective.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from rl_tpu.rl.masked import masked_sum

Array = jax.Array

VARIANTS = ("paper", "verl")
_STEP_TOL = 1e-6  # in units of a step: (3.0 - 1.2) / 0.05 = 35.999999... still allows 36 steps


@dataclasses.dataclass(frozen=True)
class BapoConfig:
    """BAPO search settings; defaults are the paper's.

    variant: "paper" (Eq. 8, weighted by pi_rollout) | "verl" (the authors' verl recipe).
    rho0: target positive share ("paper"). target: target positive/negative ratio ("verl";
    0.5 in the authors' README). [a_minus, b_minus]: range of c_low; [a_plus, b_plus]: range
    of c_high. delta1: c_high step; delta2: c_low step.
    """

    variant: str = "paper"
    rho0: float = 0.4
    target: float = 0.5
    a_minus: float = 0.6
    b_minus: float = 0.9
    a_plus: float = 1.2
    b_plus: float = 3.0
    delta1: float = 0.05
    delta2: float = 0.02

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"bapo.variant={self.variant!r}; choose one of {VARIANTS}")
        if not 0.0 <= self.rho0 <= 1.0:
            raise ValueError(f"bapo.rho0={self.rho0} must lie in [0, 1] (paper: 0.4)")
        if self.target < 0.0:
            raise ValueError(f"bapo.target={self.target} must be >= 0 (verl recipe: 0.5)")
        if self.delta1 <= 0 or self.delta2 <= 0:
            raise ValueError(
                f"bapo.delta1={self.delta1} and bapo.delta2={self.delta2} must be > 0 "
                "(paper: 0.05 and 0.02)")
        if not 0.0 <= self.a_minus <= self.b_minus:
            raise ValueError(
                f"need 0 <= bapo.a_minus <= bapo.b_minus, got {self.a_minus}, {self.b_minus} "
                "(paper: 0.6, 0.9)")
        if not self.a_plus <= self.b_plus:
            raise ValueError(
                f"need bapo.a_plus <= bapo.b_plus, got {self.a_plus}, {self.b_plus} "
                "(paper: 1.2, 3.0)")

    def _moves(self, span: float, step: float) -> int:
        # "paper" moves only while the whole step fits (c + delta <= b); "verl" also takes a
        # last partial step clamped to b (c = min(c + delta, b) while c < b).
        k = span / step
        return int(math.floor(k + _STEP_TOL) if self.variant == "paper"
                   else math.ceil(k - _STEP_TOL))

    @property
    def max_high_moves(self) -> int:
        """How far c_high can move (36 with the defaults)."""
        return self._moves(self.b_plus - self.a_plus, self.delta1)

    @property
    def max_low_moves(self) -> int:
        """How far c_low can move (15 with the defaults)."""
        return self._moves(self.b_minus - self.a_minus, self.delta2)

    @property
    def max_iters(self) -> int:
        """Each iteration moves exactly one bound one step, so the loop ends within this many."""
        return self.max_high_moves + self.max_low_moves


def positive_share(ratio: Array, advantages: Array, mask: Array, c_low, c_high,
                   weights: Optional[Array] = None) -> Array:
    """Eq. 8's rho(c_low, c_high), tokens weighted by `weights` (None: 1); 1 when the
    denominator is 0. ratio, advantages, mask, weights: [B, T]. Scalar."""
    w = mask if weights is None else mask * weights
    pos_term = jnp.abs(jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.0, c_high) * advantages))
    all_term = jnp.abs(
        jnp.minimum(ratio * advantages, jnp.clip(ratio, c_low, c_high) * advantages))
    num = masked_sum(pos_term, w * (advantages > 0))
    den = masked_sum(all_term, w)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 1.0)


def positive_negative_ratio(ratio: Array, advantages: Array, mask: Array, c_low, c_high
                            ) -> Array:
    """The verl recipe's sum_{A>0} A min(r, c_high) / sum_{A<0} |A| max(r, c_low); inf when
    the negative sum is 0. [B, T] inputs, scalar out."""
    pos = masked_sum(advantages * jnp.minimum(ratio, c_high), mask * (advantages > 0))
    neg = masked_sum(-advantages * jnp.maximum(ratio, c_low), mask * (advantages < 0))
    return jnp.where(neg > 0, pos / jnp.where(neg > 0, neg, 1.0), jnp.inf)


def adapt_clip_bounds(ratio: Array, advantages: Array, mask: Array, config: BapoConfig,
                      rollout_logprobs: Optional[Array] = None
                      ) -> tuple[Array, Array, dict[str, Array]]:
    """Run the BAPO bound search on one mini-batch.

    ratio, advantages, mask: [B, T] (advantages may be [B], broadcast over T).
    rollout_logprobs [B, T]: log pi_rollout of each sampled token, giving Eq. 8's weights
    w_t = exp(rollout_logprobs) ("paper" variant; None = weight 1; "verl" ignores them).
    Gradients are stopped: the bounds are constants of the loss. Returns (c_low, c_high,
    stats) with float32 scalars and stats = {rho_before, rho_after, iterations, n_high_moves,
    n_low_moves}; rho is the variant's criterion (share for "paper", ratio for "verl").
    """
    ratio = jax.lax.stop_gradient(jnp.asarray(ratio, jnp.float32))
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, ratio.shape)
    mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), ratio.shape)
    n_high_max, n_low_max = config.max_high_moves, config.max_low_moves
    paper = config.variant == "paper"

    weights = None
    if paper and rollout_logprobs is not None:
        lp = jax.lax.stop_gradient(jnp.asarray(rollout_logprobs, jnp.float32))
        # A probability is <= 1: min(., 0) keeps padding garbage or a rounding-positive
        # log-prob from weighting a token by more than 1.
        weights = jnp.exp(jnp.minimum(jnp.where(mask > 0, lp, 0.0), 0.0))

    def bounds(k_low, k_high):
        c_low = jnp.minimum(config.a_minus + k_low.astype(jnp.float32) * config.delta2,
                            config.b_minus)
        c_high = jnp.minimum(config.a_plus + k_high.astype(jnp.float32) * config.delta1,
                             config.b_plus)
        return c_low, c_high

    def rho_at(k_low, k_high):
        if paper:
            return positive_share(ratio, adv, mask, *bounds(k_low, k_high), weights)
        return positive_negative_ratio(ratio, adv, mask, *bounds(k_low, k_high))

    goal = config.rho0 if paper else config.target
    zero = jnp.zeros((), jnp.int32)
    rho_before = rho_at(zero, zero)

    def cond(carry):
        k_low, k_high, rho = carry
        if paper:  # `c_low + delta2 <= b_minus`  <=>  k_low + 1 <= n_low_max
            can_move = k_low + 1 <= n_low_max
        else:      # verl: either bound still below its maximum
            can_move = (k_low < n_low_max) | (k_high < n_high_max)
        return (rho < goal) & can_move

    def body(carry):
        k_low, k_high, _ = carry
        if paper:  # c_high first while it fits (`c_high + delta1 <= b_plus`), then c_low
            move_high = k_high + 1 <= n_high_max
        else:      # verl: c_low first until it reaches b_minus, then c_high
            move_high = k_low >= n_low_max
        k_high = jnp.where(move_high, k_high + 1, k_high)
        k_low = jnp.where(move_high, k_low, k_low + 1)
        return k_low, k_high, rho_at(k_low, k_high)

    k_low, k_high, rho_after = jax.lax.while_loop(cond, body, (zero, zero, rho_before))
    c_low, c_high = bounds(k_low, k_high)
    stats = {
        "rho_before": rho_before,
        "rho_after": rho_after,
        "iterations": k_low + k_high,
        "n_high_moves": k_high,
        "n_low_moves": k_low,
    }
    return c_low, c_high, stats
