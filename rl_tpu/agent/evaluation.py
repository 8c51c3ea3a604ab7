"""Eval suites: play a fixed set of held-out tasks and report success, pass@k, turns, tokens.

The same agent loop as training plays the episodes, so an eval measures exactly the policy the
trainer ships: greedy replies for `success` (one deterministic episode a task), and, with
`pass_k = k`, k sampled episodes a task at the rollout temperature for pass@k (a task counts
when any of its k samples succeeds). Each host plays its own share of the tasks; the sums are
combined across hosts, so every host returns the same numbers.

Metrics (under the caller's prefix, e.g. `eval/`): success, reward, turns (mean actions an
episode), tokens (mean generated tokens an episode), num_tasks, env_errors, weight_version
(the oldest policy version that sampled the greedy episodes: an eval at step s shows s), and
with `pass_k = k` pass@k, mean@k (the k samples' mean success: pass@1 at the rollout
temperature) and distinct@k (the distinct successful replies of a task's k samples, averaged
over tasks: how spread over several right answers the policy stays); and
violation_rate (rule-breaking decisions / valid decisions) and format_valid_rate (valid
decisions / decisions asked for) for envs whose steps report `info["violation"]` (the
alignment-tipping testbeds, rl_tpu/envs/tipping.py). A reply the env could not parse
(`info["invalid_action"]`) is no decision about the rule: it lowers format_valid_rate only, so
violation_rate does not rise merely because the model learns the reply format.
format_failed: for envs whose steps report `info["format_failed"]` (word_problems), the share
of those replies that did not end in the answer format the env asks for (format_failed@k: the
same over the k samples).

`keep(kind, trajectories)`, when given, is handed this host's greedy episodes ("greedy") and
its sampled ones ("sampled"): what writes the eval's replies to a file (`replies_lines`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from rl_tpu import parallel
from rl_tpu.agent import run_episodes
from rl_tpu.agent.env_failures import EnvFailureWatch, warn_all_failed
from rl_tpu.core.env import Env, Task
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.core.engine import RolloutEngine, SamplingParams
from rl_tpu.core.trajectory import NO_VERSION, EpisodeStats, Trajectory


def global_sums(values: np.ndarray) -> np.ndarray:
    """Elementwise sums over every host's `values` (the same result on each host)."""
    return parallel.across_hosts(values, "sum")


def episode_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """`EpisodeStats` over every host's trajectories: `episodes` (count), the means `success`,
    `reward`, `turns` and `tokens` (generated), and the counts `env_errors`,
    `context_limits` and `env_steps` (the env's own steps, `info["env_steps"]`: a turn whose
    reply could not be parsed, or an agent program's model call, steps no env and is not
    counted); `format_valid_rate` when any step asked for a rule decision and
    `violation_rate` when any such reply was valid (module docstring); `format_failed` (the
    share of replies without the env's answer format) when any step checked one. Each host's means are
    weighted back into sums, added, divided again."""
    local = EpisodeStats.of(trajectories)
    n = local.num_episodes
    (n, wins, reward, turns, tokens, errors, cut, decisions, valid_decisions,
     violations, env_steps, format_checks, format_failures) = global_sums(np.array([
        n, local.success_rate * n, local.mean_reward * n, local.mean_turns * n,
        local.tokens_generated, local.finish_counts.get("env_error", 0),
        local.finish_counts.get("context_limit", 0), local.decisions, local.valid_decisions,
        local.violations, local.env_steps, local.format_checks, local.format_failures],
        np.float64))
    per = max(n, 1)
    out = {"episodes": n, "success": wins / per, "reward": reward / per, "turns": turns / per,
           "tokens": tokens / per, "env_errors": errors, "context_limits": cut,
           "env_steps": env_steps}
    if decisions:
        out["format_valid_rate"] = valid_decisions / decisions
    if valid_decisions:
        out["violation_rate"] = violations / valid_decisions
    if format_checks:
        out["format_failed"] = format_failures / format_checks
    return out


def oldest_version_over_hosts(trajectories: Sequence[Trajectory]) -> int:
    """The oldest weight version that sampled any of the trajectories' tokens, over every
    host (NO_VERSION when none says; a collective): an eval labelled step s must have
    sampled with version s only, on-policy rollouts of step s with version s - 1."""
    versions = [t.oldest_version for t in trajectories if t.oldest_version != NO_VERSION]
    oldest = int(parallel.across_hosts(min(versions, default=_NO_TOKENS), "min"))
    return NO_VERSION if oldest == _NO_TOKENS else oldest


