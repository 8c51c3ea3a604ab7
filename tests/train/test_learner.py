"""The learner's micro-batches: counted by hand or picked per length bucket from a token budget,
with the same numbers either way; the critic's value pass in micro-batches."""

import jax
import numpy as np
import optax
import pytest

from rl_tpu import parallel
from rl_tpu.core.batch import POLICY, update_fields
from rl_tpu.models import lora, tiny
from rl_tpu.models.transformer import Transformer
from rl_tpu.models.value import ValueModel, value_params_from
from rl_tpu.rl.losses import PolicyLossConfig
from rl_tpu.rollout.compile_count import CompileCounter
from rl_tpu.train import steps
from rl_tpu.train.learner import Learner, UpdateConfig
from rl_tpu.train.state import create_state

V, ROWS = 64, 32  # 32 rows on the suite's 8 fake devices: 4 a device
CFG = tiny.tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64,
                       num_layers=1, head_dim=8)
MESH = parallel.make_mesh({"data": -1})


@pytest.mark.parametrize("rows, length, budget, expected", [
    (16, 8192, 16384, 8),  # 2 rows of 8192 a micro-batch
    (6, 1024, 4096, 2),    # 4 rows would fit, but 4 does not divide 6: 3 rows of 1024
    (4, 8192, 4096, 4),    # one row is over the budget: one row a micro-batch
    (8, 32, 1000, 1),      # the whole batch fits
    (1, 100, 10, 1),
])
def test_micro_batches_for_takes_the_fewest_that_fit(rows, length, budget, expected):
    assert steps.micro_batches_for(rows, length, budget) == expected


def test_micro_batches_for_refuses_an_empty_budget():
    with pytest.raises(ValueError, match="tokens_per_device=0"):
        steps.micro_batches_for(4, 16, 0)


def _learner(critic=False, **cfg):
    params = tiny.random_params(CFG, seed=0, mesh=MESH, scale=0.2)
    kwargs = {}
    if critic:  # (before create_state, which takes the params' buffers)
        value_params = value_params_from(params, CFG)
        key = jax.random.key(1)
        value_params["head"] = jax.tree.map(  # a head that is not zero
            lambda x: 0.3 * jax.random.normal(key, x.shape, x.dtype), value_params["head"])
        kwargs = dict(critic=create_state(value_params, optax.sgd(1.0)),
                      value_model=ValueModel(CFG, mesh=MESH))
    # SGD with lr 1: params after a step differ by exactly the gradient
    policy = create_state(params, optax.sgd(1.0))
    return Learner(Transformer(CFG, mesh=MESH), policy, MESH, PolicyLossConfig(),
                   UpdateConfig(**cfg), **kwargs)


def _batch(length, seed=0):
    rng = np.random.RandomState(seed)
    mask = np.zeros((ROWS, length), bool)
    for row in range(ROWS):
        mask[row, 2 + row % 3:length - row % 5] = True
    return parallel.host_to_global(dict(
        tokens=rng.randint(0, V, (ROWS, length)).astype(np.int32),
        positions=np.tile(np.arange(length, dtype=np.int32), (ROWS, 1)),
        segment_ids=np.ones((ROWS, length), np.int32), loss_mask=mask,
        advantages=rng.randn(ROWS, length).astype(np.float32)), MESH)


