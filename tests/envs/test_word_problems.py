"""`word_problems` (rl_tpu/envs/word_problems.py): problems worked by hand, the hash split,
the `Answer: N` checker on good, bad and hostile replies, the teacher, and the format-failure
rate reaching the eval's metrics."""

import random
import time
from types import SimpleNamespace

import pytest

from garbage import code_points, garbage_actions, step_through
from rl_tpu.agent import run_episodes
from rl_tpu.agent.evaluation import evaluate
from rl_tpu.core.engine import SamplingParams
from rl_tpu.core.env import make
from rl_tpu.core.trajectory import EpisodeStats
from rl_tpu.envs.word_problems import (TEMPLATES, WordProblemTasks, make_problem, parse_answer,
                                       split_of, teacher_reply)
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes.config import base_config
from rl_tpu.recipes.rl import Trainer
from rl_tpu.rollout.scripted import ScriptedEngine


def test_problems_match_answers_worked_by_hand():
    env = make("word_problems")
    # 11 x 2 = 22, 22 x 4 = 88
    task = env.tasks().get("eval", 0)
    assert env.reset(task) == (
        "Ava walks 11 km north from home. Then she keeps walking north until she is twice as "
        "far from home as before. Then she keeps walking north until she is four times as far "
        "from home as before. How many km from home is Ava now?\n"
        "End your reply with a line `Answer: N`.")  # the format asked for after the problem
    assert task.data["answer"] == 88
    # 16 x 5 = 80, + 5 = 85, - 2 = 83
    task = env.tasks().get("eval", 1)
    assert task.data["question"].startswith("Ben walks 16 km north from home. Then he keeps "
                                            "walking north until he is five times as far")
    assert task.data["question"].endswith("Then he walks 5 km further north. Then he walks 2 "
                                          "km back south. How many km from home is Ben now?")
    assert task.data["answer"] == 83
    # 2 + 7 = 9
    task = env.tasks().get("train", 0)
    assert task.data["question"] == ("Mia bakes 2 cookies. She bakes 7 more cookies. How many "
                                      "cookies does Mia have now?")
    assert task.data["answer"] == 9
    # the same draw in two chain templates: 19 - 3 = 16, x 3 = 48, + 4 = 52
    ages = make_problem(random.Random(7), "ages", 3, 2, 20, 5)
    assert ages["question"] == (
        "Liam is 19 years old. Omar is 3 years younger than Liam. Noah is three times as old "
        "as Omar. Nina is 4 years older than Noah. How old is Nina?")
    reading = make_problem(random.Random(7), "reading", 3, 2, 20, 5)
    assert reading["question"] == (
        "On day 1, Sam reads 19 pages. On day 2, he reads 3 fewer pages than on day 1. On day "
        "3, he reads three times as many pages as on day 2. On day 4, he reads 4 more pages "
        "than on day 3. How many pages does Sam read on day 4?")
    assert ages["answer"] == reading["answer"] == 52


def test_every_template_chains_its_operations_within_the_settings():
    """Over many problems of each template: the answer is the chain worked left to right from
    the start, every amount stays >= 1, operands and factors stay in their ranges, and the
    number of operations is within the steps asked for."""
    rng = random.Random(0)
    for template in TEMPLATES:
        for _ in range(200):
            steps = rng.randint(1, 3)
            p = make_problem(rng, template, steps, 3, 12, 4)
            assert len(p["chain"]) == steps and 3 <= p["start"] <= 12
            value = p["start"]
            for op, operand, result in p["chain"]:
                assert (2 <= operand <= 4) if op == "x" else (3 <= operand <= 12)
                value = {"+": value + operand, "-": value - operand, "x": value * operand}[op]
                assert value == result >= 1
            assert p["answer"] == value
            assert str(p["chain"][-1][1]) in p["question"] or p["chain"][-1][0] == "x"
    # no multiplication when max_factor is 1
    ops = {op for i in range(300)
           for op, _, _ in make_problem(random.Random(i), "bus", 3, 2, 9, 1)["chain"]}
    assert ops == {"+", "-"}


def test_the_split_is_by_text_hash_disjoint_and_reproducible():
    tasks = make("word_problems").tasks()
    assert tasks.size("eval") == 500
    evals = [tasks.get("eval", i).data["question"] for i in range(500)]
    train = [tasks.get("train", i).data["question"] for i in range(3000)]
    assert not set(evals) & set(train)
    assert all(split_of(q, 0.1) == "eval" for q in evals)
    assert all(split_of(q, 0.1) == "train" for q in train[:500])
    again = WordProblemTasks(1, 3, 2, 20, 5, tuple(TEMPLATES), 0.1, 1_000_000, 0, 10, 500)
    assert [again.get("eval", i).data for i in (0, 123, 499)] == [
        tasks.get("eval", i).data for i in (0, 123, 499)]
    with pytest.raises(IndexError):
        tasks.get("eval", 500)
    with pytest.raises(ValueError, match="max_steps"):
        make("word_problems", min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="pick from"):
        make("word_problems", templates=("cooking",))
    # settings allowing one text cannot fill both splits: an error that says so, not a hang
    one = WordProblemTasks(1, 1, 1, 1, 1, ("bus",), 0.5, 100, 0, 1, 1)
    with pytest.raises(ValueError, match="too few distinct problems"):
        one.get("eval" if split_of(one.get("train", 0).data["question"], 0.5) == "train"
                else "train", 0)


