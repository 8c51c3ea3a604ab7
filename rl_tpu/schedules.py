"""Schedules that steer the RL loop from outside: pure functions of the training step.

Being functions of the step alone (no hidden state), they resume exactly from a checkpoint's
step and can be plotted before a run starts. `step` is 0-based: the schedule's value at step s
is what the rollout of RL step s + 1 uses.

- `horizon(step, turns, every, default)`: ScalingInter-RL's interaction horizon. The turn limit
  grows in stages, H = turns[min(step // every, len(turns) - 1)]; an empty `turns` keeps the
  env's fixed limit. Paper settings: BabyAI (6, 13, 20), TextCraft and SciWorld (10, 20, 30),
  search (5, 8, 10), every = 100 steps.

- `generation_budget(step, kind, low, high, period, start, stairs)`: SIRI's per-turn generation
  budget L, oscillating between `low` (compression: the policy must say the same in fewer
  tokens) and `high` (expansion: room to explore) with period P. SIRI does not publish its
  formula, so the family is ours (docs/siri.md). With u = (step mod P) / P, the position in
  the cycle, and "long" starting at `high` ("short" swaps the two halves / flips the cosine):

    stair         L = high for u < 1/2, else low                   (long first)
    cosine        L = low + (high - low) (1 + cos(2 pi u)) / 2      (long first; short: 1 - cos)
    stair_cosine  the cosine held flat over `stairs` equal stairs a period: its value at the
                  first step of each stair (a staircase that follows the cosine)

  Values are rounded to whole tokens (half up). `budget_phase` names the half a step is in:
  compression where L sits at `low` or falls towards it, expansion where it sits at `high` or
  rises towards it.
"""

from __future__ import annotations

import math
from typing import Sequence

BUDGET_KINDS = ("stair", "cosine", "stair_cosine")
BUDGET_STARTS = ("long", "short")


def horizon(step: int, turns: Sequence[int], every: int, default: int) -> int:
    """The turn limit H at (0-based) training step `step`."""
    if not turns:
        return default
    if every < 1:
        raise ValueError(f"schedules.horizon_every={every} must be >= 1 step")
    if any(t < 1 for t in turns):
        raise ValueError(f"schedules.horizon_turns={tuple(turns)} must all be >= 1")
    return int(turns[min(step // every, len(turns) - 1)])


def check_budget(kind: str, low: int, high: int, period: int, start: str = "long",
                 stairs: int = 4) -> None:
    """Refuses a budget schedule that cannot run, naming the config key to change. kind ""
    (off) accepts anything: the other keys are then unread."""
    if kind == "":
        return
    if kind not in BUDGET_KINDS:
        raise ValueError(f"schedules.budget={kind!r}; choose '' (off) or one of {BUDGET_KINDS}")
    if not 1 <= low <= high:
        raise ValueError(f"schedules.budget_min={low} must be in [1, env.max_new_tokens={high}] "
                         "(the schedule runs between the two)")
    if period < 2:
        raise ValueError(f"schedules.budget_period={period} must be >= 2 steps (a compression "
                         "and an expansion half)")
    if start not in BUDGET_STARTS:
        raise ValueError(f"schedules.budget_start={start!r}; choose one of {BUDGET_STARTS}")
    if kind == "stair_cosine" and not 2 <= stairs <= period:
        raise ValueError(f"schedules.budget_stairs={stairs} must be in [2, budget_period="
                         f"{period}] for stair_cosine (stairs per period)")


def _cosine(t: int, low: int, high: int, period: int, start: str) -> float:
    wave = math.cos(2.0 * math.pi * (t % period) / period)  # 1 at the start of each cycle
    if start == "short":
        wave = -wave
    return low + (high - low) * (1.0 + wave) / 2.0


def generation_budget(step: int, kind: str, low: int, high: int, period: int,
                      start: str = "long", stairs: int = 4) -> int:
    """The per-turn generation budget L at (0-based) training step `step` (module docstring);
    `high` when the schedule is off (kind "")."""
    check_budget(kind, low, high, period, start, stairs)
    if kind == "":
        return int(high)
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    t = step % period
    if kind == "stair":
        first_half = 2 * t < period  # odd P: the first half is the longer, (P + 1) // 2 steps
        return int(high if first_half == (start == "long") else low)
    if kind == "stair_cosine":
        # The stair's first step, where a period of P steps splits into `stairs` stairs whose
        # boundaries are floor(k P / stairs); the cosine is read there and held.
        k = (t * stairs) // period
        t = (k * period + stairs - 1) // stairs  # ceil(k P / stairs): the stair's first step
    # round half up, not Python's banker's rounding: the same value on every platform
    return int(math.floor(_cosine(t, low, high, period, start) + 0.5))


def budget_phase(step: int, kind: str, period: int, start: str = "long") -> str:
    """"compression" or "expansion": the half of its cycle (0-based) step `step` is in, for
    labelling evals; "fixed" when the schedule is off. Compression is where L sits at `low`
    (stair) or falls towards it (cosine, stair_cosine); expansion the other half. So a
    long-first stair expands first (it sits at `high`), a long-first cosine compresses first
    (it falls from `high`); either way a phase ends where its half of the period ends."""
    if kind == "":
        return "fixed"
    first_half = 2 * (step % period) < period
    long_first = start == "long"
    compressing = (first_half != long_first) if kind == "stair" else (first_half == long_first)
    return "compression" if compressing else "expansion"
