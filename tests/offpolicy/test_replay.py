"""Replay keeps only rows that carry loss: fillers and unscored groups never come back."""

import numpy as np

from rl_tpu.offpolicy.replay import ReplayBuffer, ReplayConfig
from rl_tpu.train.rollout_batch import NO_LOSS
from rl_tpu.core.trajectory import Trajectory


def traj(reward, group_id, finish="done", filler=False):
    """A 3-id trajectory (prompt, two generated ids) sampled at version 0."""
    return Trajectory(tokens=np.arange(3, dtype=np.int32),
                      loss_mask=np.array([False, True, True]),
                      behaviour_logprobs=np.zeros(3, np.float32),
                      turn_ids=np.array([-1, 0, 0], np.int32), rewards=[reward], reward=reward,
                      success=reward > 0, num_turns=1, weight_versions=["0"], task_id="t",
                      group_id=group_id, finish=finish, messages=[],
                      info={NO_LOSS: True} if filler else {})


def test_replay_draws_no_filler_or_unscored_rows():
    informative = [traj(1.0, 0), traj(0.0, 0)]
    dapo_filler = [traj(1.0, 1, filler=True), traj(1.0, 1, filler=True)]  # equal rewards
    # self-play: an invalid proposal's filler rows share the proposals' group id
    proposals = [traj(0.5, 2), traj(0.0, 2), traj(0.0, 2, filler=True), traj(0.0, 2, filler=True)]
    unscored = [traj(0.0, 3, finish="env_error"), traj(0.0, 3, finish="abort")]
    buffer = ReplayBuffer(ReplayConfig(capacity=10, fraction=0.5, max_staleness=4))
    fresh = [informative, dapo_filler, proposals, unscored]
    mixed, metrics = buffer.mix(fresh, learner_version=0, step=1)
    assert mixed == fresh and metrics["replay/groups"] == 0  # an empty buffer replays nothing
    # Stored: the informative group whole, the proposals without their 2 fillers; the all-filler
    # and the all-unscored groups not at all.
    assert buffer.state() == [informative, proposals[:2]]
    # Step 2 wants ceil(0.5 / 0.5 * 4) = 4 replayed groups; the buffer holds 2 (it held 4 whose
    # 2 + 2 + 4 + 2 = 10 rows included 6 without loss, before fillers were left out).
    step_two = [[traj(1.0, g), traj(0.0, g)] for g in (4, 5, 6, 7)]
    mixed, metrics = buffer.mix(step_two, learner_version=1, step=2)
    replayed = mixed[4:]
    assert metrics["replay/groups"] == 2 and metrics["replay/buffer_groups"] == 2
    rows = [t for g in replayed for t in g]
    assert len(rows) == 4 and not any(t.info.get(NO_LOSS) for t in rows)
    assert all(t.finish == "done" for t in rows)


def test_a_loaded_buffer_leaves_out_what_carries_no_loss():
    # A checkpoint written before fillers were left out holds them; loading drops them.
    keep = [traj(1.0, 0), traj(0.0, 0, finish="env_error")]  # one scored row: kept whole
    buffer = ReplayBuffer(ReplayConfig(capacity=10))
    buffer.load_state([[traj(1.0, 1, filler=True)], keep, [traj(0.0, 2, finish="abort")]])
    assert buffer.state() == [keep]
