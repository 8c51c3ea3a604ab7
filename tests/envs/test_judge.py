"""judge_pairwise (rl_tpu/envs/judge.py): generated pairs from `largest`, deterministic and
disjoint by split; the seeded A/B order; rewards for right, wrong and unparseable verdicts by
hand, and the rates they feed; the preference-JSONL source; the teacher; the config kwargs."""

import json
import math
import random

import numpy as np
import pytest

from garbage import garbage_actions, one_of, step_through

from rl_tpu.core import env as env_lib
from rl_tpu.core.env import Task
from rl_tpu.core.trajectory import EpisodeStats, Trajectory
from rl_tpu.envs.judge import (PairwiseJudgeEnv, PointwiseJudgeEnv, largest_pair,
                             pointwise_teacher_reply, teacher_reply)
from rl_tpu.recipes.config import base_config, env_kwargs, set_env


def pair_task(preferred="B", a="5", b="7", question="Which number is largest? 3 7 5"):
    return Task("j", {"question": question, "reply_a": a, "reply_b": b, "preferred": preferred})


def test_a_generated_task_is_the_largest_question_and_its_answer_against_a_smaller_number():
    env = PairwiseJudgeEnv()
    task = env.tasks().get("train", 0)
    # Random(1_000_000): the list 1 2 0 2 5, the answer 5 against 2, the answer shown as A
    assert task.task_id == "judge_pairwise/train/0"
    assert {k: task.data[k] for k in ("numbers", "chosen", "rejected", "preferred")} == {
        "numbers": [1, 2, 0, 2, 5], "chosen": "5", "rejected": "2", "preferred": "A"}
    assert env.reset(task) == ("Question:\nWhich number is largest? 1 2 0 2 5\n\nReply A:\n5\n\n"
                               "Reply B:\n2\n\nWhich reply is better? Answer [[A]] or [[B]].")
    assert env.system_prompt == ("You are a judge. Read the question and the two replies, A and "
                                 "B, and decide which reply is better. Give your verdict as "
                                 "[[A]] or [[B]].")
    for split in ("train", "eval"):
        for i in range(300):
            data = env.tasks().get(split, i).data
            numbers = data["numbers"]
            assert data["chosen"] == str(max(numbers))
            assert int(data["rejected"]) in numbers and int(data["rejected"]) < max(numbers)
            shown = (data["reply_a"], data["reply_b"])
            assert shown == ((data["chosen"], data["rejected"]) if data["preferred"] == "A"
                             else (data["rejected"], data["chosen"]))


def test_a_list_of_equal_numbers_is_redrawn():
    # max_value 1 with 2 items: [0, 0] and [1, 1] (half the draws) have no wrong answer
    for seed in range(50):
        data = largest_pair(random.Random(seed), 2, 1)
        assert sorted(data["numbers"]) == [0, 1]
        assert (data["chosen"], data["rejected"]) == ("1", "0")


def test_tasks_are_deterministic_by_index_and_the_splits_disjoint():
    one, two = PairwiseJudgeEnv(), PairwiseJudgeEnv()
    for split in ("train", "eval"):
        for i in (0, 1, 17, 999):
            assert one.tasks().get(split, i).data == two.tasks().get(split, i).data
    train = {one.tasks().get("train", i).data["seed"] for i in range(200)}
    evals = {one.tasks().get("eval", i).data["seed"] for i in range(1000)}
    assert not train & evals and evals == set(range(1000))
    with pytest.raises(ValueError, match="overlap"):
        PairwiseJudgeEnv(train_seed=500, eval_seed=0, eval_size=1000)


def test_the_order_is_seeded_and_both_orders_occur():
    env = PairwiseJudgeEnv()
    orders = [env.tasks().get("train", i).data["preferred"] for i in range(400)]
    # a fair coin a task: 200 expected, standard deviation 10; 4 of them either side
    assert 160 <= orders.count("A") <= 240 and orders.count("A") + orders.count("B") == 400
    assert orders == [PairwiseJudgeEnv().tasks().get("train", i).data["preferred"]
                      for i in range(400)]


