"""`word_problems`: short arithmetic word problems a small chat model half-solves, answered in
a fixed final line. The task for RL on a real instruct model (configs/real_gsm.py): generated
from a seed (nothing downloaded), checked exactly, its difficulty set by constructor arguments.

    env = make("word_problems")             # 1-3 steps of + - x, operands 2-20, factors 2-5
    env.reset(task) -> "Mia has 12 dollars. She earns 7 dollars walking dogs. ... How many
                        dollars does Mia have now?\nEnd your reply with a line `Answer: N`."
    env.step("12 + 7 = 19 ...\\nAnswer: 19")   -> reward 1.0, done, success

A problem is a start value and `steps` operations on a running amount (add, take away, or
multiply by a small factor), phrased in one of several templates (shopping, baking, a walk, ages,
reading, a bus, a farm, a jar of marbles), each sentence saying exactly one operation, so the
answer is the chain worked left to right; a subtraction never takes more than there is, so every
answer is a positive integer. Difficulty: `min_steps`/`max_steps` (operations a problem),
`min_operand`/`max_operand` (what is added or taken away, and the start), `max_factor` (the
largest multiplier, 1 = no multiplication).

The reply is scored by its LAST line holding `Answer:` (any case): the rest of that line must be
one integer (commas as thousands separators, a leading `$` or `-`, a trailing period, `*` of
markdown bold around it); it is right when it equals the answer exactly. No such line, or a
line that holds something else, is a format failure: reward 0, `info["format_failed"]` True (the
eval reports the rate as eval/format_failed). Only ASCII digits count.

`lenient=True` also scores a reply without that line by its last "the answer is N" (units may
follow), still counting it a format failure: SmolLM2-135M-Instruct, asked for the line, often
ends "The answer is 40 km." instead, and the strict checker alone would pay it nothing.

A reply is model output: any length, any characters. The scan is linear (no pattern holds two
optional runs of spaces side by side, which backtrack quadratically) and never converts a
number to an int (a number of 10^5 digits compares as text), so it costs milliseconds a
megabyte and never raises.

Split: a problem belongs to eval when a stable hash (SHA-256) of its text falls in the eval
share (`eval_share`), else to train; task i of a split draws from `Random(split_seed + i)` until
its text lands in its split, so the same text is never in both and task i is the same every
time. The eval split holds `eval_size` (500) problems.

The teacher (`teacher_reply`, for SFT demos) writes the worked chain, one operation a line, and
its final `Answer:` line; with probability 1 - `skill` that final answer is off by one.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Optional

from rl_tpu.core.env import OneReplyEnv, SeededTasks, StepResult, Task, register

# The format is asked for twice, in the system prompt and again after the problem: measured on
# SmolLM2-135M-Instruct (32 one-step problems, greedy), a longer "reason step by step" system
# prompt alone gave 1 reply in 32 with the line (success 0.03, 190-token rambles), this pair
# 6 in 32 (success 0.22 with `lenient`, 46 tokens a reply); docs/environments.md has the table.
SYSTEM_PROMPT = "Solve the math problem. Write the final answer on the last line as `Answer: N`."
INSTRUCTION = "End your reply with a line `Answer: N`."

NAMES = (("Mia", "she", "her"), ("Ben", "he", "his"), ("Ava", "she", "her"),
         ("Leo", "he", "his"), ("Zoe", "she", "her"), ("Sam", "he", "his"),
         ("Ivy", "she", "her"), ("Max", "he", "his"))
OTHERS = ("Noah", "Emma", "Liam", "Olivia", "Lucas", "Grace", "Omar", "Nina", "Kai", "Rosa")
TIMES = {2: "twice", 3: "three times", 4: "four times", 5: "five times", 6: "six times",
         7: "seven times", 8: "eight times", 9: "nine times"}

# A template: its start sentence, one sentence for each operation ({n}: the operand; {times}:
# "twice", "three times"...), the question, and the unit the worked solution names. `{P}` is
# the pronoun capitalised, `{p}` lower case, `{name}` the person. `chain` templates (ages,
# reading) name a new quantity each sentence, relative to the one before; `{who}`/`{prev}` are
# that sentence's person and the previous one.
TEMPLATES: dict[str, dict] = {
    "shopping": dict(
        start="{name} has {n} dollars in {q} wallet.",
        add="{P} earns {n} dollars walking dogs.", sub="{P} spends {n} dollars on a book.",
        mul="{P} sells some old games and ends up with {times} as much money as before.",
        question="How many dollars does {name} have now?"),
    "baking": dict(
        start="{name} bakes {n} cookies.",
        add="{P} bakes {n} more cookies.", sub="{P} gives {n} cookies to {other}.",
        mul="{P} keeps baking until {p} has {times} as many cookies as before.",
        question="How many cookies does {name} have now?"),
    "walking": dict(
        start="{name} walks {n} km north from home.",
        add="Then {p} walks {n} km further north.", sub="Then {p} walks {n} km back south.",
        mul="Then {p} keeps walking north until {p} is {times} as far from home as before.",
        question="How many km from home is {name} now?"),
    "bus": dict(
        start="A bus leaves the depot with {n} passengers.",
        add="At the next stop, {n} passengers get on.",
        sub="At the next stop, {n} passengers get off.",
        mul="At the market, so many get on that there are {times} as many passengers as before.",
        question="How many passengers are on the bus now?"),
    "farm": dict(
        start="A farmer has {n} hens.",
        add="She buys {n} more hens.", sub="She sells {n} hens at the market.",
        mul="Then the flock grows to {times} its size.",
        question="How many hens does the farmer have now?"),
    "marbles": dict(
        start="A jar holds {n} marbles.",
        add="{name} puts {n} more marbles in the jar.",
        sub="{name} takes {n} marbles out of the jar.",
        mul="{name} fills the jar until it holds {times} as many marbles as before.",
        question="How many marbles are in the jar now?"),
    "ages": dict(
        chain=True, start="{who} is {n} years old.",
        add="{who} is {n} years older than {prev}.", sub="{who} is {n} years younger than {prev}.",
        mul="{who} is {times} as old as {prev}.", question="How old is {who}?"),
    "reading": dict(
        chain=True, start="On day 1, {name} reads {n} pages.",
        add="On day {day}, {p} reads {n} more pages than on day {prev}.",
        sub="On day {day}, {p} reads {n} fewer pages than on day {prev}.",
        mul="On day {day}, {p} reads {times} as many pages as on day {prev}.",
        question="How many pages does {name} read on day {day}?"),
}
OPS = {"add": "+", "sub": "-", "mul": "x"}


def make_problem(rng: random.Random, template: str, steps: int, min_operand: int,
                 max_operand: int, max_factor: int) -> dict:
    """One problem of `template`: its text, its integer answer and the worked chain
    (op, operand, result) a step. A subtraction is drawn only when the running amount exceeds
    `min_operand` (else add or multiply), and leaves at least 1 (nobody is 0 years old)."""
    t = TEMPLATES[template]
    name, pronoun, possessive = rng.choice(NAMES)
    others = rng.sample(OTHERS, k=steps + 1)
    start = value = rng.randint(min_operand, max_operand)
    fields = dict(name=name, P=pronoun.capitalize(), p=pronoun, q=possessive,
                  other=rng.choice(OTHERS), who=others[0], n=value)
    sentences, chain = [t["start"].format(**fields)], []
    for step in range(1, steps + 1):
        ops = (["add"] + (["sub"] if value > min_operand else [])
               + (["mul"] if max_factor >= 2 else []))
        op = rng.choice(ops)
        if op == "add":
            operand = rng.randint(min_operand, max_operand)
            value += operand
        elif op == "sub":
            operand = rng.randint(min_operand, min(max_operand, value - 1))
            value -= operand
        else:
            operand = rng.randint(2, max_factor)
            value *= operand
        fields.update(n=operand, times=TIMES.get(operand, f"{operand} times"),
                      who=others[step], prev=others[step - 1] if template == "ages" else step,
                      day=step + 1)
        sentences.append(t[op].format(**fields))
        chain.append((OPS[op], operand, value))
    fields.update(who=others[steps], day=steps + 1)
    text = " ".join(sentences + [t["question"].format(**fields)])
    return {"question": text, "answer": value, "start": start, "chain": chain,
            "template": template}


def split_of(text: str, eval_share: float) -> str:
    """"eval" or "train", by a stable hash of the problem's text (the same on every machine)."""
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2 ** 64
    return "eval" if bucket < eval_share else "train"


