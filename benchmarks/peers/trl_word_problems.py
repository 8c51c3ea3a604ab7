"""The TRL side of issue 47 item 3: TRL's `GRPOTrainer` on configs/real_gsm.py's job
(SmolLM2-135M-Instruct on rl_tpu's word problems), for seconds a step and held-out greedy
success after the same steps. Runs in the TRL venv (`python benchmarks/peers.py --install
--sides trl`: trl 1.16.0 + CPU torch); rl_tpu's env module is pure Python and is imported from
this checkout (the repo root goes on sys.path; importing it loads neither jax nor numpy).

    # rl_tpu's task order (its TaskStream shuffles the train split with grain, seeded by
    # config.seed), written by rl_tpu's own Python, which has grain:
    python benchmarks/peers/trl_word_problems.py --write_order /tmp/order_seed0.json \\
        --steps 16 --tasks_per_step 4 --seed 0
    ~/.cache/rl_tpu/peers/trl/bin/python benchmarks/peers/trl_word_problems.py \\
        --model_dir $(python -m launch.get_model smollm2-135m-instruct) \\
        --order_file /tmp/order_seed0.json --steps 16 --tasks_per_step 4 --samples 8 \\
        --completion 128 --lr 1e-5 --eval_tasks 64 --eval_every 4 --seed 0

What matches configs/real_gsm.py (read from it and from TRL 1.16's GRPOConfig):
- the env: WordProblemsEnv(max_steps=1, max_operand=10, lenient=True); the prompt is the
  model's chat template over [system: env.system_prompt, user: env.question(task)] plus the
  assistant header; the reward is env.score(task, reply).reward, the reply being the
  completion's text up to its first EOS, stripped (rl_tpu cuts the stop token and strips);
- the problems: step s trains on the train tasks the order file lists for it (rl_tpu's own
  order), or without one on train tasks s * tasks_per_step .. + tasks_per_step - 1;
- GRPO: group = --samples completions a problem, advantage (r - group mean) / (group std,
  unbiased, + eps) (TRL scale_rewards="group"; rl_tpu std_ddof=1), PPO clip 0.2 both sides,
  the loss averaged over each completion's tokens, then over completions (TRL
  loss_type="grpo" = rl_tpu's GRPO aggregation seq_mean_token_mean; TRL's default "dapo"
  would weight by tokens instead), beta 0 (no KL term, no reference model), one optimiser
  step per batch (num_iterations 1, the batch split in --micro_batches accumulated chunks,
  rl_tpu's train.micro_batches), log-probs at the sampling temperature;
- sampling: temperature --temperature (0.5), top_p 1, top_k off, at most --completion new
  tokens, stopping at EOS (<|im_end|>); completions cut at the cap are trained on, as in rl_tpu
  (mask_truncated_completions False);
- optimiser: AdamW (0.9, 0.999, eps 1e-8), weight decay 0, global-norm clip 1.0, constant LR,
  no warm-up; fp32 weights and compute (bf16 off: GRPOConfig turns it on by default);
- eval: greedy (do_sample False) replies of at most --completion tokens to the first
  --eval_tasks eval-split problems, at step 0 and after every --eval_every steps and the last
  (rl_tpu's eval.every rule): success, format failures, mean generated tokens (the EOS counted
  when one was generated, as rl_tpu's loss-mask count does).

What could not be matched exactly, and why:
- the samples: torch's RNG and JAX's differ, so even with one seed the two sides draw other
  completions; only the distribution matches. Seeds are comparable as repeats, not pairs;
- the advantage's eps: TRL adds 1e-4 to the group std (hard-coded), rl_tpu 1e-6; with 0/1
  rewards a group with any spread has std >= 0.35, so advantages differ by under 0.03%;
- numerics: torch CPU/GPU kernels vs XLA; the eval batches prompts with left padding
  (--eval_batch), rl_tpu's sampler pads its own way: greedy replies can differ in a rare tie;
- gradient checkpointing: off here (TRL's default is on; rl_tpu recomputes nothing). It
  changes memory and speed, not the math;
- the step's clock: TRL generates with transformers `generate` (no vLLM here), rl_tpu with its
  own JAX sampler; each side's seconds a step are its own whole step (sampling + update), on
  whatever hardware it ran: compare only runs on the same machine;
- context cap: rl_tpu also caps prompt + reply at env.max_context_tokens (256); prompts here are
  ~90 tokens, so 128 new tokens never reach it, and TRL has no such cap to set;
- train/kl: rl_tpu's config logs KL to the start model (algo.log_kl, one more forward a step, not
  in the loss); TRL computes none at beta 0, so rl_tpu's steps carry that extra forward.

Prints one `PEER_RESULT {json}` line at the end: seconds of every step (and its sampling
share), TRL's own per-step logs (reward, lengths, clip ratios, grad norm), every eval, the
task order used, versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ENV_KWARGS = dict(max_steps=1, max_operand=10, lenient=True)  # configs/real_gsm.py's env
# TRL's per-step log keys kept in the result (the rest are timings and tool stats)
LOG_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
            "completions/clipped_ratio", "clip_ratio/region_mean", "entropy", "grad_norm",
            "loss", "learning_rate")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", help="HF dir (`python -m launch.get_model "
                   "smollm2-135m-instruct` prints it)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--tasks_per_step", type=int, default=4)
    p.add_argument("--samples", type=int, default=8, help="the group: completions a problem")
    p.add_argument("--completion", type=int, default=128, help="max new tokens (train, eval)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro_batches", type=int, default=1,
                   help="the step's completions in this many accumulated chunks (one "
                        "optimiser step; rl_tpu's train.micro_batches)")
    p.add_argument("--eval_tasks", type=int, default=64, help="first N eval problems, greedy")
    p.add_argument("--eval_every", type=int, default=4, help="0: only at step 0 and the end")
    p.add_argument("--eval_batch", type=int, default=16, help="prompts a generate call")
    p.add_argument("--order_file", default="", help="JSON from --write_order: rl_tpu's train "
                   "task indices a step (without it: s * tasks_per_step + i)")
    p.add_argument("--write_order", default="", help="write rl_tpu's task order for --steps, "
                   "--tasks_per_step, --seed to this file and exit (run with rl_tpu's Python)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    if not args.write_order and not args.model_dir:
        p.error("--model_dir is required (unless --write_order)")
    if min(args.steps, args.tasks_per_step, args.samples, args.completion) < 1:
        p.error("--steps, --tasks_per_step, --samples and --completion must be >= 1")
    if (args.tasks_per_step * args.samples) % args.micro_batches:
        p.error("--micro_batches must divide tasks_per_step x samples")
    return args


def load_env():
    """configs/real_gsm.py's WordProblemsEnv, from this checkout (pure Python: no jax)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from rl_tpu.envs.word_problems import WordProblemsEnv

    return WordProblemsEnv(**ENV_KWARGS)


