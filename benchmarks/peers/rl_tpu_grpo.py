"""rl_tpu's side of benchmarks/peers.py: GRPO steps of the shared random Qwen2 on rl_tpu's
JAX sampler and learner, timed per phase; prints one JSON line (`PEER_RESULT {...}`).

    python benchmarks/peers/rl_tpu_grpo.py --model_dir M --prompts_file P --steps 4
    python benchmarks/peers/rl_tpu_grpo.py --model_dir M --prompts_file P --cache_dir /tmp/c

(M, P: the model dir and prompts file benchmarks/peers.py writes.) Each step: that step's
prompts from the file (fresh random ids each step), `--samples` completions of exactly
`--completion` tokens each (ignore_eos), the rule reward (the fraction of even ids in a
completion), GRPO advantages, one policy update (one epoch, one minibatch), the weight copy
back to the sampler. "first" is the first step, compilation included (with `--cache_dir`, XLA's
persistent compilation cache there: a second run reads what the first one wrote).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import peer_args  # noqa: E402  (this folder: the flags every peer child shares)

from rl_tpu import parallel  # noqa: E402
from rl_tpu.core.engine import GenerateRequest, SamplingParams  # noqa: E402
from rl_tpu.models import hf  # noqa: E402
from rl_tpu.models.transformer import Transformer  # noqa: E402
from rl_tpu.rl.losses import PolicyLossConfig  # noqa: E402
from rl_tpu.rollout.sampler import JaxSampler  # noqa: E402
from rl_tpu.train.learner import Learner, UpdateConfig  # noqa: E402
from rl_tpu.train.state import OptimConfig, create_state, make_optimizer  # noqa: E402


def even_fraction(ids) -> float:
    """The rule reward every side uses: the share of even token ids in a completion."""
    ids = np.asarray(ids)
    return float(np.mean(ids % 2 == 0)) if ids.size else 0.0


def grpo_step(sampler, learner, mesh, args, step: int, prompts: list[list[int]]) -> dict:
    times = {}
    t = time.perf_counter()
    if step == 1 and args.compile_ahead:  # the update compiles while the first rollout samples
        learner.compile_ahead(len(prompts) * args.samples, len(prompts[0]) + args.completion,
                              ["behaviour_logprobs"])
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=args.completion, ignore_eos=True,
                                                  temperature=1.0, seed=step * 1000 + i))
                for i, p in enumerate(prompts) for _ in range(args.samples)]
    results = sampler.generate(requests)
    times["sample"] = time.perf_counter() - t

    t = time.perf_counter()
    n, prompt = len(results), len(prompts[0])
    length = prompt + args.completion
    tokens = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length), bool)
    behaviour = np.zeros((n, length), np.float32)
    for i, (req, res) in enumerate(zip(requests, results)):
        tokens[i, :prompt], tokens[i, prompt:] = req.prompt_ids, res.output_ids
        mask[i, prompt:] = True
        behaviour[i, prompt:] = res.logprobs
    host = {"tokens": tokens, "loss_mask": mask, "behaviour_logprobs": behaviour,
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy(),
            "segment_ids": np.ones((n, length), np.int32),
            "rewards": np.array([even_fraction(r.output_ids) for r in results], np.float32),
            "group_ids": np.repeat(np.arange(len(prompts), dtype=np.int32), args.samples)}
    batch = learner.advantages(learner.score(parallel.host_to_global(host, mesh)))
    jax.block_until_ready(batch["advantages"])
    times["score"] = time.perf_counter() - t  # batch + proximal log-probs + advantages
    t = time.perf_counter()
    learner.update(batch)
    sampler.update_weights(learner.policy.params, str(step))
    jax.block_until_ready(jax.tree.leaves(sampler.weights()[0]))
    times["train"] = time.perf_counter() - t  # the update and the weight copy to the sampler
    times["update"] = times["score"] + times["train"]
    times["step"] = times["sample"] + times["update"]
    times["reward"] = float(host["rewards"].mean())
    times["completion_tokens"] = [min(len(r.output_ids) for r in results),
                                  max(len(r.output_ids) for r in results)]
    return times


def main():
    parser = peer_args.parser(__doc__, "JSON of the prompt ids per step (benchmarks/peers.py "
                              "writes it)")
    parser.add_argument("--compile_ahead", type=int, default=1,
                        help="1: the first step compiles the update on a background thread "
                        "while it samples (Learner.compile_ahead); 0: in turn")
    parser.add_argument("--cache_dir", default="",
                        help="XLA's persistent compilation cache here (empty: off)")
    args = parser.parse_args()
    if min(args.samples, args.completion) < 1 or args.steps < 0:
        raise SystemExit("--samples and --completion must be >= 1, --steps >= 0")
    per_step = [[p["ids"] for p in step] for step in peer_args.prompt_steps(args)]
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    else:  # off even where the environment names one (JAX_COMPILATION_CACHE_DIR): a cold step
        jax.config.update("jax_enable_compilation_cache", False)

    t = time.perf_counter()
    mesh = parallel.make_mesh({"data": -1})
    cfg, params = hf.load(args.model_dir, mesh=mesh)
    sampler = JaxSampler(cfg, params, mesh=parallel.make_mesh({}, devices=jax.devices()[:1]))
    state = create_state(params, make_optimizer(OptimConfig(lr=args.lr)))
    learner = Learner(Transformer(cfg, mesh=mesh), state, mesh, PolicyLossConfig(kind="ppo"),
                      UpdateConfig(advantage="grpo"))
    setup_s = time.perf_counter() - t
    first = grpo_step(sampler, learner, mesh, args, 1, per_step[0])
    rest = [grpo_step(sampler, learner, mesh, args, s, per_step[s - 1])
            for s in range(2, args.steps + 2)]
    steady = {k: statistics.median(r[k] for r in rest) for k in first
              if k != "completion_tokens"} if rest else {}
    print("PEER_RESULT " + json.dumps({
        "side": "rl_tpu", "version": _version(), "backend": jax.default_backend(),
        "devices": jax.device_count(), "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "setup_s": setup_s, "first_s": first["step"], "first": first,
        "steady_s": steady.get("step"), "sample_s": steady.get("sample"),
        "update_s": steady.get("update"), "steady": steady, "steps": args.steps,
        "completion_tokens": first["completion_tokens"],
        "cache_dir": args.cache_dir}), flush=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"rl_tpu {version('rl_tpu')}, jax {jax.__version__}"
    except PackageNotFoundError:
        return f"rl_tpu (source), jax {jax.__version__}"


if __name__ == "__main__":
    main()
