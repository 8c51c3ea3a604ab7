"""GRPO on BabyAI (minigrid) with ScalingInter-RL's growing interaction horizon.

    python -m launch.train --config configs/babyai_grpo.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/babyai_grpo

Multi-turn: the agent acts until the mission is done or the turn limit H, which grows in
stages (6, 13, 20) every 100 steps as in AgentGym-RL. Reward: the env's success reward. The env
is "babyai" in rl_tpu's primitive-action mode (`actions="primitive"`: seven primitive actions,
the view in sentences, minigrid's reward) on the 8 levels its bot solves in under 20 steps;
configs/agentgym.py:babyai trains the AgentGym default (macro actions, all 40 levels).
`get_config("smoke")` runs two steps of two-turn episodes on a tiny random model.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/babyai_grpo.py:smoke \\
        --workdir /tmp/babyai_grpo_smoke
"""

from rl_tpu.envs.babyai.levels import PRIMITIVE_LEVELS
from rl_tpu.recipes.config import base_config, multi_turn_agent, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


def get_config(arg: str = ""):
    _, smoke = parse_variant(arg, {})
    c = multi_turn_agent(base_config("grpo"), "babyai", turns=20, horizon_stages=(6, 13, 20))
    c.env.kwargs.update(actions="primitive", levels=PRIMITIVE_LEVELS)
    c.eval.num_tasks = 200
    if smoke:
        shrink_for_smoke(c, context_tokens=1024)
    return c
