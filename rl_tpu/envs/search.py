"""Deep-Search style question answering over a local corpus (AgentGym-RL's search env, offline).

The agent sees a question and acts with two commands:

    search[<query>]   -> the top-k passages of a BM25 index over the corpus
    answer[<text>]    -> ends the episode; reward 1.0 on an exact match (after SQuAD-style
                         normalisation) or the token F1 when `reward="f1"`

The default data is the synthetic corpus shipped in `rl_tpu/envs/data/` (invented entities,
written by `make_search_data.py`): a pretrained model cannot know the answers, so the only way
to a reward is to search, and two-hop questions need a second search for the bridge entity.
Any other corpus works: JSONL passages `{"id", "title", "text"}` and questions
`{"id", "split", "question", "answer"}` (answer may also be a list of accepted strings).

`SearchOracle` is a scripted policy that follows each question's `hops` (search the entity,
check the passage it expects is among the results and says what it expects, search the bridge,
answer). It is the demonstration the tests measure, and a check that retrieval works.
"""

from __future__ import annotations

import collections
import json
import math
import re
import string
from pathlib import Path
from typing import Optional, Sequence

from rl_tpu.envs.base import Env, StepResult, Task, TaskSource, invalid_action, register

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_CORPUS = DATA_DIR / "search_corpus.jsonl"
DEFAULT_QUESTIONS = DATA_DIR / "search_questions.jsonl"

SYSTEM_PROMPT = """You answer questions by searching a document collection.
Each turn, think briefly, then end your reply with exactly one action:
  search[<query>]   look up passages; you get the top results back
  answer[<answer>]  give the final answer (a short phrase: a name, a year, a place); this ends the episode
Search for the entities the question names. When a passage names another entity you need to know
more about, search for that one. Example: search[Mount Keldor]  then  answer[1842]"""

# Words that carry no retrieval signal; dropping them keeps "in what year was X born" from
# matching every passage that contains "was" and "in".
_STOPWORDS = frozenset(
    "a an and are as at be by did does for from had has have he her his how in into is it its "
    "of on or she that the their them they this to was were what when where which who whom "
    "whose why with".split())
