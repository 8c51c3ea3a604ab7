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

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/quickstart.py:smoke --workdir /tmp/quickstart_smoke
    python -m launch.train --config configs/quickstart.py:sft_only,smoke \\
        --workdir /tmp/quickstart_sft_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "rl": "SFT warm start, then GRPO with the exact reward",
    "sft_only": "the control: the same budget spent on more SFT instead of RL",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"variant": ("rl", "sft_only")})
    c = largest_task(base_config("grpo"))
    c.seed = 0
    c.eval.num_tasks = 500
    if chosen["variant"] == "sft_only":
        c.train.steps = 0
        c.sft.steps = 600
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=16)
        c.train.tasks_per_step = c.train.samples_per_task = 4
        c.sft.num_demos = 64
        c.log.plot = True  # the notebook's smoke run shows the curves
    return c
