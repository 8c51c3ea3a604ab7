"""Preference losses against numbers worked out by hand (arithmetic in the comments)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.rl.preference import PREFERENCE_LOSSES, dpo_loss, inpo_loss, ipo_loss

ATOL = 1e-5
SP1 = float(np.log1p(np.exp(-1.0)))  # softplus(-1) = -log sigmoid(1) = 0.3132617
SP2 = float(np.log1p(np.exp(1.0)))   # softplus(+1) = -log sigmoid(-1) = 1.3132617

# Three pairs (sequence log-probs: sums over response tokens).
CHOSEN = np.array([-1.0, -4.0, -2.0], np.float32)
REJECTED = np.array([-3.0, -2.0, -5.0], np.float32)
REF_CHOSEN = np.array([-2.0, -3.0, -2.0], np.float32)
REF_REJECTED = np.array([-2.0, -3.0, -3.0], np.float32)
# Log-ratios to the reference: chosen (1, -1, 0), rejected (-1, 1, -2); margins h = (2, -2, 2).


def close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected, np.float32), atol=atol)


def test_registry_names():
    assert PREFERENCE_LOSSES.names() == ["dpo", "inpo", "ipo"]
    assert PREFERENCE_LOSSES.get("dpo") is dpo_loss


def test_dpo_by_hand():
    loss, m = dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5)
    # beta * h = (1, -1, 1) -> losses softplus(-1), softplus(1), softplus(-1).
    close(loss, (2 * SP1 + SP2) / 3)  # = 0.6465950
    # Implicit rewards 0.5 * log-ratio: chosen (0.5, -0.5, 0), rejected (-0.5, 0.5, -1).
    close(m["chosen_reward"], 0.0)
    close(m["rejected_reward"], -1 / 3)
    close(m["reward_margin"], 1 / 3)          # (1 - 1 + 1) / 3
    close(m["reward_accuracy"], 2 / 3)        # pairs 1 and 3 ranked right


def test_dpo_label_smoothing_by_hand():
    # Pair 1 alone, z = beta * h = 1, eps = 0.25:
    #   (1 - eps) softplus(-z) + eps softplus(z) = softplus(-z) + eps * z  (softplus(z) -
    #   softplus(-z) = z)  = 0.3132617 + 0.25 = 0.5632617
    loss, _ = dpo_loss(CHOSEN[:1], REJECTED[:1], REF_CHOSEN[:1], REF_REJECTED[:1], beta=0.5,
                       label_smoothing=0.25)
    close(loss, SP1 + 0.25)


def test_dpo_gradient_by_hand():
    # d/d chosen_logps of mean softplus(-beta h) = -beta * sigmoid(-beta h) / B.
    # Pair 1: -0.5 * sigmoid(-1) / 3 = -0.5 * 0.2689414 / 3 = -0.0448236.
    grad = jax.grad(lambda c: dpo_loss(c, REJECTED, REF_CHOSEN, REF_REJECTED, 0.5)[0])(
        jnp.asarray(CHOSEN))
    close(grad[0], -0.5 * (1 / (1 + np.e)) / 3)


def test_ipo_by_hand():
    # beta = 0.25 -> target 1 / (2 * 0.25) = 2. h = (2, -2, 2) -> (0, 16, 0) -> mean 16/3.
    loss, m = ipo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.25)
    close(loss, 16 / 3)
    # Rewards 0.25 * log-ratio: chosen (0.25, -0.25, 0), rejected (-0.25, 0.25, -0.5).
    close(m["chosen_reward"], 0.0)
    close(m["rejected_reward"], -1 / 6)
    close(m["reward_accuracy"], 2 / 3)


def test_inpo_by_hand():
    # eta = 4, tau = 0.125 -> eta*tau = 0.5 on the reference, 0.5 on the previous policy;
    # target eta / 2 = 2.
    chosen, rejected = np.array([-1.0, -3.0]), np.array([-4.0, -2.0])
    prev_c, prev_r = np.array([-2.0, -3.0]), np.array([-3.0, -3.0])
    ref_c, ref_r = np.array([-1.0, -2.0]), np.array([-5.0, -2.0])
    loss, m = inpo_loss(chosen, rejected, prev_c, prev_r, ref_c, ref_r, eta=4.0, tau=0.125)
    # Pair 1: d_pi = -1 - -4 = 3, d_ref = -1 - -5 = 4, d_prev = -2 - -3 = 1
    #         h = 3 - 0.5*4 - 0.5*1 = 0.5 -> (0.5 - 2)^2 = 2.25
    # Pair 2: d_pi = -3 - -2 = -1, d_ref = 0, d_prev = 0 -> h = -1 -> (-1 - 2)^2 = 9
    close(loss, (2.25 + 9) / 2)  # = 5.625
    # Implicit rewards (logp - 0.5*ref - 0.5*prev) / 4:
    #   pair 1 chosen (-1 + 0.5 + 1) / 4 = 0.125, rejected (-4 + 2.5 + 1.5) / 4 = 0
    #   pair 2 chosen (-3 + 1 + 1.5) / 4 = -0.125, rejected (-2 + 1 + 1.5) / 4 = 0.125
    close(m["chosen_reward"], 0.0)
    close(m["rejected_reward"], 0.0625)
    close(m["reward_margin"], (0.125 - 0.25) / 2)  # margins are h / eta: 0.5/4, -1/4
    close(m["reward_accuracy"], 0.5)


def test_inpo_limits_are_ipo():
    rng = np.random.default_rng(0)
    c, r, pc, pr, rc, rr = (rng.normal(size=5).astype(np.float32) - 3 for _ in range(6))
    eta = 8.0
    # tau = 0: pure self-play step, IPO against the previous policy with beta = 1/eta.
    close(inpo_loss(c, r, pc, pr, rc, rr, eta=eta, tau=0.0)[0], ipo_loss(c, r, pc, pr, 1 / eta)[0])
    # eta * tau = 1: all weight on the reference, IPO against pi_ref with beta = 1/eta.
    close(inpo_loss(c, r, pc, pr, rc, rr, eta=eta, tau=1 / eta)[0],
          ipo_loss(c, r, rc, rr, 1 / eta)[0])


def test_inpo_rejects_bad_step():
    with pytest.raises(ValueError, match="eta\\*tau"):
        inpo_loss(*(np.zeros(2),) * 6, eta=10.0, tau=0.5)


@pytest.mark.parametrize("name", ["dpo", "ipo", "inpo"])
def test_jit_and_metrics_carry_no_gradient(name):
    fn = PREFERENCE_LOSSES.get(name)
    if name == "inpo":
        args, kw = (CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, REF_CHOSEN, REF_REJECTED), {
            "eta": 2.0, "tau": 0.25}
    else:
        args, kw = (CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED), {"beta": 0.5}
    eager = fn(*args, **kw)
    jitted = jax.jit(lambda *a: fn(*a, **kw))(*map(jnp.asarray, args))
    close(jitted[0], eager[0])
    for k in eager[1]:
        close(jitted[1][k], eager[1][k])
    grad = jax.grad(lambda c: sum(fn(c, *args[1:], **kw)[1].values()))(jnp.asarray(CHOSEN))
    assert np.all(np.asarray(grad) == 0)
