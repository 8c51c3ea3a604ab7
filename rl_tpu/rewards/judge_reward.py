"""A judge's verdicts as a reward: a generative verifier played by a rollout engine.

Two modes (`reward.judge`), with rl_tpu/rewards/judge.py's prompts and parsers:
  pointwise  each trajectory's task (its first user message) and final reply (its last
             assistant message) are put to the judge; [[YES]] pays 1, [[NO]] 0
  pairwise   the samples of one task are compared around a ring, k against k + 1 (two
             samples: once), each comparison's A/B order seeded; a sample's reward is its win
             rate over its comparisons with a verdict (the group's relative quality, which is
             what a group-normalised advantage reads anyway)
Judgements are greedy, in at most `reward.judge_max_new_tokens` tokens. The judge is a frozen
model of its own (`reward.judge_model_path`, an HF causal LM, on this host's sampler devices)
or, with no path, the policy itself at the weights that played the rollouts (self-judgement,
as in self-rewarding training).

A judgement without a verdict (none, two, or an unknown `[[word]]`) is never read as 0: a
trajectory left with no verdict is kept out of the loss (`rollout_batch.NO_LOSS`, like an
episode whose env failed), its parse error kept in `info["judge_error"]`, and
`rollout/judge_unparsed` counts such trajectories, so a judge that stops answering shows as a
rate, not as a policy that suddenly earns nothing.
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

import jax
import ml_collections

from rl_tpu import parallel
from rl_tpu.core.engine import GenerateRequest, RolloutEngine, SamplingParams
from rl_tpu.core.trajectory import Trajectory
from rl_tpu.models import hf
from rl_tpu.models.tokenizer import ChatTokenizer, load_tokenizer
from rl_tpu.rewards.judge import (Verdict, pairwise_messages, parse_pairwise,
                                  parse_pointwise, pointwise_messages)
from rl_tpu.rollout.sampler import JaxSampler

JUDGE_MODES = ("", "pointwise", "pairwise")


def question_and_reply(messages: Sequence[dict]) -> tuple[str, str]:
    """The task (the first user message) and the policy's final reply (the last assistant
    message) of a trajectory's transcript."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    replies = [m["content"] for m in messages if m.get("role") == "assistant"]
    if not users or not replies:
        raise ValueError(f"a transcript of {len(messages)} messages has "
                         f"{'no user message' if not users else 'no assistant reply'} to judge")
    return users[0], replies[-1]


def has_question_and_reply(messages: Sequence[dict]) -> bool:
    """Whether `question_and_reply` finds a task and a reply in `messages`."""
    roles = {m.get("role") for m in messages}
    return "user" in roles and "assistant" in roles


def ring_pairs(trajectories: Sequence[Trajectory]) -> list[tuple[int, int]]:
    """(i, j) index pairs to compare: within each group (same group_id, in order of first
    appearance), member k against member k + 1 around the ring; a group of two once, of one
    never."""
    groups: dict[int, list[int]] = {}
    for i, traj in enumerate(trajectories):
        groups.setdefault(traj.group_id, []).append(i)
    pairs = []
    for members in groups.values():
        n = len(members)
        pairs += [(members[k], members[(k + 1) % n]) for k in range(n if n > 2 else n - 1)]
    return pairs


def win_rates(n: int, pairs: Sequence[tuple[int, int]],
              winners: Sequence[Optional[int]]) -> list[Optional[float]]:
    """Each of n trajectories' share of wins over its compared pairs that have a winner
    (`winners[p]`: the index that won pair p, or None: no verdict); None where none has."""
    wins, counted = [0.0] * n, [0] * n
    for (i, j), winner in zip(pairs, winners):
        if winner is None:
            continue
        for k in (i, j):
            counted[k] += 1
            wins[k] += float(winner == k)
    return [wins[k] / counted[k] if counted[k] else None for k in range(n)]


