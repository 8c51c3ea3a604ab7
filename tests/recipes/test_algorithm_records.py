"""The algorithm records: algo_config pinned to the blocks of the per-name code it replaced,
each estimator's needs read by `algo.advantage`, and a record's defaults checked."""

import pytest

from rl_tpu import agent
from rl_tpu.recipes import algorithms
from rl_tpu.recipes.algorithms import Algorithm, register_algorithm
from rl_tpu.recipes.config import base_config, check

# The `algo` blocks algo_config returned before the records (commit ea50c9c, printed from
# `algo_config(name).to_dict()` there): the keys every algorithm shared, then each name's.
_BAPO = {"a_minus": 0.6, "a_plus": 1.2, "b_minus": 0.9, "b_plus": 3.0, "delta1": 0.05,
         "delta2": 0.02, "rho0": 0.4, "target": 0.5, "variant": "paper"}
_SHARED = {"aggregation": "token_mean", "bapo": _BAPO, "behaviour_is": "none",
           "behaviour_is_cap": 2.0, "behaviour_is_level": "token", "branch_sample": "fixed",
           "branch_turn": 0,
           "clip_high": 0.2, "clip_low": 0.2, "dual_clip": 0.0, "dynamic_sampling": False,
           "entropy_coef": 0.0, "gamma": 1.0, "kl_coef": 0.0, "kl_estimator": "k3", "lam": 1.0,
           "log_kl": False, "logprob_gap_threshold": 0.1, "mechanism_metrics": False,
           "max_refill_rounds": 3, "overlong_buffer": 0, "overlong_penalty": 1.0,
           "ratio_against": "proximal", "recompute_proximal": True, "reward_kl_coef": 0.0,
           "std_ddof": 1, "value_clip": 0.2, "value_lr": 1e-05, "whiten_advantages": False,
           # added after the records (mixtures of experts), off for every algorithm
           "routing_replay": "none", "log_routing_mismatch": False}
_OWN = {
    "ppo": {"advantage": "gae", "loss": "ppo", "lam": 0.95, "whiten_advantages": True},
    "grpo": {"advantage": "grpo", "loss": "ppo", "aggregation": "seq_mean_token_mean"},
    "dr_grpo": {"advantage": "dr_grpo", "loss": "ppo", "aggregation": "fixed_normalizer"},
    "dapo": {"advantage": "grpo", "loss": "ppo", "clip_high": 0.28, "dynamic_sampling": True},
    "gspo": {"advantage": "grpo", "loss": "gspo", "aggregation": "seq_mean_token_mean",
             "clip_low": 0.0003, "clip_high": 0.0004},
    "rloo": {"advantage": "rloo", "loss": "ppo"},
    "reinforce_pp": {"advantage": "reinforce_pp", "loss": "ppo", "reward_kl_coef": 0.01},
    "bapo": {"advantage": "grpo", "loss": "bapo", "ratio_against": "behaviour"},
    "tl_grpo": {"advantage": "tl_grpo", "loss": "ppo", "aggregation": "seq_mean_token_mean",
                "branch_turn": 2},
}
_KEYS = ["advantage", "aggregation", "bapo", "behaviour_is", "behaviour_is_cap",
         "behaviour_is_level",
         "branch_sample", "branch_turn", "clip_high", "clip_low", "dual_clip",
         "dynamic_sampling", "entropy_coef", "gamma", "kl_coef", "kl_estimator", "lam",
         "log_kl", "log_routing_mismatch", "logprob_gap_threshold", "loss",
         "max_refill_rounds", "mechanism_metrics", "name", "overlong_buffer", "overlong_penalty", "ratio_against",
         "recompute_proximal", "reward_kl_coef", "routing_replay", "std_ddof", "value_clip",
         "value_lr", "whiten_advantages"]


def _typed(tree):
    """Values with their types, so 1 and 1.0 (or 0 and False) differ."""
    if isinstance(tree, dict):
        return {k: _typed(v) for k, v in tree.items()}
    return (type(tree).__name__, tree)


@pytest.mark.parametrize("name", sorted(_OWN))
def test_algo_config_is_the_block_of_before(name):
    block = algorithms.algo_config(name)
    assert list(block.keys()) == _KEYS
    expected = {**_SHARED, **_OWN[name], "name": name}
    assert _typed(block.to_dict()) == _typed(expected)