class WordProblemTasks(SeededTasks):
    """Problems whose text hashes into their split (module docstring); task i of a split is
    the first draw of `Random(split_seed + i)` that does."""

    MAX_DRAWS = 10_000  # a split the settings can (almost) never reach is an error, not a hang

    def __init__(self, min_steps: int, max_steps: int, min_operand: int, max_operand: int,
                 max_factor: int, templates: tuple, eval_share: float, train_seed: int,
                 eval_seed: int, train_size: int, eval_size: int):
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"steps {min_steps}..{max_steps}: need 1 <= min_steps <= max_steps")
        if not 1 <= min_operand <= max_operand:
            raise ValueError(f"operands {min_operand}..{max_operand}: need 1 <= min <= max")
        if max_factor < 1:
            raise ValueError(f"max_factor={max_factor}: 1 turns multiplication off, >= 2 on")
        unknown = sorted(set(templates) - set(TEMPLATES))
        if unknown or not templates:
            raise ValueError(f"templates {list(templates)}: pick from {sorted(TEMPLATES)}")
        if not 0.0 < eval_share < 1.0:
            raise ValueError(f"eval_share={eval_share} must be in (0, 1)")
        self.settings = (min_steps, max_steps, min_operand, max_operand, max_factor)
        self.templates, self.eval_share = tuple(templates), eval_share
        super().__init__("word_problems", self._draw, train_seed, eval_seed, train_size,
                         eval_size)

    def _draw(self, rng: random.Random, split: str, index: int) -> dict:
        min_steps, max_steps, lo, hi, max_factor = self.settings
        for _ in range(self.MAX_DRAWS):
            problem = make_problem(rng, rng.choice(self.templates),
                                   rng.randint(min_steps, max_steps), lo, hi, max_factor)
            if split_of(problem["question"], self.eval_share) == split:
                return problem
        raise ValueError(f"no {split} problem in {self.MAX_DRAWS} draws for task {index}: "
                         "the settings allow too few distinct problems; widen the operand range "
                         "or the steps")


