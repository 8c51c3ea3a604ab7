"""GRPO on search-engine QA: BM25 search over the shipped corpus, answer with EM/F1 reward.
The env is "search" in rl_tpu's brackets style (`actions="brackets"`: one answer ends the
episode); configs/agentgym.py:searchqa trains the same env in AgentGym's default tag style.

    python -m launch.train --config configs/search_grpo.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/search_grpo

The agent issues `search[...]` queries and ends with `answer[...]`; horizon stages (5, 8, 10)
as AgentGym-RL trains Deep Search. `get_config("smoke")` runs two steps on a tiny model.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/search_grpo.py:smoke --workdir /tmp/search_smoke
"""

from rl_tpu.recipes.config import base_config, multi_turn_agent, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


def get_config(arg: str = ""):
    _, smoke = parse_variant(arg, {})
    c = multi_turn_agent(base_config("grpo"), "search", turns=10, horizon_stages=(5, 8, 10),
                         max_new_tokens=256)
    c.env.kwargs.actions = "brackets"
    if smoke:
        shrink_for_smoke(c, context_tokens=2048)
    return c
