"""Schedules that steer the RL loop from outside: pure functions of the training step.

Being functions of the step alone (no hidden state), they resume exactly from a checkpoint's
step and can be plotted before a run starts.

- `horizon(step, turns, every, default)`: ScalingInter-RL's interaction horizon. The turn limit
  grows in stages, H = turns[min(step // every, len(turns) - 1)]; an empty `turns` keeps the
  env's fixed limit. Paper settings: BabyAI (6, 13, 20), TextCraft and SciWorld (10, 20, 30),
  search (5, 8, 10), every = 100 steps.
"""

from __future__ import annotations

from typing import Sequence


def horizon(step: int, turns: Sequence[int], every: int, default: int) -> int:
    """The turn limit H at (0-based) training step `step`."""
    if not turns:
        return default
    if every < 1:
        raise ValueError(f"schedules.horizon_every={every} must be >= 1 step")
    if any(t < 1 for t in turns):
        raise ValueError(f"schedules.horizon_turns={tuple(turns)} must all be >= 1")
    return int(turns[min(step // every, len(turns) - 1)])
