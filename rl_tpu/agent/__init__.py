"""Agents: the multi-turn loop that plays envs with an engine, and what it hands on.

  loop.py        the episode loop: envs <-> engine -> trajectories (`run_episodes`,
                 `play_episodes`, `play_partial`), and the `Episode` state and the calls
                 (`start_episodes`, `ended_on_failure`) that branching builds on
  branching.py   branching rollouts for TL-GRPO: fork an episode, restore branch envs by replay
  trajectory.py  moved to rl_tpu/core/trajectory.py (`Trajectory`, `EpisodeStats`: what the
                 loop hands everything else); re-exported here for one release
  evaluation.py  eval suites: greedy success, pass@k, turns, tokens

The loop's public names are importable from here (`from rl_tpu import agent;
agent.run_episodes(...)`).
"""

from rl_tpu.agent.loop import (Episode, close_paused, conversation_start, default_parse_action,
                               ended_on_failure, env_tools, observation_messages, paused_task,
                               play_episodes, play_partial, run_episodes, start_episodes)

__all__ = ["Episode", "close_paused", "conversation_start", "default_parse_action",
           "ended_on_failure", "env_tools", "observation_messages", "paused_task",
           "play_episodes", "play_partial", "run_episodes", "start_episodes"]