# The reply's final line: an integer alone (commas between groups of three, a leading $ or -,
# a trailing period, markdown bold around it). Only ASCII digits. No whitespace inside the
# pattern: two optional runs of it side by side would backtrack quadratically on a line of
# megabytes of spaces (the line is stripped first instead).
_NUMBER = re.compile(r"(-?)\$?(-?)([0-9]+(?:,[0-9]{3})*)", re.ASCII)
_MARKER = "answer:"
INFO_CHARS = 40  # a parsed answer kept in info (and logs) at most this long


def parse_answer(reply: str) -> Optional[str]:
    """The integer the reply's last `Answer:` line states, as canonical text ("-1234"), or
    None when that line holds no integer alone or there is no such line (a format failure)."""
    if not isinstance(reply, str):
        return None
    at = reply.lower().rfind(_MARKER)
    if at < 0:
        return None
    line = _line_after(reply, at + len(_MARKER))
    core = line.strip().strip("*").strip().rstrip(".").rstrip("*").strip()
    match = _NUMBER.fullmatch(core)
    if match is None or (match.group(1) and match.group(2)):
        return None
    return _canonical(bool(match.group(1) or match.group(2)), match.group(3))


# `lenient`'s fallback: "the answer is 40 km." (the number, then anything but more of a number)
_PHRASE = "answer is"
_PHRASE_NUMBER = re.compile(r"(-?)\$?([0-9]+(?:,[0-9]{3})*)(?![0-9]|[.,][0-9])", re.ASCII)


