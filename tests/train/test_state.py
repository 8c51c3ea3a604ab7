"""Optimizer schedule and decay mask, checked against values worked out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.train.state import OptimConfig, TrainState, learning_rate_schedule, make_optimizer


def test_warmup_then_cosine_to_end_ratio():
    schedule = learning_rate_schedule(OptimConfig(lr=1e-3, warmup_steps=10, total_steps=110,
                                                  schedule="cosine", end_lr_ratio=0.1))
    # warm-up is linear from 0: step 5 of 10 -> 0.5e-3
    np.testing.assert_allclose(schedule(5), 5e-4, rtol=1e-6)
    # cosine over the 100 steps after warm-up; halfway (step 60) the cosine factor is 0.5:
    # lr * ((1 - 0.1) * 0.5 + 0.1) = 1e-3 * 0.55
    np.testing.assert_allclose(schedule(60), 5.5e-4, rtol=1e-5)
    np.testing.assert_allclose(schedule(110), 1e-4, rtol=1e-5)  # ends at lr * end_lr_ratio


def test_linear_decay_and_constant():
    linear = learning_rate_schedule(OptimConfig(lr=2e-3, total_steps=100, schedule="linear",
                                                end_lr_ratio=0.0))
    np.testing.assert_allclose(linear(25), 1.5e-3, rtol=1e-6)  # 2e-3 * (1 - 25/100)
    constant = learning_rate_schedule(OptimConfig(lr=3e-4))
    np.testing.assert_allclose(constant(999), 3e-4, rtol=1e-6)


def test_weight_decay_spares_norms_and_biases():
    # With a zero gradient, AdamW's update is -lr * wd * param on decayed leaves only:
    # a matrix of 1s moves to 1 - 0.1 * 0.5 = 0.95; the 1-D scale stays 1.
    params = {"kernel": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
    tx = make_optimizer(OptimConfig(lr=0.1, weight_decay=0.5, grad_clip=None))
    state = TrainState.create(params, tx).apply_gradients(
        {"kernel": jnp.zeros((2, 2)), "scale": jnp.zeros((2,))})
    np.testing.assert_allclose(state.params["kernel"], 0.95, rtol=1e-6)
    np.testing.assert_allclose(state.params["scale"], 1.0)
    assert int(state.step) == 1


def test_bad_optimizer_config_is_named():
    with pytest.raises(ValueError, match="optim.schedule='exp'"):
        OptimConfig(schedule="exp")
    with pytest.raises(ValueError, match="optim.lr must be > 0"):
        OptimConfig(lr=0.0)


def test_optimizer_moments_are_sharded_like_their_params():
    """Adam's mu and nu follow each weight's sharding (a replicated copy on every device
    would cost 2x the model per device); the step count is replicated."""
    from rl_tpu import parallel
    from rl_tpu.models import tiny
    from rl_tpu.train.state import OptimConfig, create_state, make_optimizer

    mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2})
    cfg = tiny.tiny_config("qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_layers=1, head_dim=8)
    params = tiny.random_params(cfg, mesh=mesh)
    specs = jax.tree.map(lambda x: x.sharding.spec, params)
    state = create_state(params, make_optimizer(OptimConfig(lr=1e-3, weight_decay=0.1)))
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda n: hasattr(n, "mu"))
            if hasattr(s, "mu")]
    assert adam, "no Adam state found"
    for moments in (adam[0].mu, adam[0].nu):
        assert jax.tree.map(lambda x: x.sharding.spec, moments) == specs
    assert state.step.sharding.spec == jax.sharding.PartitionSpec()


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_a_skipped_update_does_not_shift_the_lr_schedule(monkeypatch, platform):
    # Linear decay from 1.0 to 0 over 4 updates: lr(count) = 1 - count / 4 = 1, .75, .5, .25.
    # Adam with a constant gradient of 1 moves w by -lr each applied update (m_hat = v_hat =
    # 1, up to float32's bias correction: 1e-4). Update 0 is applied at lr(0) = 1, update 1 skipped (NaN loss), update 2 applied at
    # lr(2) = 0.5: w = 0 - 1 - 0.5 = -1.5. (Counting applied updates only, as before, update 2
    # ran at lr(1) = 0.75, w = -1.75, and every later lr stayed one update behind.)
    # "tpu": the select that skips an update on TPU (run here on the CPU), the cond otherwise.
    from rl_tpu.train import steps
    monkeypatch.setattr(steps.parallel, "platform", lambda mesh: platform)
    tx = make_optimizer(OptimConfig(lr=1.0, schedule="linear", total_steps=4, end_lr_ratio=0.0,
                                    grad_clip=None))
    state = TrainState.create({"w": jnp.zeros((2,), jnp.float32)}, tx)
    grads = {"w": jnp.ones((2,), jnp.float32)}
    update = jax.jit(lambda s, loss: steps.apply_update(s, loss, grads, {}))

    state, metrics = update(state, jnp.float32(0.0))
    assert float(metrics["skipped"].value) == 0.0
    np.testing.assert_allclose(state.params["w"], [-1.0, -1.0], rtol=1e-4)
    state, metrics = update(state, jnp.float32(jnp.nan))
    assert float(metrics["skipped"].value) == 1.0 and int(state.step) == 1
    np.testing.assert_allclose(state.params["w"], [-1.0, -1.0], rtol=1e-4)  # untouched
    state, metrics = update(state, jnp.float32(0.0))
    np.testing.assert_allclose(state.params["w"], [-1.5, -1.5], rtol=1e-4)
    assert int(state.step) == 2  # the step counter counts applied updates
