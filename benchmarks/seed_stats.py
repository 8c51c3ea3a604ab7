"""Statistics over seeds for method comparisons (benchmarks/compare_runs.py's table).

A run's number is the mean of its last K evals; an arm's number is the mean over its seeds,
reported with the standard error of that mean (the seeds' sample standard deviation over
sqrt(n)): the per-eval error of one run (~0.03 for 200 episodes) understates how far two seeds
of one method land apart. A method is compared with a control seed by seed (the same seed
starts both from the same place and draws the same tasks first), and the paired differences
give a 90% Student-t interval for the mean difference.

The verdict rule that docs/testbeds.md states and this module applies:
  holds    every seed's difference points the claimed way and the 90% interval excludes 0;
  unclear  otherwise (including a single seed, whose interval is unbounded).
("not testable here", where a testbed cannot show a claim by construction, is a judgement
about the testbed that no number makes; the docs say why where they use it.)
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from scipy import stats

CONFIDENCE = 0.90
_SEED_IN_NAME = re.compile(r"seed(\d+)$")


def seed_of(workdir: str) -> Optional[int]:
    """The seed a workdir's name ends with (testbed_grid.py's `<variant>_seed<S>`, or any
    `...seed<S>`): the key that pairs an arm's run with its control's; None if it ends in no
    such number."""
    match = _SEED_IN_NAME.search(workdir.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def seed_keys(workdirs: Sequence[str]) -> tuple[list[int], bool]:
    """Each workdir's pairing key and whether they are seeds: the seeds their names end with,
    or, where a name ends in none (or two share one), their sorted order 0, 1, ... (False)."""
    seeds = [seed_of(d) for d in workdirs]
    if None in seeds or len(set(seeds)) < len(seeds):
        return list(range(len(workdirs))), False
    return seeds, True


@dataclass(frozen=True)
class SeedMean:
    """An arm's seeds' values: their mean, and the standard error of that mean (nan for one
    seed, whose spread is unknown)."""
    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.mean(self.values)

    @property
    def se(self) -> float:
        if len(self.values) < 2:
            return math.nan
        return statistics.stdev(self.values) / math.sqrt(len(self.values))

    def text(self, digits: int = 3) -> str:
        spread = "" if math.isnan(self.se) else f" ± {self.se:.{digits}f}"
        return f"{self.mean:.{digits}f}{spread}"


@dataclass(frozen=True)
class PairedDifference:
    """arm minus control, seed by seed: the differences, their mean and its 90% interval."""
    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    low: float
    high: float

    @property
    def mean(self) -> float:
        return statistics.mean(self.differences)

    def verdict(self, higher_is_better: bool = True) -> str:
        """"holds" where every seed points the claimed way and the interval excludes 0, else
        "unclear" (module docstring)."""
        sign = 1.0 if higher_is_better else -1.0
        every_seed = all(sign * d > 0 for d in self.differences)
        excludes_zero = self.low > 0 if higher_is_better else self.high < 0  # False if nan
        return "holds" if every_seed and excludes_zero else "unclear"

    def text(self, digits: int = 3) -> str:
        per_seed = ", ".join(f"{d:+.{digits}f}" for d in self.differences)
        interval = ("n/a" if math.isnan(self.low) else
                    f"[{self.low:+.{digits}f}, {self.high:+.{digits}f}]")
        return f"{self.mean:+.{digits}f} {interval} ({per_seed})"


def paired_difference(arm: Mapping[int, float], control: Mapping[int, float],
                      confidence: float = CONFIDENCE) -> PairedDifference:
    """arm[s] - control[s] over the seeds both have; the interval is the mean difference ±
    t(1 - (1 - confidence) / 2, n - 1) x sd / sqrt(n) (unbounded, nan, for one seed). No common
    seed is an error naming both sides' seeds."""
    seeds = tuple(sorted(set(arm) & set(control)))
    if not seeds:
        raise SystemExit(f"no seed in common: the arm has {sorted(arm)}, the control "
                         f"{sorted(control)}")
    diffs = tuple(arm[s] - control[s] for s in seeds)
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return PairedDifference(seeds, diffs, math.nan, math.nan)
    half = (stats.t.ppf(1.0 - (1.0 - confidence) / 2.0, len(diffs) - 1)
            * statistics.stdev(diffs) / math.sqrt(len(diffs)))
    return PairedDifference(seeds, diffs, mean - half, mean + half)


def last_mean(values: Sequence[float], last: int) -> float:
    """The mean of the last `last` values (all of them if fewer); nan if none."""
    tail = list(values)[-last:]
    return statistics.mean(tail) if tail else math.nan


def value_at(xs: Sequence[float], values: Sequence[float], budget: float) -> float:
    """The last value logged at x <= budget (an eval at equal interaction or tokens): nan if
    the run logged none that early."""
    at = [v for x, v in zip(xs, values) if x <= budget]
    return at[-1] if at else math.nan
