"""The algorithm table: defaults, DAPO's extras by hand, and one trained step per algorithm."""

import numpy as np
import pytest

from rl_tpu.core.trajectory import Trajectory
from rl_tpu.recipes import algorithms
from rl_tpu.recipes.config import base_config


def traj(reward, group_id, generated=4):
    mask = np.array([False] * 3 + [True] * generated)
    return Trajectory(tokens=np.arange(len(mask), dtype=np.int32), loss_mask=mask,
                      behaviour_logprobs=np.zeros(len(mask), np.float32),
                      turn_ids=np.where(mask, 0, -1).astype(np.int32), rewards=[reward],
                      reward=reward, success=reward > 0, num_turns=1, weight_versions=["0"],
                      task_id="t", group_id=group_id, finish="done", messages=[], info={})


def test_every_algorithm_builds_its_loss_and_advantage():
    for name in algorithms.ALGORITHMS:
        algo = algorithms.algo_config(name)
        loss = algorithms.loss_config(algo, max_new_tokens=16)
        assert loss.kind == {"gspo": "gspo", "bapo": "bapo", "cispo": "cispo"}.get(name, "ppo")
        algorithms.advantage_options(algo)
    assert algorithms.uses_critic(algorithms.algo_config("ppo"))
    assert algorithms.uses_reference(algorithms.algo_config("reinforce_pp"))
    assert not algorithms.uses_reference(algorithms.algo_config("grpo"))
    dr = algorithms.loss_config(algorithms.algo_config("dr_grpo"), max_new_tokens=16)
    assert dr.fixed_normalizer == 16
    with pytest.raises(ValueError, match="unknown algorithm"):
        algorithms.algo_config("ppo2")


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    trajs = [traj(1, 0), traj(1, 0), traj(0, 1), traj(1, 1), traj(0, 2), traj(0, 2)]
    kept = algorithms.informative_groups(trajs)
    assert [[t.group_id for t in g] for g in kept] == [[1, 1]]


def test_overlong_shaping_by_hand():
    algo = algorithms.algo_config("dapo")
    algo.overlong_buffer = 4
    algo.overlong_penalty = 1.0
    # budget 10, buffer 4: no penalty up to 6 tokens, then (len - 6) / 4 of a point, at most 1
    trajs = [traj(1.0, 0, generated=n) for n in (5, 6, 8, 10)]
    algorithms.shape_overlong(trajs, algo, max_new_tokens=10)
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.5, 0.0]
    algo.overlong_buffer = 10
    with pytest.raises(ValueError, match="overlong_buffer"):
        algorithms.shape_overlong(trajs, algo, max_new_tokens=10)


def test_base_config_is_locked_and_checked():
    c = base_config("grpo")
    with pytest.raises(AttributeError):
        c.algo.clip_hgh = 0.3
    with pytest.raises(TypeError):
        c.train.steps = "abc"


def test_routed_experts_reach_the_learner_only_when_replayed_or_measured():
    from rl_tpu.recipes.config_checks import check
    from rl_tpu.recipes.rollout_settings import sampling_params
    c = base_config("grpo")
    assert "routed_experts" not in algorithms.batch_keys([traj(1, 0)], c.algo)
    assert not sampling_params(c, seed=0).return_routed_experts
    for key, value in (("routing_replay", "rollout"), ("log_routing_mismatch", True)):
        c = base_config("grpo")
        c.algo[key] = value
        assert "routed_experts" in algorithms.batch_keys([traj(1, 0)], c.algo)
        assert sampling_params(c, seed=0).return_routed_experts
    c = base_config("grpo")
    c.algo.routing_replay = "sampler"
    with pytest.raises(ValueError, match=r"routing_replay='sampler'; choose one of \('none'"):
        check(c)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "cispo"])
def test_each_algorithm_trains_a_step(tmp_path, name):
    from rl_tpu.metrics import read_metrics
    from rl_tpu.recipes import rl
    from rl_tpu.recipes.config import shrink_for_smoke

    c = shrink_for_smoke(base_config(name))
    c.train.steps = 1
    c.env.max_new_tokens = 4
    c.env.max_context_tokens = 64
    c.train.length_buckets = (64,)
    c.checkpoint.export_hf = False
    if name == "dapo":
        c.algo.overlong_buffer = 2
    rl.run(c, str(tmp_path))
    step = [r for r in read_metrics(str(tmp_path)) if r["step"] == 1][0]
    assert step["train/skipped"] == 0 and np.isfinite(step["train/loss"])
    if name == "dapo":
        assert "rollout/informative_group_frac" in step
    if name == "reinforce_pp":
        assert "train/kl" in step