_TOKEN = re.compile(r"[a-z0-9]+")
_PUNCTUATION = frozenset(string.punctuation)
_ACTION = re.compile(r"\b(search|answer)\s*\[", re.IGNORECASE)


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric tokens without stopwords (the BM25 vocabulary)."""
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOPWORDS]


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def read_jsonl(path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no} is not valid JSON: {e}") from None
    return rows


class BM25Index:
    """BM25 over passages, title and text indexed together (a search for an entity's name
    finds its own passage first).

    Written here rather than taken from rank_bm25: its Okapi idf, log((N - n + .5) / (n + .5)),
    is zero or negative for a term in half the passages or more, so on a small corpus a search
    for a word that is in 1 of 2 passages matches nothing. This uses Lucene's idf,
    log(1 + (N - n + .5) / (n + .5)), which is always positive.
    """

    def __init__(self, passages: Sequence[dict], k1: float = 1.2, b: float = 0.75):
        if not passages:
            raise ValueError("the search corpus is empty")
        self.passages = list(passages)
        self.k1, self.b = k1, b
        docs = [tokenize(f"{p.get('title', '')} {p['text']}") for p in self.passages]
        self._lengths = [len(d) for d in docs]
        self._avg_len = max(1e-9, sum(self._lengths) / len(docs))
        self._postings: dict[str, dict[int, int]] = collections.defaultdict(dict)
        for i, doc in enumerate(docs):
            for term, tf in collections.Counter(doc).items():
                self._postings[term][i] = tf
        n_docs = len(docs)
        self._idf = {t: math.log(1.0 + (n_docs - len(p) + 0.5) / (len(p) + 0.5))
                     for t, p in self._postings.items()}

    def scores(self, query: str) -> dict[int, float]:
        """Passage index -> BM25 score, for passages sharing at least one term with the query."""
        out: dict[int, float] = collections.defaultdict(float)
        for term in tokenize(query):
            for i, tf in self._postings.get(term, {}).items():
                norm = tf + self.k1 * (1 - self.b + self.b * self._lengths[i] / self._avg_len)
                out[i] += self._idf[term] * tf * (self.k1 + 1) / norm
        return out

    def search(self, query: str, k: int) -> list[tuple[dict, float]]:
        """Top-k matching passages, best first (ties broken by corpus order)."""
        scores = self.scores(query)
        best = sorted(scores, key=lambda i: (-scores[i], i))[:k]
        return [(self.passages[i], scores[i]) for i in best]


def parse_action(text: str) -> tuple[Optional[str], str]:
    """(kind, argument) of the last `search[...]` / `answer[...]` in `text`, or (None, why).

    The last command counts because models reason first and act at the end; the argument
    runs to the bracket that balances the opening one, so `answer[[1, 2]]` keeps its list.
    """
    matches = list(_ACTION.finditer(text))
    if not matches:
        return None, ("no action found; end your reply with search[<query>] or "
                      "answer[<answer>]")
    m = matches[-1]
    depth, start = 1, m.end()
    for i in range(start, len(text)):
        if text[i] == "[":
            depth += 1
        elif text[i] == "]":
            depth -= 1
            if depth == 0:
                return m.group(1).lower(), text[start:i].strip()
    return None, f"{m.group(1).lower()}[ has no closing ']'"


class SearchTasks(TaskSource):
    """Questions by their `split` field; ids are the questions' own."""

    def __init__(self, questions: Sequence[dict]):
        self._by_split = {s: [q for q in questions if q.get("split", "train") == s]
                          for s in self.splits}

    def size(self, split: str) -> int:
        self.check_split(split)
        return len(self._by_split[split])

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        q = self._by_split[split][index]
        return Task(task_id=str(q["id"]), data=dict(q))


