"""BAPO on TextCraft: adaptive clipping bounds for the off-policy settings BAPO targets.

    python -m launch.train --config configs/textcraft_bapo.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/textcraft_bapo

Crafting goals of depth 2-4 through `get`, `craft` and `inventory` actions, turn limits growing
(10, 20, 30) as in AgentGym-RL. BAPO's bounds: rho0 0.4, c_low in [0.6, 0.9], c_high in
[1.2, 3.0] (the paper's defaults), 4 minibatches so each mini-update adapts its own bounds.
`get_config("smoke")` runs two steps on a tiny random model.
"""

from rl_tpu.recipes.config import base_config, multi_turn_agent, shrink_for_smoke


def get_config(arg: str = ""):
    c = multi_turn_agent(base_config("bapo"), "textcraft", turns=30,
                         horizon_stages=(10, 20, 30))
    if arg == "smoke":
        shrink_for_smoke(c)
        c.env.max_context_tokens = 2048
        c.train.length_buckets = (1024, 2048)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; use '' or 'smoke'")
    return c
