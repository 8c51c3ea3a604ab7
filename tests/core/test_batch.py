"""The rollout batch's declaration (rl_tpu/core/batch.py FIELDS) drives its readers: the batch
trajectories_to_batch makes, the abstract batch aot and compile-ahead lower against, the
update's fields, the advantage estimators' inputs and the recipe's batch fields; a batch that
does not match it is refused, naming the field."""

import dataclasses

import jax
import numpy as np
import pytest

from rl_tpu.core import batch as core_batch
from rl_tpu.core.batch import (FIELDS, POLICY, REQUIRED, ROUTING, ROW, TOKEN, TURN, VALUE,
                               RolloutBatch, abstract_batch, update_fields)
from rl_tpu.core.trajectory import Trajectory
from rl_tpu.recipes import algorithms
from rl_tpu.rl.advantages import BATCH_KEYS, estimator_inputs
from rl_tpu.train import steps
from rl_tpu.train.rollout_batch import trajectories_to_batch

B, T, M, S, K = 4, 6, 2, 3, 2
SIZES = {TOKEN: (B, T), ROW: (B,), TURN: (B, M), ROUTING: (B, T, S, K)}


def _array(name, rows=B):
    return np.zeros((rows,) + SIZES[FIELDS[name].kind][1:], FIELDS[name].dtype)


def _full(**changes) -> RolloutBatch:
    """A batch carrying every field, as FIELDS declares it, with `changes` applied."""
    return RolloutBatch(**{name: _array(name) for name in FIELDS}).replace(**changes)


def _traj(n, group_id=0):
    return Trajectory(
        tokens=np.arange(1, n + 1, dtype=np.int32), loss_mask=np.ones(n, bool),
        behaviour_logprobs=np.full(n, -0.5, np.float32), turn_ids=np.zeros(n, np.int32),
        rewards=[1.0], reward=1.0, success=True, num_turns=1, weight_versions=["0"],
        task_id="t", group_id=group_id, finish="done", messages=[], info={})


def test_the_dataclass_and_the_table_declare_the_same_fields():
    assert [f.name for f in dataclasses.fields(RolloutBatch)] == list(FIELDS)
    assert REQUIRED == ("tokens", "positions", "segment_ids", "loss_mask")


def test_trajectories_to_batch_makes_every_array_as_declared():
    host = trajectories_to_batch([_traj(3), _traj(5, 1)], length_buckets=(8,), row_multiple=4)
    assert isinstance(host, RolloutBatch)
    assert host.check() is host  # dtypes, shape kinds, one B and one T
    for name, x in host.items():
        assert x.dtype == FIELDS[name].dtype, name
        assert x.shape == ((4, 8) if FIELDS[name].kind == TOKEN else (4,)), name
        assert FIELDS[name].made_by == core_batch.ROLLOUT, name


def test_abstract_batch_follows_the_declaration():
    abstract = abstract_batch(B, T, None, FIELDS, turns=M, routing=(S, K))
    for name, spec in FIELDS.items():
        assert abstract[name].shape == SIZES[spec.kind], name
        assert abstract[name].dtype == spec.dtype, name
    with pytest.raises(ValueError, match="'turn_rewards' needs the number of turn slots"):
        abstract_batch(B, T, None, ["turn_rewards"])
    with pytest.raises(ValueError, match="'routed_experts' needs .* \\(routing=\\)"):
        abstract_batch(B, T, None, ["routed_experts"])


def test_update_fields_follow_the_declaration():
    policy_always = [k for k, s in FIELDS.items() if POLICY in s.always]
    assert update_fields(POLICY) == policy_always
    assert policy_always == ["tokens", "positions", "segment_ids", "loss_mask", "old_logprobs",
                             "advantages"]
    # the optional ones come in only when the batch carries them; a field no update reads
    # (rewards, turn_ids) never does
    carried = ["behaviour_logprobs", "rewards", "turn_ids", "length_normalizer"]
    assert update_fields(POLICY, carried) == [
        "tokens", "positions", "segment_ids", "loss_mask", "behaviour_logprobs",
        "length_normalizer", "old_logprobs", "advantages"]
    assert update_fields(VALUE, carried) == ["tokens", "positions", "segment_ids", "loss_mask",
                                             "values", "returns"]