def write_order(args) -> None:
    """rl_tpu's train order for this run (rl_tpu/data/tasks.py's TaskStream, one host, seeded as
    rl_tpu.recipes.rl seeds it: config.seed): needs rl_tpu's environment (grain)."""
    from rl_tpu.data.tasks import TaskStream

    stream = TaskStream(load_env().tasks(), "train", tasks_per_step=args.tasks_per_step,
                        seed=args.seed, process_index=0, process_count=1)
    steps = [[int(t.data["index"]) for _, t in stream.next()] for _ in range(args.steps)]
    with open(args.write_order, "w") as f:
        json.dump({"seed": args.seed, "tasks_per_step": args.tasks_per_step,
                   "env_kwargs": ENV_KWARGS, "steps": steps}, f)
    print(f"wrote {args.steps} steps of {args.tasks_per_step} train indices to {args.write_order}")


def task_order(args) -> tuple[list[list[int]], str]:
    """Train indices a step, and where they came from."""
    if not args.order_file:
        k = args.tasks_per_step
        return [[s * k + i for i in range(k)] for s in range(args.steps)], "sequential"
    with open(args.order_file) as f:
        order = json.load(f)
    if order["tasks_per_step"] != args.tasks_per_step or len(order["steps"]) < args.steps:
        raise SystemExit(f"{args.order_file}: {len(order['steps'])} steps of "
                         f"{order['tasks_per_step']} tasks; this run needs {args.steps} of "
                         f"{args.tasks_per_step}")
    if order.get("env_kwargs", ENV_KWARGS) != ENV_KWARGS or order["seed"] != args.seed:
        print(f"(note: {args.order_file} was written for seed {order['seed']}, env "
              f"{order.get('env_kwargs')}; this run: seed {args.seed}, env {ENV_KWARGS})")
    return order["steps"][:args.steps], f"rl_tpu TaskStream seed {order['seed']}"


