"""PPO with a critic (GAE over the agent's tokens) on ScienceWorld. Needs a Java runtime.

    python -m launch.train --config configs/sciworld_ppo.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/sciworld_ppo

Multi-turn science tasks; per-turn score increments are placed on each turn's last policy
token, so GAE credits every action with its own reward. Horizon stages (10, 20, 30).
`get_config("smoke")` runs two steps on a tiny random model.
"""

from rl_tpu.recipes.config import base_config, shrink_for_smoke


def get_config(arg: str = ""):
    c = base_config("ppo")
    c.env.name = "sciworld"
    c.env.max_turns = 30
    c.env.max_new_tokens = 128
    c.env.max_context_tokens = 8192
    c.env.step_timeout_s = 120.0
    c.train.length_buckets = (1024, 2048, 4096, 8192)
    c.schedules.horizon_turns = (10, 20, 30)
    c.schedules.horizon_every = 100
    c.train.steps = 300
    c.train.tasks_per_step = 32
    c.train.samples_per_task = 4
    c.train.minibatches = 4
    c.optim.lr = 1e-6
    c.algo.value_lr = 1e-5
    c.model.dtype = "bfloat16"
    c.model.remat = "dots"
    c.eval.every = 25
    c.eval.num_tasks = 100
    if arg == "smoke":
        shrink_for_smoke(c)
        c.env.max_context_tokens = 2048
        c.train.length_buckets = (1024, 2048)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; use '' or 'smoke'")
    return c
