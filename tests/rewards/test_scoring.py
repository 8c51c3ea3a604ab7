"""Learned rewards: the Bradley-Terry step, the scorer's batches and the weighted mix, checked
against the reward model applied row by row and numbers worked out by hand."""

import math

import jax
import numpy as np
import optax
import pytest

from rl_tpu import parallel
from rl_tpu.core.trajectory import Trajectory
from rl_tpu.models import reward_model as rm
from rl_tpu.models import tiny
from rl_tpu.rewards.mix import RewardMix, source_metrics
from rl_tpu.rewards.scorer import RewardScorer
from rl_tpu.train import steps
from rl_tpu.train.rollout_batch import NO_LOSS
from rl_tpu.train.state import create_state

V = 64
CFG = tiny.tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                        head_dim=8)
HEAD = rm.RewardHead(num_labels=1, pad_token_id=0)


def reward_params(stddev=0.5, seed=0):
    policy = tiny.random_params(CFG, seed=seed, scale=0.2)
    return rm.reward_params_from(policy, CFG, 1, stddev=stddev, seed=seed)


def one_by_one(params, sequences):
    """Each sequence alone through the model: its score at its last token."""
    model = rm.RewardModel(CFG, 1)
    out = []
    for ids in sequences:
        scores = model.apply({"params": params}, np.asarray([ids], np.int32))
        out.append(float(scores[0, len(ids) - 1, 0]))
    return np.asarray(out)


def local_mesh(n):
    return parallel.make_mesh({"data": -1}, devices=jax.local_devices()[:n])


def sequences(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(1, V, n).tolist() for n in lengths]


def test_rows_for_a_length_fit_the_budget_in_powers_of_two():
    scorer = RewardScorer(CFG, HEAD, reward_params(), local_mesh(1), tokens_per_batch=100,
                          max_rows=4)
    # 100 // 16 = 6 -> 4 (max_rows); 100 // 32 = 3 -> 2; 100 // 64 = 1; 100 // 128 = 0 -> 1
    assert [scorer.rows_for(t) for t in (16, 32, 64, 128)] == [4, 2, 1, 1]
    two = RewardScorer(CFG, HEAD, reward_params(), local_mesh(2), tokens_per_batch=100,
                       max_rows=4)
    assert [two.rows_for(t) for t in (16, 32, 64)] == [4, 2, 2]  # a row a device at least


@pytest.mark.parametrize("devices", [1, 2])
def test_scores_are_the_models_own_at_each_last_token_whatever_the_batching(devices):
    params = reward_params()
    lengths = [5, 40, 17, 1, 33, 16, 9, 64, 2]  # buckets 16, 32, 64: several batches each
    seqs = sequences(lengths)
    scorer = RewardScorer(CFG, HEAD, params, local_mesh(devices), tokens_per_batch=64,
                          max_rows=4)
    got = scorer.score(seqs)
    assert got.shape == (len(seqs), 1)
    np.testing.assert_allclose(got[:, 0], one_by_one(params, seqs), atol=1e-5)
    assert scorer.score([]).shape == (0, 1)
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        scorer.score([[3], []])


def pair_batch(chosen, rejected, margin, weight):
    t = 16
    out = {}
    for side, seqs in (("chosen", chosen), ("rejected", rejected)):
        tokens = np.zeros((len(seqs), t), np.int32)
        segments = np.zeros((len(seqs), t), np.int32)
        for i, ids in enumerate(seqs):
            tokens[i, :len(ids)], segments[i, :len(ids)] = ids, 1
        out[f"{side}_tokens"], out[f"{side}_segment_ids"] = tokens, segments
        out[f"{side}_positions"] = np.broadcast_to(np.arange(t, dtype=np.int32), (len(seqs), t))
    out["margin"] = np.asarray(margin, np.float32)
    out["weight"] = np.asarray(weight, np.float32)
    return out


def test_bradley_terry_step_starts_at_log_two_and_accumulates_exactly():
    model = rm.RewardModel(CFG, 1)
    chosen, rejected = sequences([3, 7, 5, 9], 1), sequences([6, 2, 8, 4], 2)
    batch = pair_batch(chosen, rejected, [0.0, 0.5, 0.0, 1.0], [1, 1, 1, 0])
    # a zero head scores everything 0: bt = -log sigmoid(0 - m) per pair, over the 3 weighted
    zero = reward_params(stddev=0.0)
    step = jax.jit(steps.make_reward_model_step(model))
    _, m = step(create_state(zero, optax.sgd(0.1)), batch)
    expected = (math.log(2) + math.log1p(math.exp(0.5)) + math.log(2)) / 3
    assert float(m["bt_loss"]) == pytest.approx(expected, abs=1e-6)
    assert float(m["accuracy"]) == 0.5 and float(m["pairs"]) == 3.0
    # two micro-batches give the one big batch's update (weights split 2 + 1)
    params = reward_params()
    whole, m1 = jax.jit(steps.make_reward_model_step(model))(
        create_state(params, optax.sgd(1.0)), batch)
    split, m2 = jax.jit(steps.make_reward_model_step(model, cfg=steps.StepConfig(
        micro_batches=2)))(create_state(reward_params(), optax.sgd(1.0)), batch)
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(split.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), abs=1e-6)
    assert float(m2["pairs"]) == 3.0


