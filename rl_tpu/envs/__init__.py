"""Environments. Each env module registers itself with `rl_tpu.core.env.register`.

The agentic domains have one env each, AgentGym's behaviour by default and rl_tpu's own
variants as keyword options: babyai (a package: env, levels, primitive mode), textcraft,
sciworld, search (docs/environments.md), reading replies as AgentGym's clients do
(rl_tpu/core/agentgym_parse.py). The env contract and the registry are rl_tpu/core/env.py.
Serving an env over HTTP and calling a served one (server, remote, workers, isolated
scorers) live apart, in `rl_tpu.env_serving`."""

# Env name -> module under rl_tpu/envs/ that registers it; `rl_tpu.core.env.make` imports it on
# first use (this package is imported by name there, so the contract stays below the envs).
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
    "word_problems": "word_problems",
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