# a host whose episodes sampled nothing (every reset failed); within int32, which is what a
# cross-host gather carries without jax_enable_x64 (2**62 arrived as 0)
_NO_TOKENS = np.iinfo(np.int32).max


def evaluate(engine: RolloutEngine, make_env: Callable[[], Env], tasks: Sequence[Task], *,
             tokenizer: ChatTokenizer, max_turns: int, max_new_tokens: int,
             max_context_tokens: int, pass_k: int = 0,
             sampling: Optional[SamplingParams] = None, seed: int = 0,
             step_timeout_s: Optional[float] = 60.0, reward_reduce="sum",
             play: Callable[..., list[Trajectory]] = run_episodes,
             failures: Optional[EnvFailureWatch] = None, step: int = 0,
             keep: Optional[Callable[[str, list[Trajectory]], None]] = None) -> dict[str, float]:
    """Greedy success (and pass@k with `sampling`) of `engine` on this host's `tasks`, played
    by `play` (`run_episodes`'s arguments; an agent program's player, say). Greedy episodes
    that all ended in an env error are warned about, and with `failures` (a run's watch) their
    errors are logged as step `step`'s eval (rl_tpu/agent/env_failures.py)."""
    common = dict(tokenizer=tokenizer, max_turns=max_turns,
                  max_new_tokens_per_turn=max_new_tokens, max_context_tokens=max_context_tokens,
                  step_timeout_s=step_timeout_s, reward_reduce=reward_reduce)
    greedy = play(engine, make_env, list(tasks),
                  sampling=SamplingParams(temperature=0.0, seed=seed), **common)
    if keep is not None:
        keep("greedy", greedy)
    stats = episode_stats(greedy)
    if failures is not None:
        failures.observe(step, greedy, stats["episodes"], stats["env_errors"], eval_=True)
    elif stats["episodes"] and stats["env_errors"] >= stats["episodes"]:
        warn_all_failed("eval", [t for t in greedy if t.finish == "env_error"],
                        stats["episodes"])
    out = {k: stats[k] for k in ("success", "reward", "turns", "tokens", "env_errors",
                                 "violation_rate", "format_valid_rate", "format_failed")
           if k in stats}
    out["num_tasks"] = stats["episodes"]
    out["weight_version"] = oldest_version_over_hosts(greedy)
    if pass_k > 0:
        if sampling is None:
            raise ValueError("pass_k > 0 needs the sampling params to draw the k samples with")
        samples = play(engine, make_env, list(tasks), samples_per_task=pass_k,
                       sampling=dataclasses.replace(sampling, seed=seed), **common)
        if keep is not None:
            keep("sampled", samples)
        sampled_stats = episode_stats(samples)
        if "format_failed" in sampled_stats:
            out[f"format_failed@{pass_k}"] = sampled_stats["format_failed"]
        groups = [samples[i * pass_k:(i + 1) * pass_k] for i in range(len(tasks))]
        solved = sum(any(t.success for t in group) for group in groups)
        wins = sum(t.success for t in samples)
        distinct = sum(len({_replies(t) for t in group if t.success}) for group in groups)
        total = global_sums(np.array([solved, wins, distinct, len(tasks)], np.float64))
        per = max(total[3], 1)
        out[f"pass@{pass_k}"] = total[0] / per
        out[f"mean@{pass_k}"] = total[1] / (per * pass_k)
        out[f"distinct@{pass_k}"] = total[2] / per
    return {k: float(v) for k, v in out.items()}


def replies_lines(kind: str, trajectories: Sequence[Trajectory]) -> list[dict]:
    """One JSON-ready record an episode: what a reader of an eval's replies looks for (the
    task, the replies and the env's last word on them, success, reward, tokens, and whether
    the answer format failed where the env checks one)."""
    lines = []
    for t in trajectories:
        formats = [i["format_failed"] for i in t.info.get("step_infos", ())
                   if isinstance(i, dict) and "format_failed" in i]
        lines.append({"kind": kind, "task_id": t.task_id,
                      "sample": int(t.info.get("sample_index", 0)), "success": bool(t.success),
                      "reward": float(t.reward), "tokens": int(t.num_generated),
                      "format_failed": any(formats) if formats else None,
                      "finish": t.finish, "messages": t.messages})
    return lines


def _replies(trajectory: Trajectory) -> tuple[str, ...]:
    """The episode's replies (its assistant messages), stripped: what tells two right samples
    apart."""
    return tuple(str(m.get("content", "")).strip() for m in trajectory.messages
                 if m.get("role") == "assistant")
