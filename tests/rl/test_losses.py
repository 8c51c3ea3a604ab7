"""Hand-worked checks of rl_tpu.rl.losses: every expected number is derived in a comment."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.rl.masked import masked_mean
from rl_tpu.rl.losses import (AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, PolicyLossConfig,
                              aggregate, kl_penalty, policy_loss, value_loss)

TOL = dict(rtol=1e-5, atol=1e-6)


def close(actual, expected):
    actual = getattr(actual, "value", actual)  # a Metric's value, or the array itself
    np.testing.assert_allclose(np.asarray(actual), expected, **TOL)


# Jitted entry points: one compile per call site is much faster than eager op dispatch.
jit_policy_loss = jax.jit(policy_loss, static_argnames="config")
jit_value_loss = jax.jit(value_loss, static_argnames=("clip", "aggregation", "normalizer"))
jit_aggregate = jax.jit(aggregate, static_argnames=("mode", "normalizer"))


@functools.partial(jax.jit, static_argnames="config")
def policy_grad(logprobs, old_logprobs, advantages, mask, config, **kwargs):
    """d loss / d logprobs."""
    return jax.grad(lambda lp: policy_loss(lp, old_logprobs, advantages, mask, config,
                                           **kwargs)[0])(logprobs)


def test_registries_list_the_names():
    assert AGGREGATIONS.names() == [
        "fixed_normalizer", "seq_mean_token_mean", "seq_mean_token_sum", "token_mean"]
    assert POLICY_LOSSES.names() == ["bapo", "cispo", "gspo", "ppo"]
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(ValueError, match="choose one of"):
        PolicyLossConfig(kind="ppo2")


# --------------------------------------------------------------------------- aggregation

# Row 0 has an observation (tokens 2, 3) in the middle; row 1 only two policy tokens; row 2
# is a padding row with no policy token at all (its 100s must never count).
AGG_X = jnp.array([[1., 2., 3., 4., 5.],
                   [10., 20., 30., 40., 50.],
                   [100., 100., 100., 100., 100.]])
AGG_M = jnp.array([[1, 1, 0, 0, 1],
                   [0, 1, 0, 1, 0],
                   [0, 0, 0, 0, 0]], bool)


@pytest.mark.parametrize("mode, expected", [
    # (1 + 2 + 5 + 20 + 40) / 5 tokens = 68 / 5
    ("token_mean", 13.6),
    # per-seq sums 8 and 60; mean over the 2 sequences with tokens = 34
    ("seq_mean_token_sum", 34.0),
    # per-seq means 8/3 and 60/2 = 30; (8/3 + 30) / 2 = 49/3
    ("seq_mean_token_mean", 49.0 / 3.0),
])
def test_aggregate_modes(mode, expected):
    close(jit_aggregate(AGG_X, AGG_M, mode), expected)


def test_aggregate_fixed_normalizer():
    # Dr.GRPO: 68 / (B=3 rows * max length 5) = 68 / 15
    close(jit_aggregate(AGG_X, AGG_M, "fixed_normalizer", normalizer=5), 68.0 / 15.0)
    with pytest.raises(ValueError, match="normalizer"):
        jit_aggregate(AGG_X, AGG_M, "fixed_normalizer")
    with pytest.raises(ValueError, match="fixed_normalizer"):
        PolicyLossConfig(aggregation="fixed_normalizer")


def test_aggregate_empty_mask_is_zero_not_nan():
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        close(jit_aggregate(AGG_X, jnp.zeros_like(AGG_M), mode), 0.0)


# --------------------------------------------------------------------------- PPO

def _ppo_batch():
    # Six policy tokens, one per clip region, plus a padding token (NaN must not leak).
    r = jnp.array([[1.5, 1.5, 0.5, 0.5, 1.0, 1.25, 1.0]])
    adv = jnp.array([[1., -1., 1., -1., 2., 1., 7.]])
    mask = jnp.array([[1, 1, 1, 1, 1, 1, 0]], bool)
    logp = jnp.log(r)
    old = jnp.zeros_like(r).at[0, 6].set(jnp.nan)
    return logp, old, adv, mask


def test_ppo_asymmetric_clip_values_grads_metrics():
    logp, old, adv, mask = _ppo_batch()
    cfg = PolicyLossConfig(kind="ppo", clip_low=0.2, clip_high=0.28)   # ratio in [0.8, 1.28]
    # per token max(-rA, -clip(r)A):
    #   r=1.5  A=+1: max(-1.5, -1.28) = -1.28   upper bound binds   (clip_frac_high)
    #   r=1.5  A=-1: max( 1.5,  1.28) =  1.5    unclipped
    #   r=0.5  A=+1: max(-0.5, -0.8 ) = -0.5    unclipped
    #   r=0.5  A=-1: max( 0.5,  0.8 ) =  0.8    lower bound binds   (clip_frac_low)
    #   r=1.0  A=+2: -2
    #   r=1.25 A=+1: -1.25                      inside [0.8, 1.28] (clip-higher keeps it)
    # token_mean = (-1.28 + 1.5 - 0.5 + 0.8 - 2 - 1.25) / 6 = -2.73 / 6 = -0.455
    loss, m = jit_policy_loss(logp, old, adv, mask, cfg)
    close(loss, -0.455)
    close(m["pg_loss"], -0.455)
    close(m["clip_frac_high"], 1 / 6)
    close(m["clip_frac_low"], 1 / 6)
    close(m["ratio_mean"], 6.25 / 6)        # (1.5 + 1.5 + 0.5 + 0.5 + 1 + 1.25) / 6
    close(m["ratio_max"], 1.5)
    close(m["ratio_min"], 0.5)
    # Reductions across parts of a batch: token means weighted by the 6 tokens, the loss by
    # its normaliser (6 tokens for token_mean), extremes by max / min.
    assert (m["clip_frac_high"].reduce, m["ratio_max"].reduce, m["ratio_min"].reduce) == (
        "mean", "max", "min")
    close(m["clip_frac_high"].weight, 6.0)
    close(m["loss"].weight, 6.0)
    # approx_kl = mean(r - 1 - ln r): 1.5 -> 0.0945349, 0.5 -> 0.1931472, 1 -> 0,
    # 1.25 -> 0.0268564; (2*0.0945349 + 2*0.1931472 + 0.0268564) / 6 = 0.1003701
    close(m["approx_kl"], 0.1003701)
    # d loss / d logp_t = -A r / 6 where unclipped, 0 where a bound binds, 0 on padding.
    g = policy_grad(logp, old, adv, mask, cfg)
    close(g * 6, [[0.0, 1.5, -0.5, 0.0, -2.0, -1.25, 0.0]])


def test_ppo_symmetric_clip_clips_the_clip_higher_token():
    logp, old, adv, mask = _ppo_batch()
    # [0.8, 1.2]: the r=1.25, A=+1 token now gives -1.2 and counts as clipped high.
    # (-1.2 + 1.5 - 0.5 + 0.8 - 2 - 1.2) / 6 = -2.6 / 6
    loss, m = jit_policy_loss(logp, old, adv, mask, PolicyLossConfig())
    close(loss, -2.6 / 6)
    close(m["clip_frac_high"], 2 / 6)


def test_dual_clip():
    r = jnp.array([[5.0, 2.0, 5.0, 0.5]])
    adv = jnp.array([[-1.0, -1.0, 1.0, -1.0]])
    mask = jnp.ones_like(r)
    cfg = PolicyLossConfig(dual_clip=3.0)                                # clip [0.8, 1.2]
    # A<0: loss = min(max(-rA, -clip(r)A), -cA) = min(max(r, clip(r)), 3) * |A|
    #   r=5, A=-1: min(max(5, 1.2), 3) = 3         dual clip binds
    #   r=2, A=-1: min(max(2, 1.2), 3) = 2
    #   r=5, A=+1: max(-5, -1.2) = -1.2            (no dual clip for A>0)
    #   r=0.5,A=-1: min(max(0.5, 0.8), 3) = 0.8
    # mean = (3 + 2 - 1.2 + 0.8) / 4 = 4.6 / 4 = 1.15
    loss, m = jit_policy_loss(jnp.log(r), jnp.zeros_like(r), adv, mask, cfg)
    close(loss, 1.15)
    close(m["dual_clip_frac"], 0.25)
    close(m["clip_frac_low"], 0.25)                                      # the r=0.5 token
    close(m["clip_frac_high"], 0.25)                                     # the r=5, A=+1 token
    g = policy_grad(jnp.log(r), jnp.zeros_like(r), adv, mask, cfg)
    close(g * 4, [[0.0, 2.0, 0.0, 0.0]])                                 # only r=2 passes: -A r
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossConfig(dual_clip=0.5)


def test_clip_mechanism_metrics_by_hand():
    """Clip [0.8, 1.2], five tokens (r, A, behaviour p): (0.5, +1, 0.05), (1.0, +1, 0.3),
    (1.5, +1, 0.05) clipped, (0.9, -1, 0.7), (0.7, -1, 0.3) clipped. The gradient weight |r A|
    of unclipped tokens: positive (0.5 + 1.0) / 5 = 0.3, negative 0.9 / 5 = 0.18 (the negative
    share 0.18 / 0.48 = 0.375). Buckets: positive low-p tokens 2 of 5, one clipped; positive
    mid 1, none clipped; negative high 1, none; negative mid 1, clipped."""
    r = jnp.array([[0.5, 1.0, 1.5, 0.9, 0.7]])
    adv = jnp.array([[1.0, 1.0, 1.0, -1.0, -1.0]])
    old = jnp.log(jnp.array([[0.05, 0.3, 0.05, 0.7, 0.3]]))
    cfg = PolicyLossConfig(mechanism_metrics=True)
    _, m = jit_policy_loss(old + jnp.log(r), old, adv, jnp.ones_like(r), cfg)
    close(m["pg_weight_pos"], 0.3)
    close(m["pg_weight_neg"], 0.18)
    want = {"tokens_pos_plow": 0.4, "clipped_pos_plow": 0.2, "tokens_pos_pmid": 0.2,
            "clipped_pos_pmid": 0.0, "tokens_pos_phigh": 0.0, "tokens_neg_plow": 0.0,
            "tokens_neg_pmid": 0.2, "clipped_neg_pmid": 0.2, "tokens_neg_phigh": 0.2,
            "clipped_neg_phigh": 0.0}
    for name, value in want.items():
        close(m[name], value)
    assert "pg_weight_pos" not in jit_policy_loss(old, old, adv, jnp.ones_like(r),
                                                  PolicyLossConfig())[1]


def test_per_sequence_advantages_broadcast():
    logp, old, adv, mask = _ppo_batch()
    # A of shape [B] = [2] -> every token has A=2; r = (1.5, 1.5, 0.5, 0.5, 1, 1.25) in
    # [0.8, 1.2] give -2 * (1.2, 1.2, 0.5, 0.5, 1, 1.2) -> sum -11.2 / 6
    loss, _ = jit_policy_loss(logp, old, jnp.array([2.0]), mask, PolicyLossConfig())
    close(loss, -11.2 / 6)


# --------------------------------------------------------------------------- GSPO

def _gspo_batch():
    # seq 0: token log-ratios 0.1, 0.2 (third token masked, garbage) -> mean 0.15
    # seq 1: log-ratios -0.3, 0, 0.3 -> mean 0 -> s = 1
    old = jnp.array([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
    logp = old + jnp.array([[0.1, 0.2, 9.0], [-0.3, 0.0, 0.3]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
    adv = jnp.array([1.0, -0.5])
    return logp, old, adv, mask


def test_gspo_sequence_ratio_clip_and_grads():
    logp, old, adv, mask = _gspo_batch()
    cfg = PolicyLossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="token_mean")
    # s0 = exp(0.15) = 1.1618342 > 1.0004 with A=+1 -> each token -1.0004 (clipped, no grad)
    # s1 = 1 inside, A=-0.5 -> each token +0.5
    # token_mean = (2 * -1.0004 + 3 * 0.5) / 5 = -0.50080 / 5 = -0.10016
    loss, m = jit_policy_loss(logp, old, adv, mask, cfg)
    close(loss, -0.10016)
    close(m["clip_frac_high"], 2 / 5)
    close(m["clip_frac_low"], 0.0)
    close(m["ratio_max"], math.exp(0.15))
    close(m["ratio_min"], 1.0)
    close(m["ratio_mean"], (2 * math.exp(0.15) + 3) / 5)
    # grad per token of seq 1 = -A * s1 / 5 = 0.5 / 5 = 0.1; seq 0 clipped -> 0
    g = policy_grad(logp, old, adv, mask, cfg)
    close(g, [[0.0, 0.0, 0.0], [0.1, 0.1, 0.1]])
    # GSPO's own aggregation: mean over seqs of token means = (-1.0004 + 0.5) / 2 = -0.2502
    cfg2 = PolicyLossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4,
                            aggregation="seq_mean_token_mean")
    close(jit_policy_loss(logp, old, adv, mask, cfg2)[0], -0.2502)


def test_gspo_defaults_to_its_sequence_level_aggregation():
    # aggregation=None resolves per kind: GSPO's own seq_mean_token_mean, token_mean for
    # ppo and bapo; an explicit choice is kept.
    assert PolicyLossConfig(kind="gspo").aggregation == "seq_mean_token_mean"
    assert PolicyLossConfig(kind="ppo").aggregation == "token_mean"
    assert PolicyLossConfig(kind="bapo").aggregation == "token_mean"
    assert PolicyLossConfig(kind="gspo", aggregation="token_mean").aggregation == "token_mean"
    # Same batch as above, default config: (-1.0004 + 0.5) / 2 = -0.2502, not the token
    # mean -0.10016. The loss is weighted by its 2 sequences when parts are combined.
    logp, old, adv, mask = _gspo_batch()
    loss, m = jit_policy_loss(logp, old, adv, mask,
                              PolicyLossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4))
    close(loss, -0.2502)
    close(getattr(m["loss"], "weight", np.nan), 2.0)


def test_gspo_token_form_matches_sequence_level_gradient():
    # With per-sequence advantages and no clipping, GSPO-token under seq_mean_token_mean has
    # the sequence-level objective's gradient: d/dlogp_t of -mean_i A_i s_i.
    logp, old, adv, mask = _gspo_batch()
    cfg = PolicyLossConfig(kind="gspo", clip_low=0.9, clip_high=10.0,
                           aggregation="seq_mean_token_mean")

    def seq_level(lp):
        s = jnp.exp(masked_mean(lp - old, mask, axis=-1))
        return -jnp.mean(adv * s)

    g_tok = policy_grad(logp, old, adv, mask, cfg)
    g_seq = jax.jit(jax.grad(seq_level))(logp)
    close(g_tok, np.asarray(g_seq))
    close(jit_policy_loss(logp, old, adv, mask, cfg)[0], jax.jit(seq_level)(logp))


# --------------------------------------------------------------------------- log-ratio clamp

def _all_finite(tree):
    return all(np.all(np.isfinite(np.asarray(getattr(x, "value", x))))
               for x in jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "value")))


def test_huge_log_ratio_gives_finite_loss_and_gradient_ppo_and_bapo():
    # Token 0: log-ratio 95 with A = +1 (exp(95) overflows fp32 to inf); token 1: r = 1, A = -1.
    # Clamped to 20, r0 = e^20 = 4.85165e8 and the upper clip binds: gradient 0, not 0 * inf.
    logp = jnp.array([[95.0, 0.0]])
    old = jnp.zeros((1, 2))
    adv = jnp.array([[1.0, -1.0]])
    mask = jnp.ones((1, 2))
    # ppo [0.8, 1.2]: token 0 max(-e^20, -1.2) = -1.2; token 1 max(1, 1) = 1
    #   -> (-1.2 + 1) / 2 = -0.1; d/dlogp_1 = -A r / 2 = +0.5.
    # bapo: P = min(e^20, 1.2) = 1.2, N = max(1, 0.6) = 1 -> rho = 1.2 / 2.2 = 0.545 >= 0.4:
    #   bounds stay [0.6, 1.2], so the same loss and gradient.
    for kind in ("ppo", "bapo"):
        cfg = PolicyLossConfig(kind=kind)
        loss, m = jit_policy_loss(logp, old, adv, mask, cfg)
        g = policy_grad(logp, old, adv, mask, cfg)
        assert _all_finite(g) and _all_finite(m), kind
        close(loss, -0.1)
        close(g, [[0.0, 0.5]])
        close(m["ratio_max"], math.exp(20.0))
        # approx_kl: (e^20 - 1 - 20 + 0) / 2, finite
        close(m["approx_kl"], (math.expm1(20.0) - 20.0) / 2)


def test_huge_log_ratio_gives_finite_loss_and_gradient_gspo():
    # seq 0: log-ratios 95, 0 -> mean 47.5 -> s0 = e^20 after the clamp, A = +1: both tokens
    # clipped to -1.0004, no gradient. seq 1: r = 1, A = +1: -1 each.
    # seq_mean_token_mean = (-1.0004 - 1) / 2 = -1.0002; seq 1's tokens get -A s / (2 * 2).
    logp = jnp.array([[95.0, 0.0], [0.0, 0.0]])
    old = jnp.zeros((2, 2))
    adv = jnp.array([1.0, 1.0])
    mask = jnp.ones((2, 2))
    cfg = PolicyLossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4,
                           aggregation="seq_mean_token_mean")
    loss, m = jit_policy_loss(logp, old, adv, mask, cfg)
    g = policy_grad(logp, old, adv, mask, cfg)
    assert _all_finite(g) and _all_finite(m)
    close(loss, -1.0002)
    close(g, [[0.0, 0.0], [-0.25, -0.25]])


# --------------------------------------------------------------------------- behaviour IS

def _is_batch():
    # logp = old -> r = 1; A = 1 -> per-token loss -1.
    # w = exp(old - behaviour) = 1, 3, 0.25, 1.5 ; cap = 2
    old = jnp.zeros((1, 5))
    behaviour = -jnp.log(jnp.array([[1.0, 3.0, 0.25, 1.5, 1.0]]))
    mask = jnp.array([[1, 1, 1, 1, 0]], bool)
    return old, behaviour, jnp.ones((1, 5)), mask


def test_truncated_importance_weights():
    old, beh, adv, mask = _is_batch()
    cfg = PolicyLossConfig(behaviour_is="truncate", behaviour_is_cap=2.0)
    # weights sg(min(w, 2)) = 1, 2, 0.25, 1.5 -> loss -(1 + 2 + 0.25 + 1.5) / 4 = -1.1875
    loss, m = jit_policy_loss(old, old, adv, mask, cfg, behaviour_logprobs=beh)
    close(loss, -1.1875)
    close(m["is_weight_mean"], 5.75 / 4)      # (1 + 3 + 0.25 + 1.5) / 4 = 1.4375
    close(m["is_truncated_frac"], 0.25)       # only w = 3 exceeds the cap
    # gradient -A r w / 4 with the weight held constant
    g = policy_grad(old, old, adv, mask, cfg, behaviour_logprobs=beh)
    close(g * 4, [[-1.0, -2.0, -0.25, -1.5, 0.0]])


def test_masked_importance_weights():
    old, beh, adv, mask = _is_batch()
    cfg = PolicyLossConfig(behaviour_is="mask", behaviour_is_cap=2.0)
    # keep 1/2 <= w <= 2: w = 1 and 1.5 kept; 3 and 0.25 dropped (count stays 4)
    # loss = -(1 + 0 + 0 + 1) / 4 = -0.5
    loss, m = jit_policy_loss(old, old, adv, mask, cfg, behaviour_logprobs=beh)
    close(loss, -0.5)
    close(m["is_truncated_frac"], 0.5)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        jit_policy_loss(old, old, adv, mask, cfg)


# --------------------------------------------------------------------------- KL / entropy

def test_kl_estimators():
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.0]])
    # token 0: logp - ref = 0.5:  k1 = 0.5, k2 = 0.125, k3 = e^-0.5 + 0.5 - 1 = 0.1065307
    # token 1: logp - ref = -1:   k1 = -1,  k2 = 0.5,   k3 = e^1 - 1 - 1 = 0.7182818
    close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5]])
    close(kl_penalty(logp, ref, "k3"), [[0.1065307, 0.7182818]])


def test_kl_and_entropy_terms_in_loss():
    logp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -1.0]])
    ent = jnp.array([[0.3, 0.5]])
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)
    # r = 1, A = 1 -> pg = -1; kl k3 mean = (0.1065307 + 0.7182818) / 2 = 0.4124062;
    # entropy mean 0.4 -> loss = -1 + 0.1 * 0.4124062 - 0.01 * 0.4 = -0.9627594
    loss, m = jit_policy_loss(logp, logp, jnp.ones((1,)), jnp.ones((1, 2)), cfg,
                              ref_logprobs=ref, entropy=ent)
    close(loss, -0.9627594)
    close(m["kl"], 0.4124062)
    close(m["entropy"], 0.4)
    with pytest.raises(ValueError, match="ref_logprobs"):
        jit_policy_loss(logp, logp, jnp.ones((1,)), jnp.ones((1, 2)), cfg, entropy=ent)


# --------------------------------------------------------------------------- value loss

def test_value_loss_clipping_and_metrics():
    # clip 0.2. Columns: (v, old, R) -> v_clip = clip(v, old-0.2, old+0.2)
    #   (1.0, 0.5, 1.2): v_clip 0.7; (v-R)^2 0.04, (vc-R)^2 0.25 -> 0.125   clipped
    #   (0.6, 0.5, 1.0): v_clip 0.6; both 0.16                   -> 0.08    not (equal)
    #   (0.0, 0.5,-1.0): v_clip 0.3; 1 vs 1.69                   -> 0.845   clipped
    #   (2.0, 0.5, 2.5): v_clip 0.7; 0.25 vs 3.24                -> 1.62    clipped
    #   (1.0, 1.0, 0.0): inside;    1                            -> 0.5
    #   (1.0, 0.5, 0.0): v_clip 0.7; 1 vs 0.49                   -> 0.5     not
    #   masked 7th token with garbage.
    # token_mean = (0.125 + 0.08 + 0.845 + 1.62 + 0.5 + 0.5) / 6 = 3.67 / 6
    v = jnp.array([[1.0, 0.6, 0.0, 2.0, 1.0, 1.0, jnp.nan]])
    old = jnp.array([[0.5, 0.5, 0.5, 0.5, 1.0, 0.5, 0.0]])
    ret = jnp.array([[1.2, 1.0, -1.0, 2.5, 0.0, 0.0, 99.0]])
    mask = jnp.array([[1, 1, 1, 1, 1, 1, 0]], bool)
    loss, m = jit_value_loss(v, old, ret, mask, clip=0.2)
    close(loss, 3.67 / 6)
    close(m["value_clip_frac"], 0.5)
    # explained variance: residual R - v = (0.2, 0.4, -1, 0.5, -1, -1), mean -1.9/6,
    # Var = 3.45/6 - (1.9/6)^2 = 0.4747222; R mean 3.7/6, Var = 9.69/6 - (3.7/6)^2 = 1.2347222
    # EV = 1 - 0.4747222 / 1.2347222 = 0.6155230
    close(m["explained_variance"], 0.6155230)
    close(m["return_mean"], 3.7 / 6)
    g = jax.jit(jax.grad(lambda x: value_loss(x, old, ret, mask, clip=0.2)[0]))(v)
    # unclipped branches: d/dv 0.5 (v-R)^2 / 6 = (v - R) / 6: -0.4/6, 1/6, 1/6; clipped: 0
    close(g * 6, [[0.0, -0.4, 0.0, 0.0, 1.0, 1.0, 0.0]])
    # unclipped variant: 0.5 * (0.04 + 0.16 + 1 + 0.25 + 1 + 1) / 6 = 1.725 / 6
    close(jit_value_loss(v, old, ret, mask, clip=None)[0], 1.725 / 6)


# ----------------------------------------------------------------------------- k3 bound


def verl_low_var_kl(logprob, ref_logprob):
    """verl core_algos.kl_penalty(..., "low_var_kl"), written out in numpy: kl = ref - logp
    clamped to [-20, 20], k3 = exp(kl) - kl - 1 clamped to [-10, 10]."""
    kl = np.clip(ref_logprob - logprob, -20, 20)
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


def test_k3_is_bounded_like_verls_low_var_kl():
    # logp -5 against the reference's -1: d = ref - logp = 4, e^4 - 4 - 1 = 49.598 unbounded
    # (gradient d/dlogp = -(e^4 - 1) = -53.598); bounded: 10, gradient 0.
    logp, ref = jnp.array([[-5.0, -1.0]]), jnp.array([[-1.0, -1.5]])
    close(kl_penalty(logp, ref, "k3"), [[10.0, math.exp(-0.5) + 0.5 - 1]])
    grad = jax.grad(lambda lp: kl_penalty(lp, ref, "k3").sum())(logp)
    # token 1: d = -0.5, d/dlogp (e^d - d - 1) = -(e^d - 1) = 1 - e^-0.5 = 0.3934693
    close(grad, [[0.0, 1 - math.exp(-0.5)]])
    rng = np.random.default_rng(0)
    logp = -rng.exponential(2.0, (8, 32)).astype(np.float32)
    ref = -rng.exponential(2.0, (8, 32)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(kl_penalty(logp, ref, "k3")),
                               verl_low_var_kl(logp, ref), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- three policies


def test_ratio_against_behaviour_divides_by_the_engines_logprobs():
    # current -1.0, proximal -1.0, behaviour -1.5, A = 1 on one token.
    # proximal: r = 1 -> pg = -1; the IS weight proximal / behaviour = e^0.5 stays a metric
    #   (behaviour_is="none").
    # behaviour: r = e^0.5 = 1.6487 > 1.2 with A > 0 -> clipped: pg = -1.2, clip_frac_high 1.
    lp, prox, beh = jnp.array([[-1.0]]), jnp.array([[-1.0]]), jnp.array([[-1.5]])
    adv, mask = jnp.array([[1.0]]), jnp.array([[1.0]])
    _, m = jit_policy_loss(lp, prox, adv, mask, PolicyLossConfig(), behaviour_logprobs=beh)
    close(m["pg_loss"], -1.0)
    close(m["is_weight_mean"], math.exp(0.5))
    cfg = PolicyLossConfig(ratio_against="behaviour")
    _, m = jit_policy_loss(lp, prox, adv, mask, cfg, behaviour_logprobs=beh)
    close(m["pg_loss"], -1.2)
    close(m["ratio_mean"], math.exp(0.5))
    close(m["clip_frac_high"], 1.0)
    assert "is_weight_mean" not in m
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(lp, prox, adv, mask, cfg)
    with pytest.raises(ValueError, match="correct twice"):
        PolicyLossConfig(ratio_against="behaviour", behaviour_is="truncate")
    with pytest.raises(ValueError, match="ratio_against"):
        PolicyLossConfig(ratio_against="old")


def test_bapo_sees_the_staleness_only_against_behaviour():
    # Stale data: behaviour 0.5 below current everywhere. Against the proximal (= current at
    # the start of the update) every ratio is 1 and BAPO's bounds never move from a-, a+;
    # against behaviour the ratios are e^0.5 and the positive/negative balance shifts.
    rng = np.random.default_rng(1)
    lp = jnp.asarray(-rng.exponential(1.0, (4, 8)), jnp.float32)
    adv = jnp.asarray(rng.choice([-1.0, 1.0], (4, 1)) * np.ones((4, 8)), jnp.float32)
    mask = jnp.ones((4, 8))
    base = dict(kind="bapo")
    _, m = jit_policy_loss(lp, lp, adv, mask, PolicyLossConfig(**base, ratio_against="proximal"),
                           behaviour_logprobs=lp - 0.5)
    close(m["ratio_mean"], 1.0)
    _, m2 = jit_policy_loss(lp, lp, adv, mask,
                            PolicyLossConfig(**base, ratio_against="behaviour"),
                            behaviour_logprobs=lp - 0.5)
    close(m2["ratio_mean"], math.exp(0.5))