@pytest.mark.parametrize("reply,parsed", [
    ("Answer: 14", "14"), ("answer: 14", "14"), ("ANSWER:14", "14"), ("Answer: 14.", "14"),
    ("Answer: $14", "14"), ("Answer: -3", "-3"), ("Answer: $-3", "-3"), ("Answer: -$3", "-3"),
    ("Answer: 1,234", "1234"), ("Answer: 007", "7"), ("Answer: -0", "0"),
    ("**Answer: 14**", "14"), ("Answer: **14**", "14"), ("Final Answer: 14  ", "14"),
    ("12 + 2 = 14\nAnswer: 14", "14"), ("Answer: 9\nwait, no.\nAnswer: 14", "14"),
    ("Answer: 14\nThat is all.", "14"),
])
def test_the_last_answer_line_states_the_number(reply, parsed):
    assert parse_answer(reply) == parsed


@pytest.mark.parametrize("reply", [
    "", "14", "The answer is 14.", "Answer:", "Answer: fourteen", "Answer: 14 cookies",
    "Answer: 14.5", "Answer: 1,23", "Answer: --3", "Answer: 14\nAnswer: none",
    "Answer: \u0661\u0664",  # Arabic-Indic digits: only ASCII digits count
    "Answer: \uff11\uff14",  # fullwidth digits
    "Answer:\n14",  # the number must be on the Answer line
])
def test_a_reply_without_an_answer_line_holding_a_number_is_a_format_failure(reply):
    assert parse_answer(reply) is None
    env = make("word_problems")
    env.reset(env.tasks().get("eval", 2))
    result = env.step(reply)
    assert result.done and result.reward == 0.0
    assert result.info["format_failed"] and not result.info["success"]
    assert result.info["answer"] is None and "Answer: N" in result.observation


def test_scoring_is_exact_and_says_what_was_parsed():
    env = make("word_problems")
    task = env.tasks().get("eval", 0)  # 88
    for reply, right in (("Answer: 88", True), ("22 x 4 = 88\nAnswer: 88.", True),
                         ("Answer: 87", False), ("Answer: 88\nAnswer: 8", False),
                         ("Answer: 880", False), ("Answer: -88", False)):
        env.reset(task)
        result = env.step(reply)
        assert result.reward == float(right) and result.info["success"] is right
        assert result.info["format_failed"] is False and result.info["gold"] == 88
        assert result.info["answer"] == parse_answer(reply)


def test_hostile_replies_cost_bounded_time_and_never_raise():
    env = make("word_problems")
    task = env.tasks().get("eval", 0)  # 88
    huge_number = "Answer: 88" + "0" * 100_000  # beyond int()'s 4300-digit limit
    hostile = [
        "x" * 5_000_000 + "\nAnswer: 88",  # 5 MB of reasoning, then the right answer
        "Answer: 88\n" * 200_000,  # 2 MB of Answer lines
        "Answer: " + "9" * 3_000_000,  # one 3 MB number
        huge_number, "Answer: " + "1," * 500_000 + "000",
        "Answer: " + "-" * 1_000_000 + "88", "Answer:" + " " * 1_000_000 + "88",
        "Answer: 88" + "\u0000" * 1000, "\ud800Answer: 88\n\udfff", "Answer: 8\u200b8",
        # a pattern with two optional runs of spaces side by side backtracks quadratically here
        "Answer: -" + " " * 1_000_000 + "x", "Answer: $" + " \t" * 500_000 + "-",
    ]
    start = time.perf_counter()
    results = []
    for reply in hostile:
        env.reset(task)
        results.append(env.step(reply))
    assert time.perf_counter() - start < 5.0
    assert [r.reward for r in results] == [1, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0]
    assert results[3].info["answer"].endswith("...") and len(results[3].info["answer"]) < 50
    assert results[2].info["format_failed"] is False  # a number, just a wrong one
    assert results[5].info["format_failed"] and results[9].info["format_failed"]
    lenient = make("word_problems", lenient=True)
    for reply in ("the answer is" + " " * 1_000_000 + "x", "The answer is " + "8" * 100_000 + ".5",
                  "answer is " + "1," * 500_000 + "5", "answer is 88" + "0" * 100_000):
        lenient.reset(task)
        assert lenient.step(reply).reward == 0.0
    assert time.perf_counter() - start < 10.0
    rng = random.Random(3)
    kinds = ["Answer: 88", lambda r: "Answer: " + code_points(r, 0x20, 0x2FFF, 1, 40),
             lambda r: "Answer: " + "".join(r.choice("0123456789,.$- *") for _ in range(40))]
    step_through(env, garbage_actions(rng, 400, kinds), [task])


