"""PPO with a critic (GAE over the agent's tokens) on ScienceWorld. Needs a Java runtime.

    python -m launch.train --config configs/sciworld_ppo.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/sciworld_ppo

Multi-turn science tasks; per-turn score increments are placed on each turn's last policy
token, so GAE credits every action with its own reward. Horizon stages (10, 20, 30). The env
is "sciworld" with rl_tpu's options: 0..1 score increments as rewards (`reward="delta"`), the
system prompt, round-robin tasks over all 30 families, 100 replies instead of the simulator's
100-move limit; configs/agentgym.py:sciworld trains its AgentGym default.
`get_config("smoke")` runs two steps on a tiny random model.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/sciworld_ppo.py:smoke \\
        --workdir /tmp/sciworld_smoke  # Java
"""

from rl_tpu.recipes.config import base_config, multi_turn_agent, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


def get_config(arg: str = ""):
    _, smoke = parse_variant(arg, {})
    c = multi_turn_agent(base_config("ppo"), "sciworld", turns=30, horizon_stages=(10, 20, 30))
    c.env.kwargs.update(reward="delta", prompt="system", tasks="round_robin", max_steps=100,
                        move_limit=None)
    c.env.step_timeout_s = 120.0
    c.train.samples_per_task = 4
    c.algo.value_lr = 1e-5
    if smoke:
        shrink_for_smoke(c, context_tokens=2048)
    return c
