"""`maze`: walk a small walled grid to a goal, one move a turn. A long-horizon task a tiny model
plays on a CPU, for the ScalingInter-RL testbed (configs/scaling_maze.py): a task's shortest
path is drawn from [min_steps, max_steps] moves, so a turn limit H caps what can be solved at
the tasks whose path fits in H, and an agent that detours needs more.

    env = make("maze")                        # a 6 x 6 grid, paths of 2-14 moves
    env.reset(task) -> "You are at row 4, column 1. The goal is at row 0, column 3.
                        Open ways: north, east."
    env.step("north") -> "You moved north. You are at row 3, ...", reward 0
    env.step("west")  -> "A wall blocks west; you stay. You are at ...", reward 0
    ...               -> "You reached the goal.", reward 1.0, done, success

Rows grow southward, columns eastward. A move into a wall or off the grid leaves the agent in
place (a turn spent, no error); a reply naming no direction is an invalid action (reward 0, the
episode goes on). The reward is 1 when the goal is reached, whatever the turn, else 0: the
sparse success reward AgentGym's envs give, so a longer horizon only adds chances.

Tasks are reproducible by index (train and eval from disjoint seeds). Each draws walls with
probability `wall_density` a cell, a start, and a goal at a shortest-path distance drawn
uniformly from those in [min_steps, max_steps] that the grid offers (redrawn until one does).

The teacher (`teacher_reply`) walks a shortest path with probability `skill` each turn, else
steps greedily toward the goal ignoring walls (bumping into one when it is in the way), so its
demonstrations reach the goal, but later than they could, and sometimes not within a horizon.

`hidden_goal=True` makes the task partially observed: the goal is not named until it comes in
sight (in the agent's row or column with no wall between, at most `sight` cells away), and from
then on it is. With `sight=1` the goal shows only from a cell next to it. A task's
goal is never in sight from its start, so every episode begins with a search, and a good
search needs the episode's history (which cells were already seen): the observation alone
is not a state. The teacher then searches with probability `skill` a turn (a step toward the
nearest cell it has not stood on) and moves at random otherwise, until it sights the goal.
"""

from __future__ import annotations

import collections
import random
import re
from typing import Optional

from rl_tpu.core.env import Env, SeededTasks, StepResult, Task, invalid_action, register

MOVES = {"north": (-1, 0), "south": (1, 0), "west": (0, -1), "east": (0, 1)}
_DIRECTION = re.compile(r"\b(north|south|east|west)\b", re.IGNORECASE)


def distances(walls: frozenset, size: int, start: tuple[int, int]) -> dict:
    """{cell: shortest-path moves from `start`} over the open cells reachable from it (BFS)."""
    seen = {start: 0}
    queue = collections.deque([start])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            cell = (r + dr, c + dc)
            if 0 <= cell[0] < size and 0 <= cell[1] < size and cell not in walls \
                    and cell not in seen:
                seen[cell] = seen[(r, c)] + 1
                queue.append(cell)
    return seen


def in_sight(walls: frozenset, size: int, at: tuple[int, int], reach: int) -> set:
    """The cells seen from `at`: along its row and column, up to a wall, the grid's edge or
    `reach` cells away."""
    seen = {at}
    for dr, dc in MOVES.values():
        for k in range(1, reach + 1):
            cell = (at[0] + k * dr, at[1] + k * dc)
            if not (0 <= cell[0] < size and 0 <= cell[1] < size) or cell in walls:
                break
            seen.add(cell)
    return seen


