"""TextWorld env: offline game generation and caching, walkthrough demonstrations, garbage."""

import random

import pytest

pytest.importorskip("textworld")

from garbage import garbage_actions, one_of, step_through

from rl_tpu.core import env as env_lib
from rl_tpu.envs.textworld import TextWorldEnv, check_command, clean_feedback

# Small games keep generation (~1 s each, cached after) cheap; the env's defaults are bigger.
GAME = dict(nb_rooms=3, nb_objects=6, quest_length=3)


@pytest.fixture(scope="module")
def env():
    # The default cache dir (~/.cache/rl_tpu/textworld or $RL_TPU_TEXTWORLD_CACHE): games are
    # generated once per machine, so later runs of the suite skip the compile.
    e = env_lib.make("textworld", **GAME)
    yield e
    e.close()


def _play(env, task) -> tuple[float, dict]:
    env.reset(task)
    total, result = 0.0, None
    for action in env.demonstration(task):
        result = env.step(action)
        total += result.reward
        if result.done:
            break
    return total, result.info


def test_tasks_are_seeded_and_disjoint(env):
    ts = env.tasks()
    assert ts.size("train") is None and ts.size("eval") == 100
    assert ts.get("eval", 2) == ts.get("eval", 2)
    assert ts.get("train", 2).data["seed"] != ts.get("eval", 2).data["seed"]
    with pytest.raises(IndexError):
        ts.get("eval", 100)


def test_reset_and_step(env):
    task = env.tasks().get("eval", 0)
    obs = env.reset(task)
    assert "-=" in obs and "$$" not in obs  # room title, no ASCII-art banner
    r = env.step("look")
    assert not r.done and r.reward == 0.0 and r.observation and not r.observation.endswith(">")
    r = env.step("inventory")
    assert "carrying" in r.observation.lower()


def test_same_seed_same_game(tmp_path, env):
    """A seed means the same game wherever it is generated (here: a fresh cache dir)."""
    other = TextWorldEnv(cache_dir=tmp_path, **GAME)
    task = env.tasks().get("train", 0)
    assert other.reset(task) == env.reset(task)
    assert other.demonstration(task) == env.demonstration(task)
    other.close()


def test_demonstration_wins_some_eval_games(env):
    """Walkthroughs on the first 5 eval games (the 50-game version is marked slow)."""
    results = [_play(env, env.tasks().get("eval", i)) for i in range(5)]
    assert all(info["success"] for _, info in results)
    assert all(total == pytest.approx(1.0) for total, _ in results)  # rewards sum to 1 on a win


@pytest.mark.slow
def test_demonstration_wins_50_eval_games(env):
    results = [_play(env, env.tasks().get("eval", i)) for i in range(50)]
    rate = sum(info["success"] for _, info in results) / 50
    assert rate >= 0.9, rate


def test_input_checks():
    assert check_command("take key from box") is None
    for bad in ["", "a\x00b", "héllo", "x" * 500, "go north\ngo south", "quit", "RESTART",
                "restore", "script on", "undo"]:
        assert check_command(bad) is not None, bad
    raw = "\nYou can't.\n\n>                                            -= Hall =-0/2"
    assert clean_feedback(raw) == "You can't."


def test_max_steps_truncates(tmp_path):
    env = TextWorldEnv(max_steps=3, **GAME)
    env.reset(env.tasks().get("eval", 0))
    assert not env.step("look").done and not env.step("").done
    r = env.step("look")
    assert r.done and r.info["truncated"] and not r.info["success"]
    assert env.step("look").done  # after the end: an observation, no exception
    env.close()


# TextWorld's own kinds: meta commands that would end or rewind the game behind the env's back,
# valid-looking but illegal commands, legal ones, commands around the length limit.
GARBAGE = [
    one_of("quit", "restart", "restore", "save", "undo", "script", "unscript", "version",
           "verbose", "q", "yes", "no", "y"),
    one_of("take the moon", "go up", "open", "unlock chest with banana", "eat key",
           "put key on key", "examine", "drop everything", "go", "take all", "insert me into me",
           "look at the " + "very " * 30),
    one_of("look", "inventory", "go north", "go south", "go east", "go west"),
    lambda rng: "x" * rng.randrange(180, 260),
]


def test_garbage_actions_never_raise(env):
    ts = env.tasks()
    step_through(env, garbage_actions(random.Random(3), 1000, GARBAGE),
                 [ts.get("eval", 1 + i) for i in range(3)])
    total, info = _play(env, ts.get("eval", 1))  # still usable
    assert info["success"]
