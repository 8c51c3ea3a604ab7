"""The self-play arithmetic env: parsing and values of proposals, the solver's reward, tasks."""

import random

import pytest

from rl_tpu.core.env import make
from rl_tpu.envs.selfplay import evaluate, parse_expression, solve_task


@pytest.mark.parametrize("text,canonical,value,terms", [
    ("2 + 3 * 4 - 5", "2 + 3 * 4 - 5", 9, 4),  # 2 + 12 - 5
    ("10 - 2 - 3", "10 - 2 - 3", 5, 3),  # left to right
    ("2*3*4", "2 * 3 * 4", 24, 3),
    ("  7 - 20 ", "7 - 20", -13, 2),
    ("0 * 19 + 1", "0 * 19 + 1", 1, 3),
])
def test_valid_proposals_parse_to_their_canonical_form_and_value(text, canonical, value, terms):
    assert parse_expression(text, max_terms=4, max_number=20) == (canonical, value, terms)


@pytest.mark.parametrize("text", ["7", "2 +", "21 + 1", "1 + 2 + 3 + 4 + 5", "2 / 3", "x + 1",
                                  "2 + 3 = 5", "", "007 + 1", "-2 + 3"])
def test_anything_else_is_not_a_proposal(text):
    assert parse_expression(text, max_terms=4, max_number=20) is None


def test_precedence_is_pythons():
    assert evaluate([1, 2, 3, 4], ["-", "*", "+"]) == 1 - 2 * 3 + 4 == -1


def test_proposer_episode_records_the_problem_and_an_invalid_one_says_so():
    env = make("selfplay_arithmetic")
    tasks = env.tasks()
    assert env.reset(tasks.get("train", 0)) == "Write a new arithmetic problem."
    result = env.step("3 + 4 * 2")
    assert result.done and result.reward == 0.0
    assert result.info == {"valid": True, "expression": "3 + 4 * 2", "value": 11, "terms": 3}
    env.reset(tasks.get("train", 2))
    bad = env.step("three plus four")
    assert bad.done and bad.info["valid"] is False and bad.info["invalid_action"]
    assert bad.observation.startswith("Invalid action:")


def test_solver_is_rewarded_for_the_value_only():
    env = make("selfplay_arithmetic")
    task = solve_task("t", "12 - 3 * 5", 4, 20)
    assert env.reset(task) == "Compute: 12 - 3 * 5"
    right = env.step("-3")
    assert (right.reward, right.info["success"]) == (1.0, True)
    env.reset(task)
    wrong = env.step("45")
    assert (wrong.reward, wrong.info["success"]) == (0.0, False)
    assert "-3" in wrong.observation


def test_train_split_alternates_roles_and_eval_is_held_out_solving():
    tasks = make("selfplay_arithmetic").tasks()
    roles = [tasks.get("train", i).data["role"] for i in range(6)]
    assert roles == ["propose", "solve"] * 3
    evals = [tasks.get("eval", i) for i in range(50)]
    assert all(t.data["role"] == "solve" and 2 <= t.data["terms"] <= 3 for t in evals)
    assert tasks.get("eval", 7).data == tasks.get("eval", 7).data  # reproducible
    with pytest.raises(ValueError, match="overlap"):
        make("selfplay_arithmetic", train_seed=0, eval_seed=10)
    # the solver-only control's train split: solve tasks alone, the same held-out set
    solver_only = make("selfplay_arithmetic", train_roles="solve").tasks()
    assert [solver_only.get("train", i).data["role"] for i in range(6)] == ["solve"] * 6
    assert solver_only.get("eval", 7).data == tasks.get("eval", 7).data
    with pytest.raises(ValueError, match="train_roles='proposer'"):
        make("selfplay_arithmetic", train_roles="proposer")


def test_teacher_proposes_valid_problems_and_solves_at_its_skill():
    env = make("selfplay_arithmetic")
    rng = random.Random(0)
    proposals = [env.teacher_reply(env.tasks().get("train", 0), rng, 0.5) for _ in range(50)]
    assert all(parse_expression(p, 4, 20) for p in proposals)
    task = solve_task("t", "5 + 6", 4, 20)
    answers = [env.teacher_reply(task, rng, 0.5) for _ in range(400)]
    assert set(answers) == {"11", "5"}
    assert 0.4 < answers.count("11") / 400 < 0.6
