"""A policy loss kind owns its per-token surrogate: the clipped kinds pinned to the values
they gave before it could (commit ea50c9c), and a kind of another shape registered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.rl.losses import POLICY_LOSSES, PolicyLossConfig, PolicyLossKind, policy_loss


def _loss_and_grad(config, logp, old, adv, mask, **kw):
    f = lambda lp: policy_loss(lp, old, adv, mask, config, **kw)[0]  # noqa: E731
    loss, grad = jax.value_and_grad(f)(jnp.asarray(logp, jnp.float32))
    return float(loss), np.asarray(grad)


# A random batch (numpy default_rng(7)) and the loss / gradient each clipped kind gave
# before kinds owned their surrogate (commit ea50c9c).
_LOGP = [[-0.9993849396705627, -0.8506272435188293, -1.1370689868927002, -1.4452959299087524],
         [-1.2273353338241577, -1.4958232641220093, -0.9699282050132751, -0.3298923671245575]]
_OLD = [[-1.1470469236373901, -1.0367697477340698, -0.9901163578033447, -1.338229775428772],
        [-1.1957110166549683, -1.7749637365341187, -0.9787037372589111, -0.12130140513181686]]
_BEH = [[-1.281468391418457, -1.0825313329696655, -1.1802386045455933, -1.4671835899353027],
        [-1.3798844814300537, -1.7984728813171387, -1.1054483652114868, -0.09417496621608734]]
_ADV = [[0.15675108134746552, -0.18693093955516815, -2.5167596340179443, -0.5386928915977478],
        [-0.048500943928956985, 0.11330898851156235, -1.5301357507705688, -0.47775328159332275]]
_MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]
_PPO_GRAD = [[-0.025956211611628532, 0.032167982310056686, 0.31040093302726746, 0.0],
             [0.0067130196839571, -0.0, 0.22051750123500824, 0.05540075898170471]]
_PINNED = [
    ("ppo", {}, 0.5798195600509644, _PPO_GRAD),
    ("ppo", {"dual_clip": 3.0, "clip_high": 0.28}, 0.5785245895385742, _PPO_GRAD),
    ("gspo", {"clip_low": 0.05, "clip_high": 0.1}, 0.6975684762001038,
     [[-0.02780410461127758, 0.03315733000636101, 0.44641634821891785, 0.0],
      [0.006135349161922932, -0.014333539642393589, 0.19356152415275574,
       0.06043558940291405]]),
    ("bapo", {}, 0.5970519781112671,
     [[-0.025956211611628532, 0.032167982310056686, 0.0, 0.0],
      [0.0067130196839571, -0.02139909937977791, 0.22051750123500824, 0.0]]),
]


@pytest.mark.parametrize("kind,options,loss,grad", _PINNED)
def test_clipped_kinds_are_unchanged(kind, options, loss, grad):
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    extra = {"behaviour_logprobs": f32(_BEH)} if kind == "bapo" else {}
    got_loss, got_grad = _loss_and_grad(PolicyLossConfig(kind=kind, **options), f32(_LOGP),
                                        f32(_OLD), f32(_ADV), f32(_MASK), **extra)
    assert got_loss == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(got_grad, grad, rtol=1e-6, atol=1e-9)


def test_clip_low_of_one_is_no_lower_clip():
    # lower bound 0: PPO with A < 0 and r = 0.5 is no longer clipped at 0.8. One token,
    # A = -1: l = max(-rA, -clip(r, 0, 1.2) A) = max(0.5, 0.5) = 0.5, gradient -A r = 0.5
    # (with clip_low = 0.2 the clipped term 0.8 wins, gradient 0).
    logp, old = np.array([[-1.0]], np.float32), np.array([[-1.0 + np.log(2.0)]], np.float32)
    adv, mask = np.array([[-1.0]], np.float32), np.ones((1, 1), np.float32)
    loss, grad = _loss_and_grad(PolicyLossConfig(kind="ppo", clip_low=1.0), logp, old, adv, mask)
    assert loss == pytest.approx(0.5, rel=1e-5) and grad[0, 0] == pytest.approx(0.5, rel=1e-5)
    loss, grad = _loss_and_grad(PolicyLossConfig(kind="ppo"), logp, old, adv, mask)
    assert loss == pytest.approx(0.8, rel=1e-5) and grad[0, 0] == 0.0
    with pytest.raises(ValueError, match=r"clip_low=1.5 must be in \[0, 1\]"):
        PolicyLossConfig(kind="ppo", clip_low=1.5)


def test_a_kind_can_register_its_own_surrogate(monkeypatch):
    # Plain REINFORCE (-A log pi): a kind of another shape, through the same policy_loss.
    # Put in the table for this test only, so the registry's names stay the shipped ones.
    name = "test_reinforce_surrogate"
    monkeypatch.setitem(POLICY_LOSSES._table, name, PolicyLossKind(
        POLICY_LOSSES.get("ppo").ratio,
        surrogate=lambda ratio, logprobs, adv, lower, upper, config: -adv * logprobs))
    # log pi = [-1, -0.5, -2], A = [1, -2, 0.5]: -A log pi = [1, -1, 1], mean 1/3;
    # gradient -A / 3 = [-1/3, 2/3, -1/6]
    logp = np.array([[-1.0, -0.5, -2.0]], np.float32)
    adv = np.array([[1.0, -2.0, 0.5]], np.float32)
    loss, grad = _loss_and_grad(PolicyLossConfig(kind=name), logp, logp - 0.3, adv,
                                np.ones((1, 3), np.float32))
    assert loss == pytest.approx(1 / 3, rel=1e-5)
    np.testing.assert_allclose(grad, [[-1 / 3, 2 / 3, -1 / 6]], rtol=1e-6)
