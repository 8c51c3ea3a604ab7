"""Search: answer questions by searching a local corpus (AgentGym's "Deep Search" / SearchQA).

Env "search" (aliases "searchqa_agentgym", "searchqa"). Its default is AgentGym's SearchQA
protocol, so results compare with AgentGym-RL's; `actions="brackets"` is rl_tpu's own command
style. Retrieval is the same in both: BM25 over the corpus, title and text indexed together.
AgentGym's server retrieves from an e5 dense index over Wikipedia 2018, which is not available
here, so which passages come back differs from AgentGym's; the protocol does not.

Default (`actions="tags"`, AgentGym's). `step` takes the model's whole reply; the FIRST complete
`<search>...</search>` or `<answer>...</answer>` pair (tags lower-case, content may span lines)
decides what happens:
  search  the stripped content is the query; the observation is `<information>Doc 1(Title: t)
          text\\nDoc 2(Title: t) text\\n...</information>` with the top `top_k` (3) passages
          (fewer when fewer share a word with the query); reward 0, not done.
  answer  the content of the LAST `<answer>` pair is checked. Right when, normalised (lower
          case, punctuation and a/an/the dropped, spaces collapsed), it equals a normalised gold
          answer: reward 1, done, CORRECT. Else reward 0, NOT done, INCORRECT (try again).
  neither INVALID (how to write an action); reward 0, not done.
The first user turn is AgentGym's instruction and the assistant acknowledges "Ok."
(`conversation_start`); the first observation is AgentGym's prompt with the question.

Option `actions="brackets"` (rl_tpu's): a system prompt states the commands `search[<query>]`
and `answer[<text>]`; the LAST command in the reply acts (its argument runs to the balancing
bracket); observations are `Question: ...` and `[k] Title: text` result lists; an answer ENDS
the episode, right or wrong; malformed commands are `Invalid action: ...` observations.
Option `actions="tools"` (function calling): search is a tool (`tools`: one JSON schema,
`search(query)`) that the chat template states to the model; the model calls it in its
template's call format (`call_format`: "hermes" for Qwen2.5's `<tool_call>` JSON, "llama3_json"
for Llama 3.1's bare JSON object; `rl_tpu.tools.call_format_of(tokenizer)` tells which), and
the results come back as role "tool" messages (`info["observation_messages"]`, `[k] Title:
text` lines) that the agent loop appends through the template. A reply without a call is the
answer: it ENDS the episode, right or wrong, as in the brackets style; a malformed call, an
unknown tool or bad arguments are error results in a tool message; the episode goes on.
Other options: `reward="f1"` (token F1 instead of exact match; success is still exact match),
`top_k`, `max_steps` (the step that uses them up ends the episode unsuccessfully; AgentGym's
server has no limit and AgentGym-RL's loop stops after 5 turns to train, 30 to evaluate),
`corpus_path` / `questions_path` (JSONL passages `{"id", "title", "text"}` and questions
`{"id", "split", "question", "answer"}`, answer a string or a list of accepted strings).

The default data is the synthetic corpus in `rl_tpu/envs/data/` (invented entities, written by
`make_search_data.py`): a pretrained model cannot know the answers, so the only way to a reward
is to search, and two-hop questions need a second search for the bridge entity.

Tasks: data_idx indexes the questions file; task i is `Task(f"searchqa_{i}", {"data_idx": i})`
(AgentGym-RL's item ids: data_idx is the int after the last `_`). Splits `train` / `eval` hold
the data_idx whose question's `split` is train / eval, ascending; `all` is every question
(index == data_idx). A task may instead carry its own `question` and `answer` in its data.

`SearchOracle` is a scripted policy in the brackets style that follows a question's `hops`
(search the entity, check the expected passage and evidence came back, search the bridge,
answer): the demonstration the tests measure, and a check that retrieval works.
"""

from __future__ import annotations

import collections
import json
import math
import re
import string
from pathlib import Path
from typing import Optional, Sequence

from rl_tpu.core.env import Env, StepResult, Task, TaskSource, invalid_action, register
from rl_tpu.tools.builtins import search_tool
from rl_tpu.tools.calls import CALL_FORMATS, parse_tool_calls
from rl_tpu.tools.env import run_reply_calls
from rl_tpu.tools.registry import ToolRegistry

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_CORPUS = DATA_DIR / "search_corpus.jsonl"
DEFAULT_QUESTIONS = DATA_DIR / "search_questions.jsonl"
ACTION_STYLES = ("tags", "brackets", "tools")
TRAIN_TURNS, EVAL_TURNS = 5, 30  # AgentGym-RL's turn limits for SearchQA

