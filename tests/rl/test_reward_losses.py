"""Reward-model losses and calibration against numbers worked out by hand (arithmetic in the
comments). sp(x) = softplus(x) = log(1 + e^x); -log sigmoid(d) = sp(-d)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.rl.reward_losses import (bradley_terry_loss, calibration, classification_loss,
                                     pairwise_accuracy)

ATOL = 1e-5
SP_M1 = 0.31326169  # sp(-1) = log(1 + e^-1)
SP_P1 = 1.31326169  # sp(+1) = log(1 + e)
SP_M2 = 0.12692801  # sp(-2) = log(1 + e^-2)
LN2 = 0.69314718    # sp(0)

# Three pairs: differences d = r_c - r_r = (2, -1, 0): right, wrong, tie.
RC = np.array([2.0, 0.0, 1.0], np.float32)
RR = np.array([0.0, 1.0, 1.0], np.float32)


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected, np.float64), atol=atol)


def test_one_pair_with_margin():
    # r_c = 2, r_r = 0, margin 1: -log sigmoid(2 - 0 - 1) = log(1 + e^-1) = 0.3132617
    loss, m = bradley_terry_loss(jnp.array([2.0]), jnp.array([0.0]), margin=1.0)
    close(loss, SP_M1)
    close(m["bt_loss"], SP_M1)
    close(m["accuracy"], 1.0)
    close(m["reward_margin"], 2.0)  # the raw difference; the margin is not subtracted here


def test_three_pairs_accuracy_counts_a_tie_half():
    loss, m = bradley_terry_loss(RC, RR)
    # bt = sp(-2), sp(1), sp(0) -> (0.1269280 + 1.3132617 + 0.6931472) / 3 = 0.7111123
    close(loss, (SP_M2 + SP_P1 + LN2) / 3)
    close(m["accuracy"], 0.5)            # (1 + 0 + 1/2) / 3: the tie earns half
    close(m["reward_margin"], 1 / 3)     # (2 - 1 + 0) / 3
    close(m["chosen_reward"], 1.0)       # (2 + 0 + 1) / 3
    close(m["rejected_reward"], 2 / 3)   # (0 + 1 + 1) / 3
    close(m["reward_mean"], 5 / 6)       # (1 + 2/3) / 2
    close(m["pairs"], 3.0)
    close(m["centring_loss"], 0.0)
    close(pairwise_accuracy(RC, RR), [1.0, 0.0, 0.5])


def test_per_pair_margin():
    # d - m = (2 - 1, -1 - 0, 0 - (-1)) = (1, -1, 1) -> (sp(-1) + sp(1) + sp(-1)) / 3 = 0.6465950
    loss, m = bradley_terry_loss(RC, RR, margin=np.array([1.0, 0.0, -1.0]))
    close(loss, (2 * SP_M1 + SP_P1) / 3)
    close(m["accuracy"], 0.5)  # the margin does not change the ranking credit


def test_centring_adds_to_the_loss_and_is_reported():
    loss, m = bradley_terry_loss(RC, RR, centring=0.1)
    # r_c + r_r = (2, 1, 2) -> squares (4, 1, 4), mean 3 -> 0.1 * 3 = 0.3
    close(m["centring_loss"], 0.3)
    close(m["bt_loss"], (SP_M2 + SP_P1 + LN2) / 3)
    close(loss, (SP_M2 + SP_P1 + LN2) / 3 + 0.3)  # = 1.0111123


def test_gradient_by_hand():
    # d/dr_c sp(-(r_c - r_r - m)) = -sigmoid(-(d - m)); r_c = 2, r_r = 0, m = 1: -sigmoid(-1)
    # = -0.2689414; the centring term c (r_c + r_r)^2 adds 2 c (r_c + r_r) = 2 * 0.1 * 2 = 0.4.
    def f(rc, rr):
        return bradley_terry_loss(rc, rr, margin=1.0, centring=0.1)[0]

    g_c, g_r = jax.grad(f, argnums=(0, 1))(jnp.array([2.0]), jnp.array([0.0]))
    close(g_c, [-0.2689414 + 0.4])
    close(g_r, [0.2689414 + 0.4])


def test_mask_drops_padding_pairs():
    # Pair 3 is padding (weight 0), whatever its rewards: bt = (sp(-2) + sp(1)) / 2 = 0.7200948
    mask = np.array([True, True, False])
    for pad in (1.0, 50.0):
        rc = RC.copy()
        rc[2] = pad
        loss, m = bradley_terry_loss(rc, RR, weights=mask, centring=0.1)
        # centring over pairs 1 and 2: 0.1 * (2^2 + 1^2) / 2 = 0.25
        close(m["bt_loss"], (SP_M2 + SP_P1) / 2)
        close(loss, (SP_M2 + SP_P1) / 2 + 0.25)
        close(m["accuracy"], 0.5)  # (1 + 0) / 2
        close(m["pairs"], 2.0)


def test_weights_are_a_weighted_mean():
    # weights (2, 1, 1): bt = (2 sp(-2) + sp(1) + sp(0)) / 4 = 0.5651663; accuracy (2 + 0 + .5)/4
    loss, m = bradley_terry_loss(RC, RR, weights=np.array([2.0, 1.0, 1.0]))
    close(loss, (2 * SP_M2 + SP_P1 + LN2) / 4)
    close(m["accuracy"], 0.625)


def test_all_padding_batch_is_zero_not_nan():
    loss, m = bradley_terry_loss(RC, RR, weights=np.zeros(3), centring=0.1)
    close(loss, 0.0)
    close(m["accuracy"], 0.0)
    close(m["pairs"], 0.0)


def test_bf16_in_f32_math_and_jit():
    rc = jnp.array([2.0, 0.0, 1.0], jnp.bfloat16)
    rr = jnp.array([0.0, 1.0, 1.0], jnp.bfloat16)
    loss, m = jax.jit(lambda a, b, w: bradley_terry_loss(a, b, weights=w, margin=0.0))(
        rc, rr, jnp.ones(3))
    assert loss.dtype == jnp.float32 and m["accuracy"].dtype == jnp.float32
    close(loss, (SP_M2 + SP_P1 + LN2) / 3)


def test_large_differences_are_stable():
    # d - m = 2 - 100 = -98: sp(98) = 98 + log(1 + e^-98) = 98 exactly in f32; d = 200: ~e^-200
    loss, _ = bradley_terry_loss(jnp.array([2.0]), jnp.array([0.0]), margin=100.0)
    close(loss, 98.0)
    loss, _ = bradley_terry_loss(jnp.array([200.0]), jnp.array([0.0]))
    assert np.isfinite(float(loss)) and float(loss) < 1e-30


@pytest.mark.parametrize("kwargs, match", [
    ({"chosen_rewards": np.zeros(3), "rejected_rewards": np.zeros(2)}, "one length"),
    ({"chosen_rewards": np.zeros((3, 1)), "rejected_rewards": np.zeros((3, 1))}, "1-D"),
    ({"margin": np.zeros(2)}, "margin must be a scalar or"),
    ({"weights": np.zeros(2)}, "weights must be"),
    ({"weights": np.array([1.0, -1.0, 1.0])}, "finite and >= 0"),
    ({"centring": -0.1}, "centring must be >= 0"),
])
def test_bradley_terry_bad_input(kwargs, match):
    args = {"chosen_rewards": RC, "rejected_rewards": RR, **kwargs}
    with pytest.raises(ValueError, match=match):
        bradley_terry_loss(args.pop("chosen_rewards"), args.pop("rejected_rewards"), **args)


# ----------------------------------------------------------------------------- K-class head


def test_classification_two_classes_by_hand():
    logits = np.array([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]], np.float32)
    labels = np.array([0, 0, 1])
    loss, m = classification_loss(logits, labels)
    # ce = logsumexp - logit[label]: log(1 + e^-2), log(1 + e), log 2 -> mean 0.7111123
    # (the same numbers as Bradley-Terry on d = (2, -1, 0): BT is 2-class CE on (r_c, r_r))
    close(loss, (SP_M2 + SP_P1 + LN2) / 3)
    # argmax (0, 1, 0: a tie goes to class 0) vs labels (0, 0, 1): only the first is right
    close(m["accuracy"], 1 / 3)
    # p(label) = sigmoid(2), 1 - sigmoid(1), 1/2 -> (0.8807971 + 0.2689414 + 0.5) / 3
    close(m["label_prob"], 0.5499128)
    close(m["examples"], 3.0)


def test_classification_three_classes_and_mask():
    # logits (0, ln 2, ln 3): softmax (1, 2, 3) / 6; label 2 -> ce = -log(1/2) = ln 2; label 0
    # -> ce = ln 6, masked out.
    logits = np.log(np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], np.float32))
    loss, m = classification_loss(logits, np.array([2, 0]), weights=np.array([1.0, 0.0]))
    close(loss, LN2)
    close(m["accuracy"], 1.0)
    close(m["label_prob"], 0.5)
    loss, _ = jax.jit(classification_loss)(logits, jnp.array([2, 0]))
    close(loss, (LN2 + np.log(6.0)) / 2)  # unmasked: (ln 2 + ln 6) / 2 = 1.2424533


def test_classification_gradient_is_softmax_minus_onehot():
    logits = jnp.log(jnp.array([[1.0, 2.0, 3.0]]))
    g = jax.grad(lambda x: classification_loss(x, jnp.array([2]))[0])(logits)
    close(g, [[1 / 6, 2 / 6, 3 / 6 - 1]])


@pytest.mark.parametrize("logits, labels, match", [
    (np.zeros((3, 1)), np.zeros(3, int), "K >= 2"),
    (np.zeros(3), np.zeros(3, int), r"\[P, K\]"),
    (np.zeros((3, 2)), np.zeros(2, int), "labels must be"),
    (np.zeros((3, 2)), np.zeros(3), "integer class indices"),
    (np.zeros((3, 2)), np.array([0, 2, -1]), r"example\(s\) \[1, 2\] have \[2, -1\]"),
])
def test_classification_bad_input(logits, labels, match):
    with pytest.raises(ValueError, match=match):
        classification_loss(logits, labels)


# ----------------------------------------------------------------------------- calibration

# Four pairs, d = r_c - r_r = (2, -1, 0.5, 3):
#   confidence sigmoid(|d|) = 0.8807971, 0.7310586, 0.6224593, 0.9525741; right = 1, 0, 1, 1.
CAL_RC = np.array([2.0, -1.0, 0.5, 3.0])
CAL_RR = np.zeros(4)


def test_ece_two_bins_by_hand():
    cal = calibration(CAL_RC, CAL_RR, num_bins=2)
    close(cal.edges, [0.5, 0.75, 1.0])
    # bin [0.5, 0.75): pairs 2, 3 -> conf (0.7310586 + 0.6224593)/2 = 0.6767590, accuracy 1/2
    # bin [0.75, 1]:   pairs 1, 4 -> conf (0.8807971 + 0.9525741)/2 = 0.9166856, accuracy 1
    close(cal.counts, [2, 2])
    close(cal.confidence, [0.6767590, 0.9166856])
    close(cal.accuracy, [0.5, 1.0])
    # ece = 2/4 * |0.5 - 0.6767590| + 2/4 * |1 - 0.9166856| = 0.0883795 + 0.0416572
    close(cal.ece, 0.1300367)
    assert len(cal.rows()) == 3 and "0.750" in cal.rows()[1]


def test_ece_empty_bin_and_weights():
    cal = calibration(CAL_RC, CAL_RR, num_bins=4)
    # edges .5 .625 .75 .875 1: pair 3 -> bin 0, pair 2 -> bin 1, pairs 1, 4 -> bin 3, bin 2 empty
    close(cal.counts, [1, 1, 0, 2])
    assert np.isnan(cal.confidence[2]) and np.isnan(cal.accuracy[2])
    # ece = 1/4 |1 - .6224593| + 1/4 |0 - .7310586| + 2/4 |1 - .9166856| = 0.3188070
    close(cal.ece, 0.3188070)
    # a zero weight is the same as leaving the pair out: pairs 1, 3, 4 in 2 bins ->
    # bin 0: pair 3 (gap 1 - .6224593), bin 1: pairs 1, 4 (gap 1 - .9166856)
    cal = calibration(CAL_RC, CAL_RR, num_bins=2, weights=[1, 0, 1, 1])
    close(cal.counts, [1, 2])
    close(cal.ece, (0.3775407 + 2 * 0.0833144) / 3)


def test_confidence_on_an_edge_goes_to_the_upper_bin():
    # d = ln 3: sigmoid = 1 / (1 + 1/3) = 0.75 exactly, the edge between the 2 bins
    cal = calibration(np.array([np.log(3.0)]), np.zeros(1), num_bins=2)
    close(cal.counts, [0, 1])
    close(cal.ece, 0.25)  # |1 - 0.75|


def test_ece_ties_are_half_right_at_half_confidence():
    # d = 0: p = 1/2, confidence 1/2, credit 1/2 -> perfectly calibrated
    cal = calibration(np.ones(2), np.ones(2), num_bins=2)
    close(cal.counts, [2, 0])
    close(cal.accuracy[0], 0.5)
    close(cal.ece, 0.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"rejected_rewards": np.zeros(3)}, "1-D arrays of one length"),
    ({"num_bins": 0}, "num_bins"),
    ({"weights": [1, 1, 1, -1]}, "weights"),
    ({"chosen_rewards": [np.nan, 0, 0, 0]}, "finite"),
])
def test_calibration_bad_input(kwargs, match):
    args = {"chosen_rewards": CAL_RC, "rejected_rewards": CAL_RR, **kwargs}
    with pytest.raises(ValueError, match=match):
        calibration(**args)
