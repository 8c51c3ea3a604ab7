"""Expert iteration (rounds of rejection-sampling fine-tuning) on the quickstart's task.

    python -m launch.train --config configs/expert_iteration_largest.py --workdir /tmp/ei

The quickstart's setting (rl_tpu/recipes/config.py: largest_task): a tiny model, SFT warm
start on 4000 demonstrations of a teacher right 30% of the time (P_0). Then 3 rounds, each
sampling 8 replies to 512 new training tasks from the current policy at temperature 1,
keeping the correct ones (reward 1, each distinct reply once) and fine-tuning the policy on
them for 100 steps at lr 1e-3 (rl_tpu/recipes/expert_iteration.py). Greedy success on 500
held-out tasks after each round is W/metrics.jsonl's eval/success at steps 0..3.
`rft` is one round (plain rejection-sampling fine-tuning); `smoke` runs the pipeline in
seconds. The figures are in docs/loops.md.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/expert_iteration_largest.py:smoke \\
        --workdir /tmp/ei_smoke
    python -m launch.train --config configs/expert_iteration_largest.py:rft,smoke \\
        --workdir /tmp/rft_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "expert_iteration": "3 rounds of rejection-sampling fine-tuning",
    "rft": "one round (plain rejection-sampling fine-tuning)",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"rounds": ("expert_iteration", "rft")})
    c = largest_task(base_config("grpo"))
    c.recipe = "expert_iteration"
    c.eval.num_tasks = 500
    # 3 rounds (rft: 1) of 8 replies to 512 tasks; the correct ones (loop.reward_threshold 1)
    # fine-tune the policy for loop.sft_steps = 100 steps at loop.sft_lr = 1e-3
    c.loop.rounds = 1 if chosen["rounds"] == "rft" else 3
    c.loop.tasks_per_round = 512
    c.loop.samples_per_task = 8
    c.checkpoint.every = 50
    if smoke:
        shrink_for_smoke(c, warm_start_steps=30, eval_tasks=8)
    return c
