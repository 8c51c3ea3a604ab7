"""BAPO adaptive clipping bounds (Xi et al. 2025, arXiv 2510.18927, Algorithm 1).

Shape letters: B batch (sequences), T tokens. Inputs are [B, T] arrays; `mask` is 1 on the
policy's own tokens.

Off-policy updates are dominated by negative-advantage tokens. Before each mini-update BAPO
widens the clip window until the positive tokens' share of the clipped surrogate reaches
`rho0`. The ratio r = pi_theta / pi_rollout is clipped DIRECTLY to [c_low, c_high] (these are
ratio bounds, not epsilons), starting from c_low = a_minus, c_high = a_plus.

Form implemented: the one the project's PAPERS.md notes state (the paper's own Algorithm 1
text could not be retrieved here to cross-check it):

    rho(c_low, c_high) = sum_{mask, A>0} |min(r A, clip(r, 0, c_high) A)|
                         / sum_{mask}    |min(r A, clip(r, c_low, c_high) A)|

    c_low, c_high = a_minus, a_plus
    while rho(c_low, c_high) < rho0 and c_low + delta2 <= b_minus:
        if c_high + delta1 <= b_plus: c_high += delta1
        else:                         c_low  += delta2

With r >= 0 the numerator is sum_{A>0} A min(r, c_high) and the denominator is that plus
sum_{A<0} |A| max(r, c_low). Raising c_high can only raise rho; raising c_low can only lower it
(or leave it), so once c_high reaches b_plus with rho still short of rho0, the loop runs c_low
all the way to b_minus. A batch with no signal (denominator 0) counts as balanced (rho = 1).

Numerics: the bounds are a_plus + k_high * delta1 and a_minus + k_low * delta2 from integer
step counts, and the `<=` limits are turned into maximal step counts in Python with a small
tolerance, so 1.2 + 36 * 0.05 <= 3.0 holds and no float drift accumulates. The loop is a
`jax.lax.while_loop` of at most `max_iters` steps, so it is jittable. All sums run over the
whole array: under `jit` with inputs sharded over a mesh, jnp reductions are global, so every
shard sees the same bounds without any explicit collective.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from rl_tpu.rl.masked import masked_sum

Array = jax.Array

_STEP_TOL = 1e-6  # in units of a step: (3.0 - 1.2) / 0.05 = 35.999999... still allows 36 steps


@dataclasses.dataclass(frozen=True)
class BapoConfig:
    """BAPO search settings; defaults are the paper's.

    rho0: target positive share. [a_minus, b_minus]: range of c_low; [a_plus, b_plus]: range of
    c_high. delta1: c_high step; delta2: c_low step.
    """

    rho0: float = 0.4
    a_minus: float = 0.6
    b_minus: float = 0.9
    a_plus: float = 1.2
    b_plus: float = 3.0
    delta1: float = 0.05
    delta2: float = 0.02

    def __post_init__(self):
        if not 0.0 <= self.rho0 <= 1.0:
            raise ValueError(f"bapo.rho0={self.rho0} must lie in [0, 1] (paper: 0.4)")
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

    @property
    def max_high_moves(self) -> int:
        """Largest k with a_plus + k * delta1 <= b_plus (36 with the defaults)."""
        return int(math.floor((self.b_plus - self.a_plus) / self.delta1 + _STEP_TOL))

    @property
    def max_low_moves(self) -> int:
        """Largest k with a_minus + k * delta2 <= b_minus (15 with the defaults)."""
        return int(math.floor((self.b_minus - self.a_minus) / self.delta2 + _STEP_TOL))

    @property
    def max_iters(self) -> int:
        """Each iteration moves exactly one bound one step, so the loop ends within this many."""
        return self.max_high_moves + self.max_low_moves


def positive_share(ratio: Array, advantages: Array, mask: Array, c_low, c_high) -> Array:
    """rho(c_low, c_high) of the module docstring; 1 when the denominator is 0. Scalar."""
    pos_term = jnp.abs(jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.0, c_high) * advantages))
    all_term = jnp.abs(
        jnp.minimum(ratio * advantages, jnp.clip(ratio, c_low, c_high) * advantages))
    num = masked_sum(pos_term, mask * (advantages > 0))
    den = masked_sum(all_term, mask)
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 1.0)


def adapt_clip_bounds(ratio: Array, advantages: Array, mask: Array, config: BapoConfig
                      ) -> tuple[Array, Array, dict[str, Array]]:
    """Run the BAPO bound search on one mini-batch.

    ratio, advantages, mask: [B, T] (advantages may be [B], broadcast over T). Gradients are
    stopped: the bounds are constants of the loss. Returns (c_low, c_high, stats) with float32
    scalars and stats = {rho_before, rho_after, iterations, n_high_moves, n_low_moves}.
    """
    ratio = jax.lax.stop_gradient(jnp.asarray(ratio, jnp.float32))
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, ratio.shape)
    mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), ratio.shape)
    n_high_max, n_low_max = config.max_high_moves, config.max_low_moves

    def bounds(k_low, k_high):
        c_low = jnp.minimum(config.a_minus + k_low.astype(jnp.float32) * config.delta2,
                            config.b_minus)
        c_high = jnp.minimum(config.a_plus + k_high.astype(jnp.float32) * config.delta1,
                             config.b_plus)
        return c_low, c_high

    def rho_at(k_low, k_high):
        return positive_share(ratio, adv, mask, *bounds(k_low, k_high))

    zero = jnp.zeros((), jnp.int32)
    rho_before = rho_at(zero, zero)

    def cond(carry):
        k_low, k_high, rho = carry
        # `c_low + delta2 <= b_minus`  <=>  k_low + 1 <= n_low_max.
        return (rho < config.rho0) & (k_low + 1 <= n_low_max)

    def body(carry):
        k_low, k_high, _ = carry
        # `c_high + delta1 <= b_plus`  <=>  k_high + 1 <= n_high_max.
        move_high = k_high + 1 <= n_high_max
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
