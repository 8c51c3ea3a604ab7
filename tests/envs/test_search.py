"""Search env, rl_tpu's brackets style (`actions="brackets"`): BM25 retrieval, action parsing,
scoring, the oracle demonstration, garbage input."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from garbage import garbage_actions, one_of, step_through, text

from rl_tpu.core import env as env_lib
from rl_tpu.envs.search import (DATA_DIR, BM25Index, SearchEnv, SearchOracle, bracket_action,
                                exact_match, token_f1)


@pytest.fixture(scope="module")
def env():
    e = env_lib.make("search", actions="brackets")
    yield e
    e.close()


def _play_oracle(env, task):
    obs, oracle = env.reset(task), SearchOracle(env.question(task))
    for _ in range(10):
        result = env.step(oracle.act(obs))
        obs = result.observation
        if result.done:
            return result
    raise AssertionError("oracle did not answer within 10 steps")


def test_shipped_data_is_current():
    """The committed JSONL files are exactly what the generator script writes."""
    script = DATA_DIR / "make_search_data.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_tasks_are_reproducible_and_split(env):
    ts = env.tasks()
    assert ts.size("train") == 50 and ts.size("eval") == 50
    assert ts.get("eval", 3) == ts.get("eval", 3)
    train_ids = {ts.get("train", i).task_id for i in range(ts.size("train"))}
    eval_ids = {ts.get("eval", i).task_id for i in range(ts.size("eval"))}
    assert not train_ids & eval_ids
    with pytest.raises(ValueError, match="unknown split"):
        ts.get("dev", 0)


def test_search_then_answer(env):
    task = next(t for t in (env.tasks().get("eval", i) for i in range(50))
                if env.question(t)["type"] == "2hop")
    q = env.question(task)
    obs = env.reset(task)
    assert obs == f"Question: {q['question']}" and env.conversation_start() is None
    assert env.system_prompt.startswith("You answer questions") and env.agentgym_name == ""
    first = q["hops"][0]
    r = env.step(f"Thought: look it up.\nsearch[{first['query']}]")
    assert not r.done and r.reward == 0.0
    assert f"[1] {first['title']}:" in r.observation  # the entity's own passage ranks first
    assert first["evidence"] in r.observation
    r = env.step(f"answer[{q['answer'].upper()}.]")  # normalisation: case, punctuation
    assert r.done and r.reward == 1.0 and r.info["success"]
    assert env.step("search[anything]").done  # after the end: says so, no exception


def test_wrong_answer_and_f1_reward():
    env = SearchEnv(actions="brackets", reward="f1")
    task = next(t for t in (env.tasks().get("train", i) for i in range(50))
                if len(env.question(t)["answer"].split()) >= 2)
    env.reset(task)
    half = env.question(task)["answer"].split()[0]
    r = env.step(f"answer[{half}]")
    assert r.done and 0.0 < r.reward < 1.0 and not r.info["success"]
    env.reset(task)
    assert env.step("answer[zzz qqq]").reward == 0.0


def test_bm25_ranks_by_term_rarity_and_frequency():
    index = BM25Index([{"title": "A", "text": "red fox"}, {"title": "B", "text": "red red hen"},
                       {"title": "C", "text": "blue fox fox"}])
    assert [p["title"] for p, _ in index.search("hen", 3)] == ["B"]  # 1 of 3 docs still scores
    assert [p["title"] for p, _ in index.search("fox", 3)] == ["C", "A"]  # tf wins
    assert index.search("the", 3) == []  # stopwords only
    assert [p["title"] for p, _ in index.search("red hen", 1)] == ["B"]


def test_bracket_action():
    assert bracket_action("search[a b]") == ("search", "a b")
    assert bracket_action("I will SEARCH [x] then answer[[1, 2]]") == ("answer", "[1, 2]")
    assert bracket_action("answer[unclosed")[0] is None
    assert bracket_action("nothing here")[0] is None
    assert exact_match("The Vask Sea!", "vask sea") == 1.0
    assert token_f1("sea of ombrel", "Sea of Ombrel") == 1.0


def test_invalid_actions_are_observations(env):
    env.reset(env.tasks().get("train", 0))
    for action in ["", "search[]", "answer[   ]", "search[" + "x" * 400 + "]", "look around",
                   "search[foo"]:
        r = env.step(action)
        assert r.info.get("invalid_action") and not r.done
        assert r.observation.startswith("Invalid action:")
    r = env.step("search[the of and]")  # stopwords only: valid, but nothing matches
    assert "No passages match" in r.observation and not r.done


def test_max_steps_ends_episode():
    env = SearchEnv(actions="brackets", max_steps=2)
    env.reset(env.tasks().get("train", 0))
    assert not env.step("search[foo]").done
    r = env.step("search[bar]")
    assert r.done and r.info["truncated"] and r.reward == 0.0


def test_custom_corpus(tmp_path: Path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "a", "title": "Zorblat", "text": "Zorblat is blue."}) + "\n"
                                      + json.dumps({"id": "b", "title": "Quix", "text": "Quix is red."}) + "\n")
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": "1", "split": "eval", "question": "Colour of Quix?",
                                                  "answer": ["red", "crimson"]}) + "\n")
    env = SearchEnv(corpus_path=tmp_path / "c.jsonl", questions_path=tmp_path / "q.jsonl", top_k=1,
                    actions="brackets")
    assert env.tasks().size("train") == 0
    env.reset(env.tasks().get("eval", 0))
    assert "Quix is red." in env.step("search[Quix]").observation
    assert env.step("answer[crimson]").reward == 1.0
    # A task that carries its own question and answer needs no questions file entry.
    env.reset(env_lib.Task("own", {"question": "Colour of Zorblat?", "answer": "blue"}))
    assert env.step("answer[Blue]").reward == 1.0
    with pytest.raises(FileNotFoundError, match="corpus_path"):
        SearchEnv(corpus_path=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="actions must be one of"):
        SearchEnv(actions="json")


def test_oracle_solves_eval_tasks(env):
    """Demonstration: the scripted oracle on 50 eval questions (measured: 50/50)."""
    ts = env.tasks()
    results = [_play_oracle(env, ts.get("eval", i)) for i in range(50)]
    rate = sum(r.info["success"] for r in results) / len(results)
    assert rate >= 0.9, rate


# The search env's own kinds: broken, nested or oversized search[...] and answer[...] actions.
GARBAGE = [
    lambda rng: text(rng, "ab[]()<> \n\t", 10_240),
    one_of("search[", "answer[", "search[]]", "search [ ]", "search()", "SEARCH{x}",
           "answer[\x00]", "search[\u202e\u200b]", "answer:[x]", "[search]"),
    lambda rng: f"search[{text(rng, 'xyz ☃', 1, 600)}]",
    lambda rng: "search[" * rng.randrange(1, 50) + "]" * rng.randrange(0, 50),
    lambda rng: json.dumps({"action": "search", "query": "x" * rng.randrange(100)}),
    lambda rng: f"answer[{rng.random()}]",
    lambda rng: "search[" + text(rng, "abcdefghij ", 1, 40) + "]",
]


def test_garbage_actions_never_raise(env):
    ts = env.tasks()
    step_through(env, garbage_actions(random.Random(0), 1000, GARBAGE),
                 [ts.get("train", i) for i in range(ts.size("train"))])
    assert _play_oracle(env, ts.get("eval", 0)).info["success"]  # still usable
