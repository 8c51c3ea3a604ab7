"""SearchQA as AgentGym's "Deep Search" server plays it (`searchqa_agentgym`), over rl_tpu's
local corpus.

AgentGym's server retrieves from an e5 dense index over Wikipedia 2018 (wiki-18), which is not
available here; this env keeps AgentGym's protocol (tags, observations, rewards) and searches
the BM25 index of rl_tpu's own `search` env (rl_tpu/envs/search.py, its shipped synthetic
corpus by default). Which passages come back therefore differs from AgentGym; everything else
is AgentGym's.

Protocol. `step` takes the model's whole reply. The FIRST complete `<search>...</search>` or
`<answer>...</answer>` pair in it, scanning left to right (tags lower-case, content may span
lines), decides what happens:
  search  the pair's content, stripped, is the query; the observation is
          `<information>Doc 1(Title: t) text\\nDoc 2(Title: t) text\\nDoc 3(Title: t) text
          </information>` with the top 3 passages (fewer when fewer share a word with the
          query; none: `<information></information>`); reward 0, not done.
  answer  the answer checked is the content of the LAST `<answer>...</answer>` pair in the
          reply. It is right when, normalised (lower case, punctuation and the articles a/an/
          the dropped, spaces collapsed), it equals a normalised gold answer: reward 1, done,
          `Congratulations! You have answered the question correctly.` Else reward 0, not
          done, `Sorry, your answer is incorrect. Please try again.`
  neither the observation says the action was invalid and how to write one; reward 0, not
          done.
There is no turn limit in the env (AgentGym's server has none); the agent loop's sets it
(AgentGym-RL: 5 turns to train, ScalingInter 5/8/10, 30 to evaluate).

Tasks: data_idx indexes the questions file in its order; task i is
Task(f"searchqa_{i}", {"data_idx": i}). `train` / `eval` hold the data_idx values whose
question's `split` is train / eval, ascending; `all` is the whole list (index == data_idx).
"""

from __future__ import annotations

import re
from typing import Optional

from rl_tpu.envs import search as _search
from rl_tpu.envs.base import Env, StepResult, Task, TaskSource, register

TOP_K = 3  # AgentGym's server asks its retriever for 3 passages
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

# The first complete pair: the opening tag's name must close it (`<search>..</answer>` is not
# a pair), and the lazy body stops at the first closing tag.
_PAIR = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def acting_pair(reply: str) -> tuple[Optional[str], str]:
    """("search" | "answer", stripped content) of the first complete pair, or (None, "")."""
    m = _PAIR.search(reply)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


def last_answer(reply: str) -> Optional[str]:
    """The stripped content of the last `<answer>...</answer>`; None without one."""
    found = _ANSWER.findall(reply)
    return found[-1].strip() if found else None


def format_passages(passages: list[dict]) -> str:
    """`<information>` block: `Doc k(Title: t) text` per passage, one a line."""
    lines = "".join(f"Doc {k}(Title: {p.get('title', '')}) {p['text']}\n"
                    for k, p in enumerate(passages, 1))
    return f"<information>{lines.strip()}</information>"


class SearchQAAgentGymTasks(TaskSource):
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
            raise IndexError(f"searchqa_agentgym split {split!r} has {len(members)} tasks; "
                             f"index {index} is out of range")
        i = members[index]
        return Task(f"searchqa_{i}", {"data_idx": i})


@register("searchqa_agentgym")
class SearchQAAgentGymEnv(Env):
    """AgentGym's SearchQA protocol over a local BM25 corpus."""

    name = "searchqa_agentgym"
    system_prompt = ""  # AgentGym's instruction is the first user turn: conversation_start()

    def __init__(self, corpus_path: Optional[str] = None,
                 questions_path: Optional[str] = None):
        # rl_tpu's search env reads and checks the corpus and questions and builds the index.
        local = _search.SearchEnv(corpus_path=corpus_path, questions_path=questions_path)
        self.index, self.questions = local.index, local.questions
        self.questions_path = local.questions_path
        self._tasks = SearchQAAgentGymTasks(self.questions)
        self._golds: Optional[list[str]] = None
        self._done = True

    def tasks(self) -> SearchQAAgentGymTasks:
        return self._tasks

    def conversation_start(self) -> list[dict]:
        """AgentGym's opening turns: the instruction (user), then the acknowledgement "Ok."."""
        return [{"role": "user", "content": INSTRUCTION},
                {"role": "assistant", "content": ACK}]

    def data_idx(self, task: Task) -> int:
        """data["data_idx"], else the int after the last `_` of the id (`searchqa_7`)."""
        if "data_idx" in task.data:
            i = int(task.data["data_idx"])
        else:
            tail = task.task_id.rpartition("_")[2]
            if not tail.isdigit():
                raise ValueError(f"searchqa_agentgym task {task.task_id!r}: want data "
                                 "{'data_idx': i} or an id like 'searchqa_7'")
            i = int(tail)
        if not 0 <= i < len(self.questions):
            raise ValueError(f"searchqa_agentgym data_idx {i} is out of range: "
                             f"{self.questions_path} has {len(self.questions)} questions "
                             f"(0..{len(self.questions) - 1})")
        return i

    def reset(self, task: Task) -> str:
        question = self.questions[self.data_idx(task)]
        golds = question["answer"]
        self._golds = [str(g) for g in golds] if isinstance(golds, list) else [str(golds)]
        self._done = False
        return _PROMPT.format(question=str(question["question"]).strip())

    def step(self, action: str) -> StepResult:
        if self._golds is None or self._done:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        reply = action if isinstance(action, str) else str(action)
        kind, content = acting_pair(reply)
        if kind == "search":
            hits = self.index.search(content, TOP_K)
            return StepResult(format_passages([p for p, _ in hits]), 0.0, False,
                              {"query": content, "num_results": len(hits),
                               "passage_ids": [p.get("id") for p, _ in hits]})
        if kind == "answer":
            # The pair that acted may not be the one checked: the last <answer> is.
            answer = last_answer(reply)
            norm = _search.normalize_answer(answer)
            right = any(norm == _search.normalize_answer(g) for g in self._golds)
            self._done = right
            return StepResult(CORRECT if right else INCORRECT, float(right), right,
                              {"answer": answer, "success": right, "gold": self._golds[0]})
        return StepResult(INVALID, 0.0, False, {"invalid_action": True})