def test_algorithms_are_the_registered_names_in_order():
    assert algorithms.ALGORITHMS == ("ppo", "grpo", "dr_grpo", "dapo", "gspo", "rloo",
                                     "reinforce_pp", "bapo", "tl_grpo", "cispo")
    for name in algorithms.ALGORITHMS:
        record = algorithms.algorithm(name)
        block = algorithms.algo_config(name)
        assert (block.advantage, block.loss) == (record.advantage, record.loss)


def test_cispo_block_and_loss():
    block = algorithms.algo_config("cispo")
    assert _typed(block.to_dict()) == _typed(
        {**_SHARED, "name": "cispo", "advantage": "grpo", "loss": "cispo", "clip_low": 1.0,
         "clip_high": 0.28})
    loss = algorithms.loss_config(block, max_new_tokens=16)
    assert (loss.kind, loss.clip_low, loss.clip_high, loss.aggregation, loss.dual_clip) == (
        "cispo", 1.0, 0.28, "token_mean", None)
    assert algorithms.advantage_options(block) == (("ddof", 1),)
    block.dual_clip = 3.0
    with pytest.raises(ValueError, match="cispo.*dual"):
        algorithms.loss_config(block, max_new_tokens=16)
    check(base_config("cispo"))  # a whole default config passes


def test_estimator_needs_follow_algo_advantage():
    # The block's advantage decides, not its name: grpo's block told to use GAE needs a
    # critic; told to use TL-GRPO it plays branches and adds the turn arrays.
    block = algorithms.algo_config("grpo")
    assert not algorithms.uses_critic(block)
    block.advantage = "gae"
    assert algorithms.uses_critic(block)
    assert dict(algorithms.advantage_options(block)) == {"gamma": 1.0, "lam": 1.0,
                                                         "whiten": False}
    block.advantage = "tl_grpo"
    assert algorithms.episode_player(block, 0) is not agent.run_episodes
    assert algorithms.episode_player(algorithms.algo_config("cispo"), 0) is agent.run_episodes
    block.advantage = "reinforce_pp"
    block.reward_kl_coef = 0.1
    assert algorithms.uses_reference(block)
    assert algorithms.update_config(base_config("reinforce_pp")).reward_kl_coef == 0.01
    assert algorithms.update_config(base_config("grpo")).reward_kl_coef == 0.0
    block.advantage = "grpo2"
    with pytest.raises(ValueError, match=r"algo.advantage='grpo2'; choose one of \['dr_grpo'"):
        algorithms.advantage_options(block)


@pytest.mark.parametrize("name,group_based", [("grpo", True), ("dr_grpo", True), ("rloo", True),
                                              ("tl_grpo", True), ("cispo", True),
                                              ("ppo", False), ("reinforce_pp", False)])
def test_group_based_estimators_need_two_samples(name, group_based):
    c = base_config(name)
    c.train.samples_per_task = 1
    if group_based:
        with pytest.raises(ValueError, match="compares samples of a task"):
            check(c)
    else:
        check(c)


def test_tl_grpo_refuses_partial_rollouts():
    c = base_config("tl_grpo")
    c.rollout.max_staleness = 1
    c.rollout.deterministic = False
    c.rollout.partial_token_budget = 64
    with pytest.raises(ValueError, match="'tl_grpo' plays branching rollouts"):
        check(c)


@pytest.mark.parametrize("defaults,message", [
    ({"name": "x"}, "not a plain key"),
    ({"bapo": {}}, "not a plain key"),
    ({"clip_hgh": 0.3}, "not a plain key"),
    ({"clip_high": 1}, "is a int; the block's clip_high is a float"),
    ({"clip_high": 0.2}, "shared default already"),
])
def test_a_record_lists_only_changed_block_keys(defaults, message):
    with pytest.raises(ValueError, match=message):
        register_algorithm(Algorithm("never_registered", "grpo", defaults=defaults))
    assert "never_registered" not in algorithms.ALGORITHM_RECORDS


def test_a_record_names_registered_math():
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpo2'"):
        register_algorithm(Algorithm("never_registered", "grpo2"))
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        register_algorithm(Algorithm("never_registered", "grpo", "ppo2"))
    with pytest.raises(ValueError, match="algorithm 'grpo' is registered twice"):
        register_algorithm(Algorithm("grpo", "grpo"))
