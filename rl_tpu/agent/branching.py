"""Branching rollouts for TL-GRPO: one episode a task, forked at a turn into G branches.

    trajectories = run_branching_episodes(engine, make_env, tasks, plan=BranchPlan(turn=3),
                                          samples_per_task=G, tokenizer=..., max_turns=H, ...)

Each task is played by ONE episode (the trunk) up to its fork turn f. There it forks into G
branches that share its history: the trunk goes on as branch 0, and G - 1 copies of it (token
history, loss mask, behaviour log-probs, per-turn rewards, transcript) go on as branches
1..G-1, each in a fresh env restored to the trunk's state by replaying the trunk's actions
(reset(task), then every action the env took, in order). From the fork on every branch
samples its own turns (its own seed stream), so the G continuations are G samples of the
policy from the same state: the group TL-GRPO normalises in.

Restoring by replay needs an env that is deterministic given the task and the actions. An
env says so with `replayable = True` (rl_tpu.core.env.Env; False by default); forking an
env that does not at a turn f >= 1 raises `NotReplayableError` before anything is generated.
Each replayed step is also checked against what the trunk saw (observation, reward, done):
an env that declared itself replayable but diverges ends that branch with `env_error`, the
step where it diverged in `info["error"]`. f = 0 needs no replay (a fresh reset), so every
env can branch there: that is GRPO's group of G samples from the start.

The fork turn: `BranchPlan.turn` for every task (`sample="fixed"`), or drawn per task
uniformly from 0..turn (`sample="uniform"`, seeded by the plan's seed and the task's group
id, so a rerun or a resumed run forks where the first did); either way at most H - 1, the
last turn there is. A trunk that ends before its fork turn (done early, an env error) forks
at turn 0 instead: G - 1 fresh episodes join it as its group.

What the trajectories carry: `info["branch_turn"]` (f), `info["branch_reward"]` (the
episode's `reward_reduce` over its own turns f.., the reward the branch group is normalised
on), and on copies `info["replay_steps"]` / `info["replay_s"]` and `info["inherited_tokens"]`
(the trunk's sampled tokens they start with). `turn_arrays` turns them
into the learner's TL-GRPO inputs, with the shared-prefix rule of docs/architecture.md
("Turn-level GRPO and branching rollouts"): the turns before the fork carry no loss in any
branch.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Sequence

import numpy as np

from rl_tpu import agent
from rl_tpu.core.env import Env, Task
from rl_tpu.core.engine import RolloutEngine
from rl_tpu.core.trajectory import Trajectory

SAMPLES = ("fixed", "uniform")


class NotReplayableError(ValueError):
    """A branching rollout would have to restore an env that cannot be restored by replay."""


class ReplayDivergedError(RuntimeError):
    """Replaying the trunk's actions did not give what the trunk saw."""


def replayable(env: Env) -> bool:
    """Whether `env` declares that reset(task) and the same actions reach the same state
    (`Env.replayable`; tests/agent/test_branching.py replays every shipped env that declares
    it)."""
    return bool(getattr(env, "replayable", False))


@dataclasses.dataclass(frozen=True)
class BranchPlan:
    """Where each task's episode forks: `turn` (the highest one when sampled), `sample`
    "fixed" | "uniform" (0..turn per task), `seed` for the uniform draw."""

    turn: int
    sample: str = "fixed"
    seed: int = 0

    def __post_init__(self):
        if self.turn < 0:
            raise ValueError(f"algo.branch_turn={self.turn} must be >= 0 (0: fork at the start)")
        if self.sample not in SAMPLES:
            raise ValueError(f"algo.branch_sample={self.sample!r}; choose one of {SAMPLES}")

    def turn_for(self, group_id: int, max_turns: int) -> int:
        """The fork turn of the task with `group_id` under a horizon of `max_turns` actions."""
        highest = min(self.turn, max_turns - 1)
        if self.sample == "fixed":
            return highest
        key = [self.seed, int(group_id) & 0x7FFFFFFF, 0xB4]  # 0xB4: this draw's own stream
        return int(np.random.SeedSequence(key).generate_state(1)[0] % (highest + 1))


def run_branching_episodes(engine: RolloutEngine, make_env: Callable[[], Env],
                           tasks: Sequence[Task], *, plan: BranchPlan, samples_per_task: int,
                           **kwargs) -> list[Trajectory]:
    """`agent.run_episodes` with branching: `samples_per_task` = G branches per task, forked
    per `plan`; task-major, each group in branch order (the trunk first). Other arguments as
    `agent.run_episodes` (partial rollouts excepted).

    Raises:
      NotReplayableError: a fork at turn >= 1 of an env that does not declare itself
        replayable (before any generation).
      ValueError: samples_per_task < 2, or a bad argument of the agent loop.
    """
    if samples_per_task < 2:
        raise ValueError(f"a branching rollout forks into samples_per_task={samples_per_task} "
                         "branches: set train.samples_per_task >= 2")
    forker = _Forker(plan, samples_per_task)
    return agent.run_episodes(engine, make_env, tasks, samples_per_task=samples_per_task,
                              forker=forker, **kwargs)


