"""A judge's verdict as a reward: a generative verifier played by a rollout engine.

With `reward.judge = "pointwise"`, each trajectory's task (its first user message) and final
reply (its last assistant message) are put to a judge in rl_tpu/rewards/judge.py's pointwise
prompt, answered greedily in at most `reward.judge_max_new_tokens` tokens, and the verdict pays
1 ([[YES]]) or 0 ([[NO]]). The judge is a frozen model of its own (`reward.judge_model_path`,
an HF causal LM, on this host's sampler devices) or, with no path, the policy itself at the
weights that played the rollouts (self-judgement, as in self-rewarding training).

A reply the judge answers with no verdict (none, two, or an unknown `[[word]]`) is never read
as 0: the trajectory is kept out of the loss (`rollout_batch.NO_LOSS`, like an episode whose
env failed), its parse error kept in `info["judge_error"]`, and `rollout/judge_unparsed`
counts such replies, so a judge that stops answering shows as a rate, not as a policy that
suddenly earns nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import ml_collections

from rl_tpu import parallel
from rl_tpu.agent.trajectory import Trajectory
from rl_tpu.models import hf
from rl_tpu.models.tokenizer import ChatTokenizer, load_tokenizer
from rl_tpu.rewards.judge import Verdict, parse_pointwise, pointwise_messages
from rl_tpu.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams

JUDGE_MODES = ("", "pointwise")


def question_and_reply(messages: Sequence[dict]) -> tuple[str, str]:
    """The task (the first user message) and the policy's final reply (the last assistant
    message) of a trajectory's transcript."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    replies = [m["content"] for m in messages if m.get("role") == "assistant"]
    if not users or not replies:
        raise ValueError(f"a transcript of {len(messages)} messages has "
                         f"{'no user message' if not users else 'no assistant reply'} to judge")
    return users[0], replies[-1]


class JudgeReward:
    """judge(trajectories) -> one Verdict each (value True / False, or None with the error)."""

    def __init__(self, engine: RolloutEngine, tokenizer: ChatTokenizer, max_new_tokens: int):
        if max_new_tokens < 1:
            raise ValueError(f"reward.judge_max_new_tokens={max_new_tokens} must be >= 1")
        self.engine, self.tokenizer = engine, tokenizer
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)

    def prompt_ids(self, traj: Trajectory) -> list[int]:
        question, reply = question_and_reply(traj.messages)
        return self.tokenizer.apply_chat_template(pointwise_messages(question, reply),
                                                  add_generation_prompt=True)

    def judge(self, trajectories: Sequence[Trajectory]) -> list[Verdict]:
        if not trajectories:
            return []
        requests = [GenerateRequest(self.prompt_ids(t), self.sampling) for t in trajectories]
        results = self.engine.generate(requests)
        return [parse_pointwise(self.tokenizer.decode(r.output_ids, skip_special_tokens=True))
                for r in results]


def from_config(config: ml_collections.ConfigDict, devices, policy_engine: RolloutEngine,
                policy_tokenizer: ChatTokenizer) -> Optional[JudgeReward]:
    """The config's judge (None when reward.judge is ""): a frozen model on `devices` (this
    host's own: no collective), or the policy's own engine and tokenizer."""
    r = config.reward
    if not r.judge:
        return None
    if not r.judge_model_path:
        return JudgeReward(policy_engine, policy_tokenizer, r.judge_max_new_tokens)
    from rl_tpu.rollout.sampler import JaxSampler
    cfg = hf.read_config(r.judge_model_path)
    mesh = parallel.sampler_mesh(list(devices or jax.local_devices()), cfg.num_kv_heads)
    cfg, params = hf.load(r.judge_model_path, mesh=mesh, dtype=config.model.dtype)
    tokenizer = load_tokenizer(r.judge_model_path)
    sampler = JaxSampler(cfg, params, mesh=mesh, tokenizer=tokenizer,
                         max_batch=config.rollout.max_batch, seed=config.seed, version="judge")
    return JudgeReward(sampler, tokenizer, r.judge_max_new_tokens)
