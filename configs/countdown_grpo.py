"""GRPO on countdown (reasoning-gym): reach a target number with + - * / over given numbers.

    python -m launch.train --config configs/countdown_grpo.py \\
        --config.model.path=/models/Qwen2.5-1.5B-Instruct --workdir /tmp/countdown_grpo

Single-turn: one reply per task, scored by reasoning-gym's own checker (1.0 right, 0.05 for a
well-formed wrong answer). `get_config("smoke")` runs two steps on a tiny random model.
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke


def get_config(arg: str = ""):
    c = base_config("grpo")
    set_env(c, "countdown")
    c.env.max_turns = 1
    c.env.max_new_tokens = 1024
    c.env.max_context_tokens = 1536
    c.train.length_buckets = (512, 1024, 2048)
    c.train.steps = 200
    c.train.tasks_per_step = 64
    c.train.samples_per_task = 8
    c.train.minibatches = 4
    c.optim.lr = 1e-6
    c.model.dtype = "bfloat16"
    c.model.remat = "dots"
    c.eval.every = 20
    c.eval.num_tasks = 200
    c.eval.pass_k = 4
    if arg == "smoke":
        shrink_for_smoke(c)
        c.env.max_context_tokens = 512
        c.train.length_buckets = (256, 512)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; use '' or 'smoke'")
    return c