ACK = "Ok."

# Written for rl_tpu: the tag protocol AgentGym's SearchQA uses.
INSTRUCTION = ("Think inside <think>...</think> before anything else. When you are missing "
               "knowledge, write a query as <search>...</search> and stop there: do not write "
               "<information> or <answer> yourself. Search results come back to you inside "
               "<information>...</information>; only then think again and go on. Take every "
               "step in this order and do not guess the answer ahead of the information.")

_PROMPT = ("Start by reasoning inside <think>...</think>. If you do not know enough, write a "
           "<search>...</search> query and then STOP; do not write <information> or <answer> "
           "yet, and wait for the results, which arrive inside <information>...</information>. "
           "With the results in hand, reason again inside <think>. When you are sure, give the "
           "final answer inside <answer>...</answer>. Give <answer> before any <information> "
           "only if you are fully sure. If you need no outside knowledge, answer directly "
           "inside <answer> and </answer> with no long explanation, e.g. <answer> Beijing "
           "</answer>. Do this every time.\n\nQuestion: {question}")

CORRECT = "Congratulations! You have answered the question correctly."
INCORRECT = "Sorry, your answer is incorrect. Please try again."
INVALID = ("Your previous action is invalid. To search, put the query between <search> and "
           "</search>. To give the final answer, put it between <answer> and </answer>. "
           "Please try again.")

BRACKETS_PROMPT = """You answer questions by searching a document collection.
Each turn, think briefly, then end your reply with exactly one action:
  search[<query>]   look up passages; you get the top results back
  answer[<answer>]  give the final answer (a short phrase: a name, a year, a place); this ends the episode
Search for the entities the question names. When a passage names another entity you need to know
more about, search for that one. Example: search[Mount Keldor]  then  answer[1842]"""

TOOLS_PROMPT = """You answer questions by searching a document collection with the search tool.
Call it with the name of an entity the question mentions; when a passage names another entity you
need to know more about, search for that one. When you know the answer, reply with the answer alone
(a short phrase: a name, a year, a place) and no tool call; that reply ends the episode."""
MAX_CALLS_PER_REPLY = 4

# Words that carry no retrieval signal; dropping them keeps "in what year was X born" from
# matching every passage that contains "was" and "in".
_STOPWORDS = frozenset(
    "a an and are as at be by did does for from had has have he her his how in into is it its "
    "of on or she that the their them they this to was were what when where which who whom "
    "whose why with".split())
_TOKEN = re.compile(r"[a-z0-9]+")
_PUNCTUATION = frozenset(string.punctuation)
_BRACKET = re.compile(r"\b(search|answer)\s*\[", re.IGNORECASE)
# The first complete pair: the opening tag's name must close it (`<search>..</answer>` is not
# a pair), and the lazy body stops at the first closing tag.
_PAIR = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def tokenize(text: str) -> list[str]:
    """Lower-cased alphanumeric tokens without stopwords (the BM25 vocabulary)."""
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOPWORDS]


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


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


def acting_pair(reply: str) -> tuple[Optional[str], str]:
    """("search" | "answer", stripped content) of the first complete tag pair, or (None, "")."""
    m = _PAIR.search(reply)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


def last_answer(reply: str) -> Optional[str]:
    """The stripped content of the last `<answer>...</answer>`; None without one."""
    found = _ANSWER.findall(reply)
    return found[-1].strip() if found else None


def bracket_action(text: str) -> tuple[Optional[str], str]:
    """(kind, argument) of the last `search[...]` / `answer[...]` in `text`, or (None, why).

    The last command counts because models reason first and act at the end; the argument
    runs to the bracket that balances the opening one, so `answer[[1, 2]]` keeps its list.
    """
    matches = list(_BRACKET.finditer(text))
    if not matches:
        return None, "no action found; end your reply with search[<query>] or answer[<answer>]"
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


def format_passages(passages: list[dict]) -> str:
    """AgentGym's `<information>` block: `Doc k(Title: t) text` per passage, one a line."""
    lines = "".join(f"Doc {k}(Title: {p.get('title', '')}) {p['text']}\n"
                    for k, p in enumerate(passages, 1))
    return f"<information>{lines.strip()}</information>"


