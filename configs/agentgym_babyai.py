"""AgentGym-RL on BabyAI: 40 levels, navigation macros, AgentGym's score as reward.

    python -m launch.train --config configs/agentgym_babyai.py \\
        --config.model.path=/models/Qwen2.5-3B-Instruct --workdir /tmp/agentgym_babyai
    python -m launch.train --config configs/agentgym_babyai.py:fixed ...   # AgentGym-RL, fixed turns

AgentGym-RL's setting: the `babyai_agentgym` env (AgentGym's actions, observations, rewards and task
indexing; the conversation opens with the env's instruction as a user turn and the fixed
assistant acknowledgement), GRPO, 20 turns in training and 20 in evaluation.
The default variant grows the horizon as ScalingInter-RL does: (6, 13, 20) turns, a stage every
100 steps; `:fixed` keeps 20 turns throughout. `:smoke` runs two steps on a tiny
random model.
"""

from rl_tpu.recipes.config import base_config, shrink_for_smoke


def get_config(arg: str = ""):
    c = base_config("grpo")
    c.env.name = "babyai_agentgym"
    c.env.max_turns = 20
    c.eval.max_turns = 20
    c.env.max_new_tokens = 256
    c.env.max_context_tokens = 8192
    # AgentGym reports the running score each turn; its trajectory reward is the last one
    c.env.reward_reduce = "last"
    c.env.step_timeout_s = 60.0
    c.train.length_buckets = (2048, 4096, 8192)
    c.schedules.horizon_turns = (6, 13, 20)
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
    if arg == "fixed":
        c.schedules.horizon_turns = ()
    elif arg == "smoke":
        shrink_for_smoke(c)
        c.eval.max_turns = 2
        c.env.max_context_tokens = 2048
        c.train.length_buckets = (1024, 2048)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; use '', 'fixed' or 'smoke'")
    return c
