"""What one episode leaves behind, host side: `Trajectory`, and `EpisodeStats` over many.

A contract of rl_tpu.core: the boundary between the agent loop (rl_tpu/agent/loop.py, which
makes trajectories) and everything that consumes them (rl_tpu/train/, the rewards, the
replay buffer, the recipes). It imports no other rl_tpu package, so none of those depends on
the agent loop.

Versions. `weight_versions` holds the engine's version per turn (the last one that sampled in
that turn); `token_versions` holds each token's effective version, -1 where the policy did not
sample: the OLDEST version whose weights produced any of the K/V the token attended to.

- A weight update can land between two decode chunks of one generation (the embedded sampler
  and its continuous batcher pick new weights up at the next chunk; SGLang's pause / update /
  continue does the same). Tokens sampled after it attend to the prompt's and the earlier
  tokens' K/V, which the older weights computed: they keep the version the generation's K/V
  started with (the running minimum over the engine's spans), not the one that sampled them.
  Staleness, `rollout/dropped_stale` and the trainer's `rollout.mask_stale_tokens` read this
  version, so such tokens count as old as they are. (Their `behaviour_logprobs` entry is what
  the engine computed: the new weights over old K/V, neither version's exact log-prob.)
- A new generation (the next turn, or a partial rollout resumed under newer weights)
  re-prefills its whole history under the weights it starts with, so its tokens carry that
  version. (An engine that reuses cached K/V of older weights across an update, e.g.
  `rollout.prefix_cache_keep_on_update`, is inexact by choice; its reuse is not tracked here.)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Optional, Sequence

import numpy as np

NO_VERSION = -1  # token_versions on ids the policy did not sample (prompt, observations)


def version_number(version: Any) -> int:
    """A weight version as an int (rl_tpu's versions are train steps); -1 when it is not one."""
    try:
        return int(version)
    except (TypeError, ValueError):
        return NO_VERSION


def token_versions(n_tokens: int, version: Any, spans: Optional[Sequence[dict]] = None
                   ) -> list[int]:
    """Effective per-token versions of one generation of `n_tokens` ids (module doc), from the
    engine's spans ([{"version", "start", "end"}], output indices, as the sampler and SGLang
    report in `info["weight_versions"]`: which weights SAMPLED each id) when given, else
    `version` for every id.

    A span's ids attended to K/V computed by every earlier span's weights too (the prompt's by
    the first span's), so each id gets the oldest version of its span and every span before
    it: after a mid-generation swap from 3 to 5, the ids sampled by 5 count as 3. A span whose
    version is not a number (-1) marks its ids unknown and does not lower later ones."""
    out = [version_number(version)] * n_tokens
    oldest = None  # the oldest numbered version among the spans so far
    for span in sorted((s for s in spans or () if isinstance(s, dict)),
                       key=lambda s: int(s.get("start", 0))):
        start, end = int(span.get("start", 0)), min(int(span.get("end", n_tokens)), n_tokens)
        number = version_number(span.get("version"))
        if number != NO_VERSION:
            oldest = number if oldest is None else min(oldest, number)
        effective = NO_VERSION if number == NO_VERSION else oldest
        out[start:end] = [effective] * max(end - start, 0)
    return out


@dataclasses.dataclass
class Trajectory:
    """One episode, host side (see docs/architecture.md, "Trajectory").

    Turn ids: -1 on the initial prompt; k (0-based) on the k-th action's generated ids AND on
    the text appended after them (the template's closing text, the env's observation, the next
    generation prompt). So segment k is "action k and what it caused", and `rewards[k]` is the
    env's reward for it. The loss mask, not the turn id, says which ids the policy produced.
    """

    tokens: np.ndarray  # int32[T]: prompt + all turns
    loss_mask: np.ndarray  # bool[T]: exactly the ids the engine sampled
    behaviour_logprobs: np.ndarray  # float32[T]: the engine's logprob of each sampled id, else 0
    turn_ids: np.ndarray  # int32[T]: -1 prompt, k for turn k (see above)
    rewards: list[float]  # per turn, len == num_turns (0.0 for a turn the env never scored)
    reward: float  # reward_reduce(rewards), "sum" by default
    success: bool
    num_turns: int  # actions generated
    weight_versions: list  # engine weight version per turn (the last that sampled in it)
    task_id: str
    group_id: int  # samples of the same task share it
    finish: str  # one of FINISH_REASONS
    messages: list[dict]  # chat transcript for logging (ends with the final observation, if any)
    info: dict  # sample_index, env_steps, env_step_s, step_infos, error, final_observation...
    # What behaviour_logprobs are the log of (core/engine.py LOGPROB_CONVENTIONS):
    # "truncated" when any turn's engine reported renormalised top-p/top-k log-probs.
    logprob_convention: str = "full"
    # int32[T]: the weight version that sampled each id (NO_VERSION where the policy did not);
    # None from code that predates it: every generated id then has its turn's version.
    token_versions: Optional[np.ndarray] = None
    # int32[T, S, k]: a mixture of experts' experts the engine chose for each id and sparse
    # layer (-1 where it recorded none); None unless the run asked for them (routing replay)
    routed_experts: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.token_versions is None:
            per_turn = [version_number(v) for v in self.weight_versions]
            turns = np.asarray(self.turn_ids)
            versions = np.full(len(self.tokens), NO_VERSION, np.int32)
            for k, v in enumerate(per_turn):
                versions[np.asarray(self.loss_mask, bool) & (turns == k)] = v
            self.token_versions = versions

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def oldest_version(self) -> int:
        """The oldest weight version any of its sampled ids came from (NO_VERSION: none)."""
        sampled = self.token_versions[np.asarray(self.loss_mask, bool)]
        sampled = sampled[sampled != NO_VERSION]
        return int(sampled.min()) if sampled.size else NO_VERSION


def groups_of(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories -> their groups (samples of one task), in order of first appearance."""
    groups: dict[int, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    return list(groups.values())


def group_version(group: Sequence[Trajectory]) -> int:
    """The oldest weight version of any token of the group (NO_VERSION: it sampled nothing):
    what its staleness is counted from."""
    versions = [t.oldest_version for t in group if t.oldest_version != NO_VERSION]
    return min(versions) if versions else NO_VERSION


@dataclasses.dataclass
class EpisodeStats:
    """Summary of a batch of trajectories, for logs and benchmarks."""

    num_episodes: int
    mean_reward: float
    success_rate: float
    mean_turns: float
    tokens_generated: int
    mean_length: float  # tokens per trajectory, prompt included
    env_steps: int
    env_step_s: float  # mean seconds one env step took
    wall_s: Optional[float] = None
    env_steps_per_s: Optional[float] = None  # env_steps / wall_s: the loop's throughput
    finish_counts: dict = dataclasses.field(default_factory=dict)
    # Steps whose info reports a rule decision (`info["violation"]`, the alignment-tipping
    # envs): every reply asked for one (`decisions`), those the env could parse
    # (`valid_decisions`: no `invalid_action`), and how many of those broke the rule. An
    # invalid reply is no decision about the rule, so it counts in neither side of
    # violation_rate, only against format_valid_rate.
    decisions: int = 0
    valid_decisions: int = 0
    violations: int = 0
    # Steps whose info says whether the reply had the env's answer format
    # (`info["format_failed"]`, e.g. word_problems' final `Answer: N` line), and how many
    # did not: a model can be wrong, or not answer at all, and the two read differently.
    format_checks: int = 0
    format_failures: int = 0

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory],
           wall_s: Optional[float] = None) -> "EpisodeStats":
        n = len(trajectories)
        mean = (lambda xs: float(np.mean(xs)) if n else 0.0)
        steps = sum(t.info.get("env_steps", 0) for t in trajectories)
        step_s = sum(t.info.get("env_step_s", 0.0) for t in trajectories)
        return cls(
            num_episodes=n,
            mean_reward=mean([t.reward for t in trajectories]),
            success_rate=mean([float(t.success) for t in trajectories]),
            mean_turns=mean([t.num_turns for t in trajectories]),
            tokens_generated=int(sum(t.num_generated for t in trajectories)),
            mean_length=mean([len(t) for t in trajectories]),
            env_steps=int(steps),
            env_step_s=step_s / steps if steps else 0.0,
            wall_s=wall_s,
            env_steps_per_s=steps / wall_s if wall_s else None,
            finish_counts=dict(Counter(t.finish for t in trajectories)),
            decisions=sum(1 for i in _decision_infos(trajectories)),
            valid_decisions=sum(not i.get("invalid_action")
                                for i in _decision_infos(trajectories)),
            violations=sum(bool(i.get("violation")) and not i.get("invalid_action")
                           for i in _decision_infos(trajectories)),
            format_checks=sum(1 for _ in _format_infos(trajectories)),
            format_failures=sum(bool(i["format_failed"]) for i in _format_infos(trajectories)))

    @property
    def violation_rate(self) -> Optional[float]:
        """Rule-breaking decisions / valid decisions (None: no valid decision)."""
        return self.violations / self.valid_decisions if self.valid_decisions else None

    @property
    def format_valid_rate(self) -> Optional[float]:
        """Valid decisions / decisions asked for (None: no decision asked for)."""
        return self.valid_decisions / self.decisions if self.decisions else None

    @property
    def format_failed_rate(self) -> Optional[float]:
        """Replies without the env's answer format / replies checked for it (None: no env
        step checked one)."""
        return self.format_failures / self.format_checks if self.format_checks else None

    def as_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat scalars for a metrics writer (finish counts become `finish/<reason>` rates;
        the two decision rates appear when there were decisions, the format-failure rate
        when a step checked the format)."""
        out = {f"{prefix}{k}": float(v) for k, v in dataclasses.asdict(self).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for rate in ("violation_rate", "format_valid_rate", "format_failed_rate"):
            if getattr(self, rate) is not None:
                out[f"{prefix}{rate}"] = getattr(self, rate)
        for reason, count in self.finish_counts.items():
            out[f"{prefix}finish/{reason}"] = count / max(1, self.num_episodes)
        return out


def _decision_infos(trajectories: Sequence[Trajectory]):
    """The step infos that report a rule decision (the key `violation`), valid or not."""
    return (i for t in trajectories for i in t.info.get("step_infos", ()) if "violation" in i)


def _format_infos(trajectories: Sequence[Trajectory]):
    """The step infos that say whether the reply had the env's answer format."""
    return (i for t in trajectories for i in t.info.get("step_infos", ())
            if "format_failed" in i)
