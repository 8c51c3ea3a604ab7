"""Moved to rl_tpu/core/engine.py (the engine contract); this module re-exports it for one
release so that code outside rl_tpu importing `rl_tpu.rollout.engine` keeps working. Nothing
in rl_tpu, launch/ or benchmarks/ imports it (tests/test_package_layers.py)."""

from rl_tpu.core.engine import (  # noqa: F401
    FINISH_REASONS, LOGPROB_CONVENTIONS, MAX_STOP_TOKEN_IDS, GenerateRequest, GenerateResult,
    RolloutEngine, RolloutError, SamplingParams, check_stop_token_ids)
