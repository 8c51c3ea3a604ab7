"""Moved to rl_tpu/core/env.py (the env contract); this module re-exports it for one release
so that code outside rl_tpu importing `rl_tpu.envs.base` keeps working. Nothing in rl_tpu,
launch/ or benchmarks/ imports it (tests/test_package_layers.py)."""

from rl_tpu.core.env import (  # noqa: F401
    DelayedEnv, Env, OneReplyEnv, SeededTasks, StepResult, Task, TaskSource, action_line,
    check_kwargs, factory, invalid_action, kwargs_of, make, out_of_steps, register)