@register("search")
class SearchEnv(Env):
    """Question answering with `search[...]` over a local BM25 index and `answer[...]`."""

    name = "search"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, corpus_path: Optional[str] = None,
                 questions_path: Optional[str] = None, top_k: int = 3,
                 reward: str = "em", max_steps: Optional[int] = None,
                 max_query_chars: int = 300, max_passage_chars: int = 600):
        if reward not in ("em", "f1"):
            raise ValueError(f"reward must be 'em' (exact match) or 'f1' (token F1), got {reward!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.corpus_path = Path(corpus_path or DEFAULT_CORPUS)
        self.questions_path = Path(questions_path or DEFAULT_QUESTIONS)
        for path, what in ((self.corpus_path, "corpus"), (self.questions_path, "questions")):
            if not path.exists():
                raise FileNotFoundError(
                    f"search {what} file {path} does not exist; pass {what}_path= a JSONL file "
                    f"(or regenerate the default with rl_tpu/envs/data/make_search_data.py)")
        self.index = BM25Index(read_jsonl(self.corpus_path))
        self.questions = read_jsonl(self.questions_path)
        for q in self.questions:
            missing = {"id", "question", "answer"} - set(q)
            if missing:
                raise ValueError(f"{self.questions_path}: question {q} lacks fields {sorted(missing)}")
        self._by_id = {str(q["id"]): q for q in self.questions}
        self._tasks = SearchTasks(self.questions)
        self.top_k, self.reward, self.max_steps = top_k, reward, max_steps
        self.max_query_chars, self.max_passage_chars = max_query_chars, max_passage_chars
        self._question: Optional[dict] = None
        self._steps, self._done = 0, True

    def tasks(self) -> SearchTasks:
        return self._tasks

    def reset(self, task: Task) -> str:
        question = dict(task.data) if "question" in task.data else self._by_id.get(task.task_id)
        if question is None or "answer" not in question:
            raise ValueError(f"unknown search task {task.task_id!r}: give its question and "
                             f"answer in task.data or use an id from {self.questions_path}")
        self._question, self._steps, self._done = question, 0, False
        return f"Question: {question['question']}"

    def step(self, action: str) -> StepResult:
        if self._question is None or self._done:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        self._steps += 1
        result = self._apply(action if isinstance(action, str) else str(action))
        if not result.done and self.max_steps is not None and self._steps >= self.max_steps:
            # Out of turns without an answer: the episode fails, and says so.
            result = StepResult(result.observation + f"\nNo steps left ({self.max_steps}); "
                                "the episode ends without an answer.", 0.0, True,
                                {**result.info, "success": False, "truncated": True})
        self._done = result.done
        return result

    def _apply(self, action: str) -> StepResult:
        kind, arg = parse_action(action)
        if kind is None:
            return invalid_action(arg)
        if not arg:
            return invalid_action(f"{kind}[] is empty; put the {'query' if kind == 'search' else 'answer'} "
                                  "between the brackets")
        if len(arg) > self.max_query_chars:
            return invalid_action(f"the {kind} text is {len(arg)} characters; keep it under "
                                  f"{self.max_query_chars}")
        if kind == "search":
            return self._search(arg)
        return self._answer(arg)

    def _search(self, query: str) -> StepResult:
        hits = self.index.search(query, self.top_k)
        if not hits:
            return StepResult(f"No passages match {query!r}. Try the exact name of an entity "
                              "from the question.", 0.0, False, {"num_results": 0})
        lines = [f"Search results for {query!r}:"]
        for rank, (passage, _) in enumerate(hits, 1):
            text = passage["text"]
            if len(text) > self.max_passage_chars:
                text = text[: self.max_passage_chars] + " ..."
            title = passage.get("title")
            lines.append(f"[{rank}] {title}: {text}" if title else f"[{rank}] {text}")
        return StepResult("\n".join(lines), 0.0, False,
                          {"num_results": len(hits), "passage_ids": [p.get("id") for p, _ in hits]})

    def _answer(self, prediction: str) -> StepResult:
        golds = self._question["answer"]
        golds = [str(g) for g in golds] if isinstance(golds, list) else [str(golds)]
        em = max(exact_match(prediction, g) for g in golds)
        f1 = max(token_f1(prediction, g) for g in golds)
        reward = em if self.reward == "em" else f1
        verdict = "correct" if em else "incorrect"
        return StepResult(f"Your answer {prediction!r} is {verdict}.", reward, True,
                          {"success": bool(em), "em": em, "f1": f1, "gold": golds[0]})


class SearchOracle:
    """Scripted policy over a question's `hops`: one `search[...]` per hop, then the answer.

    It reads the results: a hop counts only when the passage it needs is among the ones
    returned and contains the evidence (the bridge entity, or the answer on the last hop), so
    a retrieval failure shows up as a wrong answer rather than being papered over.
    """

    def __init__(self, task: Task):
        if not task.data.get("hops"):
            raise ValueError(f"task {task.task_id!r} has no 'hops': the oracle needs them")
        self.hops = task.data["hops"]
        self._hop, self._found = 0, True

    def act(self, observation: str) -> str:
        if self._hop > 0:
            # Check the previous search returned the expected passage with its evidence.
            hop = self.hops[self._hop - 1]
            block = _result_block(observation, hop["title"])
            self._found = self._found and block is not None and hop["evidence"] in block
        if self._hop < len(self.hops):
            self._hop += 1
            return f"search[{self.hops[self._hop - 1]['query']}]"
        return f"answer[{self.hops[-1]['evidence'] if self._found else 'unknown'}]"


def _result_block(observation: str, title: str) -> Optional[str]:
    """The text of the result titled `title` in a search observation, if present."""
    for line in observation.splitlines():
        m = re.match(r"\[\d+\] (.*?): (.*)", line)
        if m and m.group(1) == title:
            return m.group(2)
    return None
