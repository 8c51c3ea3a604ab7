"""The contracts every other rl_tpu package stands on, and nothing else.

- `env`: the env interface (Task, TaskSource, Env, StepResult) and the env registry;
- `agentgym_parse`: how AgentGym's clients read a reply into an action;
- `engine`: the rollout-engine interface (SamplingParams, GenerateRequest/Result,
  RolloutEngine, RolloutError);
- `shared_weights`: waiting until servers shared by every host hold a weight version;
- `trajectory`: what one episode leaves behind (Trajectory, EpisodeStats);
- `batch`: the rollout batch the learner takes (RolloutBatch), each array's dtype, shape and
  readers declared once (FIELDS).

This package imports no other rl_tpu package (tests/test_package_layers.py checks it): an
env, an engine or a consumer of trajectories can be written against it alone. Import the
modules themselves (`from rl_tpu.core.env import Env`); this file imports none of them, so
asking for the env contract does not load JAX.
"""