class JudgeReward:
    """rewards(trajectories) -> (a reward each, None where the judge gave no verdict; the
    parse errors)."""

    def __init__(self, engine: RolloutEngine, tokenizer: ChatTokenizer, max_new_tokens: int,
                 mode: str = "pointwise", seed: int = 0):
        if max_new_tokens < 1:
            raise ValueError(f"reward.judge_max_new_tokens={max_new_tokens} must be >= 1")
        if mode not in JUDGE_MODES[1:]:
            raise ValueError(f"reward.judge={mode!r}; choose one of {JUDGE_MODES[1:]}")
        self.engine, self.tokenizer, self.mode, self.seed = engine, tokenizer, mode, seed
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)

    def prompt_ids(self, traj: Trajectory, other: Optional[Trajectory] = None) -> list[int]:
        """The judge's prompt: pointwise of `traj`, or pairwise with `traj` as A, `other` B."""
        question, reply = question_and_reply(traj.messages)
        messages = (pointwise_messages(question, reply) if other is None else
                    pairwise_messages(question, reply, question_and_reply(other.messages)[1]))
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _ask(self, prompts: list[list[int]]) -> list[str]:
        results = self.engine.generate([GenerateRequest(p, self.sampling) for p in prompts])
        return [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in results]

    def judge(self, trajectories: Sequence[Trajectory]) -> list[Verdict]:
        """Pointwise verdicts, one a trajectory; a transcript with no task or no reply is not
        put to the judge: its verdict is None, the error saying why."""
        verdicts: list[Optional[Verdict]] = [None] * len(trajectories)
        asked, prompts = [], []
        for i, traj in enumerate(trajectories):
            try:
                prompts.append(self.prompt_ids(traj))
            except ValueError as err:
                verdicts[i] = Verdict("", None, f"not judged: {err}")
                continue
            asked.append(i)
        for i, text in zip(asked, self._ask(prompts) if prompts else []):
            verdicts[i] = parse_pointwise(text)
        return verdicts

    def rewards(self, trajectories: Sequence[Trajectory]
                ) -> tuple[list[Optional[float]], list[str]]:
        if self.mode == "pointwise":
            verdicts = self.judge(trajectories)
            return ([None if v.value is None else float(v.value) for v in verdicts],
                    [v.error for v in verdicts])
        # a sample without a reply is compared with nothing: it gets no verdict
        judgeable = [has_question_and_reply(t.messages) for t in trajectories]
        pairs = [(i, j) for i, j in ring_pairs(trajectories) if judgeable[i] and judgeable[j]]
        # each comparison's order drawn from (seed, its group, its place): a judge's bias
        # toward A (or B) then falls on both sides alike
        flips = [random.Random(f"{self.seed}:{trajectories[i].group_id}:{k}").random() < 0.5
                 for k, (i, _) in enumerate(pairs)]
        ordered = [(j, i) if flip else (i, j) for (i, j), flip in zip(pairs, flips)]
        texts = self._ask([self.prompt_ids(trajectories[a], trajectories[b])
                           for a, b in ordered]) if ordered else []
        verdicts = [parse_pairwise(text) for text in texts]
        winners = [None if v.value is None else (a if v.value == "A" else b)
                   for (a, b), v in zip(ordered, verdicts)]
        errors = ["" if ok else "not judged: the transcript has no task or no reply"
                  for ok in judgeable]
        for (a, b), v in zip(ordered, verdicts):
            for k in (a, b):
                errors[k] = errors[k] or v.error
        return win_rates(len(trajectories), pairs, winners), errors


def from_config(config: ml_collections.ConfigDict, devices, policy_engine: RolloutEngine,
                policy_tokenizer: ChatTokenizer) -> Optional[JudgeReward]:
    """The config's judge (None when reward.judge is ""): a frozen model on `devices` (this
    host's own: no collective), or the policy's own engine and tokenizer."""
    r = config.reward
    if not r.judge:
        return None
    if not r.judge_model_path:
        return JudgeReward(policy_engine, policy_tokenizer, r.judge_max_new_tokens, r.judge,
                           config.seed)
    cfg = hf.read_config(r.judge_model_path)
    mesh = parallel.sampler_mesh(list(devices or jax.local_devices()), cfg.num_kv_heads)
    cfg, params = hf.load(r.judge_model_path, mesh=mesh, dtype=config.model.dtype)
    tokenizer = load_tokenizer(r.judge_model_path)
    sampler = JaxSampler(cfg, params, mesh=mesh, tokenizer=tokenizer,
                         max_batch=config.rollout.max_batch, seed=config.seed, version="judge")
    return JudgeReward(sampler, tokenizer, r.judge_max_new_tokens, r.judge, config.seed)
