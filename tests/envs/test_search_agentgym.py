"""The search env's default: AgentGym's SearchQA protocol over a local BM25 corpus.

Most tests use a four-passage corpus written here, small enough to rank by hand (BM25 over
title + text, stopwords such as "is", "a", "in", "by", "the", "and" dropped):
  p0 Alpha Tower  "Alpha Tower stands in Brenn."
      tokens: alpha tower alpha tower stands brenn (6)
  p1 Brenn        "Brenn is a town by the sea."
      tokens: brenn brenn town sea (4)
  p2 Cato         "Cato is a painter."
      tokens: cato cato painter (3)
  p3 Delta        "Delta lies near Brenn and Alpha Tower."
      tokens: delta delta lies near brenn alpha tower (7)
Query "Brenn": p1 has it twice in 4 tokens, p0 once in 6, p3 once in 7 -> p1, p0, p3.
Query "Alpha Tower": p0 has both terms twice, p3 once each, the others neither -> p0, p3 only.
"""

import json

import pytest

from rl_tpu.core import env as env_lib
from rl_tpu.envs.search import (ACK, CORRECT, INCORRECT, INSTRUCTION, INVALID, SearchEnv,
                                acting_pair, last_answer)

PASSAGES = [
    {"id": "p0", "title": "Alpha Tower", "text": "Alpha Tower stands in Brenn."},
    {"id": "p1", "title": "Brenn", "text": "Brenn is a town by the sea."},
    {"id": "p2", "title": "Cato", "text": "Cato is a painter."},
    {"id": "p3", "title": "Delta", "text": "Delta lies near Brenn and Alpha Tower."},
]
QUESTIONS = [
    {"id": "a", "split": "eval", "question": "  Where does Alpha Tower stand? ",
     "answer": ["Brenn", "Brenn town"]},
    {"id": "b", "split": "train", "question": "What is Cato?", "answer": "a painter"},
    {"id": "c", "split": "train", "question": "Which town is by the sea?", "answer": "Brenn"},
]
BRENN_DOCS = ("<information>Doc 1(Title: Brenn) Brenn is a town by the sea.\n"
              "Doc 2(Title: Alpha Tower) Alpha Tower stands in Brenn.\n"
              "Doc 3(Title: Delta) Delta lies near Brenn and Alpha Tower.</information>")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def env(tmp_path):
    return env_lib.make("search",
                     corpus_path=_write(tmp_path / "corpus.jsonl", PASSAGES),
                     questions_path=_write(tmp_path / "questions.jsonl", QUESTIONS))


def test_reset_gives_the_prompt_with_the_stripped_question(env):
    obs = env.reset(env_lib.Task("searchqa_0", {"data_idx": 0}))
    assert obs.endswith("\n\nQuestion: Where does Alpha Tower stand?")
    assert "<search>...</search>" in obs and "<answer> Beijing </answer>" in obs
    # AgentGym-RL's item ids carry data_idx after the last "_".
    assert env.reset(env_lib.Task("searchqa_1")).endswith("Question: What is Cato?")


def test_search_result_format(env):
    env.reset(env_lib.Task("searchqa_0", {"data_idx": 0}))
    r = env.step("<think>I need the town.</think>\n<search> Brenn </search>")
    assert (r.observation, r.reward, r.done) == (BRENN_DOCS, 0.0, False)
    assert r.info["query"] == "Brenn" and r.info["passage_ids"] == ["p1", "p0", "p3"]
    # Fewer than 3 passages share a word with the query: only those come back.
    r = env.step("<search>Alpha Tower</search>")
    assert r.observation == ("<information>Doc 1(Title: Alpha Tower) Alpha Tower stands in "
                             "Brenn.\nDoc 2(Title: Delta) Delta lies near Brenn and Alpha "
                             "Tower.</information>")
    # No word in common (stopwords only): an empty block. AgentGym's dense index always
    # returns 3 passages; this depends on the corpus and index.
    r = env.step("<search>what is the</search>")
    assert (r.observation, r.reward, r.done) == ("<information></information>", 0.0, False)


def test_wrong_answer_goes_on(env):
    env.reset(env_lib.Task("searchqa_0", {"data_idx": 0}))
    r = env.step("<think>Maybe Delta.</think><answer>Delta</answer>")
    assert (r.observation, r.reward, r.done) == (INCORRECT, 0.0, False)
    assert r.observation == "Sorry, your answer is incorrect. Please try again."
    assert not r.info["success"]
    # Normalisation keeps the words: "Brenn town" is a gold answer, "town of Brenn" is not.
    r = env.step("<answer>town of Brenn</answer>")
    assert (r.observation, r.reward, r.done) == (INCORRECT, 0.0, False)


