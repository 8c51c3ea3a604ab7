"""TL-GRPO with branching rollouts on AgentGym's BabyAI: `get_config("[fixed|smoke]")`.

    python -m launch.train --config configs/tl_grpo_babyai.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/tl_grpo_babyai
    python -m launch.train --config configs/tl_grpo_babyai.py:fixed ...   # fork at turn 3
    python -m launch.train --config configs/tl_grpo_babyai.py:smoke --workdir /tmp/tl_smoke

AgentGym-RL's BabyAI setting (env "babyai" in its default AgentGym mode, as in
configs/agentgym.py:babyai: 20 turns, 256 tokens a turn, the running score as the reward,
ScalingInter-RL's horizon stages 6 / 13 / 20), trained with TL-GRPO:
each task is played once up to its fork turn, drawn per task from 0..5 (`uniform`, so the
early turns are trained too, in the tasks that fork early), then forked into 8 branches that
share its history, each branch's env restored by replaying the actions (rl_tpu/agent/branching.py;
BabyAI is deterministic given the task and the actions). The branches' rewards, the score
of their own turns, are normalised in their group; the turns before the fork carry no loss
(docs/architecture.md, "Turn-level GRPO and branching rollouts"). `fixed` forks every task at
turn 3. `smoke`: a tiny random model, 2 steps of 2 tasks x 2 branches, forked at turn 1.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/tl_grpo_babyai.py:smoke --workdir /tmp/tl_smoke
    python -m launch.train --config configs/tl_grpo_babyai.py:fixed,smoke \\
        --workdir /tmp/tl_fixed_smoke
"""

from rl_tpu.recipes.config import base_config, multi_turn_agent, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "uniform": "each task forks at a turn drawn from 0..5",
    "fixed": "every task forks at turn 3",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"branch": ("uniform", "fixed")})
    c = multi_turn_agent(base_config("tl_grpo"), "babyai", turns=20, horizon_stages=(6, 13, 20),
                         max_new_tokens=256, max_context_tokens=8192)
    c.env.reward_reduce = "last"  # AgentGym's running score: the last one is the episode's
    c.env.step_timeout_s = 60.0
    c.eval.max_turns = 20
    c.algo.branch_turn = 5
    c.algo.branch_sample = "uniform"
    if chosen["branch"] == "fixed":
        c.algo.branch_turn = 3
        c.algo.branch_sample = "fixed"
    if smoke:
        shrink_for_smoke(c, context_tokens=2048)
        c.algo.branch_turn = 1  # forks after one turn: every branch but the trunk replays it
        c.algo.branch_sample = "fixed"
        c.train.length_buckets = (2048,)  # one compiled update: rows are 900-1300 tokens
        c.model.dtype, c.model.remat = "float32", "none"  # CPU: bf16 is emulated, slower
    return c
