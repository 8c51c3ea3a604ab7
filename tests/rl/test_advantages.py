"""Advantage estimators against numbers worked out by hand (arithmetic in the comments)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.rl.advantages import (ADVANTAGES, compute_advantages, dr_grpo, gae, grpo,
                                  reinforce_pp, rloo, turn_level_grpo)
from rl_tpu.rl.masked import masked_mean, masked_whiten

ATOL = 1e-5


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected, np.float32), atol=atol)


# ------------------------------------------------------------------------------- masked --


def test_masked_mean_and_whiten():
    x = jnp.array([[1.0, 100.0, 3.0], [5.0, jnp.nan, 7.0]])
    m = jnp.array([[1, 0, 1], [1, 0, 1]], bool)
    # Over everything: (1 + 3 + 5 + 7) / 4 = 4; the NaN sits off the mask and must not leak.
    close(masked_mean(x, m), 4.0)
    # Per row: (1 + 3) / 2 = 2, (5 + 7) / 2 = 6.
    close(masked_mean(x, m, axis=-1), [2.0, 6.0])
    # Empty selection gives 0, not NaN.
    close(masked_mean(x, jnp.zeros_like(m)), 0.0)
    # Whiten: mean 4, var = (9 + 1 + 1 + 9) / 4 = 5 -> (x - 4) / sqrt(5), 0 off the mask.
    s5 = np.sqrt(5.0)
    close(masked_whiten(x, m), [[-3 / s5, 0, -1 / s5], [1 / s5, 0, 3 / s5]])


# ---------------------------------------------------------------------------------- GAE --

# One two-turn trajectory, T = 8:   prompt | a a | obs obs | a a | pad
MASK = np.array([0, 1, 1, 0, 0, 1, 1, 0], bool)
# Values on masked tokens (9, 7) are garbage the recursion must never read.
VALUES = np.array([9, 1, 2, 7, 7, 2, 4, 9], np.float32)


def test_gae_skips_observation_gap_by_hand():
    # Turn-1 reward 1 on its last token (t=2), final reward 2 on the last agent token (t=6).
    rewards = np.array([0, 0, 1, 0, 0, 0, 2, 0], np.float32)
    # Second row: same episode, but the turn-1 reward sits on the observation after it (t=3),
    # the final reward on the padding (t=7), and a stray 5 in the prompt (t=0, no action to
    # credit). Rewards on masked tokens go to the agent token before them, so row 2 == row 1.
    moved = np.array([5, 0, 0, 1, 0, 0, 0, 2], np.float32)
    adv, ret = gae(jnp.stack([rewards, moved]), jnp.stack([VALUES, VALUES]),
                   jnp.stack([MASK, MASK]), gamma=0.5, lam=0.5)
    # gamma = lam = 0.5, so gamma * lam = 0.25. Agent tokens in order: 1, 2, 5, 6.
    # t=6 (last): delta = 2 + 0.5*0 - 4 = -2;            A6 = -2
    # t=5:        delta = 0 + 0.5*V6 - V5 = 2 - 2 = 0;    A5 = 0 + 0.25*(-2)     = -0.5
    # t=2 (next agent token is t=5, the gap 3..4 is skipped):
    #             delta = 1 + 0.5*V5 - V2 = 1 + 1 - 2 = 0; A2 = 0 + 0.25*(-0.5)  = -0.125
    # t=1:        delta = 0 + 0.5*V2 - V1 = 1 - 1 = 0;     A1 = 0 + 0.25*(-0.125) = -0.03125
    expected = [0, -0.03125, -0.125, 0, 0, -0.5, -2, 0]
    close(adv[0], expected)
    close(adv[1], expected)
    # returns = A + V on agent tokens: 1 - 0.03125, 2 - 0.125, 2 - 0.5, 4 - 2; 0 elsewhere.
    close(ret[0], [0, 0.96875, 1.875, 0, 0, 1.5, 2, 0])
    close(ret[1], ret[0])


def test_gae_matches_plain_gae_on_compressed_agent_tokens():
    # Independent reference: drop the masked tokens, run textbook GAE on what is left.
    rng = np.random.default_rng(0)
    b, t, gamma, lam = 4, 12, 0.9, 0.8
    mask = rng.random((b, t)) < 0.6
    mask[3] = False  # a row with no agent token at all -> all zeros
    rewards = np.where(mask, rng.normal(size=(b, t)), 0).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    adv, ret = gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    for i in range(b):
        idx = np.flatnonzero(mask[i])
        r, v = rewards[i, idx], values[i, idx]
        ref, running = np.zeros(len(idx)), 0.0
        for k in reversed(range(len(idx))):
            nv = v[k + 1] if k + 1 < len(idx) else 0.0
            running = r[k] + gamma * nv - v[k] + gamma * lam * running
            ref[k] = running
        full = np.zeros(t)
        full[idx] = ref
        close(adv[i], full, atol=1e-4)
        full[idx] += v
        close(ret[i], full, atol=1e-4)


def test_gae_lam_one_gamma_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t. Rewards 1 at t=2, 2 at t=6:
    # t=1: 3 - 1 = 2; t=2: 3 - 2 = 1; t=5: 2 - 2 = 0; t=6: 2 - 4 = -2.
    rewards = np.array([[0, 0, 1, 0, 0, 0, 2, 0]], np.float32)
    adv, _ = gae(rewards, VALUES[None], MASK[None], gamma=1.0, lam=1.0)
    close(adv[0], [0, 2, 1, 0, 0, 0, -2, 0])


# ------------------------------------------------------------------------- REINFORCE++ --


def test_reinforce_pp_with_kl_by_hand():
    # gamma = 0.5, kl_coef = 0.5; r'_t = r_t - 0.5 * kl_t on agent tokens.
    # Row 0: prompt | a a | obs | a | pad.  kl 9 on masked tokens must be ignored.
    #   r' : t1 = 0 - 0.5*2 = -1, t2 = 1 - 0 = 1, t4 = 2
    #   G4 = 2;  G2 = 1 + 0.5*2 = 2 (gap at t3 skipped);  G1 = -1 + 0.5*2 = 0
    # Row 1: prompt | a a a | obs | pad, reward 1 on the observation (t4) -> credited to t3.
    #   r' : t1 = 2 - 0 = 2, t2 = 0, t3 = (0 + 1) - 0.5*2 = 0
    #   G3 = 0;  G2 = 0 + 0.5*0 = 0;  G1 = 2 + 0.5*0 = 2
    mask = np.array([[0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 0, 0]], bool)
    rewards = np.array([[0, 0, 1, 0, 2, 0], [0, 2, 0, 0, 1, 0]], np.float32)
    kl = np.array([[9, 2, 0, 9, 0, 9], [9, 0, 0, 2, 9, 9]], np.float32)
    adv, ret = reinforce_pp(rewards, mask, gamma=0.5, kl=kl, kl_coef=0.5)
    close(ret, [[0, 0, 2, 0, 2, 0], [0, 2, 0, 0, 0, 0]])
    # Global whitening over the six masked returns {0, 2, 2, 2, 0, 0}: mean 1, var 1,
    # so A = (G - 1) / 1 = +-1 (eps = 1e-8 in the variance changes nothing at 1e-5).
    close(adv, [[0, -1, 1, 0, 1, 0], [0, 1, -1, -1, 0, 0]])


def test_reinforce_pp_kl_coef_without_kl_is_an_error():
    with pytest.raises(ValueError, match="kl_coef"):
        reinforce_pp(jnp.zeros((1, 3)), jnp.ones((1, 3), bool), kl_coef=0.1)


# ---------------------------------------------------------------------- GRPO family --

# Uneven, non-contiguous groups: id 7 has four samples, id 3 two, id 11 one; -1 = dropped row.
GROUP_IDS = np.array([7, 3, 7, 11, 7, -1, 3, 7], np.int32)
REWARDS = np.array([0, 1, 2, 5, 0, 9, 5, 2], np.float32)
# Masks of length 3 with a hole in the middle for some rows (observation between turns).
GROUP_MASK = np.array([[0, 1, 1], [1, 0, 1], [0, 1, 0], [1, 1, 1],
                       [1, 0, 1], [1, 1, 1], [0, 0, 1], [1, 1, 0]], bool)


def test_grpo_uneven_groups_by_hand():
    adv, ret = grpo(REWARDS, GROUP_IDS, GROUP_MASK, ddof=0)
    # ddof=0, the population std.
    # Group 7: rows 0, 2, 4, 7 with rewards 0, 2, 0, 2 -> mean 1, population std 1
    #          -> A = -1, +1, -1, +1   (divided by 1 + 1e-6)
    # Group 3: rows 1, 6 with rewards 1, 5 -> mean 3, std 2 -> A = -1, +1
    # Group 11: row 3 alone -> r - mean = 0 -> A = 0.  Row 5 (id -1): dropped -> 0.
    per_row = np.array([-1, -1, 1, 0, -1, 0, 1, 1], np.float32)
    close(adv, per_row[:, None] * GROUP_MASK)
    close(ret, REWARDS[:, None] * GROUP_MASK)


def test_grpo_default_std_is_unbiased_by_hand():
    # ddof=1 (the default; TRL, verl, DeepSeekMath): squared deviations / (n - 1).
    # Group 7 (0, 2, 0, 2): mean 1, deviations^2 sum 4, var 4 / 3, std 1.1547005
    #   -> A = -1 / 1.1547005 = -0.8660254 (rows 0, 4), +0.8660254 (rows 2, 7).
    # Group 3 (1, 5): mean 3, deviations^2 sum 8, var 8 / 1, std 2.8284271
    #   -> A = -2 / 2.8284271 = -0.7071068 (row 1), +0.7071068 (row 6).
    # Group 11 (one sample): r - mean = 0 -> 0 (its var 0 / max(1 - 1, 1) = 0, never 0/0).
    a, b = 0.8660254, 0.7071068
    per_row = np.array([-a, -b, a, 0, -a, 0, b, a], np.float32)
    adv, _ = grpo(REWARDS, GROUP_IDS, GROUP_MASK)
    close(adv, per_row[:, None] * GROUP_MASK)
    # The option reaches the estimator by name through compute_advantages.
    batch = {"rewards": REWARDS, "group_ids": GROUP_IDS, "loss_mask": GROUP_MASK}
    close(compute_advantages("grpo", batch, ddof=1)[0], adv)
    close(compute_advantages("grpo", batch, ddof=0)[0], grpo(REWARDS, GROUP_IDS, GROUP_MASK,
                                                               ddof=0)[0])


def test_rloo_optional_std_by_hand():
    # normalize_std=True divides the leave-one-out advantage by the group's ddof=1 std:
    # group 7: +-(4/3) / 1.1547005 = +-1.1547005; group 3: +-4 / 2.8284271 = +-1.4142136.
    adv, _ = rloo(REWARDS, GROUP_IDS, GROUP_MASK, normalize_std=True)
    a, b = 1.1547005, 1.4142136
    close(adv, np.array([-a, -b, a, 0, -a, 0, b, a], np.float32)[:, None] * GROUP_MASK)
    # ddof=0: std 1 and 2 -> group 7 keeps +-4/3, group 3 gives +-4 / 2 = +-2.
    adv0, _ = rloo(REWARDS, GROUP_IDS, GROUP_MASK, normalize_std=True, ddof=0)
    close(adv0, np.array([-4 / 3, -2, 4 / 3, 0, -4 / 3, 0, 2, 4 / 3],
                         np.float32)[:, None] * GROUP_MASK)


def test_dr_grpo_by_hand():
    adv, _ = dr_grpo(REWARDS, GROUP_IDS, GROUP_MASK)
    # No std division: group 7 -> 0-1, 2-1, 0-1, 2-1; group 3 -> 1-3 = -2, 5-3 = +2.
    per_row = np.array([-1, -2, 1, 0, -1, 0, 2, 1], np.float32)
    close(adv, per_row[:, None] * GROUP_MASK)
    close(compute_advantages("grpo", {"rewards": REWARDS, "group_ids": GROUP_IDS,
                                      "loss_mask": GROUP_MASK}, normalize_std=False)[0], adv)


def test_rloo_by_hand():
    adv, _ = rloo(REWARDS, GROUP_IDS, GROUP_MASK)
    # Group 7 (0, 2, 0, 2): row 0: 0 - (2+0+2)/3 = -4/3; row 2: 2 - (0+0+2)/3 = 4/3;
    #                       row 4: -4/3;                  row 7: 4/3.
    # Group 3 (1, 5): row 1: 1 - 5 = -4; row 6: 5 - 1 = 4.
    # Group 11 (size 1): 0.  Row 5 (id -1): 0.
    per_row = np.array([-4 / 3, -4, 4 / 3, 0, -4 / 3, 0, 4, 4 / 3], np.float32)
    close(adv, per_row[:, None] * GROUP_MASK)


def test_group_ids_need_not_be_small():
    # Remapping ids: huge ids give the same answer as small ones.
    big = np.where(GROUP_IDS >= 0, GROUP_IDS * 1_000_003 + 17, -1).astype(np.int32)
    close(grpo(REWARDS, big, GROUP_MASK)[0], grpo(REWARDS, GROUP_IDS, GROUP_MASK)[0])


# ------------------------------------------------------------------------------ TL-GRPO --


def test_turn_level_grpo_by_hand():
    # B = 4 rows, M = 3 turn slots. Group 0: turn 0 of every row (same initial state).
    # Group 1: turn 1 of rows 0 and 1 (they reached the same state). Everything else unused
    # (-1), with garbage rewards 9 that must be ignored.
    turn_rewards = np.array([[0, 1, 9], [2, 5, 9], [0, 9, 9], [2, 9, 9]], np.float32)
    turn_groups = np.array([[0, 1, -1], [0, 1, -1], [0, -1, -1], [0, -1, -1]], np.int32)
    # Tokens: prompt (-1) | turn-0 action | turn-0 observation | turn-1 action ...
    turn_ids = np.array([[-1, 0, 0, 0, 1, 1, 1],
                         [-1, 0, 0, 0, 1, 1, 1],
                         [-1, -1, 0, 0, 1, 1, 2],
                         [-1, 0, 0, -1, -1, -1, -1]], np.int32)
    mask = np.array([[0, 1, 1, 0, 1, 1, 0],
                     [0, 1, 1, 0, 1, 1, 0],
                     [0, 0, 1, 0, 1, 0, 1],
                     [0, 1, 1, 0, 0, 0, 0]], bool)
    adv, ret = turn_level_grpo(turn_rewards, turn_groups, turn_ids, mask, ddof=0)
    # ddof=0 (population std).
    # Group 0 rewards (0, 2, 0, 2): mean 1, std 1 -> turn 0 advantages -1, +1, -1, +1.
    # Group 1 rewards (1, 5): mean 3, std 2 -> row 0 turn 1: -1, row 1 turn 1: +1.
    # Row 2's turn-1 and turn-2 tokens are masked in but their slots are unused -> 0.
    close(adv, [[0, -1, -1, 0, -1, -1, 0],
                [0, 1, 1, 0, 1, 1, 0],
                [0, 0, -1, 0, 0, 0, 0],
                [0, 1, 1, 0, 0, 0, 0]])
    close(ret, [[0, 0, 0, 0, 1, 1, 0],
                [0, 2, 2, 0, 5, 5, 0],
                [0, 0, 0, 0, 0, 0, 0],
                [0, 2, 2, 0, 0, 0, 0]])
    # Without std: group 1 -> 1 - 3 = -2, 5 - 3 = +2; group 0 unchanged (std was 1).
    adv_nostd, _ = turn_level_grpo(turn_rewards, turn_groups, turn_ids, mask,
                                   normalize_std=False)
    close(adv_nostd[:2], [[0, -1, -1, 0, -2, -2, 0], [0, 1, 1, 0, 2, 2, 0]])
    # Default ddof=1: group 0 std sqrt(4 / 3) = 1.1547005 -> +-0.8660254; group 1 std
    # sqrt(8 / 1) = 2.8284271 -> +-0.7071068.
    a, b = 0.8660254, 0.7071068
    adv1, _ = turn_level_grpo(turn_rewards, turn_groups, turn_ids, mask)
    close(adv1, [[0, -a, -a, 0, -b, -b, 0],
                 [0, a, a, 0, b, b, 0],
                 [0, 0, -a, 0, 0, 0, 0],
                 [0, a, a, 0, 0, 0, 0]])


def test_turn_level_grpo_carry_forward_by_hand():
    # Branching rollouts fill one slot a row, the fork turn. B = 3 rows, M = 2 slots.
    # Rows 0, 1 forked at turn 1 (group 4, rewards 3 and 1); row 2 at turn 0 (a lone group 5).
    turn_rewards = np.array([[9, 3], [9, 1], [2, 9]], np.float32)
    turn_groups = np.array([[-1, 4], [-1, 4], [5, -1]], np.int32)
    turn_ids = np.array([[-1, 0, 0, 1, 1, 2, 3],
                         [-1, 0, 0, 1, 2, 2, 2],
                         [-1, 0, 1, 1, 2, -1, -1]], np.int32)
    mask = np.array([[0, 1, 0, 1, 0, 1, 1],
                     [0, 1, 0, 1, 1, 1, 0],
                     [0, 1, 1, 0, 1, 0, 0]], bool)
    adv, ret = turn_level_grpo(turn_rewards, turn_groups, turn_ids, mask, ddof=0,
                               carry_forward=True)
    # Group 4: mean 2, population std 1 -> +1 (row 0), -1 (row 1), on turns 1, 2, 3, ...
    # (turn 2 is an unused slot and turn 3 is past M: both take turn 1's slot). Turn 0 comes
    # before the rows' first used slot: 0. Group 5 has one member: A = 0 on every turn, and
    # its return 2 on turns 0, 1, 2.
    close(adv, [[0, 0, 0, 1, 0, 1, 1],
                [0, 0, 0, -1, -1, -1, 0],
                [0, 0, 0, 0, 0, 0, 0]])
    close(ret, [[0, 0, 0, 3, 0, 3, 3],
                [0, 0, 0, 1, 1, 1, 0],
                [0, 2, 2, 0, 2, 0, 0]])
    # Without carry_forward the same slots give turn 2 and 3 tokens nothing.
    plain, _ = turn_level_grpo(turn_rewards, turn_groups, turn_ids, mask, ddof=0)
    close(plain, [[0, 0, 0, 1, 0, 0, 0], [0, 0, 0, -1, 0, 0, 0], [0] * 7])


# --------------------------------------------------------------- common properties --


def _batch():
    rng = np.random.default_rng(1)
    b, t, m = 6, 10, 3
    mask = rng.random((b, t)) < 0.5
    turn_ids = np.sort(rng.integers(-1, m, size=(b, t)), axis=1).astype(np.int32)
    return {
        "token_rewards": rng.normal(size=(b, t)).astype(np.float32),
        "rewards": rng.normal(size=(b,)).astype(np.float32),
        "values": rng.normal(size=(b, t)).astype(np.float32),
        "loss_mask": mask,
        "group_ids": np.array([0, 0, 1, 1, 1, 2], np.int32),
        "turn_rewards": rng.normal(size=(b, m)).astype(np.float32),
        "turn_group_ids": rng.integers(-1, 3, size=(b, m)).astype(np.int32),
        "turn_ids": turn_ids,
        "kl": rng.normal(size=(b, t)).astype(np.float32),
    }


OPTIONS = {"gae": {"gamma": 0.9, "lam": 0.95}, "reinforce_pp": {"gamma": 0.99, "kl_coef": 0.1}}


def test_registry_names():
    assert ADVANTAGES.names() == sorted(
        ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "tl_grpo"])


@pytest.mark.parametrize("name", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "tl_grpo"])
def test_zero_off_mask_jit_and_no_gradient(name):
    batch = _batch()
    opts = OPTIONS.get(name, {})
    adv, ret = compute_advantages(name, batch, **opts)
    off = ~batch["loss_mask"]
    assert adv.shape == ret.shape == batch["loss_mask"].shape
    assert np.all(np.asarray(adv)[off] == 0) and np.all(np.asarray(ret)[off] == 0)
    assert np.all(np.isfinite(np.asarray(adv))) and np.all(np.isfinite(np.asarray(ret)))
    # Same numbers through jit (name and options static, arrays traced).
    jitted = jax.jit(functools.partial(compute_advantages, name, **opts))
    adv_j, ret_j = jitted({k: jnp.asarray(v) for k, v in batch.items()})
    close(adv_j, adv)
    close(ret_j, ret)

    # Advantages are targets: no gradient flows into any float input.
    def total(floats):
        a, r = compute_advantages(name, {**batch, **floats}, **opts)
        return jnp.sum(a) + jnp.sum(r)

    floats = {k: jnp.asarray(v) for k, v in batch.items() if v.dtype == np.float32}
    for g in jax.tree_util.tree_leaves(jax.jit(jax.grad(total))(floats)):
        assert np.all(np.asarray(g) == 0)


def test_compute_advantages_errors_name_the_problem():
    batch = _batch()
    del batch["values"]
    with pytest.raises(ValueError, match=r"'gae' needs batch key 'values'"):
        compute_advantages("gae", batch)
    with pytest.raises(ValueError, match=r"'grpo' takes no option\(s\) \['gamma'\]"):
        compute_advantages("grpo", _batch(), gamma=0.9)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", _batch())
    with pytest.raises(ValueError, match=r"rewards must be \[B\]"):
        grpo(np.zeros((2, 3)), np.zeros((2,), np.int32), np.ones((2, 3), bool))
