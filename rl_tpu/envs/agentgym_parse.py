"""Moved to rl_tpu/core/agentgym_parse.py; this module re-exports it for one release so that
code outside rl_tpu importing `rl_tpu.envs.agentgym_parse` keeps working. Nothing in rl_tpu,
launch/ or benchmarks/ imports it (tests/test_package_layers.py)."""

from rl_tpu.core.agentgym_parse import (  # noqa: F401
    TOO_MANY_ACTIONS, parse_action, parse_sciworld_action)