def trajectory(tokens, reward):
    n = len(tokens)
    return Trajectory(tokens=np.asarray(tokens, np.int32), loss_mask=np.ones(n, bool),
                      behaviour_logprobs=np.zeros(n, np.float32),
                      turn_ids=np.zeros(n, np.int32), rewards=[reward], reward=reward,
                      success=reward > 0, num_turns=1, weight_versions=[0], task_id="t",
                      group_id=0, finish="done", messages=[], info={})


def test_mix_weighs_the_env_and_the_model_as_declared():
    params = reward_params()
    seqs = sequences([4, 11, 6])
    scores = one_by_one(params, seqs)
    scorer = RewardScorer(CFG, HEAD, params, local_mesh(1))
    trajs = [trajectory(s, r) for s, r in zip(seqs, (1.0, 0.0, 1.0))]
    RewardMix(scorer, rule_weight=0.25, model_weight=2.0, transform="sigmoid").apply(trajs)
    for traj, rule, score in zip(trajs, (1.0, 0.0, 1.0), scores):
        sig = 1 / (1 + math.exp(-score))
        assert traj.reward == pytest.approx(0.25 * rule + 2.0 * sig, abs=1e-5)
        assert traj.info["reward_sources"]["rule"] == rule
        assert traj.info["reward_sources"]["model"] == pytest.approx(sig, abs=1e-6)
    metrics = source_metrics(trajs, ("rule", "model"))
    assert metrics["rollout/reward_rule"] == pytest.approx(2 / 3)
    sig_mean = float(np.mean(1 / (1 + np.exp(-scores))))
    assert metrics["rollout/reward_model"] == pytest.approx(sig_mean, abs=1e-6)
    assert source_metrics(trajs, ()) == {}
    with pytest.raises(ValueError, match="model_transform='tanh'"):
        RewardMix(scorer, 0.0, 1.0, transform="tanh")


def test_scorer_reads_an_exported_reward_model(tmp_path):
    params = reward_params()
    rm.save(str(tmp_path), CFG, params, HEAD)
    scorer = RewardScorer.from_dir(str(tmp_path), devices=jax.local_devices()[:2])
    seqs = sequences([3, 20, 9])
    np.testing.assert_allclose(scorer.score(seqs)[:, 0], one_by_one(params, seqs), atol=1e-5)


def unreplied(prompt, finish):
    """An episode that ended before the policy replied: its env failed at reset (no ids at
    all) or its first prompt left no room in the context (prompt ids, none sampled)."""
    n = len(prompt)
    return Trajectory(tokens=np.asarray(prompt, np.int32), loss_mask=np.zeros(n, bool),
                      behaviour_logprobs=np.zeros(n, np.float32),
                      turn_ids=np.full(n, -1, np.int32), rewards=[], reward=0.0, success=False,
                      num_turns=0, weight_versions=[], task_id="t", group_id=0, finish=finish,
                      messages=[], info={"error": "reset raised"})


def test_episodes_without_a_reply_are_not_scored_and_stay_out_of_the_loss():
    params = reward_params()
    seqs = sequences([4, 11])
    scorer = RewardScorer(CFG, HEAD, params, local_mesh(1))
    failed, too_long = unreplied([], "env_error"), unreplied([3, 4, 5], "context_limit")
    trajs = [trajectory(seqs[0], 1.0), failed, too_long, trajectory(seqs[1], 0.0)]
    RewardMix(scorer, rule_weight=0.5, model_weight=2.0).apply(trajs)  # no "sequence is empty"
    scores = one_by_one(params, seqs)
    assert trajs[0].reward == pytest.approx(0.5 + 2.0 * scores[0], abs=1e-5)
    assert trajs[3].reward == pytest.approx(2.0 * scores[1], abs=1e-5)
    for traj in (failed, too_long):
        assert traj.info[NO_LOSS] and "before the policy replied" in traj.info["reward_error"]
        assert traj.info["reward_sources"] == {"rule": 0.0} and traj.reward == 0.0
    assert not any(NO_LOSS in t.info for t in (trajs[0], trajs[3]))
    # the model's mean is over the scored episodes alone
    assert source_metrics(trajs, ("rule", "model"))["rollout/reward_model"] == pytest.approx(
        float(scores.mean()), abs=1e-5)
    RewardMix(scorer, 1.0, 1.0).apply([unreplied([], "env_error")])  # none to score at all


def test_online_dpo_with_a_reward_model_leaves_out_an_episode_without_a_reply():
    from rl_tpu.recipes import dpo
    scorer = RewardScorer(CFG, HEAD, reward_params(), local_mesh(1))
    # group 0: two replies and one whose first prompt left no room (not env_error: its
    # finish alone would not leave it out); group 1: an env that failed at reset
    replies = [trajectory([1, 2, 3], 0.0), trajectory([1, 4, 5, 6], 0.0)]
    too_long = unreplied([1, 7, 8], "context_limit")
    failed = unreplied([], "env_error")
    failed.group_id = 1
    trajectories = replies + [too_long, failed]
    RewardMix(scorer, 0.0, 1.0).apply(trajectories)  # was: "sequence 3 is empty"
    pairs, left_out = dpo.online_pairs(trajectories)
    assert left_out == 2
    best, worst = sorted(replies, key=lambda t: -t.reward)
    assert pairs == [tuple(([int(x) for x in t.tokens], [bool(m) for m in t.loss_mask])
                           for t in (best, worst))]
