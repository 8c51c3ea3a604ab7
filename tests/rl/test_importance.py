"""Hand-worked checks of rl_tpu.rl.importance: the train/inference log-prob gap metrics and
the behaviour IS weight per token and per sequence. Every expected number is derived in a
comment (e^0.2 = 1.2214028, e^0.3 = 1.3498588, e^-0.1 = 0.9048374, e^0.4 = 1.4918247,
e^0.5 = 1.6487213, e = 2.7182818)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.rl.importance import behaviour_weights, logprob_gap_metrics
from rl_tpu.rl.losses import PolicyLossConfig, policy_loss
from rl_tpu.rl.masked import combine_metrics

TOL = dict(rtol=1e-5, atol=1e-6)
jit_policy_loss = jax.jit(policy_loss, static_argnames="config")
jit_gap = jax.jit(logprob_gap_metrics, static_argnames="threshold")


def close(actual, expected):
    np.testing.assert_allclose(np.asarray(getattr(actual, "value", actual)), expected, **TOL)


# --------------------------------------------------------------------------- the gap


def _gap_batch():
    # d = old - behaviour = 0.05, -0.3, 0.0, 0.45 on the policy's tokens; the fifth token is
    # padding with garbage (a NaN engine log-prob must not leak into any metric)
    old = jnp.array([[-1.0, -2.0, -0.5, -3.0, 9.0]])
    behaviour = jnp.array([[-1.05, -1.7, -0.5, -3.45, jnp.nan]])
    mask = jnp.array([[1, 1, 1, 1, 0]], bool)
    return old, behaviour, mask


def test_gap_mean_max_share_and_sign():
    old, behaviour, mask = _gap_batch()
    m = jit_gap(old, behaviour, mask)
    close(m["logprob_gap_mean"], 0.2)      # (0.05 + 0.3 + 0 + 0.45) / 4 = 0.8 / 4
    close(m["logprob_gap_max"], 0.45)
    close(m["logprob_gap_frac"], 0.5)      # 0.3 and 0.45 are above 0.1: 2 of 4
    close(m["logprob_gap_signed"], 0.05)   # (0.05 - 0.3 + 0 + 0.45) / 4 = 0.2 / 4
    # a lower threshold, 0.04: 0.05 counts too, 3 of 4
    close(jit_gap(old, behaviour, mask, threshold=0.04)["logprob_gap_frac"], 0.75)
    assert all(m[k].weight == 4 for k in m)  # every one weighs the 4 tokens it averages


def test_gap_of_parts_combines_to_the_gap_of_the_whole():
    # part 1 as above; part 2 one token with d = -0.6; part 3 no token at all (a padding
    # micro-batch: its max of 0 must not count). Whole: mean (0.8 + 0.6) / 5 = 0.28,
    # max 0.6, share (2 + 1) / 5 = 0.6, signed (0.2 - 0.6) / 5 = -0.08.
    part1 = jit_gap(*_gap_batch())
    part2 = jit_gap(jnp.array([[-1.6, 0.0]]), jnp.array([[-1.0, 0.0]]),
                    jnp.array([[1, 0]], bool))
    part3 = jit_gap(jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.zeros((1, 2), bool))
    whole = combine_metrics([part1, part2, part3])
    close(whole["logprob_gap_mean"], 0.28)
    close(whole["logprob_gap_max"], 0.6)
    close(whole["logprob_gap_frac"], 0.6)
    close(whole["logprob_gap_signed"], -0.08)
    # ...and part 3 alone says nothing: weight 0, value 0 (not -inf, not NaN)
    assert float(part3["logprob_gap_max"].weight) == 0.0
    close(part3["logprob_gap_max"], 0.0)


@pytest.mark.parametrize("ratio_against", ["proximal", "behaviour"])
def test_policy_loss_logs_the_gap_whenever_it_has_both_logprobs(ratio_against):
    old, behaviour, mask = _gap_batch()
    cfg = PolicyLossConfig(ratio_against=ratio_against, logprob_gap_threshold=0.04)
    _, m = jit_policy_loss(old, old, jnp.ones((1,)), mask, cfg, behaviour_logprobs=behaviour)
    close(m["logprob_gap_mean"], 0.2)
    close(m["logprob_gap_frac"], 0.75)  # the config's threshold
    _, m = jit_policy_loss(old, old, jnp.ones((1,)), mask, PolicyLossConfig())
    assert not any(k.startswith("logprob_gap") for k in m)  # no engine log-probs: no gap


# --------------------------------------------------------------------------- IS levels


def _levels_batch():
    # old = logp = 0 (r = 1), A = 1 per row, so a token's loss is -w (its weight).
    # row 0: behaviour -0.2, -0.3, 0.1 -> log-ratios 0.2, 0.3, -0.1 (sum 0.4)
    # row 1: behaviour -0.5, -0.5 and a padded token -> 0.5, 0.5 (sum 1.0)
    # row 2: padding, no token of the policy at all
    behaviour = jnp.array([[-0.2, -0.3, 0.1], [-0.5, -0.5, 7.0], [3.0, 3.0, 3.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
    return jnp.zeros((3, 3)), behaviour, jnp.ones((3,)), mask


def test_token_level_weights_none_above_the_cap():
    old, behaviour, adv, mask = _levels_batch()
    cfg = PolicyLossConfig(behaviour_is="truncate", behaviour_is_cap=2.0)
    # per token: e^0.2, e^0.3, e^-0.1, e^0.5, e^0.5, none above 2 -> nothing truncated;
    # loss = -(1.2214028 + 1.3498588 + 0.9048374 + 2 * 1.6487213) / 5 = -6.7735416 / 5
    loss, m = jit_policy_loss(old, old, adv, mask, cfg, behaviour_logprobs=behaviour)
    close(loss, -6.7735416 / 5)
    close(m["is_weight_mean"], 6.7735416 / 5)
    close(m["is_truncated_frac"], 0.0)


def test_sequence_level_truncates_the_row_whose_product_passes_the_cap():
    old, behaviour, adv, mask = _levels_batch()
    cfg = PolicyLossConfig(behaviour_is="truncate", behaviour_is_cap=2.0,
                           behaviour_is_level="sequence")
    # row 0: w = e^0.4 = 1.4918247 <= 2, kept as is on its 3 tokens;
    # row 1: w = e^1.0 = 2.7182818 > 2, truncated to 2 on its 2 tokens; row 2 has none.
    # token_mean loss = -(3 * 1.4918247 + 2 * 2) / 5 = -8.4754741 / 5 = -1.6950948
    loss, m = jit_policy_loss(old, old, adv, mask, cfg, behaviour_logprobs=behaviour)
    close(loss, -1.6950948)
    # the metrics are over the 2 rows with tokens (the padding row is not a sequence):
    # mean w = (1.4918247 + 2.7182818) / 2 = 2.1050533; 1 of 2 rows above the cap
    close(m["is_weight_mean"], 2.1050533)
    close(m["is_truncated_frac"], 0.5)
    assert float(m["is_weight_mean"].weight) == 2.0
    # gradient d loss / d logp_t = -A r w_row / 5, the weight held constant: row 0's tokens
    # -1.4918247 / 5, row 1's -2 / 5, nothing off the mask
    g = jax.jit(jax.grad(lambda lp: policy_loss(lp, old, adv, mask, cfg,
                                                behaviour_logprobs=behaviour)[0]))(old)
    close(g * 5, [[-1.4918247] * 3, [-2.0, -2.0, 0.0], [0.0] * 3])


def test_sequence_level_mask_drops_the_whole_row():
    old, behaviour, adv, mask = _levels_batch()
    cfg = PolicyLossConfig(behaviour_is="mask", behaviour_is_cap=2.0,
                           behaviour_is_level="sequence")
    # keep rows with 1/2 <= w <= 2: row 0 (1.49) kept, row 1 (2.72) dropped; the token
    # count stays 5: loss = -(3 * 1) / 5 = -0.6
    loss, m = jit_policy_loss(old, old, adv, mask, cfg, behaviour_logprobs=behaviour)
    close(loss, -0.6)
    close(m["is_truncated_frac"], 0.5)


def test_sequence_weights_are_clamped_like_every_exp():
    # two rows of two tokens: log-ratios 12.5 + 12.5 = 25 and -12.5 - 12.5 = -25, clamped to
    # +-20 before the exp: w = e^20 = 4.8516520e8 and e^-20 = 2.0611536e-9, both finite.
    old = jnp.zeros((2, 2))
    behaviour = jnp.array([[-12.5, -12.5], [12.5, 12.5]])
    mask = jnp.ones((2, 2), bool)
    weight, m = behaviour_weights(old, behaviour, mask, "truncate", 2.0, "sequence")
    close(weight, [[2.0], [math.exp(-20)]])  # [B, 1]: truncated to the cap, and the small one
    close(m["is_weight_mean"], (math.exp(20) + math.exp(-20)) / 2)
    assert np.isfinite(float(m["is_weight_mean"].value))
    weight, _ = behaviour_weights(old, behaviour, mask, "mask", 2.0, "sequence")
    close(weight, [[0.0], [0.0]])  # both outside [1/2, 2]
    weight, m = behaviour_weights(old, behaviour, mask, "none", 2.0, "sequence")
    assert weight is None
    close(m["is_truncated_frac"], 0.5)  # measured even when nothing is corrected


def test_level_and_threshold_are_checked():
    with pytest.raises(ValueError, match="unknown behaviour_is_level 'row'"):
        PolicyLossConfig(behaviour_is_level="row")
    with pytest.raises(ValueError, match="logprob_gap_threshold=0.0 must be > 0"):
        PolicyLossConfig(logprob_gap_threshold=0.0)