def test_lenient_scoring_takes_the_answer_is_phrase_and_still_counts_a_format_failure():
    """SmolLM2-135M-Instruct ends "The answer is 40 km." where the line was asked for:
    `lenient` pays such a reply when right, and eval still sees it missed the format."""
    strict, lenient = make("word_problems"), make("word_problems", lenient=True)
    task = strict.tasks().get("eval", 0)  # 88
    for reply, paid, failed in (
            ("So, Ava is 88 km from home.\n\nThe answer is 88 km.", 1.0, True),
            ("The answer is **88**", 1.0, True), ("The answer is $88.", 1.0, True),
            ("The answer is 88.5 km", 0.0, True), ("The answer is 880", 0.0, True),
            ("the answer is 88, then the answer is 87", 0.0, True),
            ("The answer is 88.\nAnswer: 87", 0.0, False),  # the Answer line decides
            ("Answer: 88", 1.0, False), ("It is 88.", 0.0, True)):
        lenient.reset(task)
        result = lenient.step(reply)
        assert (result.reward, result.info["format_failed"]) == (paid, failed), reply
        strict.reset(task)
        assert strict.step(reply).reward == float(reply == "Answer: 88"), reply


def test_the_teacher_works_the_chain_and_misses_by_one_at_its_skill():
    env, rng = make("word_problems"), random.Random(0)
    tasks = [env.tasks().get("train", i) for i in range(300)]
    task = env.tasks().get("eval", 1)
    assert teacher_reply(task, rng, 1.0) == "16 x 5 = 80\n80 + 5 = 85\n85 - 2 = 83\nAnswer: 83"
    for t in tasks:
        assert parse_answer(teacher_reply(t, rng, 1.0)) == str(t.data["answer"])
        wrong = int(parse_answer(teacher_reply(t, rng, 0.0)))
        assert abs(wrong - t.data["answer"]) == 1 and wrong >= 0
    right = sum(parse_answer(teacher_reply(t, rng, 0.3)) == str(t.data["answer"])
                for t in tasks) / len(tasks)
    assert abs(right - 0.3) < 0.1


def test_the_format_failure_rate_reaches_the_eval_metrics():
    """Four held-out problems answered right, wrong, in no format, and in unicode digits:
    greedy success 1/4, eval format_failed 2/4; the rollout metrics carry the same rate."""
    env = make("word_problems")
    tasks = [env.tasks().get("eval", i) for i in range(4)]
    golds = [t.data["answer"] for t in tasks]
    replies = [f"Answer: {golds[0]}", f"Answer: {golds[1] + 1}", f"It is {golds[2]}.",
               "Answer: \u0661\u0662"]

    def policy(prompt, turn):
        return next(r for t, r in zip(tasks, replies) if t.data["question"] in prompt)

    tok = ChatTokenizer(build_tokenizer(512))
    out = evaluate(ScriptedEngine(tok, policy), lambda: make("word_problems"), tasks,
                   tokenizer=tok, max_turns=1, max_new_tokens=64, max_context_tokens=512)
    assert out["success"] == 0.25 and out["format_failed"] == 0.5
    played = run_episodes(ScriptedEngine(tok, policy), lambda: make("word_problems"), tasks,
                          sampling=SamplingParams(temperature=1.0), tokenizer=tok, max_turns=1,
                          max_new_tokens_per_turn=64, max_context_tokens=512)
    stats = EpisodeStats.of(played)
    assert (stats.format_checks, stats.format_failures) == (4, 2)
    assert stats.as_dict()["rollout/format_failed_rate"] == 0.5
    # and the trainer logs it with each step's rollouts (_rollout_metrics reads only the
    # config's schedules and the reward mix)
    trainer = SimpleNamespace(config=base_config(), reward_mix=None)
    assert Trainer._rollout_metrics(trainer, played, step=1)["rollout/format_failed"] == 0.5
    # an env that does not check a format reports no rate (not 0)
    evens = make("evens")
    assert "format_failed" not in evaluate(
        ScriptedEngine(tok, lambda prompt, turn: "4"), lambda: evens,
        [evens.tasks().get("eval", 0)], tokenizer=tok, max_turns=1, max_new_tokens=4,
        max_context_tokens=128)

