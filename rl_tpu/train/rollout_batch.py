"""Trajectories -> RolloutBatch: ragged host-side episodes stacked into one padded `[B, T]` batch.

Shape letters: B rows (trajectories + padding rows), T length bucket.

What the trainer needs from a rollout, and how each array is made (dtypes and shapes:
rl_tpu/core/batch.py FIELDS):
- `tokens`, `loss_mask`, `behaviour_logprobs`, `turn_ids` [B, T]: the trajectory's own arrays,
  right-padded to the length bucket (the smallest bucket that holds the longest row).
- `token_rewards` [B, T]: turn k's reward on the LAST policy token of turn k, so token-level
  estimators (GAE, REINFORCE++) credit each turn's action with its own reward; the episode's
  final scalar goes to `rewards` [B] for the outcome estimators (GRPO, RLOO).
- `group_ids` [B]: samples of one task share an id. The id is the task's GLOBAL stream index
  (unique across hosts and steps), so a replay buffer or several hosts never merge two tasks.
  Rows that must not enter a group's statistics get id -1: trajectories that ended with
  `env_error` or `abort` (their reward says nothing about the policy), rows flagged
  `info["no_loss"]` (DAPO's filler groups) and padding rows. Those rows also lose their loss
  mask: they carry no gradient and do not count in a token mean.
- `token_versions` [B, T]: the weight version that sampled each id (-1 elsewhere).
- Padding rows: B is rounded up to a multiple of `row_multiple` (data-parallel size x
  minibatches x micro-batches) with rows whose mask is all zero.
- `positions`, `segment_ids`: 0..T-1 and 1 on real tokens (0 on padding).
- `routed_experts` [B, T, S, K] when the trajectories carry a mixture of experts' routing (the
  sampler's, for routing replay): -1 wherever nothing was recorded, padding included, which
  the model reads as "route this token yourself".
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from rl_tpu.core.batch import FIELDS, TOKEN, RolloutBatch
from rl_tpu.core.trajectory import Trajectory
from rl_tpu.train.batching import bucket_length

# Episodes whose reward is not evidence about the policy: kept out of group statistics and loss.
UNSCORED_FINISHES = ("env_error", "abort")
NO_LOSS = "no_loss"  # a Trajectory.info flag: the row keeps the batch's shape, not its loss


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def trajectories_to_batch(trajectories: Sequence[Trajectory], *, length_buckets: Sequence[int],
                          row_multiple: int = 1, group_ids: Optional[Sequence[int]] = None,
                          length: Optional[int] = None) -> RolloutBatch:
    """Stack `trajectories` into a padded host batch (numpy).

    group_ids: one per trajectory (default: each trajectory's own `group_id`). length: the T to
    pad to (default: the bucket of the longest row); multi-host callers pass the bucket all
    hosts agreed on. Returns a RolloutBatch of tokens, positions, segment_ids, loss_mask,
    behaviour_logprobs, turn_ids, token_versions, token_rewards [B, T] and rewards, group_ids,
    valid [B].
    """
    if not trajectories:
        raise ValueError("no trajectories to batch: the rollout produced nothing")
    n = len(trajectories)
    ids = [t.group_id for t in trajectories] if group_ids is None else list(group_ids)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} group ids for {n} trajectories")
    longest = max(len(t) for t in trajectories)
    t_len = bucket_length(longest, length_buckets) if length is None else length
    if longest > t_len:
        raise ValueError(f"a trajectory of {longest} tokens does not fit length {t_len}")
    b = round_up(n, row_multiple)

    def full(name: str, fill=0):  # in the field's declared dtype; [B, T] or [B] by its kind
        shape = (b, t_len) if FIELDS[name].kind == TOKEN else (b,)
        return np.full(shape, fill, FIELDS[name].dtype)

    tokens, loss_mask, behaviour = full("tokens"), full("loss_mask"), full("behaviour_logprobs")
    turn_ids, versions = full("turn_ids", -1), full("token_versions", -1)
    token_rewards, segment_ids = full("token_rewards"), full("segment_ids")
    rewards, out_ids, valid = full("rewards"), full("group_ids", -1), full("valid")

    for i, (traj, gid) in enumerate(zip(trajectories, ids)):
        length_i = len(traj)
        tokens[i, :length_i] = traj.tokens
        segment_ids[i, :length_i] = 1
        turn_ids[i, :length_i] = traj.turn_ids
        behaviour[i, :length_i] = traj.behaviour_logprobs
        versions[i, :length_i] = traj.token_versions
        rewards[i] = traj.reward
        if traj.finish in UNSCORED_FINISHES or traj.info.get(NO_LOSS):
            continue  # no loss, no group membership: the row stays like padding
        valid[i] = True
        out_ids[i] = gid
        loss_mask[i, :length_i] = traj.loss_mask
        _place_turn_rewards(token_rewards[i], traj)

    positions = np.broadcast_to(np.arange(t_len, dtype=FIELDS["positions"].dtype),
                                (b, t_len)).copy()
    return RolloutBatch(tokens=tokens, positions=positions, segment_ids=segment_ids,
                        loss_mask=loss_mask, behaviour_logprobs=behaviour, turn_ids=turn_ids,
                        token_versions=versions, token_rewards=token_rewards, rewards=rewards,
                        group_ids=out_ids, valid=valid,
                        routed_experts=_stack_routing(trajectories, b, t_len))


def _stack_routing(trajectories: Sequence[Trajectory], rows: int, length: int
                   ) -> Optional[np.ndarray]:
    """[rows, length, S, K] of the trajectories' routed experts, -1 where absent; None when
    none carries any (a dense policy, or a run that did not ask for them)."""
    recorded = [t.routed_experts for t in trajectories if t.routed_experts is not None]
    if not recorded:
        return None
    shapes = {r.shape[1:] for r in recorded}
    if len(shapes) != 1:
        raise ValueError(f"trajectories carry routed experts of different shapes {shapes} "
                         "(sparse layers, experts a token): one policy's rollouts must agree")
    out = np.full((rows, length) + shapes.pop(), -1, FIELDS["routed_experts"].dtype)
    for i, traj in enumerate(trajectories):
        if traj.routed_experts is not None:
            out[i, :len(traj)] = traj.routed_experts
    return out


def sampled_budgets(trajectories: Sequence[Trajectory], rows: int, default: int) -> np.ndarray:
    """The batch's `length_normalizer` [rows]: the per-turn generation budget each trajectory
    was sampled with (the agent loop's `info["max_new_tokens_per_turn"]`; `default` for one
    without it, e.g. from a checkpoint written before it was recorded), padding rows
    `default`. Dr.GRPO's constant normaliser per row: a free-running producer samples a
    step's rows under earlier steps' budgets, and each row is normalised by its own."""
    if default < 1 or rows < len(trajectories):
        raise ValueError(f"default budget {default} must be >= 1 and rows {rows} >= "
                         f"{len(trajectories)} trajectories")
    out = np.full((rows,), default, FIELDS["length_normalizer"].dtype)
    out[:len(trajectories)] = [t.info.get("max_new_tokens_per_turn", default)
                               for t in trajectories]
    return out


def _place_turn_rewards(row: np.ndarray, traj: Trajectory) -> None:
    """Turn k's reward onto the last policy token of turn k (row is [T], written in place).

    A turn with no policy token (an engine that returned nothing) has no action to credit: its
    reward moves to the closest earlier policy token, as the advantage estimators would do.
    """
    mask = np.asarray(traj.loss_mask, bool)
    turns = np.asarray(traj.turn_ids)
    last_policy = -1
    for k, reward in enumerate(traj.rewards):
        where = np.flatnonzero(mask & (turns == k))
        if where.size:
            last_policy = int(where[-1])
        if reward and last_policy >= 0:
            row[last_policy] += reward
