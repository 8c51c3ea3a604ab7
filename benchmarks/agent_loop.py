"""Env steps per second of the agent loop (rl_tpu.agent.run_episodes).

`--engine scripted` (default): a scripted engine answers instantly, so the numbers measure the
loop itself: batching, chat templating and incremental tokenization, and the parallel env
steps, for a registered env (`--env`, default babyai) driven by a fixed cycle of actions.

`--engine sampler`: the real embedded JAX sampler on a tiny random model, for each turn limit
of `--turn_limits` with and without prefix reuse (rl_tpu/rollout/prefix_cache.py): prompt
tokens prefilled per episode (computed / reused) and env steps/s. Each row is timed after a
warm-up rollout of the same shape (compiles), the cache flushed between them.

    python benchmarks/agent_loop.py --env babyai --tasks 16 --samples 4 --turns 10
    python benchmarks/agent_loop.py --env textcraft --actions "inventory,craft 1 stick"
    python benchmarks/agent_loop.py --engine sampler --env babyai --tasks 4 --samples 2 \
        --turn_limits 10,20 --new-tokens 32
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl_tpu import agent  # noqa: E402
from rl_tpu.core.engine import SamplingParams  # noqa: E402
from rl_tpu.core import env as env_lib  # noqa: E402
from rl_tpu.models.tiny_tokenizer import build_tokenizer  # noqa: E402
from rl_tpu.models.tokenizer import ChatTokenizer  # noqa: E402
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
        probe = env_lib.make(name)
    except Exception as e:  # noqa: BLE001 - an env still being written, or a missing package
        print(f"# skipping env {name!r}: it could not be built ({type(e).__name__}: {e}). "
              f"Install its optional dependency or pick another with --env.", file=sys.stderr)
        return None
    try:
        source = probe.tasks()
        tasks = [source.get("train", i) for i in range(num_tasks)]
    except TypeError:  # no built-in tasks: ids are all it gets
        tasks = [env_lib.Task(str(i)) for i in range(num_tasks)]
    finally:
        probe.close()
    return (lambda: env_lib.make(name)), tasks


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


def _env_name(wanted: str) -> str:
    """`wanted` if registered, else its AgentGym-mode twin (or the reverse): the env modules
    are being reorganised, so the name is looked up at run time."""
    from rl_tpu.envs import ENV_MODULES
    for name in (wanted, f"{wanted}_agentgym", wanted.replace("_agentgym", "")):
        if name in ENV_MODULES:
            return name
    return wanted


def _bench_sampler(args, make_env, tasks):
    """Rows of the real sampler on a tiny random model: per turn limit, reuse off then on."""
    from rl_tpu.models import hf, tiny
    from rl_tpu.models.tokenizer import load_tokenizer
    from rl_tpu.rollout.sampler import JaxSampler

    path = os.path.join(tempfile.mkdtemp(prefix="agent_loop_"), "model")
    probe = make_env()  # the tokenizer learns the env's text: realistic token counts
    corpus = [probe.reset(t) for t in tasks[:4]] + [getattr(probe, "system_prompt", "") or ""]
    probe.close()
    # (`corpus` is newer than some checkouts of tiny.py: without it, plain tiny tokenizer)
    learn = {"corpus": corpus} if "corpus" in inspect.signature(
        tiny.write_tiny_model).parameters else {}
    tiny.write_tiny_model(path, "qwen3", vocab_size=args.vocab, **learn,
                          hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                          num_layers=args.layers, num_heads=max(1, args.hidden // 16),
                          num_kv_heads=max(1, args.hidden // 32), head_dim=16,
                          max_position_embeddings=args.context)
    cfg, params = hf.load(path)
    tokenizer = load_tokenizer(path)
    print("| H | reuse | episodes | turns/ep | prompt tok/ep | prefilled tok/ep | reused tok/ep "
          "| env steps | wall s | env steps/s |")
    print("|---|-------|----------|----------|---------------|------------------|---------------"
          "|-----------|--------|-------------|")
    for turns in [int(t) for t in args.turn_limits.split(",")]:
        for reuse in (False, True):
            sampler = JaxSampler(cfg, params, tokenizer=tokenizer, max_batch=args.max_batch,
                                 prefix_cache_tokens=args.cache_tokens if reuse else 0)
            for seed in (0, 1):  # 0 warms up (compiles every bucket), 1 is timed
                sampler.flush_cache()
                before = sampler.stats()
                start = time.perf_counter()
                trajs = agent.run_episodes(
                    sampler, make_env, tasks, tokenizer=tokenizer,
                    samples_per_task=args.samples, max_turns=turns,
                    max_new_tokens_per_turn=args.new_tokens, max_context_tokens=args.context,
                    sampling=SamplingParams(temperature=1.0, seed=seed),
                    step_timeout_s=args.timeout, num_threads=args.threads)
                wall = time.perf_counter() - start
            after = sampler.stats()
            s = agent.EpisodeStats.of(trajs, wall_s=wall)
            per = lambda key: (after[key] - before[key]) / max(s.num_episodes, 1)  # noqa: E731
            print(f"| {turns} | {'on' if reuse else 'off'} | {s.num_episodes} "
                  f"| {s.mean_turns:.1f} | {per('prompt_tokens'):.0f} "
                  f"| {per('prefill_tokens'):.0f} | {per('reused_tokens'):.0f} "
                  f"| {s.env_steps} | {wall:.2f} | {s.env_steps_per_s or 0:.2f} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="babyai", help="registered env name")
    p.add_argument("--engine", default="scripted", choices=("scripted", "sampler"),
                   help="scripted (loop cost only) or the real embedded sampler (tiny model)")
    p.add_argument("--turn_limits", default="10,20", help="sampler mode: H values, one row "
                   "pair (reuse off / on) each")
    p.add_argument("--vocab", type=int, default=1024, help="sampler mode: tiny model vocab")
    p.add_argument("--hidden", type=int, default=64, help="sampler mode: tiny model width")
    p.add_argument("--layers", type=int, default=2, help="sampler mode: tiny model layers")
    p.add_argument("--max_batch", type=int, default=64, help="sampler mode: rows per batch")
    p.add_argument("--cache_tokens", type=int, default=65536,
                   help="sampler mode: prefix cache size (tokens) when reuse is on")
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
    args.env = _env_name(args.env)
    if args.engine == "sampler":
        registered = _registered_env(args.env, args.tasks)
        if registered is not None:
            _bench_sampler(args, *registered)
        return

    tokenizer = ChatTokenizer(build_tokenizer(1024))
    print("| env        | episodes |   H | gen calls | env steps |  wall s | env steps/s "
          "| ms per step | mean len | finish |")
    print("|------------|----------|-----|-----------|-----------|---------|-------------"
          "|-------------|----------|--------|")

    registered = _registered_env(args.env, args.tasks)
    if registered is not None:
        make_env, tasks = registered
        actions = args.actions.split(",") if args.actions else DEFAULT_ACTIONS.get(
            args.env.replace("_agentgym", ""), GENERIC_ACTIONS)
        # The prompt length varies across episodes, so mixing it in varies the action sequence.
        policy = lambda text, turn: actions[(turn + len(text)) % len(actions)]  # noqa: E731
        engine = ScriptedEngine(tokenizer, policy)
        _bench(args.env, engine, make_env, tasks, tokenizer, args)


if __name__ == "__main__":
    main()
