"""GRPO on countdown (reasoning-gym): reach a target number with + - * / over given numbers.

    python -m launch.train --config configs/countdown_grpo.py \\
        --config.model.path=/models/Qwen2.5-1.5B-Instruct --workdir /tmp/countdown_grpo

Single-turn: one reply per task, scored by reasoning-gym's own checker (1.0 right, 0.05 for a
well-formed wrong answer). `get_config("smoke")` runs two steps on a tiny random model.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/countdown_grpo.py:smoke \\
        --workdir /tmp/countdown_smoke
"""

from rl_tpu.recipes.config import base_config, shrink_for_smoke, single_turn_reasoning
from rl_tpu.recipes.variants import parse_variant


def get_config(arg: str = ""):
    _, smoke = parse_variant(arg, {})
    c = single_turn_reasoning(base_config("grpo"), "countdown", max_new_tokens=1024,
                              max_context_tokens=1536)
    c.eval.pass_k = 4
    if smoke:
        shrink_for_smoke(c, context_tokens=512)
    return c
