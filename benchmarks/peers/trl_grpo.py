"""TRL's side of benchmarks/peers.py: GRPO steps of the shared random Qwen2 with TRL's own
`GRPOTrainer` (transformers generation, no vLLM) on CPU torch; prints one JSON line
(`PEER_RESULT {...}`). Runs in the TRL venv (`python benchmarks/peers.py --install`).

    ~/.cache/rl_tpu/peers/trl/bin/python benchmarks/peers/trl_grpo.py \
        --model_dir /tmp/peer_model --prompts_file /tmp/peer_model/prompts.json --steps 4

One trainer step = `--prompts` prompts x `--samples` generations (per_device_train_batch_size
= prompts x samples, steps_per_generation 1, num_iterations 1: one optimizer step on all the
completions), completions of exactly `--completion` tokens (min_new_tokens = max_new_tokens,
so EOS cannot end one early), beta 0 (no reference model), gradient checkpointing off (TRL
turns it on by default; rl_tpu and Tunix recompute nothing either), the rule reward (the fraction of
even ids in a completion). A callback times each step (on_step_begin .. on_step_end); the
sample share is the trainer's `_generate_and_score_completions` (generation + rewards +
advantages), the update the rest of the step (forward, backward, optimizer).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

# Before torch starts its OpenMP pool: spinning waiters would steal the cores of whatever runs
# beside (the benchmark's other processes, other users of a shared machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import peer_args  # noqa: E402  (this folder: the flags every peer child shares)


def even_fraction(prompts, completions, completion_ids, **_) -> list[float]:
    """The rule reward every side uses: the share of even token ids in a completion."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


class StepTimer(transformers.TrainerCallback):
    """Wall time of every optimizer step (generation included: TRL generates inside it)."""

    def __init__(self):
        self.steps, self._start = [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(time.perf_counter() - self._start)


def time_generation(trainer) -> tuple[list[float], list[int]]:
    """Wraps the trainer's generate-and-score phase with a timer; returns the lists it fills:
    seconds per call, and the completion tokens of every sample (to check their length)."""
    times, lengths, inner = [], [], trainer._generate_and_score_completions

    def timed(batch):
        start = time.perf_counter()
        out = inner(batch)
        times.append(time.perf_counter() - start)
        lengths.extend(out["completion_mask"].sum(-1).tolist())
        return out

    trainer._generate_and_score_completions = timed
    return times, lengths


def main():
    parser = peer_args.parser(__doc__, "JSON of the prompt texts per step (benchmarks/peers.py "
                              "writes it)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--gradient_checkpointing", action="store_true",
                        help="TRL's default; off here as on the other sides (no remat)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    per_step = peer_args.prompt_steps(args)
    prompts = [p["text"] for step in per_step for p in step]
    n_prompts = len(per_step[0])

    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=10_000,
            disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, seed=0,
            max_steps=args.steps + 1, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, per_device_train_batch_size=n_prompts * args.samples,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            num_generations=args.samples, max_completion_length=args.completion,
            generation_kwargs={"min_new_tokens": args.completion}, temperature=1.0,
            beta=0.0, dataloader_num_workers=0,
            gradient_checkpointing=args.gradient_checkpointing)
        timer = StepTimer()
        trainer = GRPOTrainer(model=model, reward_funcs=even_fraction, args=config,
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=tokenizer, callbacks=[timer])
        sample_times, lengths = time_generation(trainer)
        setup_s = time.perf_counter() - t
        trainer.train()
    if len(timer.steps) != args.steps + 1 or len(sample_times) != args.steps + 1:
        raise SystemExit(f"expected {args.steps + 1} steps, timed {len(timer.steps)} steps and "
                         f"{len(sample_times)} generations")
    updates = [s - g for s, g in zip(timer.steps, sample_times)]
    rest = slice(1, None)
    med = lambda xs: statistics.median(xs[rest]) if args.steps else None  # noqa: E731
    print("PEER_RESULT " + json.dumps({
        "side": "trl", "version": f"trl {trl.__version__}, torch {torch.__version__}, "
                                  f"transformers {transformers.__version__}",
        "backend": "cpu", "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "params": sum(p.numel() for p in model.parameters()), "setup_s": setup_s,
        "first_s": timer.steps[0], "first": {"sample": sample_times[0], "update": updates[0]},
        "steady_s": med(timer.steps), "sample_s": med(sample_times), "update_s": med(updates),
        "completion_tokens": [min(lengths), max(lengths)],
        "gradient_checkpointing": args.gradient_checkpointing, "steps": args.steps}),
        flush=True)


if __name__ == "__main__":
    main()
