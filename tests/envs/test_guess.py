"""`guess` (rl_tpu/envs/guess.py): closeness rewards worked by hand, the feedback, invalid
replies, and a teacher that halving makes optimal."""

import math
import random

from rl_tpu.core.env import Task, make


def test_a_game_by_hand():
    """Target 17 of 0-63: 32 is 'Lower.' worth 1 - 15/63, 10 'Higher.' worth 1 - 7/63, a word
    or 64 is invalid (reward 0, not done), 17 ends it: reward 1, success."""
    env = make("guess")
    assert "from 0 to 63" in env.reset(Task("t", {"target": 17}))
    r = env.step("32")
    assert (r.observation, r.done) == ("Lower.", False)
    assert abs(r.reward - (1 - 15 / 63)) < 1e-12
    r = env.step(" 10\n")
    assert r.observation == "Higher." and abs(r.reward - (1 - 7 / 63)) < 1e-12
    for bad in ("ten", "64", "1 2", "-1"):
        r = env.step(bad)
        assert r.info["invalid_action"] and r.reward == 0.0 and not r.done
    r = env.step("17")
    assert (r.observation, r.reward, r.done, r.info["success"]) == ("Correct!", 1.0, True, True)
    assert env.step("17").info["invalid_action"]


def test_the_skilled_teacher_halves_and_finds_any_number_in_seven_turns():
    env, rng, worst = make("guess"), random.Random(0), 0
    for target in range(64):
        task = Task(f"t{target}", {"target": target})
        env.reset(task)
        for turn in range(int(math.log2(64)) + 1):
            r = env.step(env.teacher_reply(task, rng, skill=1.0))
            if r.done:
                break
        assert r.info["success"], target
        worst = max(worst, turn + 1)
    assert worst == 7  # some number takes all seven


def test_an_unskilled_teacher_never_guesses_outside_the_feedback():
    env, rng = make("guess", max_value=15), random.Random(1)
    task = env.tasks().get("eval", 0)
    target, low, high = task.data["target"], 0, 15
    env.reset(task)
    for _ in range(20):
        guess = int(env.teacher_reply(task, rng, skill=0.0))
        assert low <= guess <= high
        r = env.step(str(guess))
        if r.done:
            break
        low, high = (guess + 1, high) if guess < target else (low, guess - 1)
    assert r.done
