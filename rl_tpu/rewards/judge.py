"""LLM-judge prompts and verdicts: what a judge is asked, and how its reply is read. Pure
Python, no model: the `judge_pairwise` env (rl_tpu/envs/judge.py) trains a judge with these
prompts, and a judge reward reads its replies with the same parsers.

Two kinds of judgement:

    pointwise   a question and one reply: is the reply correct?  verdict [[YES]] or [[NO]]
    pairwise    a question and replies A and B: which is better?  verdict [[A]] or [[B]]
                ([[TIE]] too, only where the prompt offers it: `allow_tie=True`)

`pointwise_messages` / `pairwise_messages` render a judgement as chat messages (a system
message stating the format, a user message with the material) for a ChatTokenizer;
`parse_pointwise` / `parse_pairwise` read the judge's reply into a `Verdict`.

The format is ONE token, the verdict word in double square brackets (MT-Bench's judge
convention), anywhere in the reply, so a judge may reason before (or after) it. The parse
rules, and why:
  - Case and spaces inside the brackets do not matter (`[[a]]`, `[[ Yes ]]`): a tokenizer's
    split or a small model's capitalisation says nothing about the judgement.
  - Every `[[word]]` in the reply is a verdict attempt. A word that is not a verdict of this
    kind (`[[C]]`, `[[MAYBE]]`, `[[TIE]]` where ties are not offered) makes the reply
    unparseable: a hedge through an unknown token is no verdict.
  - Two different verdicts (`[[A]] ... [[B]]`) are ambiguous and refused: a judge that could
    name both and be read as either would be paid for hedging. The same verdict repeated
    (`[[A]] ... so: [[A]]`) is one verdict.
  - Nothing else counts: no bare "A", "yes", "Verdict: B". Those words occur in reasoning
    ("A is wrong because ...") and reading them would score a reply by a word it did not
    mean as its verdict. A reply without the bracketed token is unparseable.
An unparseable reply is a `Verdict` whose `value` is None and whose `error` says why; it is
never silently a score (the env pays it 0 and counts it against `format_valid_rate`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence, Union

Message = dict  # {"role": str, "content": str}
Material = Union[str, Sequence[Message]]  # a text, or chat messages (a preference pair's)

POINTWISE_SYSTEM = ("You are a judge. Read the question and the reply, and decide whether the "
                    "reply is correct. Give your verdict as [[YES]] or [[NO]].")
PAIRWISE_SYSTEM = ("You are a judge. Read the question and the two replies, A and B, and "
                   "decide which reply is better. Give your verdict as [[A]] or [[B]].")
PAIRWISE_TIE_SYSTEM = ("You are a judge. Read the question and the two replies, A and B, and "
                       "decide which reply is better. Give your verdict as [[A]], [[B]], or "
                       "[[TIE]] when they are equally good.")

POINTWISE_VERDICTS = {"YES": True, "NO": False}
PAIRWISE_VERDICTS = ("A", "B")
TIE = "TIE"

# Any word in double square brackets, spaces allowed inside: every one is a verdict attempt.
_BRACKETED = re.compile(r"\[\[\s*([^\[\]\s]*)\s*\]\]")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A judge's reply read: `value` is True/False (pointwise) or "A"/"B"/"TIE" (pairwise),
    None when unparseable, with `error` saying why ("" when parsed)."""
    text: str
    value: Optional[Union[bool, str]]
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None


def render(material: Material) -> str:
    """A question or reply as the text shown to the judge: a string as it is; one message as
    its content; several as "role: content" blocks (a multi-turn prompt or reply)."""
    if isinstance(material, str):
        return material
    messages = list(material) if isinstance(material, (list, tuple)) else []
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                               and isinstance(m.get("role"), str) for m in messages):
        raise ValueError(f"a judge's question or reply is a string or a non-empty list of "
                         f"{{'role': str, 'content': str}} messages, got {material!r:.120}")
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)


def pointwise_user(question: Material, reply: Material) -> str:
    return (f"Question:\n{render(question)}\n\nReply:\n{render(reply)}\n\n"
            "Is the reply correct? Answer [[YES]] or [[NO]].")


def pairwise_user(question: Material, reply_a: Material, reply_b: Material,
                  allow_tie: bool = False) -> str:
    options = "[[A]], [[B]] or [[TIE]]" if allow_tie else "[[A]] or [[B]]"
    return (f"Question:\n{render(question)}\n\nReply A:\n{render(reply_a)}\n\n"
            f"Reply B:\n{render(reply_b)}\n\nWhich reply is better? Answer {options}.")


def pointwise_messages(question: Material, reply: Material) -> list[Message]:
    """The pointwise judgement as chat messages (system, user) for a ChatTokenizer."""
    return [{"role": "system", "content": POINTWISE_SYSTEM},
            {"role": "user", "content": pointwise_user(question, reply)}]


def pairwise_messages(question: Material, reply_a: Material, reply_b: Material,
                      allow_tie: bool = False) -> list[Message]:
    """The pairwise judgement as chat messages (system, user) for a ChatTokenizer."""
    system = PAIRWISE_TIE_SYSTEM if allow_tie else PAIRWISE_SYSTEM
    return [{"role": "system", "content": system},
            {"role": "user", "content": pairwise_user(question, reply_a, reply_b, allow_tie)}]


def _read(text, allowed: Sequence[str]) -> tuple[Optional[str], str]:
    """(the one verdict word of `text`, upper case, or None; why not) under the module's rules."""
    if not isinstance(text, str):
        return None, f"the reply is {type(text).__name__}, not text"
    words = [w.upper() for w in _BRACKETED.findall(text)]
    expected = " or ".join(f"[[{w}]]" for w in allowed)
    if not words:
        return None, f"no verdict: the reply names none of {expected}"
    unknown = sorted({w for w in words if w not in allowed})
    if unknown:
        return None, (f"[[{unknown[0]}]] is not a verdict here (one of {expected})")
    if len(set(words)) > 1:
        return None, (f"ambiguous: the reply names {len(set(words))} different verdicts "
                      f"({', '.join(f'[[{w}]]' for w in dict.fromkeys(words))})")
    return words[0], ""


def parse_pointwise(text) -> Verdict:
    """[[YES]] -> True, [[NO]] -> False, else value None with the reason (module docstring)."""
    word, error = _read(text, tuple(POINTWISE_VERDICTS))
    raw = text if isinstance(text, str) else repr(text)
    return Verdict(raw, None if word is None else POINTWISE_VERDICTS[word], error)


def parse_pairwise(text, allow_tie: bool = False) -> Verdict:
    """[[A]] -> "A", [[B]] -> "B", [[TIE]] -> "TIE" when `allow_tie`, else value None with
    the reason (module docstring)."""
    allowed = PAIRWISE_VERDICTS + ((TIE,) if allow_tie else ())
    word, error = _read(text, allowed)
    raw = text if isinstance(text, str) else repr(text)
    return Verdict(raw, word, error)