def messages(env, task) -> list[dict]:
    return [{"role": "system", "content": env.system_prompt},
            {"role": "user", "content": env.question(task)}]


def reply_text(tokenizer, ids, eos_ids) -> tuple[str, int]:
    """(the reply as the env gets it, generated tokens): text up to the first EOS, stripped;
    the count includes that EOS."""
    ids = [int(t) for t in ids]
    cut = next((j for j, t in enumerate(ids) if t in eos_ids), None)
    text = tokenizer.decode(ids[:cut] if cut is not None else ids, skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
    return text.strip(), (cut + 1 if cut is not None else len(ids))


def main():
    args = parse_args()
    if args.write_order:
        write_order(args)
        return
    # Before torch starts its OpenMP pool (as trl_grpo.py: no spinning waiters on a shared box)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    run(args)


def run(args) -> None:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, HERE)
    from trl_grpo import StepTimer, time_generation  # this folder's TRL peer

    torch.set_num_threads(args.threads)
    env = load_env()
    source = env.tasks()
    order, order_from = task_order(args)
    train_tasks = {i: source.get("train", i) for step in order for i in step}
    eval_tasks = [source.get("eval", i) for i in range(args.eval_tasks)]

    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    eval_tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir,
                                                                padding_side="left")
    eos_ids = {tokenizer.eos_token_id}
    gen_eos = model.generation_config.eos_token_id
    eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None
                   else [])

    seen: list[int] = []  # the train index of every scored completion, to check the order

    def word_problem_reward(prompts, completions, completion_ids, task_index, **_):
        rewards = []
        for ids, i in zip(completion_ids, task_index):
            seen.append(int(i))
            rewards.append(float(env.score(train_tasks[int(i)],
                                           reply_text(tokenizer, ids, eos_ids)[0]).reward))
        return rewards

    @torch.no_grad()
    def evaluate(step: int) -> dict:
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        config = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=args.completion, eos_token_id=sorted(eos_ids),
            pad_token_id=eval_tokenizer.pad_token_id, temperature=None, top_p=None,
            top_k=None)
        wins = fails = tokens = 0
        for b in range(0, len(eval_tasks), args.eval_batch):
            chunk = eval_tasks[b:b + args.eval_batch]
            texts = [eval_tokenizer.apply_chat_template(messages(env, t), tokenize=False,
                                                        add_generation_prompt=True)
                     for t in chunk]
            enc = eval_tokenizer(texts, return_tensors="pt", padding=True,
                                 add_special_tokens=False).to(model.device)
            out = model.generate(**enc, generation_config=config)
            for task, ids in zip(chunk, out[:, enc["input_ids"].shape[1]:].tolist()):
                text, n = reply_text(eval_tokenizer, ids, eos_ids)
                info = env.score(task, text).info
                wins += bool(info["success"])
                fails += bool(info["format_failed"])
                tokens += n
        if was_training:
            model.train()
        n = max(len(eval_tasks), 1)
        result = {"step": step, "tasks": len(eval_tasks), "success": wins / n,
                  "format_failed": fails / n, "tokens": tokens / n,
                  "seconds": time.perf_counter() - start}
        print(f"eval step {step}: success {result['success']:.3f}, format_failed "
              f"{result['format_failed']:.3f}, tokens {result['tokens']:.1f} "
              f"({result['seconds']:.1f} s)", flush=True)
        return result

    evals, train_log = [], []

    class EvalAndLog(transformers.TrainerCallback):
        """After the step timer has stopped: the eval when due; TRL's own step logs."""

        def on_step_end(self, targs, state, control, **kwargs):
            step = state.global_step
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                evals.append(evaluate(step))

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                train_log.append({"step": state.global_step,
                                  **{k: logs[k] for k in LOG_KEYS if k in logs}})

    prompts = [messages(env, train_tasks[i]) for step in order for i in step]
    indices = [i for step in order for i in step]
    batch = args.tasks_per_step * args.samples
    use_cpu = not torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=1,
            disable_tqdm=True, use_cpu=use_cpu, bf16=False, fp16=False, seed=args.seed,
            max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9,
            adam_beta2=0.999, adam_epsilon=1e-8,
            per_device_train_batch_size=batch // args.micro_batches,
            gradient_accumulation_steps=args.micro_batches,
            steps_per_generation=args.micro_batches, num_iterations=1,
            num_generations=args.samples, max_completion_length=args.completion,
            temperature=args.temperature, top_p=1.0, top_k=0, beta=0.0,
            loss_type="grpo", scale_rewards="group", epsilon=0.2, epsilon_high=0.2,
            mask_truncated_completions=False, shuffle_dataset=False,
            gradient_checkpointing=False, dataloader_num_workers=0)
        timer = StepTimer()
        trainer = GRPOTrainer(
            model=model, reward_funcs=word_problem_reward, args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts, "task_index": indices}),
            processing_class=tokenizer, callbacks=[timer, EvalAndLog()])
        sample_times, lengths = time_generation(trainer)
        setup_s = time.perf_counter() - t0
        evals.append(evaluate(0))
        trainer.train()

    expected = [i for i in indices for _ in range(args.samples)]
    if sorted(seen) != sorted(expected) or len(timer.steps) != args.steps:
        raise SystemExit(f"the trainer did not follow the planned problems: {len(timer.steps)} "
                         f"steps timed; scored train indices {sorted(set(seen))[:12]}..., planned"
                         f" {sorted(set(indices))[:12]}...")
    per_step_seen = [sorted(set(seen[s * batch:(s + 1) * batch])) for s in range(args.steps)]
    in_order = per_step_seen == [sorted(step) for step in order]
    steady = timer.steps[1:] or timer.steps
    print("PEER_RESULT " + json.dumps({
        "side": "trl", "job": "word_problems (configs/real_gsm.py)",
        "version": f"trl {trl.__version__}, torch {torch.__version__}, "
                   f"transformers {transformers.__version__}",
        "device": "cpu" if use_cpu else torch.cuda.get_device_name(0),
        "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "settings": {k: getattr(args, k) for k in (
            "steps", "tasks_per_step", "samples", "completion", "lr", "temperature", "seed",
            "micro_batches", "eval_tasks", "eval_every", "eval_batch")},
        "env_kwargs": ENV_KWARGS, "task_order": order_from, "steps_in_planned_order": in_order,
        "setup_s": setup_s, "step_s": timer.steps, "sample_s": sample_times,
        "update_s": [s - g for s, g in zip(timer.steps, sample_times)],  # one generation a step
        "median_step_s_after_first": statistics.median(steady),
        "completion_tokens": [min(lengths), max(lengths)] if lengths else None,
        "evals": evals, "train_log": train_log}), flush=True)


if __name__ == "__main__":
    main()
