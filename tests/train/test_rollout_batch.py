"""Trajectories -> Batch: token rewards, group ids, unscored and padding rows, by hand."""

import numpy as np
import pytest

from rl_tpu.core.trajectory import Trajectory
from rl_tpu.train.rollout_batch import sampled_budgets, trajectories_to_batch


def traj(mask, turns, rewards, finish="done", group_id=0):
    n = len(mask)
    return Trajectory(
        tokens=np.arange(1, n + 1, dtype=np.int32), loss_mask=np.asarray(mask, bool),
        behaviour_logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        turn_ids=np.asarray(turns, np.int32), rewards=list(rewards), reward=float(sum(rewards)),
        success=sum(rewards) > 0, num_turns=len(rewards), weight_versions=["0"] * len(rewards),
        task_id="t", group_id=group_id, finish=finish, messages=[], info={})


# Two turns: prompt (3 tokens, turn -1), action 0 = tokens 3-4, observation 5-6 (turn 0),
# action 1 = tokens 7-8.
TWO_TURNS = traj(mask=[0, 0, 0, 1, 1, 0, 0, 1, 1], turns=[-1, -1, -1, 0, 0, 0, 0, 1, 1],
                 rewards=[0.25, 1.0])


def test_turn_rewards_sit_on_each_turns_last_policy_token():
    b = trajectories_to_batch([TWO_TURNS], length_buckets=(16,))
    # turn 0's last policy token is index 4, turn 1's is index 8
    expected = np.zeros(16, np.float32)
    expected[4], expected[8] = 0.25, 1.0
    np.testing.assert_array_equal(b["token_rewards"][0], expected)
    assert b["rewards"][0] == 1.25
    assert b["tokens"].shape == (1, 16)
    np.testing.assert_array_equal(b["segment_ids"][0], [1] * 9 + [0] * 7)
    np.testing.assert_array_equal(b["positions"][0], np.arange(16))


def test_turn_without_policy_tokens_credits_the_previous_action():
    # turn 1 produced no tokens (an empty generation): its reward goes to turn 0's last token
    t = traj(mask=[0, 1, 1, 0], turns=[-1, 0, 0, 0], rewards=[0.5, 2.0])
    b = trajectories_to_batch([t], length_buckets=(4,))
    np.testing.assert_array_equal(b["token_rewards"][0], [0, 0, 2.5, 0])


def test_unscored_finishes_and_padding_rows_carry_no_loss_and_no_group():
    rows = [TWO_TURNS, traj([0, 1], [-1, 0], [1.0], finish="env_error"),
            traj([0, 1], [-1, 0], [0.0], finish="abort")]
    b = trajectories_to_batch(rows, length_buckets=(16,), row_multiple=4,
                              group_ids=[7, 7, 9])
    assert b["tokens"].shape == (4, 16)  # 3 rows rounded up to a multiple of 4
    np.testing.assert_array_equal(b["group_ids"], [7, -1, -1, -1])
    np.testing.assert_array_equal(b["valid"], [True, False, False, False])
    assert b["loss_mask"][1:].sum() == 0 and b["token_rewards"][1:].sum() == 0
    assert b["loss_mask"][0].sum() == 4


def test_length_is_the_bucket_of_the_longest_row_and_errors_are_clear():
    assert trajectories_to_batch([TWO_TURNS], length_buckets=(8, 12, 32))["tokens"].shape[1] == 12
    with pytest.raises(ValueError, match="largest length bucket"):
        trajectories_to_batch([TWO_TURNS], length_buckets=(4,))
    with pytest.raises(ValueError, match="no trajectories"):
        trajectories_to_batch([], length_buckets=(4,))
    with pytest.raises(ValueError, match="does not fit"):
        trajectories_to_batch([TWO_TURNS], length_buckets=(16,), length=8)


def test_each_row_keeps_the_budget_it_was_sampled_with():
    # rows sampled under budgets 32 and 64 (a stale chunk's), one without a record (an older
    # checkpoint's), then 2 padding rows: the default (this step's budget, 48) for both
    rows = [traj([0, 1], [-1, 0], [1.0]) for _ in range(3)]
    rows[0].info["max_new_tokens_per_turn"], rows[1].info["max_new_tokens_per_turn"] = 32, 64
    np.testing.assert_array_equal(sampled_budgets(rows, 5, 48), [32, 64, 48, 48, 48])
    assert sampled_budgets(rows, 5, 48).dtype == np.float32
    with pytest.raises(ValueError, match="rows 2 >= 3"):
        sampled_budgets(rows, 2, 48)
