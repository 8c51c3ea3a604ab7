"""Quickstart: a tiny model learns, on a laptop CPU, to beat the teacher it was trained on.

    python -m launch.train --config configs/quickstart.py --workdir /tmp/quickstart

1. Builds a tiny random Qwen2 (with a locally trained tokenizer) in <workdir>/init_model.
2. SFT warm start on demonstrations of the `largest` task ("Which number is largest? 3 7 2 5
   1") from an imperfect teacher: it names the largest number 30% of the time and the FIRST
   number otherwise, solving about 47% of tasks (0.496 of the 500 held-out ones). Imitation
   copies that habit.
3. GRPO with the exact reward (1 for the largest number) on the embedded JAX sampler; greedy
   eval success on 500 held-out tasks at step 0 (the SFT start) and every 10 steps.
It prints the teacher's success, the SFT start's, and the final one; W/metrics.jsonl holds
every step, W/curves.png the curves. `get_config("smoke")` runs the same pipeline in seconds;
`get_config("sft_only")` is the control: the same budget spent on more SFT instead of RL.
"""

from rl_tpu.recipes.config import base_config, largest_task


def get_config(arg: str = ""):
    c = largest_task(base_config("grpo"))
    c.seed = 0
    c.eval.num_tasks = 500
    if arg == "smoke":
        c.train.steps = 2
        c.train.tasks_per_step = 4
        c.train.samples_per_task = 4
        c.sft.steps = 4
        c.sft.num_demos = 64
        c.sft.batch_size = 16
        c.eval.num_tasks = 16
        c.eval.every = 2
        c.checkpoint.every = 1
    elif arg == "sft_only":
        c.train.steps = 0
        c.sft.steps = 600
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; use '', 'smoke' or 'sft_only'")
    return c
