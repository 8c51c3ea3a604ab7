"""Advantage estimators: pure jnp functions from rewards (and values) to per-token advantages.

Shape letters: B batch (trajectories), T tokens per trajectory (prompt + every turn, padded),
M turn slots per trajectory (the most turns any row may have).

Every estimator takes `loss_mask` [B, T] (bool or 0/1 float), set exactly on the policy's own
tokens, and returns `(advantages [B, T], returns [B, T])`, both zero outside the mask and both
behind `stop_gradient`: they are targets, so no gradient may flow back into values or rewards.

Multi-turn trajectories interleave the agent's tokens with observation tokens from the
environment (mask 0). The token-level recursions here (GAE, REINFORCE++) run over the agent's
tokens only: an observation gap is skipped as if it were not there, so the token after the last
agent token of turn k is the first agent token of turn k+1, and discounting counts agent tokens
only. After the last agent token of a row the episode is over (next value 0).

Reward placement for the token-level estimators: a reward may sit on any token. A reward on an
agent token belongs to that token; a reward on a masked token (an observation, the end-of-turn
marker, padding) is credited, undiscounted, to the closest agent token BEFORE it, i.e. to the
action that caused it. So "reward on the last token of the row" works whatever comes after the
last action. A reward before the first agent token (in the prompt) has no action to credit and
does not enter any advantage.

`compute_advantages(name, batch, **options)` is the uniform entry point configs use: it pulls
the arrays an estimator needs from the batch dict by name and passes the options through.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from rl_tpu.core.batch import FIELDS, shape_of
from rl_tpu.rl.masked import masked_whiten
from rl_tpu.rl.registry import Registry

Array = jax.Array

ADVANTAGES: Registry = Registry("advantage estimator")

# The batch keys an estimator may read, each with the shape it must have (for error messages):
# any rollout batch field (rl_tpu/core/batch.py), and the KL the learner derives for a
# KL-shaped reward.
BATCH_KEYS = {**{name: shape_of(name) for name in FIELDS}, "kl": "[B, T]"}


def _check_ndim(estimator: str, **arrays: Any) -> None:
    # Shapes are static under jit, so a wrong-rank input fails here, at trace time, by name.
    for key, x in arrays.items():
        want = BATCH_KEYS[key].count(",") + 1
        if jnp.ndim(x) != want:
            raise ValueError(
                f"{estimator}: {key} must be {BATCH_KEYS[key]}, got shape {jnp.shape(x)}")


def _float_mask(loss_mask: Array, like: Array) -> Array:
    dtype = like.dtype if jnp.issubdtype(like.dtype, jnp.floating) else jnp.float32
    return jnp.asarray(loss_mask).astype(dtype)


def _reverse_scan_agent_tokens(step: Callable, init: tuple, *xs: Array) -> Array:
    """Runs `step(carry, (x_t[B] ...), m_t[B])` from t = T-1 down to 0 over [B, T] inputs.

    The last of `xs` is the mask. Transposes to time-major [T, B] so one scan step handles the
    whole batch; outputs come back as [B, T].
    """
    xs_tm = tuple(jnp.swapaxes(x, 0, 1) for x in xs)
    _, out = jax.lax.scan(step, init, xs_tm, reverse=True)
    return jnp.swapaxes(out, 0, 1)


# ------------------------------------------------------------------ token-level (critic) --


@ADVANTAGES.register("gae")
def gae(token_rewards: Array, values: Array, loss_mask: Array, gamma: float = 1.0,
        lam: float = 1.0, whiten: bool = False) -> tuple[Array, Array]:
    """Generalised advantage estimation over the agent's tokens only.

    token_rewards [B, T], values [B, T] (critic's V on each token), loss_mask [B, T].
    For consecutive agent tokens t -> t' (observation tokens in between skipped):
      delta_t = r_t + gamma * V_t' - V_t,   A_t = delta_t + gamma * lam * A_t'
    with V = A = 0 after a row's last agent token. Rewards on masked tokens go to the agent
    token before them (module docstring). Returns (A, A + V), both [B, T], zero off the mask;
    `whiten` then standardises A over every masked token of the batch (verl's default), the
    returns staying A + V of the raw A.
    """
    _check_ndim("gae", token_rewards=token_rewards, values=values, loss_mask=loss_mask)
    rewards = jnp.asarray(token_rewards, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    mask = _float_mask(loss_mask, rewards)
    batch = rewards.shape[0]

    def step(carry, x):
        next_value, next_adv, pending = carry
        r, v, m = x
        on = m != 0
        # `pending` holds rewards seen on masked tokens after this one (later in time), which
        # belong to the next agent token met going backwards, i.e. the action preceding them.
        r_here = r + pending
        delta = r_here + gamma * next_value - v
        adv = delta + gamma * lam * next_adv
        # Off the mask nothing moves: the carry jumps the observation gap untouched.
        carry = (jnp.where(on, v, next_value), jnp.where(on, adv, next_adv),
                 jnp.where(on, 0.0, r_here))
        return carry, jnp.where(on, adv, 0.0)

    zeros = jnp.zeros((batch,), jnp.float32)
    adv = _reverse_scan_agent_tokens(step, (zeros, zeros, zeros), rewards, values, mask)
    returns = jnp.where(mask != 0, adv + values, 0.0)
    if whiten:
        adv = masked_whiten(adv, mask)
    return jax.lax.stop_gradient(adv), jax.lax.stop_gradient(returns)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(token_rewards: Array, loss_mask: Array, gamma: float = 1.0,
                 kl: Optional[Array] = None, kl_coef: float = 0.0) -> tuple[Array, Array]:
    """REINFORCE++: discounted per-token return over agent tokens, whitened over the batch.

    token_rewards [B, T], loss_mask [B, T], kl [B, T] (per-token KL estimate to the reference,
    e.g. log pi_old - log pi_ref; read on agent tokens only) or None.
      r'_t = r_t - kl_coef * kl_t                   on agent tokens
      G_t  = r'_t + gamma * G_t'                    t' = next agent token, G = 0 after the last
      A    = (G - mean(G)) / std(G)                 mean, std over ALL masked tokens of the batch
    Rewards on masked tokens go to the agent token before them (module docstring).
    Returns (A, G), both [B, T], zero off the mask.
    """
    _check_ndim("reinforce_pp", token_rewards=token_rewards, loss_mask=loss_mask)
    rewards = jnp.asarray(token_rewards, jnp.float32)
    mask = _float_mask(loss_mask, rewards)
    if kl is None:
        if not isinstance(kl_coef, (int, float)) or kl_coef != 0.0:
            raise ValueError("reinforce_pp: kl_coef is set but no `kl` array was given; pass "
                             "kl [B, T] (e.g. behaviour minus reference logprobs) or kl_coef=0")
        shaped = rewards
    else:
        _check_ndim("reinforce_pp", kl=kl)
        # The KL penalty is a per-token reward; observation tokens have no action to penalise.
        shaped = rewards - kl_coef * jnp.where(mask != 0, jnp.asarray(kl, jnp.float32), 0.0)

    def step(carry, x):
        next_return, pending = carry
        r, m = x
        on = m != 0
        r_here = r + pending
        ret = r_here + gamma * next_return
        carry = (jnp.where(on, ret, next_return), jnp.where(on, 0.0, r_here))
        return carry, jnp.where(on, ret, 0.0)

    zeros = jnp.zeros((rewards.shape[0],), jnp.float32)
    returns = _reverse_scan_agent_tokens(step, (zeros, zeros), shaped, mask)
    # Global whitening (not per prompt): REINFORCE++ uses the batch as its baseline.
    adv = masked_whiten(returns, mask)
    return jax.lax.stop_gradient(adv), jax.lax.stop_gradient(returns)


# ----------------------------------------------------------------- group-relative (no critic) --


@jax.jit  # one compiled kernel even when called eagerly: `unique` op by op is slow to dispatch
def _group_stats(x: Array, ids: Array, ddof=0) -> tuple[Array, Array, Array, Array]:
    """Per-element (group sum, group count, group mean, group variance) over [N].

    The variance divides the squared deviations by count - ddof (ddof=0: population, 1:
    unbiased), or by 1 when count - ddof < 1, which for a lone element gives 0, never 0/0.
    Groups are elements sharing an integer id; ids need not be contiguous, sorted, small or
    equally sized. Negative ids mark elements in no group: they are excluded from every
    statistic. Ids are remapped to 0..N-1 with a fixed-size `unique` (jittable), then reduced
    with segment sums: O(N log N), never an [N, N] comparison matrix.
    """
    n = x.shape[0]
    valid = (ids >= 0).astype(x.dtype)
    _, slot = jnp.unique(ids, return_inverse=True, size=n)
    slot = slot.reshape(n)
    seg = lambda v: jax.ops.segment_sum(v, slot, num_segments=n)[slot]  # noqa: E731
    count = seg(valid)
    total = seg(valid * x)
    mean = total / jnp.maximum(count, 1.0)
    var = seg(valid * jnp.square(x - mean)) / jnp.maximum(count - ddof, 1.0)
    return total, count, mean, var


def _broadcast_over_tokens(per_row: Array, loss_mask: Array) -> Array:
    mask = _float_mask(loss_mask, per_row)
    return jnp.where(mask != 0, per_row[:, None], 0.0)


@ADVANTAGES.register("grpo")
def grpo(rewards: Array, group_ids: Array, loss_mask: Array, normalize_std: bool = True,
         eps: float = 1e-6, ddof: int = 1) -> tuple[Array, Array]:
    """GRPO outcome advantage: the reward normalised within its group, on every policy token.

    rewards [B] (one scalar per trajectory), group_ids int [B] (samples of one task share an id;
    any ints, groups of any sizes; a negative id drops the row: advantage 0), loss_mask [B, T].
      A_i = (r_i - mean_g) / (std_g + eps)     normalize_std=True (GRPO)
      A_i = r_i - mean_g                       normalize_std=False (Dr. GRPO)
    std_g = sqrt(sum_g (r - mean_g)^2 / (n_g - ddof)). The default ddof=1 (unbiased) is what
    TRL, verl and DeepSeekMath's GRPO use (torch's std), so advantages and reward curves
    compare with theirs; ddof=0 is the population std. A lone sample gets A = 0 under either
    (r - mean = 0; verl instead gives it A = r with std 1).
    Returns (A_i on row i's masked tokens, r_i on row i's masked tokens), both [B, T].
    """
    _check_ndim("grpo", rewards=rewards, group_ids=group_ids, loss_mask=loss_mask)
    r = jnp.asarray(rewards, jnp.float32)
    ids = jnp.asarray(group_ids, jnp.int32)
    _, _, mean, var = _group_stats(r, ids, ddof)
    adv = r - mean
    if normalize_std:
        adv = adv / (jnp.sqrt(var) + eps)
    adv = jnp.where(ids >= 0, adv, 0.0)
    out = (_broadcast_over_tokens(adv, loss_mask), _broadcast_over_tokens(r, loss_mask))
    return jax.lax.stop_gradient(out)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: Array, group_ids: Array, loss_mask: Array) -> tuple[Array, Array]:
    """Dr. GRPO: `grpo` without the division by the group std (mean-centred rewards only)."""
    return grpo(rewards, group_ids, loss_mask, normalize_std=False)


@ADVANTAGES.register("rloo")
def rloo(rewards: Array, group_ids: Array, loss_mask: Array, normalize_std: bool = False,
         eps: float = 1e-6, ddof: int = 1) -> tuple[Array, Array]:
    """REINFORCE leave-one-out: each reward minus the mean of the OTHER rewards in its group.

    rewards [B], group_ids int [B] (as in `grpo`; negative = dropped row), loss_mask [B, T].
      A_i = r_i - (sum_g - r_i) / (n_g - 1)        (0 when the group has one sample)
    normalize_std=True further divides by (std_g + eps), std_g the group's reward std with
    `ddof` as in `grpo` (default 1, unbiased); off by default, as in the RLOO paper.
    Returns (A_i, r_i) broadcast over row i's masked tokens, both [B, T].
    """
    _check_ndim("rloo", rewards=rewards, group_ids=group_ids, loss_mask=loss_mask)
    r = jnp.asarray(rewards, jnp.float32)
    ids = jnp.asarray(group_ids, jnp.int32)
    total, count, _, var = _group_stats(r, ids, ddof)
    others = (total - r) / jnp.maximum(count - 1.0, 1.0)
    adv = r - others
    if normalize_std:
        adv = adv / (jnp.sqrt(var) + eps)
    adv = jnp.where((count > 1) & (ids >= 0), adv, 0.0)
    out = (_broadcast_over_tokens(adv, loss_mask), _broadcast_over_tokens(r, loss_mask))
    return jax.lax.stop_gradient(out)


@ADVANTAGES.register("tl_grpo")
def turn_level_grpo(turn_rewards: Array, turn_group_ids: Array, turn_ids: Array,
                    loss_mask: Array, normalize_std: bool = True,
                    eps: float = 1e-6, ddof: int = 1,
                    carry_forward: bool = False) -> tuple[Array, Array]:
    """TL-GRPO: turn rewards normalised among the samples that acted from the same state.

    turn_rewards [B, M] (reward of each turn), turn_group_ids int [B, M] (turns taken from the
    same state share an id, across rows and turn slots; -1 marks an unused slot), turn_ids int
    [B, T] (the turn each token belongs to, -1 for the prompt; values >= M are out of range and
    get advantage 0), loss_mask [B, T].
      A_(b,k) = (R_(b,k) - mean_g) / (std_g + eps)     (no std division if normalize_std=False)
    std_g with `ddof` as in `grpo` (default 1, unbiased).
    Every masked token of turn k in row b gets A_(b,k). Returns (A, R_(b,k)) per token, [B, T].

    carry_forward=True: a token whose turn's slot is unused (-1, or k >= M) takes the slot of
    the closest EARLIER used turn of its row instead of 0; tokens before a row's first used
    slot still get 0. A branching rollout (rl_tpu/agent/branching.py) fills one slot a row, its
    fork turn f, so every token of turns f, f+1, ... carries the branch's advantage.
    """
    _check_ndim("tl_grpo", turn_rewards=turn_rewards, turn_group_ids=turn_group_ids,
                turn_ids=turn_ids, loss_mask=loss_mask)
    r = jnp.asarray(turn_rewards, jnp.float32)
    ids = jnp.asarray(turn_group_ids, jnp.int32)
    batch, turns = r.shape
    # Flatten (row, turn) into one list of turns so a group may span rows and slots.
    _, _, mean, var = _group_stats(r.reshape(-1), ids.reshape(-1), ddof)
    adv = r.reshape(-1) - mean
    if normalize_std:
        adv = adv / (jnp.sqrt(var) + eps)
    adv = jnp.where(ids.reshape(-1) >= 0, adv, 0.0).reshape(batch, turns)

    tid = jnp.asarray(turn_ids, jnp.int32)
    if carry_forward:
        # the latest used slot at or before each slot (-1: none yet), looked up per token
        latest = jax.lax.cummax(jnp.where(ids >= 0, jnp.arange(turns), -1), axis=1)
        tid = jnp.where(tid >= 0, jnp.take_along_axis(
            latest, jnp.clip(tid, 0, turns - 1), axis=1), -1)
    on = (_float_mask(loss_mask, r) != 0) & (tid >= 0) & (tid < turns)
    idx = jnp.clip(tid, 0, turns - 1)
    tok_adv = jnp.where(on, jnp.take_along_axis(adv, idx, axis=1), 0.0)
    tok_ret = jnp.where(on & (jnp.take_along_axis(ids, idx, axis=1) >= 0),
                        jnp.take_along_axis(r, idx, axis=1), 0.0)
    return jax.lax.stop_gradient((tok_adv, tok_ret))


# ------------------------------------------------------------------------------- dispatch --


def estimator_inputs(name: str) -> tuple[str, ...]:
    """The batch arrays the estimator registered as `name` reads: its arguments named like a
    batch key (required or not)."""
    return tuple(p for p in inspect.signature(ADVANTAGES.get(name)).parameters
                 if p in BATCH_KEYS)


def compute_advantages(name: str, batch: Mapping[str, Array], **options: Any
                       ) -> tuple[Array, Array]:
    """Runs the estimator registered as `name` on the arrays it needs from `batch`.

    Arguments of the estimator named like a batch key (see BATCH_KEYS) are read from `batch`;
    all others are options taken from `options` (e.g. gamma, lam, normalize_std, ddof,
    kl_coef) or left at their defaults. A missing required array or an option the estimator
    does not take is a ValueError naming it, so a config typo fails before any compute.
    Jittable with `name` and `options` static.
    """
    fn = ADVANTAGES.get(name)
    params = inspect.signature(fn).parameters
    unknown = sorted(set(options) - {p for p in params if p not in BATCH_KEYS})
    if unknown:
        takes = sorted(p for p in params if p not in BATCH_KEYS)
        raise ValueError(f"advantage estimator {name!r} takes no option(s) {unknown}; "
                         f"its options are {takes}")
    args = {}
    for pname, p in params.items():
        if pname in BATCH_KEYS:
            if pname in batch and batch[pname] is not None:
                args[pname] = batch[pname]
            elif p.default is inspect.Parameter.empty:
                raise ValueError(
                    f"advantage estimator {name!r} needs batch key {pname!r} "
                    f"({BATCH_KEYS[pname]}); the batch has keys {sorted(batch)}")
        elif pname in options:
            args[pname] = options[pname]
    return fn(**args)
