"""Environments. Each env module registers itself with `rl_tpu.envs.base.register`.

The agentic domains have one env each, AgentGym's behaviour by default and rl_tpu's own
variants as keyword options: babyai (a package: env, levels, primitive mode), textcraft,
sciworld, search (docs/environments.md); agentgym_parse is AgentGym's action format. Serving
an env over HTTP and calling a served one (server, remote, workers, isolated scorers) live
apart, in `rl_tpu.env_serving`."""

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
    "evens": "evens",
    "guess": "guess",
    "maze": "maze",
    "selfplay_arithmetic": "selfplay",
    "tipping_routes": "tipping",
    "tipping_commons": "tipping",
    "judge_pairwise": "judge",
    "judge_pointwise": "judge",
    "agent_program": "agent_programs",
    "code": "code",
    "code_repair": "code_repair",
    "tir": "tir",
    "tool_calling": "tool_calling",
    # Older names of the same envs (AgentGym's task names, and the envs before they merged)
    "babyai_agentgym": "babyai",
    "textcraft_agentgym": "textcraft",
    "sciworld_agentgym": "sciworld",
    "searchqa_agentgym": "search",
    "searchqa": "search",
}
