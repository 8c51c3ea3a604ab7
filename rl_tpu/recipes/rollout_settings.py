"""What each step's rollouts run with, the same for every driver: the step's sampling seed,
the sampling params, the turn limit (ScalingInter-RL's horizon) and the per-turn generation
budget (SIRI) at that step.
"""

from __future__ import annotations

from typing import Optional

import ml_collections
import numpy as np

from rl_tpu import schedules
from rl_tpu.core.engine import SamplingParams
from rl_tpu.recipes.algorithms import records_routing


def step_seed(seed: int, step: int, what: int = 0) -> int:
    """The sampling seed of one step (and purpose), for every driver: fresh each step, the same on a rerun."""
    return int(np.random.SeedSequence([seed, step, what]).generate_state(1)[0] & 0x7FFFFFFF)


def sampling_params(config: ml_collections.ConfigDict, seed: Optional[int]) -> SamplingParams:
    """The `rollout.*` sampling of a request (temperature, top-p, top-k) with `seed` (None:
    the engine's own; greedy evals pass their own temperature), asking for a mixture of
    experts' routed experts when the algorithm replays or measures them."""
    r = config.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=seed,
                          return_routed_experts=records_routing(config.algo))


def horizon_at(config: ml_collections.ConfigDict, step: int) -> int:
    """The turn limit H at 0-based RL step `step` (ScalingInter-RL's stages, else
    env.max_turns)."""
    return schedules.horizon(step, tuple(config.schedules.horizon_turns),
                             config.schedules.horizon_every, config.env.max_turns)


def budget_at(config: ml_collections.ConfigDict, step: int) -> int:
    """The per-turn generation budget L at 0-based RL step `step` (SIRI; env.max_new_tokens
    when schedules.budget is off)."""
    s = config.schedules
    return schedules.generation_budget(step, s.budget, s.budget_min, config.env.max_new_tokens,
                                       s.budget_period, s.budget_start, s.budget_stairs)