def test_right_answer_after_normalising(env):
    env.reset(env_lib.Task("searchqa_0", {"data_idx": 0}))
    # lower case, "!" dropped, the article dropped, spaces collapsed: "brenn town"
    r = env.step("<answer>  The   BRENN   town! </answer>")
    assert (r.observation, r.reward, r.done) == (CORRECT, 1.0, True)
    assert r.observation == "Congratulations! You have answered the question correctly."
    assert r.info["success"] and r.info["answer"] == "The   BRENN   town!"
    after = env.step("<answer>Brenn</answer>")
    assert after.done and after.reward == 0.0 and after.info["invalid_action"]
    env.reset(env_lib.Task("searchqa_1", {"data_idx": 1}))  # gold "a painter" -> "painter"
    assert env.step("<answer>Painter.</answer>").reward == 1.0


def test_first_pair_acts(env):
    env.reset(env_lib.Task("searchqa_0", {"data_idx": 0}))
    # A search before the answer: the search acts, the answer is ignored.
    r = env.step("<search>Brenn</search> and then <answer>Brenn</answer>")
    assert (r.observation, r.reward, r.done) == (BRENN_DOCS, 0.0, False)
    # An answer first: it acts, the later search does not.
    r = env.step("<answer>Delta</answer>\n<search>Brenn</search>")
    assert (r.observation, r.reward, r.done) == (INCORRECT, 0.0, False)
    # The answer checked is the LAST <answer>, not the first one.
    r = env.step("<answer>Delta</answer> no, rather <answer>Brenn</answer>")
    assert (r.observation, r.reward, r.done) == (CORRECT, 1.0, True)


def test_pairs_need_matching_tags(env):
    env.reset(env_lib.Task("searchqa_2", {"data_idx": 2}))
    # <search> closed by </answer> is no pair; the first complete pair is the answer.
    r = env.step("<search>Cato</answer> <answer>\nBrenn\n</answer>")
    assert (r.observation, r.reward, r.done) == (CORRECT, 1.0, True)
    env.reset(env_lib.Task("searchqa_2", {"data_idx": 2}))
    for reply in ("It is Brenn.", "<Search>Brenn</Search>", "<search>Brenn", "search[Brenn]"):
        r = env.step(reply)
        assert (r.observation, r.reward, r.done) == (INVALID, 0.0, False), reply
        assert r.info["invalid_action"]


def test_parsing_helpers():
    assert acting_pair("x <answer> a </answer> <search>q</search>") == ("answer", "a")
    assert acting_pair("<search>\nmulti\nline\n</search>") == ("search", "multi\nline")
    assert acting_pair("nothing") == (None, "")
    assert last_answer("<answer>1</answer><answer> 2 </answer>") == "2"
    assert last_answer("<search>q</search>") is None


def test_tasks_and_indices(env):
    ts = env.tasks()
    assert ts.get("all", 2) == env_lib.Task("searchqa_2", {"data_idx": 2})
    assert ts.get("all", 2).data == {"data_idx": 2}
    assert [ts.get("train", i).data["data_idx"] for i in range(ts.size("train"))] == [1, 2]
    assert [ts.get("eval", i).task_id for i in range(ts.size("eval"))] == ["searchqa_0"]
    with pytest.raises(IndexError, match="out of range"):
        ts.get("eval", 1)
    with pytest.raises(ValueError, match="data_idx 3 is out of range.*3 questions"):
        env.reset(env_lib.Task("searchqa_3", {"data_idx": 3}))
    with pytest.raises(ValueError, match="searchqa_7"):
        env.reset(env_lib.Task("question-a"))


def test_conversation_start(env):
    user, assistant = env.conversation_start()
    assert user == {"role": "user", "content": INSTRUCTION}
    assert assistant == {"role": "assistant", "content": "Ok."} and ACK == "Ok."
    assert "<search>...</search>" in INSTRUCTION and "<information>" in INSTRUCTION
    assert SearchEnv.system_prompt == "" and env.system_prompt == ""
    assert env.agentgym_name == "searchqa"  # what the env server reads


def test_shipped_corpus():
    """The default data (rl_tpu/envs/data): question 0 asks for Mys Dehaes's profession,
    `apothecary`; only the passage about Mys Dehaes has both words of the name."""
    env = env_lib.make("searchqa_agentgym")  # the old name: an alias of "search"
    assert isinstance(env, SearchEnv) and env.actions == "tags"
    assert env.tasks().size("all") == 100
    obs = env.reset(env.tasks().get("all", 0))
    assert obs.endswith("Question: What is the profession of Mys Dehaes?")
    r = env.step("<think>Look it up.</think><search>Mys Dehaes</search>")
    assert r.observation.startswith("<information>Doc 1(Title: Mys Dehaes) ")
    assert "apothecary" in r.observation and r.observation.endswith("</information>")
    r = env.step("<answer>Apothecary.</answer>")
    assert (r.observation, r.reward, r.done) == (CORRECT, 1.0, True)
