"""CISPO's loss and gradient by hand: every token keeps a gradient, scaled by its clipped
weight."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.rl.losses import PolicyLossConfig, policy_loss

LN2 = math.log(2.0)


def _loss_and_grad(config, logp, old, adv, mask, **kw):
    f = lambda lp: policy_loss(lp, old, adv, mask, config, **kw)[0]  # noqa: E731
    loss, grad = jax.value_and_grad(f)(jnp.asarray(logp, jnp.float32))
    return float(loss), np.asarray(grad)


# One row, three tokens: log pi = [-1, -0.5, -2], old log pi chosen so r = [2, 1, 0.5],
# A = [1, -2, 0.5]; clip [1 - 0.2, 1 + 0.28] = [0.8, 1.28].
LOGP = np.array([[-1.0, -0.5, -2.0]], np.float32)
OLD = np.array([[-1.0 - LN2, -0.5, -2.0 + LN2]], np.float32)
ADV = np.array([[1.0, -2.0, 0.5]], np.float32)
MASK = np.ones((1, 3), np.float32)


def test_cispo_loss_and_gradient_by_hand():
    cfg = PolicyLossConfig(kind="cispo", clip_low=0.2, clip_high=0.28)
    # weights w = sg(clip(r, 0.8, 1.28)) = [1.28, 1, 0.8]
    # per token -w A log pi = [-(1.28)(1)(-1), -(1)(-2)(-0.5), -(0.8)(0.5)(-2)]
    #                       = [1.28, -1.0, 0.8];  token mean = 1.08 / 3 = 0.36
    # d loss / d log pi_t = -w_t A_t / 3 = [-1.28/3, 2/3, -0.4/3]
    #                     = [-0.426667, 0.666667, -0.133333]
    loss, grad = _loss_and_grad(cfg, LOGP, OLD, ADV, MASK)
    assert loss == pytest.approx(0.36, rel=1e-5)
    np.testing.assert_allclose(grad, [[-1.28 / 3, 2 / 3, -0.4 / 3]], rtol=1e-5)


def test_a_token_outside_the_clip_keeps_its_gradient_under_cispo_only():
    # Token 0 has r = 2 > 1.28 and A = 1 > 0. PPO: max(-rA, -clip(r)A) = max(-2, -1.28)
    # = -1.28, a constant: gradient 0. CISPO: -1.28 * 1 / 3 (the bound scales it).
    # Token 2 has r = 0.5 < 0.8 and A = 0.5 > 0: PPO takes the unclipped -rA = -0.25
    # (its gradient -rA/3 = -0.25/3, d r / d log pi = r); CISPO -0.8 * 0.5 / 3 = -0.4/3.
    # Token 1 (r = 1, inside): both give -A/3 = 2/3.
    ppo = PolicyLossConfig(kind="ppo", clip_low=0.2, clip_high=0.28)
    cispo = PolicyLossConfig(kind="cispo", clip_low=0.2, clip_high=0.28)
    _, g_ppo = _loss_and_grad(ppo, LOGP, OLD, ADV, MASK)
    _, g_cispo = _loss_and_grad(cispo, LOGP, OLD, ADV, MASK)
    np.testing.assert_allclose(g_ppo, [[0.0, 2 / 3, -0.25 / 3]], rtol=1e-5, atol=1e-7)
    assert g_cispo[0, 0] == pytest.approx(-1.28 / 3, rel=1e-5)
    assert g_cispo[0, 1] == pytest.approx(g_ppo[0, 1], rel=1e-6)


def test_cispo_default_bounds_have_no_lower_clip():
    # clip_low = 1 (the cispo record's default): bounds [0, 1.28]. Token 2's r = 0.5 now
    # weighs 0.5: per token [1.28, -1.0, -(0.5)(0.5)(-2) = 0.5], mean 0.78 / 3 = 0.26,
    # gradient [-1.28/3, 2/3, -0.25/3].
    cfg = PolicyLossConfig(kind="cispo", clip_low=1.0, clip_high=0.28)
    loss, grad = _loss_and_grad(cfg, LOGP, OLD, ADV, MASK)
    assert loss == pytest.approx(0.26, rel=1e-5)
    np.testing.assert_allclose(grad, [[-1.28 / 3, 2 / 3, -0.25 / 3]], rtol=1e-5)


def test_cispo_ignores_padding_and_rejects_a_dual_clip():
    # A padded fourth token with log pi = -inf (never a real value) changes nothing.
    logp = np.concatenate([LOGP, [[-np.inf]]], axis=1)
    old = np.concatenate([OLD, [[0.0]]], axis=1)
    adv = np.concatenate([ADV, [[5.0]]], axis=1)
    mask = np.array([[1, 1, 1, 0]], np.float32)
    cfg = PolicyLossConfig(kind="cispo", clip_low=0.2, clip_high=0.28)
    loss, grad = _loss_and_grad(cfg, logp, old, adv, mask)
    assert loss == pytest.approx(0.36, rel=1e-5)
    np.testing.assert_allclose(grad, [[-1.28 / 3, 2 / 3, -0.4 / 3, 0.0]], rtol=1e-5)
    with pytest.raises(ValueError, match="dual_clip=3.0: kind='cispo'"):
        PolicyLossConfig(kind="cispo", dual_clip=3.0)


def test_cispo_is_ppo_on_policy():
    # r = 1 everywhere (old = current): both gradients are -A / n on every masked token.
    rng = np.random.default_rng(3)
    logp = rng.normal(-1.0, 0.5, (2, 4)).astype(np.float32)
    adv = rng.normal(0.0, 1.0, (2, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
    _, g_ppo = _loss_and_grad(PolicyLossConfig(kind="ppo"), logp, logp, adv, mask)
    _, g_cispo = _loss_and_grad(PolicyLossConfig(kind="cispo"), logp, logp, adv, mask)
    np.testing.assert_allclose(g_cispo, g_ppo, rtol=1e-6)
    np.testing.assert_allclose(g_cispo, -adv * mask / 7, rtol=1e-6)


def test_cispo_accepts_clip_low_one_and_refuses_above():
    PolicyLossConfig(kind="cispo", clip_low=1.0)
    with pytest.raises(ValueError, match=r"clip_low=1.5 must be in \[0, 1\]"):
        PolicyLossConfig(kind="cispo", clip_low=1.5)
