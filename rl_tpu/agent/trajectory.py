"""Moved to rl_tpu/core/trajectory.py; this module re-exports it for one release so that code
outside rl_tpu importing `rl_tpu.agent.trajectory` keeps working. Nothing in rl_tpu, launch/
or benchmarks/ imports it (tests/test_package_layers.py)."""

from rl_tpu.core.trajectory import (  # noqa: F401
    NO_VERSION, EpisodeStats, Trajectory, group_version, groups_of, token_versions,
    version_number)
