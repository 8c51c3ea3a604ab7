"""Sample replay: past task groups mixed into each update, within a staleness cap.

BAPO's off-policy setting trains on samples of older policies, and replay is the simplest way
to get them: every step's fresh groups are added to a buffer, and each update also takes
`ceil(fraction / (1 - fraction) * fresh groups)` groups drawn from the buffer, so that
replayed groups are `fraction` of the update (fewer while the buffer is filling). A group
is eligible while its staleness (the learner's version minus the oldest version of any of its
tokens) is at most `max_staleness`; older groups leave the buffer. The draw is seeded by
(seed, step), so a resumed run draws what the uninterrupted one drew, and the buffer is saved
with the checkpoint (`state()` / `load_state()`, host-side: it holds this host's groups).

A replayed group keeps its behaviour log-probs and versions: the trainer recomputes the
proximal log-probs with the current params, so the ratio and the staleness correction see
how far the data has drifted (docs/architecture.md, the three policies). Its group id is its
original stream position, so its advantages are computed within the group as when it was
fresh (the same rewards, hence the same advantages for group-relative estimators).

Only what carries loss is stored: a group's rows flagged NO_LOSS (DAPO's equal-reward fillers,
self-play's filler rows) are left out, and a group with no scored row left (all fillers, or
every episode ended in env_error / abort) is not stored at all, so replayed rows are never
rows the update ignores.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from rl_tpu.train.rollout_batch import NO_LOSS, UNSCORED_FINISHES
from rl_tpu.core.trajectory import Trajectory, group_version


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    capacity: int = 0  # groups kept (0 = no replay)
    fraction: float = 0.5  # share of an update's groups that are replayed, once full
    max_staleness: int = 4  # versions; older groups are evicted
    seed: int = 0

    def __post_init__(self):
        if self.capacity < 0:
            raise ValueError(f"train.replay.capacity={self.capacity} must be >= 0 (0 = off)")
        if self.capacity and not 0.0 < self.fraction < 1.0:
            raise ValueError(f"train.replay.fraction={self.fraction} must be in (0, 1)")
        if self.max_staleness < 1:
            raise ValueError(f"train.replay.max_staleness={self.max_staleness} must be >= 1")


class ReplayBuffer:
    """Groups of past steps, oldest first; `mix` returns an update's fresh + replayed groups."""

    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self._groups: list[list[Trajectory]] = []

    def __len__(self) -> int:
        return len(self._groups)

    def mix(self, fresh: list[list[Trajectory]], learner_version: int, step: int,
            fewest_on_any_host: Callable[[int], int] = lambda n: n
            ) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """`fresh` groups plus replayed ones drawn from the buffer as it was before this
        step; then `fresh` joins the buffer. Returns the groups and replay metrics.

        `fewest_on_any_host(n)`: the smallest n over every host (a collective; identity on
        one host). Each host evicts its own groups by their own versions, and in free-running
        mode those differ between hosts, so buffers can hold different counts; every host
        replays the count the emptiest one can, so each gives the global batch as many rows."""
        self._evict(learner_version)
        want = math.ceil(self.cfg.fraction / (1.0 - self.cfg.fraction) * len(fresh))
        take = int(fewest_on_any_host(min(want, len(self._groups))))
        rng = np.random.default_rng([self.cfg.seed, step])
        picks = sorted(rng.choice(len(self._groups), size=take, replace=False)) if take else []
        replayed = [self._groups[i] for i in picks]
        ages = [learner_version - group_version(g) for g in replayed]
        metrics = {"replay/groups": float(take), "replay/buffer_groups": float(len(self._groups)),
                   "replay/staleness_mean": float(np.mean(ages)) if ages else 0.0}
        self._groups.extend(_stored(fresh))
        if len(self._groups) > self.cfg.capacity:
            del self._groups[:len(self._groups) - self.cfg.capacity]
        return list(fresh) + replayed, metrics

    def _evict(self, learner_version: int) -> None:
        self._groups = [g for g in self._groups
                        if learner_version - group_version(g) <= self.cfg.max_staleness]

    def state(self) -> list[list[Trajectory]]:
        return list(self._groups)

    def load_state(self, groups: list[list[Trajectory]]) -> None:
        self._groups = _stored(groups)  # a checkpoint from before fillers were left out too


def _stored(groups: list[list[Trajectory]]) -> list[list[Trajectory]]:
    """What of `groups` replay keeps: each group's rows that are not NO_LOSS fillers, for the
    groups where one of those is scored (the others would take batch rows without loss)."""
    kept = []
    for group in groups:
        rows = [t for t in group if not t.info.get(NO_LOSS)]
        if any(t.finish not in UNSCORED_FINISHES for t in rows):
            kept.append(rows)
    return kept
