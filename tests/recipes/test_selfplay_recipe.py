"""Self-play's reward for the proposer and the game's metrics, by hand; the smoke end to end."""

import numpy as np
import pytest
from test_loops import _train, _traj

from rl_tpu.metrics import read_metrics
from rl_tpu.recipes.config import selfplay_block
from rl_tpu.recipes.selfplay import game_metrics, proposer_reward
from rl_tpu.train.rollout_batch import NO_LOSS


@pytest.mark.parametrize("p,target,reward", [
    (0.5, 0.5, 1.0), (0.0, 0.5, 0.0), (1.0, 0.5, 0.0), (0.25, 0.5, 0.5),
    (1.0, 0.25, 0.0), (0.0, 0.25, 1 - 0.25 / 0.75), (0.5, 0.25, 1 - 0.25 / 0.75)])
def test_proposer_reward_peaks_at_the_target_success(p, target, reward):
    sp = selfplay_block()
    sp.target_success = target
    assert proposer_reward(p, sp) == pytest.approx(reward)


@pytest.mark.parametrize("p,learnability,band", [
    (0.0, 0.0, 0.0), (0.1, 0.36, 0.0), (0.2, 0.64, 1.0), (0.5, 1.0, 1.0), (0.8, 0.64, 1.0),
    (0.9, 0.36, 0.0), (1.0, 0.0, 0.0)])
def test_learnability_is_4p_1_minus_p_and_the_band_pays_inside_it(p, learnability, band):
    """4 p (1 - p): 4 * 0.1 * 0.9 = 0.36, 4 * 0.2 * 0.8 = 0.64; the band [0.2, 0.8] pays 1
    at its ends and inside."""
    sp = selfplay_block()
    sp.proposer_reward = "learnability"
    assert proposer_reward(p, sp) == pytest.approx(learnability)
    sp.proposer_reward = "band"
    assert proposer_reward(p, sp) == band
    sp.proposer_reward = "peek"
    with pytest.raises(ValueError, match="proposer_reward='peek'"):
        proposer_reward(p, sp)


def _proposal(terms, value, reward):
    t = _traj("propose/0", [1, 2], reward)
    t.info.update(role="propose", step_infos=[{"valid": True, "terms": terms, "value": value}])
    return t


def test_game_metrics_count_real_rows_by_role():
    invalid = _traj("propose/1", [1, 3], 0.0)
    invalid.info.update(role="propose", step_infos=[{"valid": False}])
    filler = _traj("propose/1", [1, 3], 0.0)
    filler.info.update(role="propose", step_infos=[{"valid": False}], **{NO_LOSS: True})
    solves = [_traj("solve/0", [4, 5], r) for r in (1.0, 0.0, 1.0, 1.0)]
    for t in solves:
        t.info["role"] = "solve"
    m = game_metrics([_proposal(2, 7, 0.5), _proposal(4, -3, 1.0), invalid, filler, *solves])
    assert m["selfplay/proposal_valid"] == 2 / 3  # the filler is not a proposal
    assert m["selfplay/proposal_terms"] == 3.0 and m["selfplay/proposal_abs_value"] == 5.0
    assert m["selfplay/solver_success"] == 0.75
    assert m["selfplay/proposer_reward"] == 0.5  # (0.5 + 1.0 + 0.0) / 3
    assert m["selfplay/solver_tokens"] == sum(t.num_generated for t in solves) > 0


def test_a_bad_proposer_reward_is_refused_at_start():
    from test_rl import config

    from rl_tpu.recipes.config import check
    from rl_tpu.recipes.selfplay import PROPOSER_REWARDS
    c = config("selfplay_arithmetic")
    for name in PROPOSER_REWARDS:
        c.selfplay.proposer_reward = name
        check(c)
    c.selfplay.proposer_reward = "peek"
    with pytest.raises(ValueError, match=r"selfplay.proposer_reward='peek' must be one of"):
        check(c)
    c.selfplay.proposer_reward, c.selfplay.band_low = "band", 0.9
    with pytest.raises(ValueError, match=r"band_low=0.9 <= selfplay.band_high=0.8"):
        check(c)


def test_selfplay_with_partial_rollouts_is_refused_naming_both_keys():
    from test_rl import config

    from rl_tpu.recipes.config import check
    c = config("selfplay_arithmetic")
    c.rollout.max_staleness, c.rollout.deterministic = 1, False  # what partial rollouts need
    check(c)
    c.rollout.partial_token_budget = 32  # paused episodes would be played without the game
    with pytest.raises(ValueError, match=r"recipe='selfplay' with "
                                         r"rollout\.partial_token_budget=32.*set "
                                         r"rollout\.partial_token_budget=0"):
        check(c)
    c.recipe = "rl"  # plain RL pauses and resumes its episodes as they are
    check(c)