class _Forker:
    """Called by the agent loop before each round: forks every trunk that has reached its fork
    turn (or ended before it) into its group's other G - 1 episodes."""

    def __init__(self, plan: BranchPlan, samples_per_task: int):
        self.plan, self.g = plan, samples_per_task

    def bind(self, groups: list[list], make_env, tokenizer, workers, max_turns: int,
             max_context: int) -> None:
        """The call's groups (one trunk each, just reset) and what forking needs. Refuses an
        env that a fork would have to replay but cannot, before anything is generated."""
        self.groups, self.make_env, self.tokenizer = groups, make_env, tokenizer
        self.workers, self.max_context = workers, max_context
        self.turns = [self.plan.turn_for(group[0].group_id, max_turns) for group in groups]
        for group, turn in zip(groups, self.turns):
            env = group[0].env
            if turn >= 1 and env is not None and group[0].finish is None and not replayable(env):
                raise NotReplayableError(
                    f"env {getattr(env, 'name', type(env).__name__)!r} "
                    f"({type(env).__name__}) does not declare `replayable = True`, but a "
                    f"branching rollout forks at turn {turn} and restores each branch by "
                    "replaying the episode's actions in a fresh env. If reset(task) and the "
                    "same actions always reach the same state, declare `replayable = True` on "
                    "the env class; otherwise fork at the start (algo.branch_turn=0).")
        self.forked = [False] * len(groups)

    def __call__(self, episodes: list) -> None:
        copies, fresh = [], []
        for gi, (group, turn) in enumerate(zip(self.groups, self.turns)):
            trunk = group[0]
            if self.forked[gi] or (trunk.finish is None and trunk.turn < turn):
                continue  # forked already, or not at its fork turn yet
            self.forked[gi] = True
            at_turn = trunk.finish is None and trunk.turn_start is None
            trunk.info["branch_turn"] = turn if at_turn else 0
            for s in range(1, self.g):
                if at_turn:  # a copy of the trunk, its env restored by replay
                    branch = _copy_episode(trunk, len(episodes), s)
                    copies.append((branch, trunk))
                else:  # the trunk ended before its fork turn: fork at the start instead
                    branch = agent.Episode(len(episodes), trunk.task, trunk.group_id, s)
                    branch.info["branch_turn"] = 0
                    fresh.append(branch)
                episodes.append(branch)
                group.append(branch)
        if fresh:
            agent.start_episodes(fresh, self.make_env, self.tokenizer, self.workers, self.max_context)
        outcomes = self.workers.map([_replay_call(branch, trunk, self.make_env)
                                     for branch, trunk in copies])
        for (branch, _), outcome in zip(copies, outcomes):
            if not agent.ended_on_failure(branch, outcome, "replaying the trunk's actions"):
                branch.info["replay_steps"] = outcome.value
                branch.info["replay_s"] = outcome.seconds


def _copy_episode(trunk, index: int, sample_index: int):
    """A copy of the trunk's state (everything but its env), as branch `sample_index`."""
    env, trunk.env = trunk.env, None
    try:
        branch = copy.deepcopy(trunk)  # every field, so one added to Episode is copied too
    finally:
        trunk.env = env
    branch.index, branch.abandoned = index, False
    branch.info["sample_index"] = sample_index
    # the trunk sampled these once; a throughput count must not count them again per copy
    branch.info["inherited_tokens"] = int(sum(trunk.mask))
    return branch


def _replay_call(branch, trunk, make_env: Callable[[], Env]) -> Callable[[], int]:
    """The worker call that gives `branch` a fresh env in the trunk's state: reset, then the
    trunk's actions, each answer checked against the trunk's. Returns the steps replayed."""
    task, first, trace = trunk.task, trunk.first_observation, list(trunk.env_trace)

    def call() -> int:
        branch.env = make_env()  # set first, so an env whose replay fails is still closed
        seen = branch.env.reset(task)
        if seen != first:
            raise ReplayDivergedError(
                f"reset({task.task_id!r}) gave {seen!r:.120}, the trunk's reset gave "
                f"{first!r:.120}: the env is not deterministic given the task")
        for i, (action, observation, reward, done) in enumerate(trace):
            result = branch.env.step(action)
            got = (result.observation, float(result.reward), bool(result.done))
            if got != (observation, reward, done):
                raise ReplayDivergedError(
                    f"step {i} ({action!r:.80}) gave (observation, reward, done) = "
                    f"{got!r:.200}, the trunk saw {(observation, reward, done)!r:.200}: the "
                    "env is not deterministic given the task and the actions")
        return len(trace)

    return call


def turn_arrays(trajectories: Sequence[Trajectory], loss_mask: np.ndarray,
                group_ids: np.ndarray, num_slots: int) -> dict[str, np.ndarray]:
    """The TL-GRPO inputs of a host batch whose first rows are `trajectories` (in order).

    Returns `turn_rewards` f32[B, M] and `turn_group_ids` int32[B, M] (M = num_slots): slot f
    of row i (f its fork turn) holds its branch reward and its group id (the batch's
    `group_ids[i]`: -1 for a row that carries no loss), every other slot -1; the `tl_grpo`
    estimator with `carry_forward` gives every token of turns >= f that slot's advantage.
    And `loss_mask` [B, T] with the shared prefix (turns < f) cleared in every row.
    """
    b = loss_mask.shape[0]
    turn_rewards = np.zeros((b, num_slots), np.float32)
    turn_group_ids = np.full((b, num_slots), -1, np.int32)
    mask = np.array(loss_mask, bool)
    for i, traj in enumerate(trajectories):
        turn = traj.info.get("branch_turn")
        if turn is None:
            raise ValueError(f"trajectory of task {traj.task_id!r} has no branch turn: the "
                             "tl_grpo advantage trains on branching rollouts "
                             "(rl_tpu.agent.branching), not on plain or partial ones")
        if turn >= num_slots:
            raise ValueError(f"trajectory of task {traj.task_id!r} forked at turn {turn}, past "
                             f"the {num_slots} turn slots of algo.branch_turn={num_slots - 1}")
        mask[i, :len(traj)] &= np.asarray(traj.turn_ids) >= turn
        turn_rewards[i, turn] = traj.info["branch_reward"]
        turn_group_ids[i, turn] = group_ids[i]
    return {"loss_mask": mask, "turn_rewards": turn_rewards, "turn_group_ids": turn_group_ids}
