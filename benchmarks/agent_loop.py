"""Env steps per second of the agent loop (rl_tpu.agent.run_episodes), engine cost excluded.

A scripted engine answers instantly, so the numbers measure the loop itself: batching, chat
templating and incremental tokenization, and the parallel env steps, for a registered env
(`--env`, default babyai) driven by a fixed cycle of actions.

    python benchmarks/agent_loop.py --env babyai --tasks 16 --samples 4 --turns 10
    python benchmarks/agent_loop.py --env textcraft --actions "inventory,craft 1 stick"
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl_tpu import agent  # noqa: E402
from rl_tpu.envs import base  # noqa: E402
from rl_tpu.models.tiny_tokenizer import build_tokenizer  # noqa: E402
from rl_tpu.models.tokenizer import ChatTokenizer  # noqa: E402
from rl_tpu.rollout.engine import SamplingParams  # noqa: E402
from rl_tpu.rollout.scripted import ScriptedEngine  # noqa: E402

# BabyAI's env executes the last "Action: ..." line; other envs parse their own formats.
DEFAULT_ACTIONS = {
    "babyai": ["Action: move forward", "Action: turn left", "Action: move forward",
               "Action: turn right", "Action: pick up"],
}
GENERIC_ACTIONS = ["look", "inventory", "move forward", "turn left"]


def _registered_env(name: str, num_tasks: int):
    """(make_env, tasks) for a registered env, or None with the reason printed."""
    try:
        probe = base.make(name)
    except Exception as e:  # noqa: BLE001 - an env still being written, or a missing package
        print(f"# skipping env {name!r}: it could not be built ({type(e).__name__}: {e}). "
              f"Install its optional dependency or pick another with --env.", file=sys.stderr)
        return None
    try:
        source = probe.tasks()
        tasks = [source.get("train", i) for i in range(num_tasks)]
    except TypeError:  # no built-in tasks: ids are all it gets
        tasks = [base.Task(str(i)) for i in range(num_tasks)]
    finally:
        probe.close()
    return (lambda: base.make(name)), tasks


def _bench(label, engine, make_env, tasks, tokenizer, args):
    start = time.perf_counter()
    trajs = agent.run_episodes(
        engine, make_env, tasks, tokenizer=tokenizer, samples_per_task=args.samples,
        max_turns=args.turns, max_new_tokens_per_turn=args.new_tokens,
        max_context_tokens=args.context, sampling=SamplingParams(temperature=1.0),
        step_timeout_s=args.timeout, num_threads=args.threads)
    wall = time.perf_counter() - start
    s = agent.EpisodeStats.of(trajs, wall_s=wall)
    finishes = ",".join(f"{k}={v}" for k, v in sorted(s.finish_counts.items()))
    print(f"| {label:<10} | {s.num_episodes:>8} | {args.turns:>3} | {len(engine.calls):>9} "
          f"| {s.env_steps:>9} | {wall:>7.3f} | {s.env_steps_per_s or 0:>11.1f} "
          f"| {1e3 * s.env_step_s:>11.3f} | {s.mean_length:>8.0f} | {finishes} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="babyai", help="registered env name")
    p.add_argument("--actions", default=None,
                   help="comma-separated action texts the scripted engine cycles through")
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="G, samples per task")
    p.add_argument("--turns", type=int, default=10, help="H, the turn limit")
    p.add_argument("--new-tokens", type=int, default=64, help="L, new tokens per turn")
    p.add_argument("--context", type=int, default=8192, help="max context tokens")
    p.add_argument("--threads", type=int, default=None, help="env threads (0 = inline)")
    p.add_argument("--timeout", type=float, default=60.0, help="per env call, seconds")
    args = p.parse_args(argv)

    tokenizer = ChatTokenizer(build_tokenizer(1024))
    print("| env        | episodes |   H | gen calls | env steps |  wall s | env steps/s "
          "| ms per step | mean len | finish |")
    print("|------------|----------|-----|-----------|-----------|---------|-------------"
          "|-------------|----------|--------|")

    registered = _registered_env(args.env, args.tasks)
    if registered is not None:
        make_env, tasks = registered
        actions = args.actions.split(",") if args.actions else DEFAULT_ACTIONS.get(
            args.env, GENERIC_ACTIONS)
        # The prompt length varies across episodes, so mixing it in varies the action sequence.
        policy = lambda text, turn: actions[(turn + len(text)) % len(actions)]  # noqa: E731
        engine = ScriptedEngine(tokenizer, policy)
        _bench(args.env, engine, make_env, tasks, tokenizer, args)


if __name__ == "__main__":
    main()