@pytest.mark.slow
def test_selfplay_smoke_trains_both_roles(tmp_path):
    out = _train("configs/selfplay_arithmetic.py:smoke", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in read_metrics(str(tmp_path)) if "selfplay/proposal_valid" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["train/skipped"] == 0 and np.isfinite(r["train/loss"])
        assert 0 <= r["selfplay/proposal_valid"] <= 1


def _decision_trajectories():
    a = _traj("t/0", [1, 2], 1.0)
    a.info["step_infos"] = [{"violation": True}, {"violation": False}, {}]  # 2 valid, 1 broke
    b = _traj("t/1", [1, 2], 0.3)
    # an invalid reply (asked again), then a valid violation: 2 asked, 1 valid, 1 broke
    b.info["step_infos"] = [{"violation": False, "invalid_action": True}, {"violation": True}]
    c = _traj("t/2", [1, 2], 0.0)  # no decisions at all
    return a, b, c


def test_violation_rate_is_over_valid_decisions_and_format_validity_apart():
    from rl_tpu.agent.evaluation import episode_stats
    a, b, c = _decision_trajectories()
    stats = episode_stats([a, b, c])
    # asked 2 + 2 = 4; valid 2 + 1 = 3; broke 1 + 1 = 2. The invalid reply is no decision
    # about the rule: 2 / 3 (not 2 / 4), and 3 of 4 replies were valid.
    assert stats["violation_rate"] == 2 / 3
    assert stats["format_valid_rate"] == 3 / 4
    assert "violation_rate" not in episode_stats([c])  # an env without rules reports none
    assert "format_valid_rate" not in episode_stats([c])
    invalid_only = _traj("t/3", [1, 2], 0.0)
    invalid_only.info["step_infos"] = [{"violation": False, "invalid_action": True}]
    only = episode_stats([invalid_only])  # asked once, never valid: no rate of violations
    assert only["format_valid_rate"] == 0.0 and "violation_rate" not in only


def test_episode_stats_count_decisions_asked_valid_and_broken():
    from rl_tpu.core.trajectory import EpisodeStats
    stats = EpisodeStats.of(list(_decision_trajectories()))
    assert (stats.decisions, stats.valid_decisions, stats.violations) == (4, 3, 2)
    d = stats.as_dict()
    assert d["rollout/violation_rate"] == 2 / 3 and d["rollout/format_valid_rate"] == 3 / 4
    assert "rollout/violation_rate" not in EpisodeStats.of([_traj("t", [1, 2], 0.0)]).as_dict()


def test_rollout_metrics_log_violation_and_format_valid_rates():
    from types import SimpleNamespace

    from rl_tpu.recipes.config import base_config
    from rl_tpu.recipes.rl import Trainer
    a, b, c = _decision_trajectories()
    # _rollout_metrics reads only the config (the horizon and budget schedules)
    trainer = SimpleNamespace(config=base_config(), reward_mix=None)
    m = Trainer._rollout_metrics(trainer, [a, b, c], step=1)
    assert m["rollout/violation_rate"] == 2 / 3 and m["rollout/format_valid_rate"] == 3 / 4


@pytest.mark.slow
@pytest.mark.parametrize("testbed", ["tipping_routes", "tipping_commons"])
def test_tipping_smoke_logs_violation_rates_in_rollouts_and_evals(tmp_path, testbed):
    out = _train(f"configs/{testbed}.py:kl,seed1,smoke", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_metrics(str(tmp_path))
    evals = [r for r in records if "eval/success" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(0 <= r["eval/format_valid_rate"] <= 1 for r in evals)
    # no violation rate without a valid choice to count (a smoke's untrained replies)
    assert all(("eval/violation_rate" in r) == (r["eval/format_valid_rate"] > 0) for r in evals)
    assert all(0 <= r.get("eval/violation_rate", 0) <= 1 for r in evals)
    steps = [r for r in records if "rollout/reward" in r]
    assert all(0 <= r["rollout/format_valid_rate"] <= 1 and r["train/kl"] >= 0 for r in steps)
    # the smoke's sampled replies are mostly not A/B: a step without one valid reply has no
    # violation rate (not 0, which counting invalid replies as compliant used to report)
    assert all(("rollout/violation_rate" in r) == (r["rollout/format_valid_rate"] > 0)
               for r in steps)