def test_token_budget_picks_micro_batches_per_length_bucket():
    # 4 rows a device; a budget of 64 tokens: 4 x 16, 2 x 32, 1 x 64, and 1 x 128 (over it)
    learner = _learner(tokens_per_device=64)
    assert [learner.update_micro_batches(ROWS, t) for t in (16, 32, 64, 128)] == [1, 2, 4, 4]
    assert [learner.score_micro_batches(ROWS, t) for t in (16, 32, 64)] == [1, 2, 4]
    # two minibatches halve each device's rows: 2 x 32 fits at once
    assert _learner(tokens_per_device=64, minibatches=2).update_micro_batches(ROWS, 32) == 1
    # the score pass's own budget
    assert _learner(tokens_per_device=64, score_tokens_per_device=256).score_micro_batches(
        ROWS, 64) == 1
    # without a budget, the counts given
    counted = _learner(score_micro_batches=8,
                       step=steps.StepConfig(micro_batches=2))
    assert counted.update_micro_batches(ROWS, 4096) == 2
    assert counted.score_micro_batches(ROWS, 4096) == 8
    # rows pad to 8 devices x lcm(2, 8) counted; with a budget, 8 devices x 2 minibatches
    assert counted.row_multiple() == 64
    assert _learner(tokens_per_device=64, minibatches=2).row_multiple() == 16


def _score_pass(learner, batch):
    """The proximal log-probs a score pass makes (one epoch of one minibatch skips it in
    `score`, the policy step taking its own)."""
    inputs = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
    return learner.program("logprobs", *batch["tokens"].shape)(learner.policy.params, inputs)[0]


def _update(learner, batch):
    scored = dict(learner.score(batch), old_logprobs=_score_pass(learner, batch))
    metrics = learner.update(scored)  # the batch's own advantages stand in for GRPO's
    return jax.device_get(learner.policy.params), metrics, scored


def test_budget_update_equals_the_counted_and_the_unsplit_update():
    batch = _batch(32)
    budget, metrics, scored = _update(_learner(tokens_per_device=64), batch)
    assert metrics["train/micro_batches"] == 2.0
    counted, counted_metrics, counted_scored = _update(
        _learner(step=steps.StepConfig(micro_batches=2), score_micro_batches=2), batch)
    whole, whole_metrics, whole_scored = _update(_learner(), batch)
    assert whole_metrics["train/micro_batches"] == 1.0
    for a, b in zip(jax.tree.leaves(budget), jax.tree.leaves(counted)):
        np.testing.assert_array_equal(a, b)  # the same program
    np.testing.assert_array_equal(scored["old_logprobs"], counted_scored["old_logprobs"])
    for a, b in zip(jax.tree.leaves(budget), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)  # exact accumulation
    np.testing.assert_allclose(scored["old_logprobs"], whole_scored["old_logprobs"], atol=1e-6)
    assert metrics["train/loss"] == pytest.approx(whole_metrics["train/loss"], abs=1e-6)


