"""The RL algorithms a config can name, as settings of the same loop.

Each algorithm is a choice of advantage estimator, policy loss (ratio clipping, aggregation)
and rollout-side extras. `algo_config(name)` returns the `algo` config block with that
algorithm's defaults filled in, so an experiment file shows every knob it can sweep; the
functions below turn the (possibly overridden) block into the objects the learner takes.

| name         | advantage    | policy loss                     | extras                          |
|--------------|--------------|---------------------------------|---------------------------------|
| ppo          | gae (critic) | ppo clip [0.8, 1.2], token mean | value step after the policy step|
| grpo         | grpo         | ppo clip [0.8, 1.2], seq mean   |                                 |
| dr_grpo      | dr_grpo      | ppo clip, fixed normaliser      | normaliser = generation budget  |
| dapo         | grpo         | clip-higher [0.8, 1.28], token  | dynamic sampling, overlong shape|
| gspo         | grpo         | gspo (sequence ratio) 3e-4/4e-4 | sequence-level aggregation      |
| rloo         | rloo         | ppo clip, token mean            |                                 |
| reinforce_pp | reinforce_pp | ppo clip, token mean            | KL to the reference, in reward  |
| bapo         | grpo         | bapo adaptive bounds (Eq. 8)    | variant=verl: dual clip 3.0     |
"""

from __future__ import annotations

from typing import Sequence

import ml_collections

from rl_tpu.agent import Trajectory
from rl_tpu.rl.bapo import BapoConfig
from rl_tpu.rl.losses import PolicyLossConfig

ALGORITHMS = ("ppo", "grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "bapo")

_ADVANTAGE = {"ppo": "gae", "grpo": "grpo", "dr_grpo": "dr_grpo", "dapo": "grpo",
              "gspo": "grpo", "rloo": "rloo", "reinforce_pp": "reinforce_pp", "bapo": "grpo"}
_LOSS_KIND = {"gspo": "gspo", "bapo": "bapo"}


def algo_config(name: str) -> ml_collections.ConfigDict:
    """The `algo` block with `name`'s defaults (every key a sweep may override)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {ALGORITHMS}")
    c = ml_collections.ConfigDict()
    c.name = name
    c.advantage = _ADVANTAGE[name]
    c.gamma = 1.0  # gae / reinforce_pp discount (over the agent's tokens)
    c.lam = 0.95 if name == "ppo" else 1.0  # gae lambda
    c.std_ddof = 1  # grpo std: 1 = unbiased (TRL, verl, DeepSeekMath)
    c.loss = _LOSS_KIND.get(name, "ppo")
    c.clip_low = 3e-4 if name == "gspo" else 0.2
    c.clip_high = {"dapo": 0.28, "gspo": 4e-4}.get(name, 0.2)
    c.dual_clip = 0.0  # 0 = off (bapo.variant="verl" turns on its own 3.0)
    c.aggregation = {"grpo": "seq_mean_token_mean", "gspo": "seq_mean_token_mean",
                     "dr_grpo": "fixed_normalizer"}.get(name, "token_mean")
    c.entropy_coef = 0.0
    c.kl_coef = 0.0  # KL(pi || ref) as a loss term; > 0 keeps a frozen reference policy
    c.kl_estimator = "k3"
    c.reward_kl_coef = 0.01 if name == "reinforce_pp" else 0.0  # KL folded into the reward
    c.behaviour_is = "none"  # none | truncate | mask: engine/trainer mismatch correction
    c.behaviour_is_cap = 2.0
    c.dynamic_sampling = name == "dapo"  # drop groups whose rewards are all equal, refill
    c.max_refill_rounds = 3
    c.overlong_buffer = 0  # DAPO overlong shaping: the last N tokens of the budget are penalised
    c.overlong_penalty = 1.0  # ... linearly up to this much at the full budget (DAPO: set
    # the buffer per experiment, below the generation budget)
    c.bapo = ml_collections.ConfigDict(vars(BapoConfig()))
    c.value_clip = 0.2
    c.value_lr = 1e-5
    return c


def loss_config(algo: ml_collections.ConfigDict, max_new_tokens: int) -> PolicyLossConfig:
    if algo.name not in ALGORITHMS:
        raise ValueError(f"algo.name={algo.name!r}; choose one of {ALGORITHMS}")
    return PolicyLossConfig(
        kind=algo.loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
        dual_clip=algo.dual_clip or None, aggregation=algo.aggregation,
        fixed_normalizer=(max_new_tokens if algo.aggregation == "fixed_normalizer" else None),
        behaviour_is=algo.behaviour_is, behaviour_is_cap=algo.behaviour_is_cap,
        entropy_coef=algo.entropy_coef, kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
        bapo=BapoConfig(**algo.bapo.to_dict()))


def advantage_options(algo: ml_collections.ConfigDict) -> tuple:
    """(name, value) options compute_advantages passes to the estimator."""
    by_estimator = {"gae": {"gamma": algo.gamma, "lam": algo.lam},
                    "reinforce_pp": {"gamma": algo.gamma},
                    "grpo": {"ddof": algo.std_ddof},
                    "rloo": {}, "dr_grpo": {}}
    if algo.advantage not in by_estimator:
        raise ValueError(f"algo.advantage={algo.advantage!r}; choose one of {sorted(by_estimator)}")
    return tuple(sorted(by_estimator[algo.advantage].items()))


def uses_critic(algo: ml_collections.ConfigDict) -> bool:
    return algo.advantage == "gae"


def uses_reference(algo: ml_collections.ConfigDict) -> bool:
    return bool(algo.kl_coef) or bool(algo.reward_kl_coef and algo.advantage == "reinforce_pp")


def shape_overlong(trajectories: Sequence[Trajectory], algo, max_new_tokens: int) -> None:
    """DAPO's soft overlong punishment, in place: a response longer than budget - buffer loses
    (len - (budget - buffer)) / buffer * penalty of reward, up to `penalty` at the budget."""
    buffer = int(algo.overlong_buffer)
    if buffer <= 0:
        return
    if buffer >= max_new_tokens:
        raise ValueError(f"algo.overlong_buffer={buffer} must be below the generation budget "
                         f"{max_new_tokens}")
    start = max_new_tokens - buffer
    for traj in trajectories:
        over = traj.num_generated - start
        if over > 0:
            penalty = min(over / buffer, 1.0) * algo.overlong_penalty
            traj.reward -= penalty
            if traj.rewards:  # the last turn's reward too, so token-level rewards agree
                traj.rewards[-1] -= penalty


def informative_groups(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Groups (by group_id, in order) whose rewards are not all equal: DAPO's dynamic sampling
    keeps only these, since a group of equal rewards has zero advantage everywhere."""
    groups: dict[int, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    return [g for g in groups.values() if len({round(t.reward, 9) for t in g}) > 1]
