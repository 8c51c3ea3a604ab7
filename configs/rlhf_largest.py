"""RL against a learned reward model on the quickstart's task, beside RL on the env's own reward.

    python -m launch.train --config configs/reward_model_largest.py --workdir /tmp/rm_largest
    python -m launch.train --config configs/rlhf_largest.py:rm \\
        --config.reward.model_path=/tmp/rm_largest/reward_model_hf --workdir /tmp/rlhf_rm
    python -m launch.train --config configs/rlhf_largest.py:gold --workdir /tmp/rlhf_gold

The quickstart's setting (rl_tpu/recipes/config.py: largest_task): GRPO from the SFT warm start,
60 steps of 32 tasks x 8 samples.
  rm     the trajectory's reward is the reward model's score alone (reward.model_weight 1,
         reward.rule_weight 0, the raw score: GRPO normalises within each group); the env's
         verdict is still logged as rollout/success and judged by the held-out eval, the gold
         signal the model stands in for (rollout/reward_model, rollout/reward_rule beside it)
  gold   the env's exact reward (the control: what RL reaches with the true reward)
Same seed, same steps, same warm start. The table of both is in docs/rewards.md. `smoke`
shrinks either (rm needs --config.reward.model_path, e.g. the reward_model_largest smoke's).

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/reward_model_largest.py:smoke \\
        --workdir /tmp/rm_smoke
    python -m launch.train --config configs/rlhf_largest.py:rm,smoke \\
        --config.reward.model_path=/tmp/rm_smoke/reward_model_hf --workdir /tmp/rlhf_rm_smoke
    python -m launch.train --config configs/rlhf_largest.py:gold,smoke \\
        --workdir /tmp/rlhf_gold_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "rm": "the reward model's score alone (reward.model_path)",
    "gold": "the env's exact reward (the control)",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"reward": ("rm", "gold")}, numbered={"seed": 0})
    c = largest_task(base_config("grpo"))
    c.seed = chosen["seed"]
    c.eval.num_tasks = 500
    if chosen["reward"] == "rm":
        c.reward.model_path = "/tmp/rm_largest/reward_model_hf"  # reward_model_largest's
        c.reward.model_weight = 1.0
        c.reward.rule_weight = 0.0
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=8)
        c.sft.num_demos = 64
    return c
