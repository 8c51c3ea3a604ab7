"""BAPO on TextCraft, off-policy: an asynchronous producer two versions behind the learner.

    python -m launch.train --config configs/textcraft_bapo.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/textcraft_bapo

Crafting goals of depth 2-4 through `get`, `craft` and `inventory` actions, turn limits growing
(10, 20, 30) as in AgentGym-RL. The env is "textcraft" with rl_tpu's options (system prompt,
batch crafting, eval goals held out from training); configs/agentgym.py:textcraft trains its
AgentGym default. The rollouts come from an asynchronous producer on devices of
its own (`rollout.sampler_devices`, half of each host's by default), at most
`rollout.max_staleness` = 2 versions behind the learner: BAPO's setting, where its ratio
pi_theta / pi_rollout sees the staleness. `--config.rollout.max_staleness=0` trains
on-policy instead. BAPO's bounds: rho0 0.4, c_low in [0.6, 0.9], c_high in [1.2, 3.0] (the
paper's defaults), 4 minibatches so each mini-update adapts its own bounds.
`get_config("smoke")` runs two steps on a tiny random model, on-policy.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/textcraft_bapo.py:smoke \\
        --workdir /tmp/textcraft_smoke
"""

from rl_tpu.recipes.config import base_config, multi_turn_agent, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


def get_config(arg: str = ""):
    _, smoke = parse_variant(arg, {})
    c = multi_turn_agent(base_config("bapo"), "textcraft", turns=30,
                         horizon_stages=(10, 20, 30))
    c.env.kwargs.update(prompt="system", batch_crafting=True, tasks="held_out")
    c.rollout.max_staleness = 2
    if smoke:
        shrink_for_smoke(c, context_tokens=2048)
        c.rollout.max_staleness = 0  # the smoke suite runs on one device
    return c
