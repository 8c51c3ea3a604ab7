"""BAPO bound search (rl_tpu.rl.bapo) on batches whose move sequence is worked out by hand.

With r >= 0 the paper's positive share (Eq. 8) reduces to
    rho = P / (P + N),  P = sum_{A>0} w A min(r, c_high),  N = sum_{A<0} w |A| max(r, c_low),
with w = pi_rollout(y) (1 when no rollout log-probs are given), and the verl recipe's
criterion is R = P / N with w = 1; the comments below evaluate these.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl_tpu.rl.bapo import BapoConfig, adapt_clip_bounds
from rl_tpu.rl.losses import PolicyLossConfig, policy_loss

TOL = dict(rtol=1e-5, atol=1e-6)

adapt = jax.jit(adapt_clip_bounds, static_argnums=3)


def close(actual, expected):
    actual = getattr(actual, "value", actual)  # a Metric's value, or the array itself
    np.testing.assert_allclose(np.asarray(actual), expected, **TOL)


def check(result, c_low, c_high, n_high, n_low, rho_before, rho_after):
    lo, hi, stats = result
    close(lo, c_low)
    close(hi, c_high)
    assert int(stats["n_high_moves"]) == n_high
    assert int(stats["n_low_moves"]) == n_low
    assert int(stats["iterations"]) == n_high + n_low
    close(stats["rho_before"], rho_before)
    close(stats["rho_after"], rho_after)


def test_defaults_and_step_counts():
    cfg = BapoConfig()
    assert (cfg.rho0, cfg.a_minus, cfg.b_minus, cfg.a_plus, cfg.b_plus, cfg.delta1,
            cfg.delta2) == (0.4, 0.6, 0.9, 1.2, 3.0, 0.05, 0.02)
    # (3.0 - 1.2) / 0.05 = 36 high steps (1.2 + 36 * 0.05 <= 3.0 must count despite float
    # rounding); (0.9 - 0.6) / 0.02 = 15 low steps; each iteration makes exactly one move.
    assert (cfg.max_high_moves, cfg.max_low_moves, cfg.max_iters) == (36, 15, 51)
    with pytest.raises(ValueError, match="delta1"):
        BapoConfig(delta1=0.0)


def test_balanced_batch_makes_no_move():
    # P = 1 * min(1, 1.2) = 1, N = 1 * max(1, 0.6) = 1 -> rho = 0.5 >= 0.4: 0 iterations.
    r = jnp.array([[1.0, 1.0]])
    a = jnp.array([[1.0, -1.0]])
    check(adapt(r, a, jnp.ones_like(r), BapoConfig()), 0.6, 1.2, 0, 0, 0.5, 0.5)


# Negative-dominated batch: one positive token (A=+1, r=5), eight negatives at r=1 and one
# negative at r=0.5 (so N feels c_low). Position 10 is masked out: were it counted, its
# A=+100 would balance the batch at once.
DOM_R = jnp.array([[5.0, 1, 1, 1, 1, 1, 1, 1, 1, 0.5, 5.0]])
DOM_A = jnp.array([[1.0, -1, -1, -1, -1, -1, -1, -1, -1, -1, 100.0]])
DOM_M = jnp.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]], bool)


def test_negative_dominated_batch_saturates_high_then_low():
    # Start: P = min(5, 1.2) = 1.2, N = 8 + max(0.5, 0.6) = 8.6 -> rho = 1.2 / 9.8 = 0.1224490.
    # c_high climbs 1.2 -> 3.0 in 36 steps of 0.05 (P = c_high, rho at 3.0 = 3 / 11.6 = 0.2586
    # < 0.4), then c_low climbs 0.6 -> 0.9 in 15 steps of 0.02; each low step RAISES
    # N = 8 + c_low, so rho only falls: at the end rho = 3 / (3 + 8.9) = 3 / 11.9 = 0.2521008.
    # 0.9 + 0.02 > 0.9 stops the loop after 36 + 15 = 51 iterations.
    check(adapt(DOM_R, DOM_A, DOM_M, BapoConfig()), 0.9, 3.0, 36, 15, 1.2 / 9.8, 3 / 11.9)


def test_high_moves_come_first():
    # Same batch, rho0 = 0.19: with c_low fixed at 0.6, rho = c / (c + 8.6) >= 0.19
    #   <=> 0.81 c >= 1.634 <=> c >= 2.01728. c = 2.00 gives 2 / 10.6 = 0.18868 (< 0.19),
    # c = 2.05 gives 2.05 / 10.65 = 0.19249: stop after (2.05 - 1.2) / 0.05 = 17 high moves,
    # c_low never moved.
    check(adapt(DOM_R, DOM_A, DOM_M, BapoConfig(rho0=0.19)), 0.6, 2.05, 17, 0,
          1.2 / 9.8, 2.05 / 10.65)


def test_low_moves_start_when_high_range_is_exhausted():
    # b_plus = 1.3: two high moves (1.25, 1.30; 1.35 > 1.3), then 15 low moves to 0.9.
    # rho_after = 1.3 / (1.3 + 8 + 0.9) = 1.3 / 10.2 = 0.1274510
    check(adapt(DOM_R, DOM_A, DOM_M, BapoConfig(b_plus=1.3)), 0.9, 1.3, 2, 15,
          1.2 / 9.8, 1.3 / 10.2)


def test_target_reached_after_exactly_five_high_moves():
    # Row 0: positive r=3 (A=+1), negative r=1 (A=-1), a masked junk token.
    # Row 1: negative r=1.16 (A=-1), two masked junk tokens.
    # P = min(3, c_high) = c_high; N = 1 + 1.16 = 2.16 for any c_low <= 0.9.
    # rho = c / (c + 2.16) >= 0.4 <=> 0.6 c >= 0.864 <=> c >= 1.44.
    #   c = 1.20: 1.2 / 3.36 = 0.3571429;   c = 1.40: 1.4 / 3.56 = 0.39326 (< 0.4)
    #   c = 1.45: 1.45 / 3.61 = 0.4016620  -> k = (1.45 - 1.2) / 0.05 = 5 high moves.
    r = jnp.array([[3.0, 1.0, 50.0], [1.16, 50.0, 50.0]])
    a = jnp.array([[1.0, -1.0, 9.0], [-1.0, 9.0, 9.0]])
    m = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
    check(adapt(r, a, m, BapoConfig()), 0.6, 1.45, 5, 0, 1.2 / 3.36, 1.45 / 3.61)


def test_no_signal_counts_as_balanced():
    # All advantages 0 (or nothing masked): denominator 0 -> rho = 1, no move.
    r = jnp.ones((2, 3))
    check(adapt(r, jnp.zeros_like(r), jnp.ones_like(r), BapoConfig()), 0.6, 1.2, 0, 0, 1.0, 1.0)
    check(adapt(r, -jnp.ones_like(r), jnp.zeros_like(r), BapoConfig()), 0.6, 1.2, 0, 0, 1.0, 1.0)


def test_sharded_over_eight_devices_matches_unsharded():
    devices = jax.devices()
    assert len(devices) == 8, "tests/conftest.py should force 8 CPU devices"
    mesh = Mesh(np.array(devices), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    rng = np.random.default_rng(0)
    b, t = 16, 8
    ratio = np.exp(0.6 * rng.standard_normal((b, t))).astype(np.float32)
    # Per-sequence advantages biased negative: the search stops inside the c_high range
    # (22 high moves for this seed), so the result hinges on each rho comparison.
    adv = np.broadcast_to(rng.standard_normal((b, 1)) - 0.4, (b, t)).astype(np.float32)
    mask = rng.random((b, t)) < 0.8
    cfg = BapoConfig()

    want = adapt(ratio, adv, mask, cfg)
    sharded = [jax.device_put(x, sharding) for x in (ratio, adv, mask)]
    assert len(sharded[0].sharding.device_set) == 8
    got = adapt(*sharded, cfg)

    assert 0 < int(want[2]["n_high_moves"]) < cfg.max_high_moves
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    for key in ("iterations", "n_high_moves", "n_low_moves"):
        assert int(got[2][key]) == int(want[2][key])
    close(got[2]["rho_after"], float(want[2]["rho_after"]))


@jax.jit
def _bapo_vs_ppo(logp, old, adv, mask):
    out = {}
    for kind in ("bapo", "ppo"):
        cfg = PolicyLossConfig(kind=kind)
        fn = lambda lp: policy_loss(lp, old, adv, mask, cfg)  # noqa: E731
        (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp)
        out[kind] = (loss, metrics, grad)
    return out


def test_policy_loss_bapo_uses_adapted_bounds():
    # Token 0: A=+1, r=2; tokens 1..9: A=-1, r=1. P = min(2, c_high), N = 9:
    # rho <= 2 / 11 = 0.1818 < 0.4 always -> c_high -> 3.0 (36 moves), c_low -> 0.9 (15).
    # BAPO loss: token 0 max(-2, -clip(2, 0.9, 3.0)) = -2, negatives max(1, 1) = 1 each
    #   -> (-2 + 9) / 10 = 0.7; d/dlogp_0 = -A r / 10 = -0.2 (r=2 inside [0.9, 3]).
    # PPO [0.8, 1.2]: token 0 clipped to -1.2 -> (-1.2 + 9) / 10 = 0.78, zero gradient there.
    r = jnp.array([[2.0] + [1.0] * 9])
    adv = jnp.array([[1.0] + [-1.0] * 9])
    mask = jnp.ones_like(r)
    out = _bapo_vs_ppo(jnp.log(r), jnp.zeros_like(r), adv, mask)

    loss, m, grad = out["bapo"]
    assert np.all(np.isfinite(np.asarray(grad)))
    close(loss, 0.7)
    close(m["bapo_c_low"], 0.9)
    close(m["bapo_c_high"], 3.0)
    close(m["bapo_iterations"], 51)
    close(m["bapo_rho"], 2 / 11)
    close(m["clip_frac_high"], 0.0)
    close(grad, [[-0.2] + [0.1] * 9])

    loss, m, grad = out["ppo"]
    close(loss, 0.78)
    close(m["clip_frac_high"], 0.1)
    close(grad, [[0.0] + [0.1] * 9])


# -------------------------------------------------------------- Eq. 8's pi_rollout weights

# Token 0: A=+1, r=3, pi_rollout = 0.5; tokens 1, 2: A=-1, r=1, pi_rollout = 1 (log 0);
# token 3 is masked, with a junk log-prob +5 (weight e^5) that must not count.
W_R = jnp.array([[3.0, 1.0, 1.0, 7.0]])
W_A = jnp.array([[1.0, -1.0, -1.0, 1.0]])
W_M = jnp.array([[1, 1, 1, 0]], bool)
W_LP = jnp.array([[np.log(0.5), 0.0, 0.0, 5.0]], jnp.float32)


def test_paper_share_is_weighted_by_rollout_probability():
    # Weighted: P = 0.5 min(3, c), N = 1 + 1 = 2 (r = 1 >= any c_low <= 0.9).
    #   rho = 0.5c / (0.5c + 2) >= 0.4 <=> 0.3c >= 0.8 <=> c >= 2.6667:
    #   c = 1.20: 0.6 / 2.6 = 0.2307692;  c = 2.65: 1.325 / 3.325 = 0.39850 (< 0.4);
    #   c = 2.70: 1.35 / 3.35 = 0.4029851 -> (2.70 - 1.2) / 0.05 = 30 high moves.
    check(adapt(W_R, W_A, W_M, BapoConfig(), W_LP), 0.6, 2.70, 30, 0, 0.6 / 2.6, 1.35 / 3.35)
    # Unweighted (rollout_logprobs=None, w = 1): rho = c / (c + 2) >= 0.4 <=> c >= 1.3333:
    #   c = 1.20: 1.2 / 3.2 = 0.375; c = 1.30: 0.3939; c = 1.35: 1.35 / 3.35 -> 3 moves.
    check(adapt(W_R, W_A, W_M, BapoConfig()), 0.6, 1.35, 3, 0, 1.2 / 3.2, 1.35 / 3.35)


def test_policy_loss_bapo_weights_by_behaviour_logprobs():
    # The same batch through the loss: with behaviour_logprobs the bounds are the weighted
    # ones (c_high 2.70), without them the unweighted ones (1.35).
    logp, old = jnp.log(W_R), jnp.zeros_like(W_R)
    cfg = PolicyLossConfig(kind="bapo")
    _, m = jax.jit(policy_loss, static_argnames="config")(
        logp, old, W_A, W_M, cfg, behaviour_logprobs=W_LP)
    close(m["bapo_c_high"], 2.70)
    close(m["bapo_rho"], 1.35 / 3.35)
    _, m = jax.jit(policy_loss, static_argnames="config")(logp, old, W_A, W_M, cfg)
    close(m["bapo_c_high"], 1.35)


# -------------------------------------------------------------- the authors' verl variant

# Token 0: A=+0.6, r=2; token 1: A=-1, r=0.5; token 2: A=-1, r=1.1.
V_R = jnp.array([[2.0, 0.5, 1.1]])
V_A = jnp.array([[0.6, -1.0, -1.0]])
V_M = jnp.ones_like(V_R)


def verl(**overrides):
    return BapoConfig(variant="verl", **overrides)


def test_verl_variant_raises_c_low_first_then_c_high():
    # R = 0.6 min(2, c_high) / (max(0.5, c_low) + 1.1), target 0.5.
    # Start: 0.72 / 1.7 = 0.4235294 < 0.5. c_low first: 0.6 -> 0.9 in 15 steps of 0.02; R only
    # falls (0.72 / 2.0 = 0.36). Then c_high: 0.6 c / 2.0 >= 0.5 <=> c >= 1.6667:
    #   c = 1.65: 0.99 / 2 = 0.495;  c = 1.70: 1.02 / 2 = 0.51 -> 10 high moves.
    check(adapt(V_R, V_A, V_M, verl()), 0.9, 1.70, 10, 15, 0.72 / 1.7, 0.51)
    # The paper variant on the same batch: share 0.6c / (0.6c + 1.7) >= 0.4 <=> c >= 1.8889:
    #   c = 1.85: 1.11 / 2.81 = 0.39502;  c = 1.90: 1.14 / 2.84 = 0.4014085 -> 14 high moves,
    #   c_low untouched.
    check(adapt(V_R, V_A, V_M, BapoConfig()), 0.6, 1.90, 14, 0, 0.72 / 2.42, 1.14 / 2.84)


def test_verl_variant_last_step_is_clamped_to_the_bound():
    # c_low range [0.6, 0.71] in steps of 0.03: 0.63, 0.66, 0.69, then min(0.72, 0.71) = 0.71
    # (4 moves; the paper variant only takes whole steps: 3).
    cfg = verl(b_minus=0.71, delta2=0.03)
    assert cfg.max_low_moves == 4
    assert BapoConfig(b_minus=0.71, delta2=0.03).max_low_moves == 3
    # N = 0.71 + 1.1 = 1.81; 0.6 c / 1.81 >= 0.5 <=> c >= 1.50833:
    #   c = 1.50: 0.9 / 1.81 = 0.49724;  c = 1.55: 0.93 / 1.81 = 0.5138122 -> 7 high moves.
    check(adapt(V_R, V_A, V_M, cfg), 0.71, 1.55, 7, 4, 0.72 / 1.7, 0.93 / 1.81)


def test_verl_variant_without_negatives_is_balanced():
    # No A < 0: nothing to balance, R = inf, no move; rollout log-probs are ignored.
    r = jnp.array([[0.5, 2.0]])
    lo, hi, stats = adapt(r, jnp.ones_like(r), jnp.ones_like(r), verl(), jnp.full_like(r, -3.0))
    close(lo, 0.6)
    close(hi, 1.2)
    assert int(stats["iterations"]) == 0 and np.isinf(float(stats["rho_after"]))


def test_verl_variant_defaults_to_dual_clip_three():
    assert PolicyLossConfig(kind="bapo", bapo=verl()).dual_clip == 3.0
    assert PolicyLossConfig(kind="bapo").dual_clip is None
    assert PolicyLossConfig(kind="bapo", bapo=verl(), dual_clip=5.0).dual_clip == 5.0
    # The loss with the verl bounds (0.9, 1.70): token 0 max(-1.2, -0.6 * 1.7) = -1.02;
    # token 1 max(0.5, 0.9) = 0.9 (dual clip 3 does not bind); token 2: 1.1.
    # mean = (-1.02 + 0.9 + 1.1) / 3 = 0.98 / 3
    loss, m = jax.jit(policy_loss, static_argnames="config")(
        jnp.log(V_R), jnp.zeros_like(V_R), V_A, V_M, PolicyLossConfig(kind="bapo", bapo=verl()))
    close(loss, 0.98 / 3)
    close(m["bapo_c_low"], 0.9)
    close(m["dual_clip_frac"], 0.0)


def test_bad_variant_is_named():
    with pytest.raises(ValueError, match="bapo.variant='vErl'"):
        BapoConfig(variant="vErl")
    with pytest.raises(ValueError, match="bapo.target"):
        BapoConfig(target=-1.0)
