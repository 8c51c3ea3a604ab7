"""The eval every driver runs (rl, sft, evaluate, the policy-chain loops): its turn limit,
fixed over a run, and the suite's arguments built in one place.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
import ml_collections

from rl_tpu.agent import run_episodes
from rl_tpu.agent.evaluation import evaluate, replies_lines
from rl_tpu.agent.program import player_for
from rl_tpu.core.engine import RolloutEngine
from rl_tpu.metrics import atomic_write_text
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes.rollout_settings import sampling_params

EVALS_DIR = "evals"  # W/evals/: one file an eval (and its replies, with eval.save_replies)


def eval_horizon(config: ml_collections.ConfigDict) -> int:
    """The eval turn limit: `eval.max_turns`, else the final stage of the horizon schedule
    (ScalingInter-RL), else `env.max_turns`. Fixed over the run, so an eval curve measures the
    policy, not the schedule (evaluating at each step's training horizon would make success
    jump at every stage by construction)."""
    stages = tuple(config.schedules.horizon_turns)
    return int(config.eval.max_turns or (stages[-1] if stages else config.env.max_turns))


def evaluate_policy(config: ml_collections.ConfigDict, engine: RolloutEngine, make_env,
                    tasks, tokenizer: ChatTokenizer, seed: int, failures=None,
                    step: int = 0, replies_path: Optional[str] = None) -> dict[str, float]:
    """The config's eval suite on `tasks` (greedy success, pass@k, turns, tokens): the one
    place rl, sft and evaluate build the eval's arguments. `failures`: the run's
    agent.env_failures.EnvFailureWatch, told of step `step`'s eval episodes. With
    `eval.save_replies` and a `replies_path`, this host's episodes are written there as JSON
    lines (`replies_file`)."""
    env = config.env
    kept: list[dict] = []

    def keep(kind, trajectories):
        kept.extend(replies_lines(kind, trajectories))

    if not (config.eval.save_replies and replies_path):
        keep = None
    result = evaluate(engine, make_env, tasks, tokenizer=tokenizer,
                    play=player_for(config, run_episodes),
                    max_turns=eval_horizon(config),
                    max_new_tokens=config.eval.max_new_tokens or env.max_new_tokens,
                    max_context_tokens=env.max_context_tokens, pass_k=config.eval.pass_k,
                    sampling=sampling_params(config, None), seed=seed,
                    step_timeout_s=env.step_timeout_s, reward_reduce=env.reward_reduce,
                    failures=failures, step=step, keep=keep)
    if keep is not None:
        write_replies(replies_path, kept)
    return result


def replies_file(workdir: str, name: str) -> str:
    """Where an eval named `name` writes its replies: W/evals/<name>.replies.jsonl on process
    0, <name>.replies.host<i>.jsonl on process i (each host plays its own tasks)."""
    host = jax.process_index()
    return os.path.join(workdir, EVALS_DIR,
                        f"{name}.replies{f'.host{host}' if host else ''}.jsonl")


def write_replies(path: str, lines: list[dict]) -> None:
    """The records as JSON lines, the file replaced whole."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(line) + "\n" for line in lines))
