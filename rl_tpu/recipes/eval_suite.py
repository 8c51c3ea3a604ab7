"""The eval every driver runs (rl, sft, evaluate, the policy-chain loops): its turn limit,
fixed over a run, and the suite's arguments built in one place.
"""

from __future__ import annotations

import ml_collections

from rl_tpu.agent import run_episodes
from rl_tpu.agent.evaluation import evaluate
from rl_tpu.agent.program import player_for
from rl_tpu.core.engine import RolloutEngine
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes.rollout_settings import sampling_params


def eval_horizon(config: ml_collections.ConfigDict) -> int:
    """The eval turn limit: `eval.max_turns`, else the final stage of the horizon schedule
    (ScalingInter-RL), else `env.max_turns`. Fixed over the run, so an eval curve measures the
    policy, not the schedule (evaluating at each step's training horizon would make success
    jump at every stage by construction)."""
    stages = tuple(config.schedules.horizon_turns)
    return int(config.eval.max_turns or (stages[-1] if stages else config.env.max_turns))


def evaluate_policy(config: ml_collections.ConfigDict, engine: RolloutEngine, make_env,
                    tasks, tokenizer: ChatTokenizer, seed: int, failures=None,
                    step: int = 0) -> dict[str, float]:
    """The config's eval suite on `tasks` (greedy success, pass@k, turns, tokens): the one
    place rl, sft and evaluate build the eval's arguments. `failures`: the run's
    agent.env_failures.EnvFailureWatch, told of step `step`'s eval episodes."""
    env = config.env
    return evaluate(engine, make_env, tasks, tokenizer=tokenizer,
                    play=player_for(config, run_episodes),
                    max_turns=eval_horizon(config),
                    max_new_tokens=config.eval.max_new_tokens or env.max_new_tokens,
                    max_context_tokens=env.max_context_tokens, pass_k=config.eval.pass_k,
                    sampling=sampling_params(config, None), seed=seed,
                    step_timeout_s=env.step_timeout_s, reward_reduce=env.reward_reduce,
                    failures=failures, step=step)
