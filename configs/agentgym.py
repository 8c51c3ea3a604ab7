"""AgentGym-RL's setting on its envs: `get_config("<env>[,fixed|,smoke]")`.

    python -m launch.train --config configs/agentgym.py:babyai \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/agentgym_babyai
    python -m launch.train --config configs/agentgym.py:textcraft,fixed ...   # fixed turns
    python -m launch.train --config configs/agentgym.py:sciworld,smoke ...    # tiny, 2 steps

<env> is babyai, textcraft, sciworld (needs Java) or searchqa: the envs "babyai", "textcraft",
"sciworld" and "search" with their defaults, which are AgentGym's actions, observations,
rewards and task indexing, and the conversation opened as AgentGym-RL opens it (the env's
instruction as a user turn, a fixed assistant acknowledgement). GRPO; AgentGym reports a running score each turn, so the trajectory reward
is the last one. Turn limits are AgentGym-RL's (train / eval): BabyAI 20 / 20, TextCraft
30 / 30, SciWorld 20 / 30, SearchQA 5 / 30. The default grows the horizon in ScalingInter-RL's
stages, one every 100 steps; `fixed` keeps the training limit throughout. SearchQA searches
rl_tpu's shipped corpus (AgentGym's server uses an e5 index over wiki-18) with the same
protocol.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/agentgym.py:babyai,smoke \\
        --workdir /tmp/agentgym_babyai_smoke
    python -m launch.train --config configs/agentgym.py:textcraft,fixed,smoke \\
        --workdir /tmp/agentgym_textcraft_smoke
    python -m launch.train --config configs/agentgym.py:searchqa,smoke \\
        --workdir /tmp/agentgym_searchqa_smoke
    python -m launch.train --config configs/agentgym.py:sciworld,smoke \\
        --workdir /tmp/agentgym_sciworld_smoke  # Java
"""

from rl_tpu.recipes.config import base_config, multi_turn_agent, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant

# env: (train turns, eval turns, ScalingInter-RL stages, tokens a turn, step timeout s)
SETTINGS = {
    "babyai": (20, 20, (6, 13, 20), 256, 60.0),
    "textcraft": (30, 30, (10, 20, 30), 256, 60.0),
    "sciworld": (20, 30, (10, 20, 30), 256, 120.0),
    "searchqa": (5, 30, (5, 8, 10), 512, 60.0),
}
ENV_NAMES = {"searchqa": "search"}  # AgentGym's name -> rl_tpu's, where they differ


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "babyai": "AgentGym's BabyAI (macro actions, all 40 levels), 20 / 20 turns",
    "textcraft": "TextCraft crafting goals, 30 / 30 turns",
    "sciworld": "ScienceWorld (needs a Java runtime), 20 / 30 turns",
    "searchqa": "search QA over rl_tpu's shipped corpus, 5 / 30 turns",
    "scaling": "the turn limit grows in ScalingInter-RL's stages, one every 100 steps",
    "fixed": "the training turn limit throughout",
}


def get_config(arg: str = "babyai"):
    chosen, smoke = parse_variant(arg, {"env": tuple(SETTINGS), "horizon": ("scaling", "fixed")})
    env = chosen["env"]
    train_turns, eval_turns, stages, new_tokens, timeout = SETTINGS[env]
    c = multi_turn_agent(base_config("grpo"), ENV_NAMES.get(env, env), turns=train_turns,
                         horizon_stages=stages, max_new_tokens=new_tokens,
                         max_context_tokens=12288 if env != "babyai" else 8192)
    c.eval.max_turns = eval_turns
    c.env.reward_reduce = "last"
    c.env.step_timeout_s = timeout
    if chosen["horizon"] == "fixed":
        c.schedules.horizon_turns = ()
    if smoke:
        shrink_for_smoke(c, context_tokens=2048)
    return c
