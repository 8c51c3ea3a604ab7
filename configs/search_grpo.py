"""GRPO on search-engine QA: BM25 search over the shipped corpus, answer with EM/F1 reward.

    python -m launch.train --config configs/search_grpo.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/search_grpo

The agent issues `search[...]` queries and ends with `answer[...]`; horizon stages (5, 8, 10)
as AgentGym-RL trains Deep Search. `get_config("smoke")` runs two steps on a tiny model.
"""

from rl_tpu.recipes.config import base_config, shrink_for_smoke


def get_config(arg: str = ""):
    c = base_config("grpo")
    c.env.name = "search"
    c.env.max_turns = 10
    c.env.max_new_tokens = 256
    c.env.max_context_tokens = 8192
    c.train.length_buckets = (1024, 2048, 4096, 8192)
    c.schedules.horizon_turns = (5, 8, 10)
    c.schedules.horizon_every = 100
    c.train.steps = 300
    c.train.tasks_per_step = 32
    c.train.samples_per_task = 8
    c.train.minibatches = 4
    c.optim.lr = 1e-6
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