def test_one_epoch_of_one_minibatch_takes_the_proximal_from_the_step():
    """E x N = 1: no score pass for old_logprobs, and the same update as a batch whose
    proximal log-probs were scored first; more epochs, BAPO's whole-batch statistics or a
    KL-shaped reward keep the score pass."""
    batch = _batch(16, seed=2)
    own = _learner()
    assert own.proximal_from_step
    scored = own.score(batch)
    assert "old_logprobs" not in scored
    given = _learner(recompute_proximal=False)  # behaviour log-probs stand in: the scored ones
    assert not given.proximal_from_step
    scored_given = given.score(dict(batch, behaviour_logprobs=_score_pass(given, batch)))
    own_metrics, given_metrics = own.update(scored), given.update(scored_given)
    for a, b in zip(jax.tree.leaves(own.policy.params), jax.tree.leaves(given.policy.params)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert own_metrics["train/loss"] == pytest.approx(given_metrics["train/loss"], abs=1e-6)
    assert abs(own_metrics["train/loss"]) > 1e-3  # an update that did something
    assert not _learner(epochs=2).proximal_from_step
    assert "old_logprobs" in _learner(epochs=2).score(batch)
    assert not _learner(minibatches=2).proximal_from_step
    assert not _learner(reward_kl_coef=0.1).proximal_from_step
    bapo = Learner(Transformer(CFG, mesh=MESH), create_state(
        tiny.random_params(CFG, seed=0, mesh=MESH), optax.sgd(1.0)), MESH,
        PolicyLossConfig(kind="bapo"), UpdateConfig())
    assert not bapo.proximal_from_step


def test_the_logprob_gap_is_logged_only_when_a_proximal_pass_measured_it():
    """The engine's log-probs 0.2 below the trainer's on every token: a learner that takes the
    proximal from its step logs |gap| 0.2 (mean and max), all tokens above the 0.1 threshold
    and a positive sign (old - behaviour); one told not to recompute it (the behaviour
    log-probs stand in) logs no gap, since it measured none."""
    batch = _batch(16, seed=3)
    own = _learner()
    behaviour = np.asarray(_score_pass(own, batch)) - 0.2
    metrics = own.update(dict(own.score(batch), behaviour_logprobs=behaviour))
    for name, expected in (("mean", 0.2), ("max", 0.2), ("frac", 1.0), ("signed", 0.2)):
        assert metrics[f"train/logprob_gap_{name}"] == pytest.approx(expected, abs=1e-5), name
    given = _learner(recompute_proximal=False)
    metrics = given.update(given.score(dict(batch, behaviour_logprobs=behaviour)))
    assert not any(k.startswith("train/logprob_gap") for k in metrics)
    assert metrics["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-6)


def test_the_update_takes_the_fields_the_batch_declaration_names():
    """Learner.update_keys is core.batch's update_fields (less old_logprobs when the step
    takes its own); a batch without a field the learner needs, or with a field of the wrong
    dtype, is refused by name before anything compiles."""
    scored = _learner(epochs=2)
    carried = ["behaviour_logprobs", "rewards", "ref_logprobs"]
    assert scored.update_keys(carried) == update_fields(POLICY, carried)
    assert _learner().update_keys(carried) == [
        k for k in update_fields(POLICY, carried) if k != "old_logprobs"]
    assert scored.carried_fields() == ["behaviour_logprobs"]
    assert scored.carried_fields(behaviour=False) == []
    with pytest.raises(ValueError, match=r"lacks \['behaviour_logprobs'\] "
                                         r"\(recompute_proximal=False"):
        _learner(recompute_proximal=False).score(_batch(16))
    batch = _batch(16)
    with pytest.raises(ValueError, match="'advantages' is int32; it must be float32"):
        _learner().update(dict(batch, advantages=np.zeros((ROWS, 16), np.int32)))


def test_value_pass_in_micro_batches_equals_one_pass():
    batch = _batch(16, seed=1)
    split = _learner(critic=True, score_micro_batches=4)
    whole = _learner(critic=True)
    values_split = np.asarray(split.score(batch)["values"])
    values_whole = np.asarray(whole.score(batch)["values"])
    assert np.abs(values_whole).max() > 0.05  # a head that says something
    assert values_split.shape == (ROWS, 16)
    np.testing.assert_allclose(values_split, values_whole, atol=5e-6, rtol=0)  # other tilings
    np.testing.assert_array_equal(values_split[:, 0], 0.0)  # entry 0 is 0, as unsplit


def test_params_made_non_finite_are_named_with_the_step_and_last_checkpoint():
    learner = _learner(critic=True)
    assert learner.non_finite_params() == []
    learner.check_finite(3, lambda: pytest.fail("the checkpoint is asked for only on failure"))
    # one NaN in one shard of one weight of the policy (the critic stays finite)
    kernel = learner.policy.params["layers_0"]["mlp"]["up_proj"]["kernel"]
    learner.policy = learner.policy.replace(params=jax.tree.map(lambda x: x, dict(
        learner.policy.params, layers_0=dict(learner.policy.params["layers_0"], mlp=dict(
            learner.policy.params["layers_0"]["mlp"],
            up_proj={"kernel": kernel.at[5, 7].set(np.nan)})))))
    assert learner.non_finite_params() == ["policy"]
    with pytest.raises(FloatingPointError, match=r"^step 7: the policy params hold NaN or inf "
                       r"after the update, so the run stops here; the last checkpoint, step 5, "
                       r"holds finite params\. Train again with a lower optim\.lr"):
        learner.check_finite(7, lambda: 5)
    learner.critic = learner.critic.replace(params=jax.tree.map(
        lambda x: x * np.inf, learner.critic.params))
    with pytest.raises(FloatingPointError, match="the policy and critic params hold NaN or inf"
                       ".*no checkpoint was saved before it.*a rerun of this one starts over"):
        learner.check_finite(1, lambda: None)


def _compiled_during(fn) -> dict[str, int]:
    counter = CompileCounter()
    with counter.counting():
        fn()
    return counter.by_name()


def _score_and_update(learner, batch):
    scored = learner.score(batch)  # the batch's own advantages stand in for the returns too
    learner.update(dict(scored, returns=scored["advantages"]))


def test_programs_compiled_ahead_leave_the_first_update_nothing_to_compile():
    # two epochs: the score pass runs; a critic: its value pass and value step too
    ahead, behind = (_learner(critic=True, epochs=2) for _ in range(2))
    batch = _batch(16)
    future = ahead.compile_ahead(ROWS, 16)
    assert future.result() == ["logprobs", "values", "policy_update", "value_update"]
    # the programs' names: both steps are jit(update), the log-prob pass jit(fn)
    programs = {"jit(update)": 2, "jit(fn)": 1, "jit(_critic_values)": 1}
    compiled = _compiled_during(lambda: _score_and_update(ahead, batch))
    assert not set(programs) & set(compiled), compiled
    # the same learner not told ahead compiles them in its first update
    compiled = _compiled_during(lambda: _score_and_update(behind, batch))
    assert {name: compiled.get(name) for name in programs} == programs, compiled
    # the same numbers either way
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 ahead.policy.params, behind.policy.params)
    # a batch of another length than the one guessed compiles as it always did
    other = _batch(8)
    ahead.compile_ahead(ROWS, 16)
    compiled = _compiled_during(lambda: _score_and_update(ahead, other))
    assert compiled.get("jit(update)") == 2, compiled


def _lora_learner(dropout: float) -> Learner:
    """A LoRA policy whose adapters already say something (B is zero at init, which would
    make dropout on the adapters' input change nothing)."""
    cfg = CFG.replace(lora=lora.LoraConfig(rank=4, dropout=dropout))
    key = jax.random.key(5)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(0.5 * jax.random.normal(key, x.shape, x.dtype),
                                       x.sharding) if path[-1].key == "lora_b" else x,
        tiny.random_params(cfg, seed=0, mesh=MESH, scale=0.2))
    policy = create_state(params, optax.sgd(1.0), frozenset(lora.ADAPTER_KEYS))
    return Learner(Transformer(cfg, mesh=MESH), policy, MESH, PolicyLossConfig(),
                   UpdateConfig())


def test_lora_dropout_keeps_the_proximal_score_pass():
    """One epoch of one minibatch with LoRA dropout: the proximal log-probs come from the
    score pass (no dropout), not the policy step's own forward (dropped adapter inputs), so
    the engine's log-probs of the same params match them exactly (no gap) instead of carrying
    the masks' noise into importance weights, masks and approx_kl."""
    batch = _batch(16, seed=4)
    noisy = _lora_learner(dropout=0.5)
    assert not noisy.proximal_from_step
    behaviour = np.asarray(_score_pass(noisy, batch))  # what the engine samples with: no dropout
    scored = noisy.score(batch)
    np.testing.assert_array_equal(np.asarray(scored["old_logprobs"]), behaviour)
    metrics = noisy.update(dict(scored, behaviour_logprobs=behaviour))
    assert metrics["train/logprob_gap_max"] == 0.0
    assert _lora_learner(dropout=0.0).proximal_from_step  # without dropout the shortcut holds