class SearchTasks(TaskSource):
    """data_idx over the questions file; train/eval by each question's `split`."""

    splits = ("train", "eval", "all")

    def __init__(self, questions: list[dict]):
        self._members = {
            "all": list(range(len(questions))),
            **{s: [i for i, q in enumerate(questions) if q.get("split", "train") == s]
               for s in ("train", "eval")}}

    def size(self, split: str) -> int:
        self.check_split(split)
        return len(self._members[split])

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        members = self._members[split]
        if not 0 <= index < len(members):
            raise IndexError(f"search split {split!r} has {len(members)} tasks; "
                             f"index {index} is out of range")
        return Task(f"searchqa_{members[index]}", {"data_idx": members[index]})


@register("search")
class SearchEnv(Env):
    """Question answering over a local BM25 index (see the module docstring for the options)."""

    name = "search"
    system_prompt = ""  # AgentGym's instruction is the first user turn: conversation_start()

    def __init__(self, corpus_path: Optional[str] = None, questions_path: Optional[str] = None,
                 actions: str = "tags", reward: str = "em", top_k: int = 3,
                 max_steps: Optional[int] = None, max_query_chars: int = 300,
                 max_passage_chars: int = 600, call_format: str = "hermes"):
        if actions not in ACTION_STYLES:
            raise ValueError(f"actions must be one of {ACTION_STYLES} ('tags': AgentGym's "
                             f"<search>/<answer>; 'brackets': search[...]/answer[...]; 'tools': "
                             f"search as a function call), got {actions!r}")
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {CALL_FORMATS} (the policy "
                             f"tokenizer's: rl_tpu.tools.call_format_of), got {call_format!r}")
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
        self._tasks = SearchTasks(self.questions)
        self.actions, self.reward, self.top_k, self.max_steps = actions, reward, top_k, max_steps
        self.max_query_chars, self.max_passage_chars = max_query_chars, max_passage_chars
        if actions == "brackets":
            self.system_prompt = BRACKETS_PROMPT
        self.call_format = call_format
        self._registry: Optional[ToolRegistry] = None
        if actions == "tools":
            self.system_prompt = TOOLS_PROMPT
            self._registry = ToolRegistry([search_tool(self.index, top_k, max_passage_chars)])
        self._golds: Optional[list[str]] = None
        self._steps, self._done = 0, True

    def tasks(self) -> SearchTasks:
        return self._tasks

    @property
    def agentgym_name(self) -> str:
        """"searchqa" while the env plays AgentGym's protocol, else "" (the env server reads it)."""
        return "searchqa" if self.actions == "tags" else ""

    @property
    def tools(self) -> Optional[list[dict]]:
        """The search tool's schema in the tools style (the agent loop renders it into the
        prompt); None in the others."""
        return self._registry.schemas if self._registry is not None else None

    def conversation_start(self) -> Optional[list[dict]]:
        """AgentGym's opening turns (the instruction, then "Ok."); None in the brackets and
        tools styles, whose system prompt states the commands."""
        if self.actions in ("brackets", "tools"):
            return None
        return [{"role": "user", "content": INSTRUCTION}, {"role": "assistant", "content": ACK}]

    def question(self, task: Task) -> dict:
        """The task's question: its own data when it has `question` and `answer`, else the
        questions file's entry at data_idx (data["data_idx"] or the int after the id's last `_`)."""
        if "question" in task.data and "answer" in task.data:
            return dict(task.data)
        value = task.data.get("data_idx", task.task_id.rpartition("_")[2])
        if not str(value).isdigit():
            raise ValueError(f"search task {task.task_id!r}: want data {{'data_idx': i}}, an id "
                             "like 'searchqa_7', or data with its own question and answer")
        i = int(value)
        if not 0 <= i < len(self.questions):
            raise ValueError(f"search data_idx {i} is out of range: {self.questions_path} has "
                             f"{len(self.questions)} questions (0..{len(self.questions) - 1})")
        return self.questions[i]

    def reset(self, task: Task) -> str:
        question = self.question(task)
        golds = question["answer"]
        self._golds = [str(g) for g in golds] if isinstance(golds, list) else [str(golds)]
        self._steps, self._done = 0, False
        text = str(question["question"])
        if self.actions in ("brackets", "tools"):
            return f"Question: {text}"
        return _PROMPT.format(question=text.strip())

    def step(self, action: str) -> StepResult:
        if self._golds is None or self._done:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        self._steps += 1
        reply = action if isinstance(action, str) else str(action)
        play = {"brackets": self._brackets, "tools": self._function_calls, "tags": self._tags}
        result = play[self.actions](reply)
        if not result.done and self.max_steps is not None and self._steps >= self.max_steps:
            result = StepResult(result.observation + f"\nNo steps left ({self.max_steps}); "
                                "the episode ends without an answer.", 0.0, True,
                                {**result.info, "success": False, "truncated": True})
        self._done = result.done
        return result

    def _tags(self, reply: str) -> StepResult:
        kind, content = acting_pair(reply)
        if kind == "search":
            hits = self.index.search(content, self.top_k)
            return StepResult(format_passages([p for p, _ in hits]), 0.0, False,
                              {"query": content, "num_results": len(hits),
                               "passage_ids": [p.get("id") for p, _ in hits]})
        if kind == "answer":
            answer = last_answer(reply)  # the pair that acted may not be the one checked
            result = self._judge(answer)
            result.observation = CORRECT if result.done else INCORRECT
            return result
        return StepResult(INVALID, 0.0, False, {"invalid_action": True})

    def _brackets(self, reply: str) -> StepResult:
        kind, arg = bracket_action(reply)
        if kind is None:
            return invalid_action(arg)
        if not arg:
            what = "query" if kind == "search" else "answer"
            return invalid_action(f"{kind}[] is empty; put the {what} between the brackets")
        if len(arg) > self.max_query_chars:
            return invalid_action(f"the {kind} text is {len(arg)} characters; keep it under "
                                  f"{self.max_query_chars}")
        if kind == "answer":
            result = self._judge(arg)
            verdict = "correct" if result.done else "incorrect"
            result.observation, result.done = f"Your answer {arg!r} is {verdict}.", True
            return result
        hits = self.index.search(arg, self.top_k)
        if not hits:
            return StepResult(f"No passages match {arg!r}. Try the exact name of an entity "
                              "from the question.", 0.0, False, {"num_results": 0})
        lines = [f"Search results for {arg!r}:"]
        for rank, (passage, _) in enumerate(hits, 1):
            text = passage["text"]
            if len(text) > self.max_passage_chars:
                text = text[: self.max_passage_chars] + " ..."
            title = passage.get("title")
            lines.append(f"[{rank}] {title}: {text}" if title else f"[{rank}] {text}")
        return StepResult("\n".join(lines), 0.0, False,
                          {"num_results": len(hits), "passage_ids": [p.get("id") for p, _ in hits]})

    def _function_calls(self, reply: str) -> StepResult:
        parsed = parse_tool_calls(reply, self.call_format)
        if not parsed.calls and not parsed.errors:
            answer = parsed.content
            if not answer:
                return invalid_action("the reply is empty; call the search tool, or reply with "
                                      "the answer")
            result = self._judge(answer)
            verdict = "correct" if result.done else "incorrect"
            result.observation, result.done = f"Your answer {answer!r} is {verdict}.", True
            return result
        def run(call):
            if len(str(call.arguments.get("query", ""))) > self.max_query_chars:
                return self._registry.error_result(
                    f"the query is longer than {self.max_query_chars} characters", call.name)
            return self._registry.execute(call)

        results = run_reply_calls(self._registry, parsed.calls, parsed.errors,
                                  MAX_CALLS_PER_REPLY, run)
        messages = [r.as_message() for r in results]
        return StepResult("\n\n".join(m["content"] for m in messages), 0.0, False, {
            "observation_messages": messages, "tool_errors": sum(not r.ok for r in results),
            "queries": [c.arguments.get("query") for c in parsed.calls]})

    def _judge(self, answer: str) -> StepResult:
        """Reward (exact match, or token F1) and success (exact match) of an answer; done when
        it is right (the brackets style ends the episode either way)."""
        em = max(exact_match(answer, g) for g in self._golds)
        f1 = max(token_f1(answer, g) for g in self._golds)
        return StepResult("", em if self.reward == "em" else f1, bool(em),
                          {"answer": answer, "success": bool(em), "em": em, "f1": f1,
                           "gold": self._golds[0]})


register("searchqa_agentgym")(SearchEnv)
register("searchqa")(SearchEnv)


class SearchOracle:
    """Scripted brackets-style policy over a question's `hops`: one `search[...]` per hop,
    then the answer.

    It reads the results: a hop counts only when the passage it needs is among the ones
    returned and contains the evidence (the bridge entity, or the answer on the last hop), so
    a retrieval failure shows up as a wrong answer rather than being papered over.
    """

    def __init__(self, question: dict):
        if not question.get("hops"):
            raise ValueError(f"question {question.get('id')!r} has no 'hops': the oracle needs them")
        self.hops = question["hops"]
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
    """The text of the result titled `title` in a brackets-style search observation."""
    for line in observation.splitlines():
        m = re.match(r"\[\d+\] (.*?): (.*)", line)
        if m and m.group(1) == title:
            return m.group(2)
    return None