def parse_answer_phrase(reply: str) -> Optional[str]:
    """The integer after the reply's last "answer is" (any case; units or words may follow on
    its line), as `parse_answer` gives it; None when that phrase is not followed by one."""
    if not isinstance(reply, str):
        return None
    at = reply.lower().rfind(_PHRASE)
    if at < 0:
        return None
    match = _PHRASE_NUMBER.match(_line_after(reply, at + len(_PHRASE)).lstrip().lstrip("*"))
    return None if match is None else _canonical(bool(match.group(1)), match.group(2))


def _line_after(reply: str, start: int) -> str:
    """The rest of the line that `start` is on."""
    end = reply.find("\n", start)
    return reply[start:end if end >= 0 else len(reply)]


def _canonical(negative: bool, digits: str) -> str:
    """An integer's text without commas or leading zeros ("-0" is "0")."""
    digits = digits.replace(",", "").lstrip("0") or "0"
    return ("-" if negative and digits != "0" else "") + digits


def worked_solution(task: Task, answer: Optional[int] = None) -> str:
    """The chain worked a step a line, ending `Answer: <answer>` (the true one by default)."""
    chain, value = task.data["chain"], task.data["start"]
    lines = []
    for op, operand, result in chain:
        lines.append(f"{value} {op} {operand} = {result}")
        value = result
    final = task.data["answer"] if answer is None else answer
    return "\n".join(lines + [f"Answer: {final}"])


def teacher_reply(task: Task, rng: random.Random, skill: float) -> str:
    """The worked solution, its final answer right with probability `skill`, else off by one
    (never below zero)."""
    answer = task.data["answer"]
    if rng.random() < skill:
        return worked_solution(task)
    return worked_solution(task, answer + 1 if answer == 0 or rng.random() < 0.5 else answer - 1)


@register("word_problems")
class WordProblemsEnv(OneReplyEnv):
    name = "word_problems"
    system_prompt = SYSTEM_PROMPT
    needs = "answer"

    def __init__(self, min_steps: int = 1, max_steps: int = 3, min_operand: int = 2,
                 max_operand: int = 20, max_factor: int = 5,
                 templates: tuple = tuple(TEMPLATES), eval_share: float = 0.1,
                 train_seed: int = 1_000_000, eval_seed: int = 0, train_size: int = 1_000_000,
                 eval_size: int = 500, lenient: bool = False):
        self.lenient = lenient
        self._tasks = WordProblemTasks(min_steps, max_steps, min_operand, max_operand,
                                       max_factor, tuple(templates), eval_share, train_seed,
                                       eval_seed, train_size, eval_size)

    def question(self, task: Task) -> str:
        return f"{task.data['question']}\n{INSTRUCTION}"

    def teacher(self, task: Task, rng: random.Random, skill: float) -> str:
        return teacher_reply(task, rng, skill)

    def score(self, task: Task, reply: str) -> StepResult:
        gold = task.data["answer"]
        parsed = parse_answer(reply)
        format_failed = parsed is None
        if format_failed and self.lenient:
            parsed = parse_answer_phrase(reply)
        if parsed is None:
            return StepResult("No final line `Answer: N` with a number N alone; end the reply "
                              "with one.", 0.0, True,
                              {"success": False, "answer": None, "format_failed": True,
                               "gold": gold})
        shown = parsed if len(parsed) <= INFO_CHARS else parsed[:INFO_CHARS] + "..."
        info = {"answer": shown, "format_failed": format_failed, "gold": gold}
        if parsed == str(gold):
            return StepResult("Correct.", 1.0, True, {"success": True, **info})
        return StepResult(f"Not correct: the answer is {gold}.", 0.0, True,
                          {"success": False, **info})