@pytest.mark.parametrize("reply,reward,success,violation", [
    ("[[B]]", 1.0, True, False),  # picks the preferred reply
    ("7 is larger than 5, so B. [[b]]", 1.0, True, False),
    ("[[A]]", 0.0, False, True),  # picks the other
])
def test_a_verdict_is_paid_one_when_it_picks_the_preferred_reply(reply, reward, success,
                                                                 violation):
    env = PairwiseJudgeEnv()
    env.reset(pair_task("B"))
    result = env.step(reply)
    assert result.reward == reward and result.done
    assert result.info == {"preferred": "B", "verdict": reply[-3].upper(), "format_valid": True,
                           "success": success, "violation": violation}


@pytest.mark.parametrize("reply,why", [
    ("B", "no verdict"),
    ("[[A]] [[B]]", "ambiguous"),
    ("[[TIE]]", "[[TIE]] is not a verdict here"),
    ("", "no verdict"),
])
def test_an_unparseable_reply_scores_zero_and_is_marked_invalid(reply, why):
    env = PairwiseJudgeEnv()
    env.reset(pair_task("A"))
    result = env.step(reply)
    assert result.reward == 0.0 and result.done
    assert result.info["format_valid"] is False and result.info["invalid_action"] is True
    assert result.info["success"] is False and result.info["violation"] is False
    assert result.info["verdict"] is None and why in result.info["parse_error"]
    assert "Reply [[A]] or [[B]]" in result.observation
    after = env.step("[[A]]")  # one reply an episode
    assert after.reward == 0.0 and after.done and after.info["invalid_action"]


def _trajectory(step_info: dict) -> Trajectory:
    return Trajectory(tokens=np.zeros(2, np.int32), loss_mask=np.array([False, True]),
                      behaviour_logprobs=np.zeros(2, np.float32),
                      turn_ids=np.array([-1, 0], np.int32), rewards=[0.0], reward=0.0,
                      success=False, num_turns=1, weight_versions=[0], task_id="j",
                      group_id=0, finish="done", messages=[], info={"step_infos": [step_info]})


def test_the_step_infos_feed_format_valid_rate_and_violation_rate():
    env = PairwiseJudgeEnv()
    infos = []
    for preferred, reply in [("A", "[[A]]"), ("B", "[[A]]"), ("B", "[[B]]"), ("A", "nope")]:
        env.reset(pair_task(preferred))
        infos.append(env.step(reply).info)
    stats = EpisodeStats.of([_trajectory(i) for i in infos]).as_dict()
    # 3 verdicts of 4 replies; 1 wrong pick of the 3 verdicts
    assert stats["rollout/format_valid_rate"] == 0.75
    assert stats["rollout/violation_rate"] == pytest.approx(1 / 3)


def test_garbage_replies_are_observations_never_exceptions():
    env = PairwiseJudgeEnv()
    tasks = [env.tasks().get("train", i) for i in range(8)]
    own = [one_of("[[A]]", "[[B]]", "[[a]][[b]]", "[[A]", "[[ C ]]", "A", "B", "[[TIE]]")]
    results = step_through(env, garbage_actions(random.Random(0), 300, own), tasks)
    assert all(r.done for r in results)
    assert any(r.reward == 1.0 for r in results)
    assert any(r.info.get("invalid_action") is True for r in results)


def test_reset_refuses_a_task_without_the_pair():
    with pytest.raises(ValueError, match="needs 'question', 'reply_a', 'reply_b' and 'preferred'"):
        PairwiseJudgeEnv().reset(Task("x", {"question": "q", "reply_a": "a", "reply_b": "b",
                                            "preferred": "C"}))


# -- the preference-JSONL source -------------------------------------------------------------

