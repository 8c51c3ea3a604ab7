"""One GRPO step end to end, seconds per phase: sample -> batch -> score -> advantages ->
update -> weight sync, on the embedded JAX sampler and the trainer's learner.

    python benchmarks/rl_step.py                    # 8 prompts x 4 samples, prompt 32, completion 64
    python benchmarks/rl_step.py --prompts 32 --samples 8 --steps 5
    python benchmarks/rl_step.py --trainer --step_latency_s 1.5 --epochs 4   # the whole
        trainer, sync vs async (max_staleness 1) vs async deterministic, with envs that wait
        1.5 s a reset and a step (an env server's round trip) and 4 update epochs
    python benchmarks/rl_step.py --trainer --no_proximal   # recompute_proximal on vs off
    python benchmarks/rl_step.py --cache_dir /tmp/c; python benchmarks/rl_step.py --cache_dir /tmp/c
        # the first step cold, then with a warm persistent compilation cache
    python benchmarks/rl_step.py --model_path $(python -m launch.get_model smollm2-135m-instruct) \
        --prompts 8 --samples 8 --prompt 64 --completion 256 --tokens_per_device 4096 --steps 2
        # a real model (its HF directory), the update in micro-batches of <= 4096 tokens

Completions run to their full length (ignore_eos: no EOS cuts them short), rewards are random
0/1, so the shapes are exactly the ones named. Every step samples fresh random prompts (a
prompt seen before could be served from the sampler's prefix cache). The first step's time is
mostly compilation and is reported on its own row; the steady rows are the median of the
following steps. Prints markdown table rows, with the 1-minute load average at each row's end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import SHAPES  # noqa: E402
from rl_tpu import parallel  # noqa: E402
from rl_tpu.core.engine import GenerateRequest, SamplingParams  # noqa: E402
from rl_tpu.models import tiny  # noqa: E402
from rl_tpu.models.transformer import ModelConfig, Transformer  # noqa: E402
from rl_tpu.rl.losses import PolicyLossConfig  # noqa: E402
from rl_tpu.rollout.sampler import JaxSampler  # noqa: E402
from rl_tpu.train.learner import Learner, UpdateConfig  # noqa: E402
from rl_tpu.train.state import OptimConfig, create_state, make_optimizer  # noqa: E402

PHASES = ("sample", "batch", "score", "advantages", "update", "sync")


def one_step(sampler, learner, mesh, vocab, args, step, rng):
    times = {}
    prompts = [list(rng.integers(3, vocab, args.prompt)) for _ in range(args.prompts)]
    t = time.perf_counter()
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=args.completion, ignore_eos=True,
                                                  temperature=1.0, seed=step * 1000 + i))
                for i, p in enumerate(prompts) for _ in range(args.samples)]
    results = sampler.generate(requests)
    times["sample"] = time.perf_counter() - t

    t = time.perf_counter()
    n, length = len(results), args.prompt + args.completion
    tokens = np.zeros((n, length), np.int32)
    mask = np.zeros((n, length), bool)
    behaviour = np.zeros((n, length), np.float32)
    for i, (req, res) in enumerate(zip(requests, results)):
        tokens[i, :args.prompt], tokens[i, args.prompt:] = req.prompt_ids, res.output_ids
        mask[i, args.prompt:] = True
        behaviour[i, args.prompt:] = res.logprobs
    host = {"tokens": tokens, "loss_mask": mask, "behaviour_logprobs": behaviour,
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy(),
            "segment_ids": np.ones((n, length), np.int32),
            "rewards": rng.integers(0, 2, n).astype(np.float32),
            "group_ids": np.repeat(np.arange(len(prompts), dtype=np.int32), args.samples)}
    batch = parallel.host_to_global(host, mesh)
    times["batch"] = time.perf_counter() - t

    t = time.perf_counter()
    batch = learner.score(batch)  # at one epoch of one minibatch, no old_logprobs: the
    jax.block_until_ready(batch)  # update takes its own (Learner.proximal_from_step)
    times["score"] = time.perf_counter() - t
    t = time.perf_counter()
    batch = learner.advantages(batch)
    jax.block_until_ready(batch["advantages"])
    times["advantages"] = time.perf_counter() - t
    t = time.perf_counter()
    learner.update(batch)
    times["update"] = time.perf_counter() - t
    t = time.perf_counter()
    sampler.update_weights(learner.policy.params, str(step))
    jax.block_until_ready(jax.tree.leaves(sampler.weights()[0]))
    times["sync"] = time.perf_counter() - t
    times["total"] = sum(times.values())
    times["load"] = os.getloadavg()[0]
    return times


# The trainer rows: the quickstart's model and task, no warm start, eval and checkpoints only
# at the ends (the median skips the first step, which compiles, and the last, which evaluates).
TRAINER_FLAGS = ["--config", "configs/quickstart.py", "--config.sft.steps=0",
                 "--config.eval.num_tasks=8", "--config.eval.every=1000",
                 "--config.checkpoint.every=1000", "--config.checkpoint.export_hf=false",
                 "--config.log.plot=false"]
TRAINER_MODES = {
    "sync": [],
    "async k=1": ["--config.rollout.max_staleness=1"],
    "async k=1 deterministic": ["--config.rollout.max_staleness=1",
                                "--config.rollout.deterministic=true"],
}
PROXIMAL_MODES = {"recompute_proximal": [],
                  "recompute_proximal=False": ["--config.algo.recompute_proximal=false"]}


def trainer_rows(args) -> None:
    """The trainer end to end (`python -m launch.train`), one subprocess per mode, all with
    the same batch: seconds per step and the learner's idle time, medians of the steady steps."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    modes = PROXIMAL_MODES if args.no_proximal else TRAINER_MODES
    flags = TRAINER_FLAGS + [f"--config.train.steps={args.steps + 2}",
                             f"--config.train.tasks_per_step={args.prompts}",
                             f"--config.train.samples_per_task={args.samples}",
                             f"--config.env.step_latency_s={args.step_latency_s}",
                             f"--config.train.epochs={args.epochs}"]
    print(f"trainer step, quickstart model and task, {args.prompts} tasks x {args.samples} "
          f"samples, {args.epochs} epoch(s), env latency {args.step_latency_s} s per reset "
          f"and step, 2 x "
          f"{jax.devices()[0].device_kind} devices (sampler 1 + learner 1 when async)")
    print("| mode | s / step | rollout s | score s | update s | learner idle s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for name, extra in modes.items():
        with tempfile.TemporaryDirectory() as workdir:
            subprocess.run([sys.executable, "-m", "launch.train", *flags, *extra,
                            "--workdir", workdir], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f]
        steady = [r for r in records if 1 < r["step"] < args.steps + 2]
        med = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
        step_s = med("time/step_s")
        base = base or step_s
        print(f"| {name} | {step_s:.3f} | {med('time/rollout_s'):.3f} | "
              f"{med('time/score_s'):.3f} | {med('time/update_s'):.3f} | "
              f"{med('time/learner_idle_s'):.3f} | {base / step_s:.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="steps after the first (compile) one")
    parser.add_argument("--model_path", default="", help="a real model's HF directory "
                        "(default: random weights of the rl_step shape)")
    parser.add_argument("--tokens_per_device", type=int, default=0,
                        help="the update's micro-batches: at most this many tokens each "
                             "(0: one micro-batch)")
    parser.add_argument("--score_tokens_per_device", type=int, default=0,
                        help="the score pass's micro-batches, likewise")
    parser.add_argument("--trainer", action="store_true",
                        help="the whole trainer, synchronous vs asynchronous rollouts")
    parser.add_argument("--no_proximal", action="store_true",
                        help="with --trainer: recompute_proximal on vs off")
    parser.add_argument("--step_latency_s", type=float, default=0.0,
                        help="with --trainer: seconds every env reset and step waits")
    parser.add_argument("--epochs", type=int, default=1,
                        help="with --trainer: update epochs (the learner's share of a step)")
    parser.add_argument("--cache_dir", default="",
                        help="JAX's persistent compilation cache here (as the launchers keep "
                             "one): a second run shows the first step with a warm cache")
    args = parser.parse_args()
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if args.trainer:
        trainer_rows(args)
        return

    mesh = parallel.make_mesh({"data": -1})
    if args.model_path:
        from rl_tpu.models import hf
        cfg, params = hf.load(args.model_path, mesh=mesh, dtype="float32")
        name = os.path.basename(os.path.dirname(os.path.abspath(args.model_path)))
    else:
        cfg = ModelConfig(**SHAPES["rl_step"])
        params = tiny.random_params(cfg, mesh=mesh, scale=0.04)
        name = f"{cfg.arch} (rl_step shape, random)"
    n_params = sum(x.size for x in jax.tree.leaves(params))
    sampler = JaxSampler(cfg, params, mesh=parallel.make_mesh({}, devices=jax.devices()[:1]))
    state = create_state(params, make_optimizer(OptimConfig(lr=1e-6)))
    learner = Learner(Transformer(cfg, mesh=mesh), state, mesh,
                      PolicyLossConfig(kind="ppo"), UpdateConfig(
                          advantage="grpo", tokens_per_device=args.tokens_per_device,
                          score_tokens_per_device=args.score_tokens_per_device))
    rng = np.random.default_rng(0)

    first = one_step(sampler, learner, mesh, cfg.vocab_size, args, 1, rng)
    rest = [one_step(sampler, learner, mesh, cfg.vocab_size, args, s, rng)
            for s in range(2, args.steps + 2)]
    steady = {k: statistics.median(r[k] for r in rest) for k in first}
    tokens = args.prompts * args.samples * args.completion
    device = jax.devices()[0].device_kind
    print(f"GRPO step, {n_params / 1e6:.2f}M-param {name}, {args.prompts} prompts x "
          f"{args.samples} samples, prompt {args.prompt}, completion {args.completion}, "
          f"{jax.device_count()} x {device}")
    print("| step | " + " | ".join(f"{p} s" for p in PHASES)
          + " | total s | sampled tok/s | load average |")
    print("|---" * (len(PHASES) + 4) + "|")
    for label, row in (("first (compile)", first), (f"steady (median of {args.steps})", steady)):
        cells = " | ".join(f"{row[p]:.3f}" for p in PHASES)
        print(f"| {label} | {cells} | {row['total']:.3f} | {tokens / row['sample']:,.0f} | "
              f"{row['load']:.1f} |")


if __name__ == "__main__":
    main()
