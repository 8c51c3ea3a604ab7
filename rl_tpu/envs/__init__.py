"""Environments. Each env module registers itself with `rl_tpu.envs.base.register`."""

# Env name -> module under rl_tpu/envs/ that registers it; `base.make` imports it on first use.
ENV_MODULES: dict[str, str] = {
    "babyai": "babyai",
    "textcraft": "textcraft",
    "sciworld": "sciworld",
    "textworld": "textworld",
    "search": "search",
    "countdown": "reasoning",
    "arithmetic": "reasoning",
    "reasoning_gym": "reasoning",
    "math": "math",
    "largest": "largest",
    # AgentGym-compatible modes: AgentGym's actions, observations, rewards and task indexing
    "babyai_agentgym": "babyai",
    "textcraft_agentgym": "textcraft",
    "sciworld_agentgym": "sciworld",
    "searchqa_agentgym": "search",
    "searchqa": "search",
}
