"""The eval suite's sampled metrics (rl_tpu/agent/evaluation.py): pass@k, mean@k and
distinct@k counted by hand on `evens`, format failures and the kept replies on
`word_problems`, with scripted policies."""

import itertools

from rl_tpu.agent.evaluation import evaluate, replies_lines
from rl_tpu.core.engine import SamplingParams
from rl_tpu.core.env import make
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rollout.scripted import ScriptedEngine


def test_pass_mean_and_distinct_at_k_by_hand():
    """Two tasks, k = 4. Greedy replies (temperature 0) are the first number; samples cycle
    over a script. Task 0's samples: two different right answers, one of them twice, and a
    wrong one (distinct 2, 3 right); task 1's: all wrong. pass@4 = 1/2, mean@4 = 3/8,
    distinct@4 = (2 + 0) / 2 = 1."""
    env = make("evens")
    tasks = [env.tasks().get("eval", i) for i in range(2)]
    evens = [t.data["answers"] for t in tasks]
    odd = next(str(n) for n in range(1, 10, 2))
    scripts = {0: itertools.cycle([evens[0][0], evens[0][-1], evens[0][0], odd]),
               1: itertools.cycle([odd])}
    assert evens[0][0] != evens[0][-1]  # (the task has two different even numbers)

    def policy(prompt, turn):
        which = 0 if " ".join(map(str, tasks[0].data["numbers"])) in prompt else 1
        if "greedy" in policy.mode:
            return str(tasks[which].data["numbers"][0])
        return next(scripts[which])

    tok = ChatTokenizer(build_tokenizer(512))
    engine = ScriptedEngine(tok, policy)
    original = engine.generate

    def generate(requests):  # which policy answers: greedy (the success pass) or sampled
        policy.mode = "greedy" if requests[0].sampling.temperature == 0 else "sampled"
        return original(requests)

    engine.generate = generate
    out = evaluate(engine, lambda: make("evens"), tasks, tokenizer=tok, max_turns=1,
                   max_new_tokens=4, max_context_tokens=128, pass_k=4,
                   sampling=SamplingParams(temperature=1.0))
    greedy = [str(t.data["numbers"][0]) in t.data["answers"] for t in tasks]
    assert out["success"] == sum(greedy) / 2
    assert out["pass@4"] == 0.5 and out["mean@4"] == 3 / 8 and out["distinct@4"] == 1.0


def test_format_failures_greedy_and_sampled_and_the_kept_replies():
    """word_problems, two tasks, k = 4. Greedy: task 0 ends with `Answer: N` (right), task 1
    says "The answer is N." (a format failure): success and format_failed 1/2. Each task's
    samples are [Answer line, phrase, no line, Answer line]: 4 of 8 fail the format and 4 are
    right, so format_failed@4 = mean@4 = 1/2. `keep` is handed 2 greedy and 8 sampled
    episodes, whose records say which failed."""
    env = make("word_problems")
    tasks = [env.tasks().get("eval", i) for i in range(2)]
    answers = [t.data["answer"] for t in tasks]

    def which(prompt):
        return 0 if tasks[0].data["question"] in prompt else 1

    def policy(prompt, turn):
        n = answers[which(prompt)]
        if policy.mode == "greedy":
            return f"Answer: {n}" if which(prompt) == 0 else f"The answer is {n}."
        return next(policy.script).format(n=n)

    policy.script = itertools.cycle(["Answer: {n}", "The answer is {n}.", "so {n}, no line",
                                     "Answer: {n}"])
    tok = ChatTokenizer(build_tokenizer(512))
    engine = ScriptedEngine(tok, policy)
    original = engine.generate

    def generate(requests):
        policy.mode = "greedy" if requests[0].sampling.temperature == 0 else "sampled"
        return original(requests)

    engine.generate = generate
    kept = []
    out = evaluate(engine, lambda: make("word_problems"), tasks, tokenizer=tok, max_turns=1,
                   max_new_tokens=64, max_context_tokens=1024, pass_k=4,
                   sampling=SamplingParams(temperature=1.0),
                   keep=lambda kind, trajectories: kept.extend(replies_lines(kind,
                                                                             trajectories)))
    assert out["success"] == 0.5 and out["format_failed"] == 0.5
    assert out["format_failed@4"] == 0.5 and out["mean@4"] == 0.5
    assert [r["kind"] for r in kept] == ["greedy"] * 2 + ["sampled"] * 8
    assert [r["format_failed"] for r in kept[:2]] == [False, True]
    assert sum(r["format_failed"] for r in kept[2:]) == 4
    assert sum(r["success"] for r in kept[2:]) == 4
    assert kept[0]["messages"][-1]["role"] in ("assistant", "user")
    assert any(m.get("content") == f"Answer: {answers[0]}" for m in kept[0]["messages"])
