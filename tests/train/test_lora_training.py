"""Training LoRA adapters on a frozen base: what a step changes, what the optimizer holds, what
a checkpoint saves, and the compute the frozen weights no longer cost."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl_tpu.persistence.checkpoint import Checkpointer
from rl_tpu.models import lora
from rl_tpu.models.transformer import ModelConfig, Transformer
from rl_tpu.rl.losses import PolicyLossConfig
from rl_tpu.train import steps
from rl_tpu.train.state import OptimConfig, create_state, make_optimizer

V, B, T = 128, 4, 16
BASE = ModelConfig(arch="qwen2", vocab_size=V, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
ADAPTERS = frozenset(lora.ADAPTER_KEYS)


def params_of(cfg, seed=0):
    tokens = np.zeros((1, 4), np.int32)
    return nn.meta.unbox(Transformer(cfg).init(jax.random.key(seed), tokens))["params"]


def batch(seed=0):
    rng = np.random.RandomState(seed)
    mask = np.ones((B, T), bool)
    mask[:, :4] = False
    return dict(tokens=rng.randint(0, V, (B, T)).astype(np.int32), loss_mask=mask,
                old_logprobs=np.full((B, T), -4.0, np.float32),
                advantages=rng.randn(B).astype(np.float32))


def lora_state(cfg, lr=1e-2):
    return create_state(params_of(cfg), make_optimizer(OptimConfig(lr=lr)), ADAPTERS)


def test_a_step_moves_the_adapters_and_leaves_the_base_bit_for_bit():
    cfg = BASE.replace(lora=lora.LoraConfig(rank=4, alpha=8))
    state = lora_state(cfg)
    before = jax.tree.map(np.asarray, state.params)
    step = jax.jit(steps.make_policy_step(Transformer(cfg), PolicyLossConfig()))
    for i in range(2):  # B is zero at first: A's gradient is zero until B has moved
        state, metrics = step(state, batch(i))
    assert metrics["grad_norm"] > 0
    flat_before = jax.tree_util.tree_flatten_with_path(before)[0]
    for (path, old), new in zip(flat_before, jax.tree.leaves(state.params)):
        name = jax.tree_util.keystr(path)
        if path[-1].key in lora.ADAPTER_KEYS:
            assert np.abs(np.asarray(new) - old).max() > 1e-4, name
        else:
            np.testing.assert_array_equal(np.asarray(new), old, err_msg=name)


def test_the_optimizer_holds_moments_of_the_adapters_only():
    cfg = BASE.replace(lora=lora.LoraConfig(rank=4))
    state = lora_state(cfg)
    n = lora.adapter_count(state.params)
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    assert moments == 2 * n  # Adam's mu and nu, over the adapters alone
    assert state.master is None  # fp32 adapters need no master copy ...
    bf16 = create_state(params_of(cfg.replace(dtype="bfloat16", param_dtype="bfloat16")),
                        make_optimizer(OptimConfig()), ADAPTERS)
    assert bf16.master is None  # ... over a bf16 base either


def test_the_frozen_weights_cost_no_gradient_flops():
    """The update of a LoRA policy skips every frozen kernel's weight gradient: at rank 4 its
    step costs well under the full step's flops (the forward and the input gradients stay)."""
    def flops(cfg, trainable):
        state = create_state(params_of(cfg), optax.sgd(1.0), trainable)
        step = jax.jit(steps.make_sft_step(Transformer(cfg)))
        compiled = step.lower(state, batch()).compile()
        return compiled.cost_analysis()["flops"]
    wide = BASE.replace(hidden_size=128, intermediate_size=512, head_dim=32)  # matmul-bound
    full = flops(wide, None)
    low = flops(wide.replace(lora=lora.LoraConfig(rank=4)), ADAPTERS)
    # dW was about a third of the full step's matmul flops (forward, input grad, weight grad)
    assert low < 0.75 * full, (low, full)


def test_lora_dropout_masks_follow_the_step():
    """Dropout keys are fold_in(key(0), step): one state and batch give one update (a resumed
    run repeats the masks); with dropout off, the update differs (the masks mattered)."""
    on = BASE.replace(lora=lora.LoraConfig(rank=4, dropout=0.3))
    state = lora_state(on)
    state, _ = jax.jit(steps.make_sft_step(Transformer(on)))(state, batch())  # B nonzero now
    step = jax.jit(steps.make_sft_step(Transformer(on), steps.StepConfig(micro_batches=2)))
    a, _ = step(state, batch(1))
    b, _ = step(state, batch(1))
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
    off = BASE.replace(lora=lora.LoraConfig(rank=4))
    c, _ = jax.jit(steps.make_sft_step(Transformer(off), steps.StepConfig(micro_batches=2)))(
        state, batch(1))
    diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a.params),
                                                            jax.tree.leaves(c.params)))
    assert diff > 1e-6


def test_a_checkpoint_holds_the_adapters_and_their_moments_only(tmp_path):
    cfg = BASE.replace(lora=lora.LoraConfig(rank=4))
    state = lora_state(cfg)
    state, _ = jax.jit(steps.make_sft_step(Transformer(cfg)))(state, batch())
    view = state.checkpoint_view()
    saved = sum(x.size for x in jax.tree.leaves(view) if x.ndim > 0)
    assert saved == 3 * lora.adapter_count(state.params)  # adapters, mu, nu
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    ckpt.save(1, {"policy": view}, {})
    fresh = lora_state(cfg)  # the base reloaded, fresh adapters and moments
    _, restored, _ = ckpt.restore({"policy": fresh.checkpoint_view()})
    back = fresh.from_checkpoint(restored["policy"])
    ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, back.params, state.params)
    jax.tree.map(np.testing.assert_array_equal, back.opt_state, state.opt_state)
    assert int(back.step) == int(state.step) == 1