def test_estimators_read_fields_by_name_and_the_recipe_sends_what_they_read():
    for name in FIELDS:  # any field can be an estimator's input, with its declared shape
        assert BATCH_KEYS[name] == core_batch.shape_of(name)
    assert estimator_inputs("grpo") == ("rewards", "group_ids", "loss_mask")
    full = [_traj(3)]
    grpo = algorithms.algo_config("grpo")
    assert algorithms.batch_keys(full, grpo) == [*REQUIRED, "rewards", "group_ids",
                                                 "behaviour_logprobs"]
    # GAE reads values too, but the learner makes them: the recipe does not send them
    assert algorithms.batch_keys(full, algorithms.algo_config("ppo")) == [
        *REQUIRED, "token_rewards", "behaviour_logprobs"]
    tl = algorithms.batch_keys(full, algorithms.algo_config("tl_grpo"))
    assert {"turn_rewards", "turn_group_ids", "turn_ids"} <= set(tl)


def test_truncated_logprobs_are_left_out_unless_needed():
    truncated = [dataclasses.replace(_traj(3), logprob_convention="truncated")]
    grpo = algorithms.algo_config("grpo")
    assert "behaviour_logprobs" not in algorithms.batch_keys(truncated, grpo)
    grpo.recompute_proximal = False
    with pytest.raises(ValueError, match="recompute_proximal=False need log-probs of the full"):
        algorithms.batch_keys(truncated, grpo)


@pytest.mark.parametrize("changes, message", [
    (dict(tokens=None), r"lacks \['tokens'\]"),
    (dict(tokens=np.zeros((B, T), np.int64)), "'tokens' is int64; it must be int32"),
    (dict(loss_mask=np.zeros((B, T), np.float32)), "'loss_mask' is float32; it must be bool"),
    (dict(rewards=np.zeros((B, T), np.float32)), r"'rewards' has shape \(4, 6\); it must be "
                                                  r"\[B\]"),
    (dict(advantages=np.zeros((B, T + 1), np.float32)), "'advantages' has T=7 but 'tokens' "
                                                         "has T=6"),
    (dict(group_ids=np.zeros((B + 1,), np.int32)), "'group_ids' has B=5 but 'tokens' has B=4"),
])
def test_a_batch_unlike_its_declaration_is_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        _full(**changes).check()


def test_a_field_a_consumer_needs_is_asked_for_by_name():
    batch = _full(behaviour_logprobs=None)
    with pytest.raises(ValueError, match=r"lacks \['behaviour_logprobs'\] \(the proximal\)"):
        batch.check(["behaviour_logprobs"], why="the proximal")
    with pytest.raises(ValueError, match="'kl_rewards'] are not rollout batch fields; declare"):
        RolloutBatch.of({"tokens": _array("tokens"), "kl_rewards": _array("rewards")})


def test_absent_fields_are_no_leaves_and_present_ones_are_read_by_name():
    batch = _full().only(REQUIRED)
    assert len(jax.tree.leaves(batch)) == len(REQUIRED)
    assert "advantages" not in batch and "dropout_rng" not in batch
    assert batch.get("advantages") is None and list(batch) == list(REQUIRED)
    with pytest.raises(KeyError, match="no 'advantages'"):
        batch["advantages"]
    # a pytree: micro-batch splitting and jit keep the type; the field set is jit's cache key
    split = steps.split_micro_batches(batch, 2)
    assert isinstance(split, RolloutBatch) and split.tokens.shape == (2, B // 2, T)
    total = jax.jit(lambda b: sum(x.sum() for x in jax.tree.leaves(b)))
    assert int(total(batch.replace(tokens=np.ones((B, T), np.int32)))) == B * T
