"""A trajectory's reward from several sources, combined by declared weights.

    reward = reward.rule_weight * (the env's own reward) + reward.model_weight * f(model score)

The env's reward (its scorer, math-verify, an exact answer: the "rule") is what the episode
loop already put on the trajectory; the reward model's score is that of the trajectory's
token ids at its last token (rl_tpu/rewards/scorer.py), where f is `reward.model_transform`:
"none" (the raw score) or "sigmoid" (a probability-like score in (0, 1), on the scale of a
success reward). Each trajectory keeps its sources in `info["reward_sources"]`, and
`source_metrics` logs their means over every host beside rollout/reward, so a run against a
learned reward shows what the model paid and what the env would have (rollout/success stays
the env's own verdict: the gold signal against a proxy).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import ml_collections
import numpy as np

from rl_tpu.agent.evaluation import global_sums
from rl_tpu.agent.trajectory import Trajectory
from rl_tpu.rewards.scorer import RewardScorer

log = logging.getLogger(__name__)

TRANSFORMS = ("none", "sigmoid")
SOURCES = ("rule", "model")


class RewardMix:
    """apply(trajectories): each one's reward becomes the weighted sum of its sources."""

    def __init__(self, scorer: RewardScorer, rule_weight: float, model_weight: float,
                 transform: str = "none"):
        if transform not in TRANSFORMS:
            raise ValueError(f"reward.model_transform={transform!r}; choose one of {TRANSFORMS}")
        self.scorer, self.transform = scorer, transform
        self.rule_weight, self.model_weight = float(rule_weight), float(model_weight)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, devices) -> Optional["RewardMix"]:
        """The config's mix (None without reward.model_path or reward.urls), its reward model
        on `devices` (this host's sampler devices: it scores on the producer thread, as the
        sampler plays), or on the reward servers of reward.urls (rl_tpu/rewards/remote.py)."""
        r = config.reward
        if r.urls:
            from rl_tpu.rewards.remote import RemoteRewardScorer
            scorer = RemoteRewardScorer(r.urls)
            log.info("reward model: %d label(s) served at %s", scorer.num_labels, r.urls)
        elif r.model_path:
            scorer = RewardScorer.from_dir(r.model_path, devices, dtype=config.model.dtype,
                                           tokens_per_batch=r.tokens_per_batch)
        else:
            return None
        return cls(scorer, r.rule_weight, r.model_weight, r.model_transform)

    def model_rewards(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
        """[N] f(score) of each trajectory's ids."""
        scores = self.scorer.score([t.tokens for t in trajectories])[:, 0].astype(np.float64)
        if self.transform == "sigmoid":
            scores = 1.0 / (1.0 + np.exp(-scores))
        return scores

    def apply(self, trajectories: Sequence[Trajectory]) -> None:
        if not trajectories:
            return
        model = self.model_rewards(trajectories)
        for traj, score in zip(trajectories, model):
            rule = float(traj.reward)
            traj.info["reward_sources"] = {"rule": rule, "model": float(score)}
            traj.reward = self.rule_weight * rule + self.model_weight * float(score)


def source_metrics(trajectories: Sequence[Trajectory], enabled: bool) -> dict[str, float]:
    """rollout/reward_rule and rollout/reward_model: each source's mean over every host's
    trajectories (a collective: every host calls it alike, `enabled` from the config)."""
    if not enabled:
        return {}
    sums = np.zeros(1 + len(SOURCES), np.float64)
    for traj in trajectories:
        sources = traj.info.get("reward_sources")
        if sources is not None:
            sums += [1.0] + [sources[s] for s in SOURCES]
    sums = global_sums(sums)
    n = max(sums[0], 1.0)
    return {f"rollout/reward_{s}": float(sums[1 + i] / n) for i, s in enumerate(SOURCES)}