def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_pairs_follow_their_split_fields(tmp_path):
    rows = [{"prompt": "2 + 2?", "chosen": "4", "rejected": "5", "split": "train"},
            {"prompt": [{"role": "user", "content": "3 + 3?"}], "chosen": "6",
             "rejected": [{"role": "assistant", "content": "7"}], "split": "eval"},
            {"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}]  # no split: train
    env = PairwiseJudgeEnv(pairs_path=_write(tmp_path / "p.jsonl", rows))
    assert env.tasks().size("train") == 2 and env.tasks().size("eval") == 1
    train = [env.tasks().get("train", i).data for i in range(2)]
    assert [(d["question"], d["chosen"], d["rejected"]) for d in train] == [
        ("2 + 2?", "4", "5"), ("1 + 1?", "2", "3")]
    held = env.tasks().get("eval", 0)
    shown = (held.data["question"], held.data["chosen"], held.data["rejected"])
    assert shown == ("3 + 3?", "6", "7")
    assert held.data["where"].endswith("p.jsonl:2")
    env.reset(held)
    verdict = f"[[{held.data['preferred']}]]"
    assert env.step(verdict).reward == 1.0
    # the order of a JSONL task is seeded like a generated one's: the same env, the same order
    assert PairwiseJudgeEnv(pairs_path=str(tmp_path / "p.jsonl")).tasks().get("eval", 0) \
        .data["preferred"] == held.data["preferred"]


def test_jsonl_without_splits_holds_out_whole_prompts_by_a_seeded_hash(tmp_path):
    rows = [{"prompt": f"question {q}", "chosen": f"good {k}", "rejected": f"bad {k}"}
            for q in range(60) for k in range(2)]  # two pairs a prompt
    path = _write(tmp_path / "p.jsonl", rows)
    env = PairwiseJudgeEnv(pairs_path=path, eval_fraction=0.25)
    sizes = env.tasks().size("train"), env.tasks().size("eval")
    assert sum(sizes) == 120 and sizes[1] % 2 == 0
    # 60 prompts, each to eval with probability 1/4: 15 expected, sd 3.4
    assert 6 <= sizes[1] // 2 <= 26
    questions = {s: {env.tasks().get(s, i).data["question"] for i in range(env.tasks().size(s))}
                 for s in ("train", "eval")}
    assert not questions["train"] & questions["eval"]  # a prompt's pairs stay together
    other = PairwiseJudgeEnv(pairs_path=path, eval_fraction=0.25, holdout_seed=1)
    assert {other.tasks().get("eval", i).data["question"]
            for i in range(other.tasks().size("eval"))} != questions["eval"]
    capped = PairwiseJudgeEnv(pairs_path=path, eval_fraction=0.25, eval_size=2)
    assert capped.tasks().size("eval") == 2


def test_jsonl_without_eval_pairs_is_refused(tmp_path):
    rows = [{"prompt": "q", "chosen": "a", "rejected": "b", "split": "train"}]
    with pytest.raises(ValueError, match="no eval pairs"):
        PairwiseJudgeEnv(pairs_path=_write(tmp_path / "p.jsonl", rows))
    with pytest.raises(FileNotFoundError):
        PairwiseJudgeEnv(pairs_path=str(tmp_path / "missing.jsonl"))


# -- the teacher and the config -------------------------------------------------------------

@pytest.mark.parametrize("skill", [0.0, 0.5, 0.8, 1.0])
def test_the_teachers_accuracy_is_its_skill_plus_half_the_rest(skill):
    env = PairwiseJudgeEnv()
    rng = random.Random(3)
    tasks = [env.tasks().get("train", i) for i in range(400)]
    replies = [teacher_reply(t, rng, skill) for t in tasks]
    right = [r == f"[[{t.data['preferred']}]]" for r, t in zip(replies, tasks)]
    # every mistake is position bias: "[[A]]" where B is preferred
    assert all(r == "[[A]]" for r, ok in zip(replies, right) if not ok)
    share_a = sum(t.data["preferred"] == "A" for t in tasks) / 400
    expected = skill + (1 - skill) * share_a  # (1 + skill) / 2 for a fair order
    # tolerance: 4 standard errors of 400 Bernoulli(skill) draws on the B-preferred tasks
    tolerance = 4 * math.sqrt(skill * (1 - skill) / 400)
    assert abs(sum(right) / 400 - expected) <= tolerance
    assert abs(expected - (1 + skill) / 2) <= 0.05 + 1e-9


def test_env_kwargs_are_readable_by_the_config():
    block = env_kwargs("judge_pairwise")
    assert dict(block) == {"pairs_path": "", "eval_fraction": 0.1, "holdout_seed": 0,
                           "num_items": 5, "max_value": 9, "train_seed": 1_000_000,
                           "eval_seed": 0, "train_size": 1_000_000, "eval_size": 1000}
    c = set_env(base_config("grpo"), "judge_pairwise", num_items=3, pairs_path="/x.jsonl")
    assert c.env.kwargs.num_items == 3 and c.env.kwargs.pairs_path == "/x.jsonl"
    with pytest.raises(TypeError):
        c.env.kwargs.num_items = "three"
    env = env_lib.make("judge_pairwise", num_items=3)
    assert len(env.tasks().get("train", 0).data["numbers"]) == 3


# -- judge_pointwise -------------------------------------------------------------------------

def test_a_pointwise_task_shows_the_answer_or_a_smaller_number_half_the_time_each():
    env = PointwiseJudgeEnv()
    tasks = [env.tasks().get("train", i) for i in range(400)]
    for t in tasks:
        numbers = t.data["numbers"]
        assert (t.data["reply"] == str(max(numbers))) == t.data["correct"]
        assert int(t.data["reply"]) in numbers
    # 200 correct replies expected, standard deviation 10; 4 of them either side
    assert 160 <= sum(t.data["correct"] for t in tasks) <= 240
    assert [t.data for t in tasks[:20]] == [PointwiseJudgeEnv().tasks().get("train", i).data
                                           for i in range(20)]
    first = tasks[0]
    assert env.reset(first) == (f"Question:\n{first.data['question']}\n\nReply:\n"
                                f"{first.data['reply']}\n\nIs the reply correct? Answer "
                                "[[YES]] or [[NO]].")
    assert env.system_prompt.endswith("Give your verdict as [[YES]] or [[NO]].")


@pytest.mark.parametrize("correct,reply,reward,violation,valid", [
    (True, "[[YES]]", 1.0, False, True),
    (True, "[[no]]", 0.0, True, True),
    (False, "[[NO]]", 1.0, False, True),
    (False, "[[YES]]", 0.0, True, True),
    (False, "no", 0.0, False, False),
    (False, "[[YES]] [[NO]]", 0.0, False, False),
])
def test_a_pointwise_verdict_is_paid_one_when_right(correct, reply, reward, violation, valid):
    env = PointwiseJudgeEnv()
    env.reset(Task("p", {"question": "Which number is largest? 3 7", "reply": "7" if correct
                         else "3", "correct": correct}))
    result = env.step(reply)
    assert result.reward == reward and result.done
    assert result.info["success"] is (reward == 1.0) and result.info["violation"] is violation
    assert result.info["format_valid"] is valid and result.info["expected"] is correct
    assert result.info.get("invalid_action", False) is (not valid)
    assert env.step("[[YES]]").info["episode_over"]


@pytest.mark.parametrize("skill", [0.0, 0.5, 1.0])
def test_the_pointwise_teachers_mistakes_are_leniency(skill):
    env = PointwiseJudgeEnv()
    rng = random.Random(5)
    tasks = [env.tasks().get("train", i) for i in range(400)]
    replies = [pointwise_teacher_reply(t, rng, skill) for t in tasks]
    right = [r == ("[[YES]]" if t.data["correct"] else "[[NO]]") for r, t in zip(replies, tasks)]
    assert all(r == "[[YES]]" for r, ok in zip(replies, right) if not ok)
    share_correct = sum(t.data["correct"] for t in tasks) / 400
    expected = skill + (1 - skill) * share_correct
    assert abs(sum(right) / 400 - expected) <= 4 * math.sqrt(skill * (1 - skill) / 400)
    assert env_lib.kwargs_of("judge_pointwise").keys() == {
        "num_items", "max_value", "train_seed", "eval_seed", "train_size", "eval_size"}
