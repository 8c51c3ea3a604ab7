"""A reward model for the quickstart's task, learned from the env's own ranking of replies.

    python -m launch.train --config configs/reward_model_largest.py --workdir /tmp/rm_largest
    python -m launch.train --config configs/reward_model_largest.py:ssrm --workdir /tmp/rm_ssrm

The quickstart's setting (rl_tpu/recipes/config.py: largest_task): P_0 is the tiny model after
its SFT warm start on a teacher right 30% of the time. It samples 8 replies to each training
task at temperature 1; the env's exact reward ranks them, and each task whose replies differ
gives one (best, worst) pair. A Bradley-Terry reward model (P_0's trunk and a zero score head,
rl_tpu/recipes/reward_model.py) trains on them; its held-out pairwise accuracy on pairs from
eval-split tasks is W/metrics.jsonl's rm/eval_accuracy. W/reward_model_hf is what
configs/rlhf_largest.py trains a policy against.
  bt     1024 tasks' pairs, 400 BT steps
  ssrm   semi-supervised: 128 tasks' pairs, then 3 rounds that each pseudo-label a pool of 512
         tasks' unlabelled pairs and keep those at confidence >= 0.9
  proxy  a weak model from 24 tasks' pairs, 100 steps: the proxy that
         configs/overoptimisation_largest.py over-optimises
`smoke` runs the pipeline in seconds. The figures are in docs/rewards.md.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/reward_model_largest.py:smoke \\
        --workdir /tmp/rm_smoke
    python -m launch.train --config configs/reward_model_largest.py:ssrm,smoke \\
        --workdir /tmp/rm_ssrm_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "bt": "Bradley-Terry on 1024 tasks' pairs, 400 steps",
    "ssrm": "semi-supervised: 128 tasks' pairs, then 3 pseudo-label rounds",
    "proxy": "a weak model from 24 tasks' pairs, 100 steps",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"variant": ("bt", "ssrm", "proxy")})
    c = largest_task(base_config("grpo"))
    c.recipe = "reward_model"
    c.eval.num_tasks = 200
    c.loop.samples_per_task = 8
    rm = c.reward_model
    rm.prompts = 1024
    rm.eval_prompts = 256
    rm.steps = 400
    rm.batch_size = 32
    rm.lr = 1e-3  # a tiny model's rate (the policy's SFT runs at 3e-3)
    if chosen["variant"] == "ssrm":
        rm.prompts = 128
        rm.steps = 200
        rm.ssrm_rounds = 3
        rm.ssrm_pool = 512
        rm.ssrm_threshold = 0.9
    if chosen["variant"] == "proxy":
        rm.prompts = 24
        rm.steps = 100
    if smoke:
        shrink_for_smoke(c, warm_start_steps=30, eval_tasks=8)
        rm.prompts = rm.eval_prompts = rm.ssrm_pool = 8
        rm.steps = 3
        rm.batch_size = 8
        rm.ssrm_rounds = min(rm.ssrm_rounds, 1)
    return c
