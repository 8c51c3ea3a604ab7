"""Update steps: exact accumulation, sharded == single device, bucketing, skips, each step kind."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from rl_tpu import parallel
from rl_tpu.models import tiny
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.transformer import Transformer
from rl_tpu.models.value import ValueModel, value_params_from
from rl_tpu.rl import losses
from rl_tpu.rl.bapo import adapt_clip_bounds
from rl_tpu.rl.losses import PolicyLossConfig
from rl_tpu.train import batching, steps
from rl_tpu.train.state import (OptimConfig, TrainState, advance_schedule, create_state,
                                 make_optimizer)

V, B, T = 128, 8, 24
CFG = tiny.tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                        head_dim=8)
MODEL = Transformer(CFG)
# SGD with lr 1: params after a step differ exactly by the gradient, so comparisons of params
# are comparisons of gradients (Adam's first step, ~lr * sign(g), would amplify rounding).
SGD = optax.sgd(1.0)


def fresh_params(mesh=None):
    return tiny.random_params(CFG, seed=0, mesh=mesh, scale=0.2)


def policy_batch(seed=0, t=T):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, V, (B, t)).astype(np.int32)
    mask = np.zeros((B, t), bool)
    for row in range(B):  # prompt, a first turn, an observation gap, a second turn, padding
        p, end = 3 + row % 3, t - (row % 4)
        mask[row, p:end] = True
        mask[row, p + 4:p + 7] = False
    return dict(tokens=tokens, loss_mask=mask,
                old_logprobs=(rng.randn(B, t) * 0.1 - 4.0).astype(np.float32),
                advantages=rng.randn(B).astype(np.float32))


def run_step(step_fn, params, batch, tx=SGD):
    state = TrainState.create(params, tx)
    new_state, metrics = jax.jit(step_fn)(state, batch)
    return new_state, metrics


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   atol=atol, rtol=0)


def test_chunked_token_logprobs_equal_full_log_softmax():
    params = fresh_params()
    batch = policy_batch()
    lp, ent = jax.jit(lambda p, b: token_logprobs(MODEL, p, b, chunk=7))(params, batch)
    logits = MODEL.apply({"params": params}, batch["tokens"])
    logp = jax.nn.log_softmax(logits, -1)
    expected = np.take_along_axis(np.asarray(logp[:, :-1]), batch["tokens"][:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(lp[:, 1:], expected, atol=1e-5)
    assert np.all(np.asarray(lp[:, 0]) == 0)
    entropy = -(np.exp(logp) * logp).sum(-1)
    np.testing.assert_allclose(ent[:, 1:], entropy[:, :-1], atol=1e-4)


@pytest.mark.parametrize("kind,aggregation", [("ppo", "token_mean"), ("bapo", "token_mean"),
                                              ("gspo", "seq_mean_token_mean")])
def test_four_micro_batches_equal_one_big_batch(kind, aggregation):
    clip = (3e-4, 4e-4) if kind == "gspo" else (0.2, 0.28)  # GSPO clips sequence ratios tightly
    loss_cfg = PolicyLossConfig(kind=kind, clip_low=clip[0], clip_high=clip[1],
                                aggregation=aggregation)
    batch = policy_batch()
    # shift old logprobs toward the model's own so ratios straddle the clip bounds
    lp, _ = token_logprobs(MODEL, fresh_params(), batch)
    batch["old_logprobs"] = np.asarray(lp) + np.random.RandomState(1).randn(B, T).astype(
        np.float32) * 0.3
    one, m1 = run_step(steps.make_policy_step(MODEL, loss_cfg), fresh_params(), batch)
    four, m4 = run_step(steps.make_policy_step(MODEL, loss_cfg, steps.StepConfig(micro_batches=4)),
                        fresh_params(), batch)
    assert_trees_close(one.params, four.params, atol=1e-6)
    for key in ("loss", "pg_loss", "clip_frac_low", "clip_frac_high", "ratio_mean",
                "approx_kl", "entropy", "ratio_max", "ratio_min"):
        np.testing.assert_allclose(m1[key], m4[key], atol=1e-6, err_msg=key)
    assert float(m1["clip_frac_high"]) + float(m1["clip_frac_low"]) > 0  # clipping was exercised
    if kind == "bapo":
        np.testing.assert_allclose(m1["bapo_c_high"], m4["bapo_c_high"], atol=1e-7)
        np.testing.assert_allclose(m1["bapo_c_low"], m4["bapo_c_low"], atol=1e-7)


def test_sharded_policy_step_equals_single_device():
    loss_cfg = PolicyLossConfig(kind="ppo", clip_high=0.28)
    batch = policy_batch()
    single, m_single = run_step(steps.make_policy_step(MODEL, loss_cfg), fresh_params(), batch)

    mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2})
    model = Transformer(CFG, mesh=mesh, rules=parallel.DEFAULT_RULES)
    state = create_state(fresh_params(mesh), SGD)
    assert state.params["embed"]["embedding"].sharding.spec == P("tensor", "fsdp")
    step = steps.compile_step(steps.make_policy_step(model, loss_cfg), state, mesh)
    state, metrics = step(state, parallel.host_to_global(batch, mesh))
    assert state.params["layers_0"]["mlp"]["up_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert_trees_close(state.params, single.params, atol=1e-5)
    np.testing.assert_allclose(metrics["loss"], m_single["loss"], atol=1e-6)


def test_step_compiles_once_per_length_bucket():
    buckets = (16, 32, 48)
    mesh = parallel.make_mesh({"fsdp": -1})
    state = create_state(fresh_params(mesh), make_optimizer(OptimConfig(lr=1e-4)))
    step = steps.compile_step(steps.make_policy_step(MODEL, PolicyLossConfig()), state, mesh)
    rng = np.random.RandomState(0)
    seen = set()
    for i in range(20):
        length = int(rng.randint(5, 48))
        batch = batching.pad_to_bucket(policy_batch(seed=i, t=length), buckets)
        seen.add(batch["tokens"].shape[1])
        state, metrics = step(state, parallel.host_to_global(batch, mesh))
        assert float(metrics["skipped"]) == 0
    assert int(state.step) == 20
    assert step._cache_size() == len(seen) <= len(buckets)


def test_non_finite_loss_skips_the_update():
    batch = policy_batch()
    batch["advantages"] = np.full((B,), np.nan, np.float32)
    params = fresh_params()
    state, metrics = run_step(steps.make_policy_step(MODEL, PolicyLossConfig()), params, batch,
                              make_optimizer(OptimConfig(lr=1e-3)))
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 0
    assert_trees_close(state.params, params, atol=0)


def test_skipped_update_is_counted_across_minibatches_and_leaves_state_untouched():
    # Two minibatches through one state: a finite one, then a genuinely non-finite one (NaN
    # advantages). The second leaves params, optimizer moments and step counter exactly as
    # the first left them, and the minibatches' metrics combine to skipped = 0 + 1 = 1.
    good = policy_batch()
    bad = dict(policy_batch(seed=1), advantages=np.full((B,), np.nan, np.float32))
    step = jax.jit(steps.make_policy_step(MODEL, PolicyLossConfig(),
                                          steps.StepConfig(tagged_metrics=True)))
    state = TrainState.create(fresh_params(), make_optimizer(OptimConfig(lr=1e-3)))
    after_good, m_good = step(state, good)
    after_bad, m_bad = step(after_good, bad)
    assert int(after_good.step) == 1 and int(after_bad.step) == 1
    assert_trees_close(after_bad.params, after_good.params, atol=0)
    # a skipped update leaves Adam's moments alone but moves the lr schedule on
    assert_trees_close(after_bad.opt_state, advance_schedule(after_good.opt_state), atol=0)
    assert float(m_good["skipped"].value) == 0.0 and float(m_bad["skipped"].value) == 1.0
    combined = steps.metric_values(steps.combine_metrics([m_good, m_bad]))
    assert float(combined["skipped"]) == 1.0
    assert np.isnan(float(combined["loss"]))  # the bad minibatch's loss shows, not hidden


def test_huge_log_ratio_token_does_not_skip_the_step():
    # One policy token of row 0 (A > 0) has log-ratio 95: exp overflows to inf, and without
    # the +-20 clamp the gradient is NaN (0 * inf) and the whole update is skipped.
    batch = policy_batch()
    lp, _ = token_logprobs(MODEL, fresh_params(), batch)
    batch["old_logprobs"] = np.asarray(lp).copy()
    row = int(np.argmax(batch["advantages"]))
    col = int(np.flatnonzero(batch["loss_mask"][row])[0])
    batch["old_logprobs"][row, col] -= 95.0
    assert batch["advantages"][row] > 0
    params = fresh_params()
    state, metrics = run_step(steps.make_policy_step(MODEL, PolicyLossConfig()), params, batch)
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 1
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.params))
    np.testing.assert_allclose(metrics["ratio_max"], np.exp(20.0), rtol=1e-5)


def test_empty_micro_batch_does_not_distort_metrics():
    # Micro-batch 1 of 2 takes rows 1, 3, 5, 7: with their masks empty it sees no token, and
    # its ratio_min / ratio_max (0 by the empty-mask convention) must not win the min; every
    # token mean must equal the one big batch's.
    batch = policy_batch()
    batch["loss_mask"][1::2] = False
    lp, _ = token_logprobs(MODEL, fresh_params(), batch)
    batch["old_logprobs"] = np.asarray(lp) + np.random.RandomState(2).randn(B, T).astype(
        np.float32) * 0.3
    loss_cfg = PolicyLossConfig(clip_high=0.28)
    one, m1 = run_step(steps.make_policy_step(MODEL, loss_cfg), fresh_params(), batch)
    two, m2 = run_step(steps.make_policy_step(MODEL, loss_cfg, steps.StepConfig(micro_batches=2)),
                       fresh_params(), batch)
    assert float(m1["ratio_min"]) > 0.1
    for key in m1:
        np.testing.assert_allclose(m1[key], m2[key], atol=1e-6, err_msg=key)
    assert_trees_close(one.params, two.params, atol=1e-6)


def test_bapo_bounds_weighted_by_behaviour_logprobs_and_same_for_two_micro_batches():
    # The policy step passes the batch's behaviour_logprobs: Eq. 8's pi_rollout weights. The
    # bounds it reports are adapt_clip_bounds on the whole batch with those weights, for one
    # micro-batch (from the loss's own log-probs) and for two (from the scoring pass).
    batch = policy_batch()
    params = fresh_params()
    lp, _ = token_logprobs(MODEL, params, batch)
    batch["old_logprobs"] = np.asarray(lp) + np.random.RandomState(1).randn(B, T).astype(
        np.float32) * 0.3
    # Positive-advantage rows were sampled with low probability: down-weighted, so the
    # positive share is smaller and the bounds must move further than without weights.
    batch["behaviour_logprobs"] = np.where(batch["advantages"][:, None] > 0, -4.0, -0.1
                                           ).astype(np.float32)
    loss_cfg = PolicyLossConfig(kind="bapo")
    ratio = np.exp(np.where(batch["loss_mask"], np.asarray(lp) - batch["old_logprobs"], 0.0))
    want_lo, want_hi, _ = adapt_clip_bounds(ratio, batch["advantages"], batch["loss_mask"],
                                            loss_cfg.bapo, batch["behaviour_logprobs"])
    _, unweighted_hi, _ = adapt_clip_bounds(ratio, batch["advantages"], batch["loss_mask"],
                                            loss_cfg.bapo)
    assert float(want_hi) > float(unweighted_hi)  # the weights matter on this batch

    one, m1 = run_step(steps.make_policy_step(MODEL, loss_cfg), fresh_params(), batch)
    two, m2 = run_step(steps.make_policy_step(MODEL, loss_cfg, steps.StepConfig(micro_batches=2)),
                       fresh_params(), batch)
    for m in (m1, m2):
        np.testing.assert_allclose(m["bapo_c_high"], want_hi, atol=1e-7)
        np.testing.assert_allclose(m["bapo_c_low"], want_lo, atol=1e-7)
    assert_trees_close(one.params, two.params, atol=1e-6)
    for key in ("loss", "clip_frac_high", "clip_frac_low", "bapo_rho", "bapo_iterations"):
        np.testing.assert_allclose(m1[key], m2[key], atol=1e-6, err_msg=key)


def test_any_policy_loss_can_declare_batch_statistics(monkeypatch):
    # A made-up loss: PPO whose clip epsilon is the WHOLE batch's mean |log r| (+ 0.05). The
    # step must compute it once over all B rows and give every micro-batch the same value.
    seen_rows = []

    def statistics(logprobs, batch, config):
        seen_rows.append(logprobs.shape[0])
        mask = jnp.asarray(batch["loss_mask"], jnp.float32)
        eps = 0.05 + jnp.sum(jnp.abs(logprobs - batch["old_logprobs"]) * mask) / jnp.sum(mask)
        return {"eps": eps}, {"batch_eps": losses.Metric.of(eps)}

    def ratio(logprobs, old_logprobs, advantages, mask, config, stats):
        return (losses.token_ratio(logprobs, old_logprobs, mask), 1.0 - stats["eps"],
                1.0 + stats["eps"], {})

    monkeypatch.setitem(losses.POLICY_LOSSES._table, "ppo_batch_eps",
                        losses.PolicyLossKind(ratio, batch_statistics=statistics))
    loss_cfg = PolicyLossConfig(kind="ppo_batch_eps")
    batch = policy_batch()
    lp, _ = token_logprobs(MODEL, fresh_params(), batch)
    batch["old_logprobs"] = np.asarray(lp) + np.random.RandomState(1).randn(B, T).astype(
        np.float32) * 0.3
    want = 0.05 + np.abs(np.asarray(lp) - batch["old_logprobs"])[batch["loss_mask"]].mean()

    one, m1 = run_step(steps.make_policy_step(MODEL, loss_cfg), fresh_params(), batch)
    two, m2 = run_step(steps.make_policy_step(MODEL, loss_cfg, steps.StepConfig(micro_batches=2)),
                       fresh_params(), batch)
    assert seen_rows == [B, B]  # once per step, over the whole batch, never per micro-batch
    np.testing.assert_allclose(m1["batch_eps"], want, rtol=1e-5)
    np.testing.assert_allclose(m2["batch_eps"], want, rtol=1e-5)
    assert float(m1["clip_frac_high"]) + float(m1["clip_frac_low"]) > 0
    assert_trees_close(one.params, two.params, atol=1e-6)


def test_bf16_params_keep_an_fp32_master():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), fresh_params())
    model = Transformer(CFG.replace(dtype="bfloat16", param_dtype="bfloat16"))
    state, metrics = run_step(steps.make_sft_step(model), params, policy_batch(),
                              make_optimizer(OptimConfig(lr=1e-3)))
    leaf = state.params["layers_0"]["attn"]["q_proj"]["kernel"]
    master = state.master["layers_0"]["attn"]["q_proj"]["kernel"]
    assert leaf.dtype == jnp.bfloat16 and master.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(master.astype(jnp.bfloat16)), np.asarray(leaf))
    assert float(metrics["skipped"]) == 0


def test_sft_and_value_steps_reduce_their_loss():
    batch = policy_batch()
    tx = make_optimizer(OptimConfig(lr=3e-3))
    sft = jax.jit(steps.make_sft_step(MODEL, steps.StepConfig(micro_batches=2)))
    state = TrainState.create(fresh_params(), tx)
    losses = []
    for _ in range(3):
        state, metrics = sft(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]

    critic = ValueModel(CFG)
    value_batch = dict(batch, values=np.zeros((B, T), np.float32),
                       returns=np.where(batch["loss_mask"], 1.0, 0.0).astype(np.float32))
    vstep = jax.jit(steps.make_value_step(critic, clip=None))
    state = TrainState.create(value_params_from(fresh_params(), CFG), tx)
    first, _ = None, None
    for _ in range(3):
        state, metrics = vstep(state, value_batch)
        first = first if first is not None else float(metrics["value_loss"])
    assert float(metrics["value_loss"]) < first


def test_preference_step_dpo_learns_the_preference():
    rng = np.random.RandomState(0)
    chosen = rng.randint(0, V, (4, 12)).astype(np.int32)
    rejected = rng.randint(0, V, (4, 12)).astype(np.int32)
    mask = np.zeros((4, 12), bool)
    mask[:, 4:] = True
    params = fresh_params()
    ref = lambda toks: np.asarray(  # noqa: E731
        (token_logprobs(MODEL, params, {"tokens": toks})[0] * mask).sum(1))
    batch = dict(chosen_tokens=chosen, chosen_loss_mask=mask, rejected_tokens=rejected,
                 rejected_loss_mask=mask, ref_chosen_logps=ref(chosen),
                 ref_rejected_logps=ref(rejected))
    step = jax.jit(steps.make_preference_step(MODEL, "dpo", steps.StepConfig(micro_batches=2),
                                              beta=0.1))
    state = TrainState.create(params, make_optimizer(OptimConfig(lr=3e-3)))
    state, first = step(state, batch)
    np.testing.assert_allclose(first["loss"], np.log(2), atol=1e-5)  # policy == reference
    for _ in range(2):
        state, metrics = step(state, batch)
    assert float(metrics["loss"]) < float(first["loss"])
    assert float(metrics["reward_accuracy"]) == 1.0


def test_missing_batch_key_is_named():
    batch = policy_batch()
    del batch["old_logprobs"]
    with pytest.raises(ValueError, match=r"policy_step: batch lacks \['old_logprobs'\]"):
        run_step(steps.make_policy_step(MODEL, PolicyLossConfig()), fresh_params(), batch)


def test_bucket_errors_and_padding():
    with pytest.raises(ValueError, match="exceeds the largest length bucket 32"):
        batching.bucket_length(33, (16, 32))
    padded = batching.pad_to_bucket(policy_batch(t=10), (16, 32))
    assert padded["tokens"].shape == (B, 16) and not padded["loss_mask"][:, 10:].any()
    assert padded["segment_ids"][:, 10:].sum() == 0 and padded["advantages"].shape == (B,)


def test_compiled_logprob_fn_matches_token_logprobs_on_a_mesh():
    """Old/reference log-probs of a rollout batch: sharded, micro-batched, same numbers."""
    params = fresh_params()
    batch = policy_batch()
    expected, _ = token_logprobs(MODEL, params, batch)
    mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2})
    model = Transformer(CFG, mesh=mesh, rules=parallel.DEFAULT_RULES)
    fn = steps.compile_logprob_fn(
        steps.make_logprob_fn(model, steps.StepConfig(micro_batches=2)), fresh_params(mesh), mesh)
    lp, entropy = fn(fresh_params(mesh), parallel.host_to_global(
        {k: batch[k] for k in ("tokens",)}, mesh))
    assert entropy is None
    np.testing.assert_allclose(lp, expected, atol=1e-5)
