"""A trajectory's reward from several sources, combined by declared weights.

    reward = reward.rule_weight * (the env's own reward) + reward.model_weight * f(model score)
             + reward.judge_weight * (a judge's verdict: 1 or 0)

The env's reward (its scorer, math-verify, an exact answer: the "rule") is what the episode
loop already put on the trajectory; the reward model's score is that of the trajectory's
token ids at its last token (rl_tpu/rewards/scorer.py), where f is `reward.model_transform`:
"none" (the raw score) or "sigmoid" (a probability-like score in (0, 1), on the scale of a
success reward); the judge's verdict is rl_tpu/rewards/judge_reward.py's (a reply it gives no
verdict on is kept out of the loss). Each trajectory keeps its sources in
`info["reward_sources"]`, and `source_metrics` logs their means over every host beside
rollout/reward, so a run against a learned reward shows what the model paid and what the env would have (rollout/success stays
the env's own verdict: the gold signal against a proxy).

An episode without a reply (its env failed at reset, or its first prompt left no room in the
context) is never put to the reward model or the judge: there is nothing of the policy's to
score, a reward model refuses an empty sequence and a judge a transcript with no answer, and
one such episode must not end a run. It keeps the env's part of the reward, is kept out of the
loss (`NO_LOSS`, as an env error is) and says why in `info["reward_error"]`.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import ml_collections
import numpy as np

from rl_tpu import parallel
from rl_tpu.core.trajectory import Trajectory
from rl_tpu.models.tokenizer import ChatTokenizer, load_tokenizer
from rl_tpu.rewards import judge_reward
from rl_tpu.rewards.scorer import RewardScorer
from rl_tpu.rewards.tokenizer_match import check_match, fingerprint
from rl_tpu.train.rollout_batch import NO_LOSS

log = logging.getLogger(__name__)

TRANSFORMS = ("none", "sigmoid")
SOURCES = ("rule", "model", "judge")


class RewardMix:
    """apply(trajectories): each one's reward becomes the weighted sum of its sources: the
    env's (always), a reward model's (`scorer`, optional) and a judge's verdict (`judge`,
    optional: rl_tpu/rewards/judge_reward.py)."""

    def __init__(self, scorer: Optional[RewardScorer], rule_weight: float, model_weight: float,
                 transform: str = "none", judge=None, judge_weight: float = 1.0):
        if transform not in TRANSFORMS:
            raise ValueError(f"reward.model_transform={transform!r}; choose one of {TRANSFORMS}")
        if scorer is None and judge is None:
            raise ValueError("a reward mix needs a reward model or a judge beside the env")
        self.scorer, self.transform, self.judge = scorer, transform, judge
        self.rule_weight, self.model_weight = float(rule_weight), float(model_weight)
        self.judge_weight = float(judge_weight)

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources this mix pays from (the same on every host: the config's)."""
        return tuple(s for s, on in zip(SOURCES, (True, self.scorer is not None,
                                                  self.judge is not None)) if on)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, devices, policy_engine=None,
                    policy_tokenizer=None) -> Optional["RewardMix"]:
        """The config's mix (None without reward.model_path, reward.urls or reward.judge): its
        reward model on `devices` (this host's sampler devices: it scores on the producer
        thread, as the sampler plays) or on the reward servers of reward.urls
        (rl_tpu/rewards/remote.py), refused if its tokenizer is not `policy_tokenizer`; its
        judge a frozen model on `devices` or the policy (`policy_engine`,
        `policy_tokenizer`)."""
        r = config.reward
        scorer = None
        if r.urls:
            # imported here for its cost: the reward server's web stack, needed only with
            # reward.urls
            from rl_tpu.rewards.remote import RemoteRewardScorer
            scorer = RemoteRewardScorer(r.urls)
            log.info("reward model: %d label(s) served at %s", scorer.num_labels, r.urls)
        elif r.model_path:
            scorer = RewardScorer.from_dir(r.model_path, devices, dtype=config.model.dtype,
                                           tokens_per_batch=r.tokens_per_batch)
        if scorer is not None and policy_tokenizer is not None:
            check_reward_tokenizer(config, scorer, policy_tokenizer)
        judge = judge_reward.from_config(config, devices, policy_engine, policy_tokenizer)
        if scorer is None and judge is None:
            return None
        return cls(scorer, r.rule_weight, r.model_weight, r.model_transform, judge,
                   r.judge_weight)

    def model_rewards(self, trajectories: Sequence[Trajectory]) -> np.ndarray:
        """[N] f(score) of each trajectory's ids (each with a reply: `has_reply`)."""
        scores = self.scorer.score([t.tokens for t in trajectories])[:, 0].astype(np.float64)
        if self.transform == "sigmoid":
            scores = 1.0 / (1.0 + np.exp(-scores))
        return scores

    def apply(self, trajectories: Sequence[Trajectory]) -> None:
        for traj in trajectories:
            if not has_reply(traj):
                rule = float(traj.reward)
                traj.info[NO_LOSS] = True
                traj.info["reward_error"] = (
                    f"not scored: the episode ended (finish={traj.finish!r}) before the policy "
                    "replied, so the reward model and judge have nothing to score")
                traj.info["reward_sources"] = {"rule": rule}
                traj.reward = self.rule_weight * rule
        trajectories = [t for t in trajectories if has_reply(t)]
        if not trajectories:
            return
        model = self.model_rewards(trajectories) if self.scorer is not None else None
        judged = self.judge.rewards(trajectories) if self.judge is not None else None
        for i, traj in enumerate(trajectories):
            rule = float(traj.reward)
            sources, reward = {"rule": rule}, self.rule_weight * rule
            if model is not None:
                sources["model"] = float(model[i])
                reward += self.model_weight * float(model[i])
            if judged is not None:
                value, error = judged[0][i], judged[1][i]
                if value is None:  # no verdict: out of the loss, never a silent 0
                    traj.info[NO_LOSS] = True
                    traj.info["judge_error"] = error
                    sources["judge"] = float("nan")
                else:
                    sources["judge"] = value
                    reward += self.judge_weight * value
            traj.info["reward_sources"] = sources
            traj.reward = reward


