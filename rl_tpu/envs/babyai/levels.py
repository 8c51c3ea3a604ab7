"""BabyAI's levels and AgentGym's task numbering: data_idx -> (level, seed).

AgentGym numbers BabyAI tasks by data_idx: level (data_idx mod 40) + 1 (1-based), seed
data_idx div 40. Only level 1 (GoToRedBallGrey) and level 40 (BossLevelNoUnlock) are known
from AgentGym's notes; minigrid registers exactly 40 BabyAI level classes, the first of them
GoToRedBallGrey and the last BossLevelNoUnlock, so LEVELS is those classes in minigrid's
registration order, each as its first registered id (PutNext as PutNextS4N1, OpenDoorsOrder
as OpenDoorsOrderN2, MoveTwoAcross as MoveTwoAcrossS5N2: these classes have no default size).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

from rl_tpu.core.env import Task, TaskSource

log = logging.getLogger(__name__)

# minigrid's 40 BabyAI level classes in its registration order (see the module docstring).
LEVELS: tuple[str, ...] = tuple(f"BabyAI-{name}-v0" for name in (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObj", "GoToLocal", "GoTo",
    "GoToImpUnlock", "GoToSeq", "GoToRedBlueBall", "GoToDoor", "GoToObjDoor", "Open",
    "OpenRedDoor", "OpenDoor", "OpenTwoDoors", "OpenDoorsOrderN2", "Pickup", "UnblockPickup",
    "PickupLoc", "PickupDist", "PickupAbove", "PutNextLocal", "PutNextS4N1", "Unlock",
    "UnlockLocal", "KeyInBox", "UnlockPickup", "BlockedUnlockPickup", "UnlockToUnlock",
    "ActionObjDoor", "FindObjS5", "KeyCorridor", "OneRoomS8", "MoveTwoAcrossS5N2", "Synth",
    "SynthLoc", "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock"))

# Levels whose missions minigrid's bot completes on every seed tried, in at most ~17 primitive
# steps (mean 5-7), so a 20-turn horizon leaves a primitive-action policy room for detours.
PRIMITIVE_LEVELS: tuple[str, ...] = (
    "BabyAI-GoToRedBallGrey-v0", "BabyAI-GoToRedBall-v0", "BabyAI-GoToObj-v0",
    "BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0", "BabyAI-PickupDist-v0",
    "BabyAI-OpenDoor-v0", "BabyAI-GoToDoor-v0")


def data_idx_of(task: Task) -> int:
    """The task's AgentGym data_idx: `data["data_idx"]`, else the int after the last `_` of
    its id (AgentGym's item ids are `babyai_<n>`)."""
    data = task.data or {}
    if "data_idx" in data:
        return int(data["data_idx"])
    tail = task.task_id.rsplit("_", 1)[-1]
    if not tail.isdigit():
        raise ValueError(f"BabyAI task {task.task_id!r} has no data_idx: give it "
                         "data={'data_idx': n} or an id like 'babyai_<n>'")
    return int(tail)


def level_and_seed(data_idx: int) -> tuple[str, int]:
    """AgentGym's indexing: level (data_idx mod 40) + 1 (1-based), seed data_idx div 40."""
    if data_idx < 0:
        raise ValueError(f"data_idx must be >= 0, got {data_idx}")
    return LEVELS[data_idx % len(LEVELS)], data_idx // len(LEVELS)


def level_numbers(levels: Union[str, int, Sequence[Union[str, int]]]) -> tuple[int, ...]:
    """1-based AgentGym level numbers of `levels`, given as numbers or minigrid ids."""
    if isinstance(levels, (str, int)):
        levels = [levels]
    numbers, bad = [], []
    for level in levels:
        if isinstance(level, str) and level in LEVELS:
            numbers.append(LEVELS.index(level) + 1)
        elif not isinstance(level, str) and 1 <= int(level) <= len(LEVELS):
            numbers.append(int(level))
        else:
            bad.append(level)
    if bad:
        raise ValueError(f"unknown BabyAI level(s) {bad}: give AgentGym's level numbers "
                         f"1..{len(LEVELS)} (data_idx mod 40 + 1) or minigrid ids of {LEVELS}")
    return tuple(numbers)


class BabyAITasks(TaskSource):
    """Task j of a split is Task(f"babyai_{i}", {"data_idx": i}) with
    eval: i = j, for 0 <= j < eval_size (<= TRAIN_START): seeds 0.. of all 40 levels in turn;
    train: i = TRAIN_START + j: seeds from 100 on, so the splits never share a grid.

    `levels` (1-based, as AgentGym counts them) keeps only those levels: task j is then level
    levels[j mod m] at seed j div m (from seed 100 for train), still as AgentGym's data_idx
    40 * seed + level - 1, so a remote AgentGym server plays the same grid."""

    TRAIN_START = 4000  # = 100 seeds x 40 levels reserved for eval

    def __init__(self, train_size: int = 100_000, eval_size: int = 400,
                 levels: Sequence[Union[str, int]] = ()):
        if not 0 < eval_size <= self.TRAIN_START:
            raise ValueError(f"eval_size must be in 1..{self.TRAIN_START} so eval data_idx "
                             f"stay below the train range; got {eval_size}")
        self._sizes = {"train": int(train_size), "eval": int(eval_size)}
        self._levels = level_numbers(levels) if levels else ()

    def size(self, split: str) -> Optional[int]:
        self.check_split(split)
        return self._sizes[split]

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        if not 0 <= index < self._sizes[split]:
            raise IndexError(f"task index {index} out of range for split {split!r} of size "
                             f"{self._sizes[split]}")
        if self._levels:
            m = len(self._levels)
            seed = index // m + (0 if split == "eval" else self.TRAIN_START // len(LEVELS))
            i = len(LEVELS) * seed + self._levels[index % m] - 1
        else:
            i = index if split == "eval" else self.TRAIN_START + index
        return Task(f"babyai_{i}", {"data_idx": i})


def silence_minigrid_sampling_prints() -> None:
    """minigrid prints "Sampling rejected: ..." to stdout while it retries level generation.

    That chatter would corrupt anything that owns stdout (the env server's log, a progress
    bar). Rebinding `print` in that one module's globals routes it to our debug log instead,
    without touching stdout for anyone else (unlike `contextlib.redirect_stdout`, which is
    process-wide and so unsafe with threads).
    """
    from minigrid.envs.babyai.core import roomgrid_level

    roomgrid_level.print = lambda *args, **kwargs: log.debug(" ".join(map(str, args)))