@register("maze")
class MazeEnv(Env):
    name = "maze"
    replayable = True  # reset(task) and the same replies reach the same state
    system_prompt = ("You walk a grid to a goal. Each turn, reply with one direction: north, "
                     "south, east or west. Rows grow to the south, columns to the east.")

    def __init__(self, size: int = 6, wall_density: float = 0.2, min_steps: int = 2,
                 max_steps: int = 14, train_seed: int = 1_000_000, eval_seed: int = 0,
                 train_size: int = 1_000_000, eval_size: int = 1000,
                 hidden_goal: bool = False, sight: int = 0):
        if size < 2 or not 0 <= wall_density < 0.6 or not 1 <= min_steps <= max_steps \
                or sight < 0:
            raise ValueError(f"maze: size={size} must be >= 2, wall_density={wall_density} in "
                             f"[0, 0.6), 1 <= min_steps={min_steps} <= max_steps={max_steps}, "
                             f"and sight={sight} >= 0 (0: as far as the walls allow)")
        self.size, self.wall_density = size, wall_density
        self.min_steps, self.max_steps = min_steps, max_steps
        self.hidden_goal = hidden_goal
        self.sight = sight or size  # no line in the grid is longer than `size`
        self._tasks = SeededTasks("maze", self._draw, train_seed, eval_seed, train_size,
                                  eval_size)
        self._walls: frozenset = frozenset()
        self._at: Optional[tuple[int, int]] = None  # None: no episode under way
        self._goal = (0, 0)
        self._goal_seen = True
        self._stood_on: set = set()  # the cells of this episode so far: the teacher's memory

    def _draw(self, rng: random.Random, split: str, index: int) -> dict:
        del split, index  # both splits draw alike, from their own seeds
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        for _ in range(1000):
            walls = frozenset(x for x in cells if rng.random() < self.wall_density)
            start = rng.choice([x for x in cells if x not in walls] or cells)
            reach = distances(walls, self.size, start)
            if self.hidden_goal:  # a goal in sight from the start would need no search
                sight = in_sight(walls, self.size, start, self.sight)
                reach = {x: d for x, d in reach.items() if x not in sight}
            lengths = sorted({d for d in reach.values()
                              if self.min_steps <= d <= self.max_steps})
            if lengths:
                steps = rng.choice(lengths)
                goal = rng.choice(sorted(x for x, d in reach.items() if d == steps))
                return {"walls": sorted(map(list, walls)), "start": list(start),
                        "goal": list(goal), "shortest": steps}
        raise ValueError(f"maze: no grid of size {self.size} at wall_density "
                         f"{self.wall_density} offers a path of {self.min_steps}-"
                         f"{self.max_steps} moves")

    def tasks(self) -> SeededTasks:
        return self._tasks

    def reset(self, task: Task) -> str:
        data = task.data or {}
        if not {"walls", "start", "goal"} <= set(data):
            raise ValueError(f"task {task.task_id!r} needs 'walls', 'start' and 'goal'; take "
                             "tasks from env.tasks().get(split, index)")
        self._walls = frozenset(tuple(x) for x in data["walls"])
        self._goal, self._stood_on = tuple(data["goal"]), set()
        self._goal_seen = not self.hidden_goal
        self._arrive(tuple(data["start"]))
        return self._where()

    def _arrive(self, cell: tuple[int, int]) -> None:
        """The agent stands on `cell`: remembered for the teacher, and a hidden goal in sight
        from it is seen from now on."""
        self._at = cell
        self._stood_on.add(cell)
        if not self._goal_seen:
            self._goal_seen = self._goal in in_sight(self._walls, self.size, cell, self.sight)

    def _open_ways(self) -> list[str]:
        r, c = self._at
        return [name for name, (dr, dc) in MOVES.items() if self._open((r + dr, c + dc))]

    def _open(self, cell: tuple[int, int]) -> bool:
        return (0 <= cell[0] < self.size and 0 <= cell[1] < self.size
                and cell not in self._walls)

    def _where(self) -> str:
        r, c = self._at
        goal = (f"The goal is at row {self._goal[0]}, column {self._goal[1]}."
                if self._goal_seen else "The goal is not in sight.")
        ways = ", ".join(self._open_ways()) or "none"
        return f"You are at row {r}, column {c}. {goal} Open ways: {ways}."

    def step(self, action: str) -> StepResult:
        if self._at is None:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        found = _DIRECTION.findall(str(action))
        if not found:
            return invalid_action("reply with one direction: north, south, east or west")
        move = found[-1].lower()
        dr, dc = MOVES[move]
        target = (self._at[0] + dr, self._at[1] + dc)
        if not self._open(target):
            return StepResult(f"A wall blocks {move}; you stay. {self._where()}", 0.0, False,
                              {"success": False, "bumped": True})
        self._arrive(target)
        if target == self._goal:
            self._at = None
            return StepResult("You reached the goal.", 1.0, True, {"success": True})
        return StepResult(f"You moved {move}. {self._where()}", 0.0, False,
                          {"success": False, "bumped": False})

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        """A shortest-path move with probability `skill`, else a greedy one that ignores the
        walls; while a hidden goal is unseen, a search move or a random one (module docstring)."""
        del task  # the env's own state holds where the agent is
        if not self._goal_seen:
            if rng.random() < skill:
                move = self._toward_a_new_cell()
                if move:
                    return move
            return rng.choice(self._open_ways() or list(MOVES))
        if rng.random() < skill:
            to_goal = distances(self._walls, self.size, self._goal)
            here = to_goal.get(self._at, 0)
            for name, (dr, dc) in MOVES.items():
                if to_goal.get((self._at[0] + dr, self._at[1] + dc), here) < here:
                    return name
        dr, dc = self._goal[0] - self._at[0], self._goal[1] - self._at[1]
        options = ([("south" if dr > 0 else "north")] if dr else []) + \
                  ([("east" if dc > 0 else "west")] if dc else [])
        return rng.choice(options or list(MOVES))

    def _toward_a_new_cell(self) -> Optional[str]:
        """The first move of a shortest path to the nearest cell not yet stood on (None when
        every reachable cell has been)."""
        here = distances(self._walls, self.size, self._at)
        fresh = [x for x in here if x not in self._stood_on]
        if not fresh:
            return None
        nearest = min(fresh, key=lambda x: (here[x], x))
        back = distances(self._walls, self.size, nearest)
        for name, (dr, dc) in MOVES.items():
            cell = (self._at[0] + dr, self._at[1] + dc)
            if cell in back and back[cell] < back[self._at]:
                return name
        return None