def check_reward_tokenizer(config: ml_collections.ConfigDict, scorer,
                           policy_tokenizer: ChatTokenizer) -> None:
    """ValueError when the reward model's tokenizer is not the policy's
    (rl_tpu/rewards/tokenizer_match.py); a warning when it cannot be told (a reward server
    without a tokenizer, a reward model directory without one)."""
    r = config.reward
    where = f"reward.urls={r.urls!r}" if r.urls else f"reward.model_path={r.model_path!r}"
    if r.urls:
        reward = scorer.info().get("tokenizer")
    else:
        try:
            reward = fingerprint(load_tokenizer(r.model_path))
        except FileNotFoundError:
            reward = None
    if reward is None:
        log.warning("%s: the reward model has no tokenizer to compare with the policy's; its "
                    "scores are only meaningful if it was trained on the policy's token ids",
                    where)
        return
    check_match(policy_tokenizer, reward, where)


def has_reply(traj: Trajectory) -> bool:
    """Whether the policy sampled any id in `traj` (an episode that ended before its first
    reply has none)."""
    return traj.num_generated > 0


def source_metrics(trajectories: Sequence[Trajectory],
                   sources: Sequence[str] = ()) -> dict[str, float]:
    """rollout/reward_<source>: each source's mean over every host's trajectories that have it
    (a judge's unparsed verdicts left out), and rollout/judge_unparsed, the share of judged
    trajectories without a verdict. A collective: every host calls it with the same `sources`
    (the mix's, from the config; () = no mix, nothing to do)."""
    if not sources:
        return {}
    sums = np.zeros((len(sources), 2), np.float64)  # [source, (count, sum)]
    unparsed = 0.0
    for traj in trajectories:
        got = traj.info.get("reward_sources", {})
        for j, source in enumerate(sources):
            value = got.get(source)
            if value is not None and math.isfinite(value):
                sums[j] += (1.0, value)
            elif value is not None:
                unparsed += 1
    local = np.append(sums.ravel(), [unparsed, float(len(trajectories))])
    totals = parallel.across_hosts(local, "sum")  # every host's, the same on each
    sums, unparsed, n = totals[:-2].reshape(len(sources), 2), totals[-2], totals[-1]
    out = {f"rollout/reward_{s}": float(sums[j, 1] / max(sums[j, 0], 1.0))
           for j, s in enumerate(sources)}
    if "judge" in sources:
        out["rollout/judge_unparsed"] = float(unparsed / max(n, 1.0))
    return out
