"""Preference pairs: the JSONL format shared by DPO and reward-model training, and pairs built
from a scorer's rewards.

Each non-blank line of a pairs file is one JSON object:
    {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}
    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "chosen": [{"role": "assistant", "content": "..."}], "rejected": "...",
     "margin": 2.0, "split": "eval"}
  prompt    a non-blank string (one user message) or a non-empty list of chat messages
            {"role": str, "content": str} (earlier assistant turns may be part of it)
  chosen,   a string (one assistant message; may be empty, an empty reply can be the worse
  rejected  one) or a non-empty list of messages whose first is the assistant's (a multi-turn
            reply: assistant, tool, assistant, ...)
  margin    optional number: how strongly chosen is preferred (Llama 2's reward-model margin,
            bradley_terry_loss's `margin`); null or absent is no margin
  split     optional "train" or "eval"; null or absent is no split
Other fields are kept, as they are, in `PreferencePair.extra`. A pair whose chosen and
rejected are the same messages is an error (it teaches nothing: both sides score alike)
unless the reader is told to skip such lines.

`read_preference_pairs(path)` checks every line and raises on the first bad one, naming the
file, the line number and the field. `pairs_from_scores` makes best-vs-worst pairs from
several scored replies per prompt (an env's own scorer, a reward model);
`write_preference_pairs` writes pairs back in this format.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from pathlib import Path
from typing import Any, Sequence

from rl_tpu.data.jsonl import SPLITS, json_type_name, split_rows

Message = dict  # {"role": str, "content": str}
_OWN_FIELDS = ("prompt", "chosen", "rejected", "margin", "split")
_EXAMPLE = '{"prompt": "...", "chosen": "...", "rejected": "..."}'


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One checked pair; text fields are already chat messages, so every consumer builds the
    conversation prompt + chosen (or + rejected) the same way."""
    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    margin: float | None = None
    split: str | None = None
    extra: dict = dataclasses.field(default_factory=dict)
    where: str = ""  # "file:line" for messages about this pair; "" when not from a file

    @property
    def chosen_conversation(self) -> list[Message]:
        return self.prompt + self.chosen

    @property
    def rejected_conversation(self) -> list[Message]:
        return self.prompt + self.rejected

    def to_row(self) -> dict:
        """The JSONL object of this pair (messages kept as lists, optional fields only when
        set), which `parse_preference_line` reads back to an equal pair."""
        row: dict[str, Any] = {**self.extra, "prompt": self.prompt, "chosen": self.chosen,
                               "rejected": self.rejected}
        if self.margin is not None:
            row["margin"] = self.margin
        if self.split is not None:
            row["split"] = self.split
        return row


def _messages(where: str, field: str, value: Any, *, reply: bool) -> list[Message]:
    """A prompt or reply as a checked message list (a string is one message)."""
    if isinstance(value, str):
        if not reply and not value.strip():
            raise ValueError(f"{where}: 'prompt' is empty; every pair needs a prompt")
        return [{"role": "assistant" if reply else "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError(f"{where}: {field!r} must be a string or a list of chat messages "
                         f"{{\"role\", \"content\"}}, got {json_type_name(value)} {value!r:.80}")
    if not value:
        raise ValueError(f"{where}: {field!r} is an empty message list")
    out = []
    for i, message in enumerate(value):
        at = f"{where}: {field}[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{at} must be an object {{\"role\": ..., \"content\": ...}}, got "
                             f"{json_type_name(message)} {message!r:.80}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "nothing" if key not in message else json_type_name(message[key])
                raise ValueError(f"{at} needs a string {key!r}, got {got}")
        if not message["role"]:
            raise ValueError(f"{at} has an empty 'role'")
        out.append(dict(message))
    if reply and out[0]["role"] != "assistant":
        raise ValueError(f"{where}: {field!r} must start with the assistant's message (the "
                         f"reply being judged); its first message has role {out[0]['role']!r}")
    return out


def parse_preference_line(where: str, line: str, *,
                          skip_identical: bool = False) -> PreferencePair | None:
    """One checked pair from one JSONL line; `where` ("file:line") starts every error. With
    skip_identical, a pair whose two sides are the same gives None instead of an error."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e}); each line must be one JSON object "
                         f"like {_EXAMPLE}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a JSON {json_type_name(row)}, not an object; each line must "
                         f"be one object like {_EXAMPLE}")
    for field in ("prompt", "chosen", "rejected"):
        if field not in row:
            raise ValueError(f"{where} has no {field!r} field (it has {sorted(row)}); every "
                             "line needs a prompt, a chosen reply and a rejected reply")
    prompt = _messages(where, "prompt", row["prompt"], reply=False)
    chosen = _messages(where, "chosen", row["chosen"], reply=True)
    rejected = _messages(where, "rejected", row["rejected"], reply=True)
    if chosen == rejected:
        if skip_identical:
            return None
        raise ValueError(f"{where}: 'chosen' and 'rejected' are the same reply; such a pair "
                         "carries no preference (drop the line, or read with "
                         "skip_identical=True)")
    margin = row.get("margin")
    if margin is not None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise ValueError(f"{where}: 'margin' must be a number (or null), got "
                             f"{json_type_name(margin)} {margin!r}")
        if not math.isfinite(margin):
            raise ValueError(f"{where}: 'margin' must be finite, got {margin}")
        margin = float(margin)
    split = row.get("split")
    if split is not None and split not in SPLITS:
        raise ValueError(f"{where}: 'split' must be one of {SPLITS} (or left out), got {split!r}")
    extra = {k: v for k, v in row.items() if k not in _OWN_FIELDS}
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected, margin=margin,
                          split=split, extra=extra, where=where)


def read_preference_pairs(path: str, *, split: str | None = None,
                          skip_identical: bool = False) -> list[PreferencePair]:
    """Every pair of a JSONL file, checked, in file order (blank lines skipped). With `split`,
    only the pairs whose "split" field is that split."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"preference pairs file {file} does not exist; pass a JSONL with "
                                f"one {_EXAMPLE} object per line")
    pairs = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            pair = parse_preference_line(f"{file}:{number}", line, skip_identical=skip_identical)
            if pair is not None and (split is None or pair.split == split):
                pairs.append(pair)
    if not pairs:
        which = "" if split is None else f" with split {split!r}"
        raise ValueError(f"{file} holds no preference pairs{which}")
    return pairs


def write_preference_pairs(path: str, pairs: Sequence[PreferencePair]) -> None:
    """Pairs as a JSONL file that read_preference_pairs reads back."""
    with open(path, "w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair.to_row(), ensure_ascii=False) + "\n")


def split_pairs_file(path: str, out_path: str, eval_fraction: float = 0.0,
                     seed: int = 0) -> dict[str, int]:
    """Checks every line of a preference JSONL and writes it to `out_path` in canonical form
    (messages as lists), each pair's "split" filled in: its own, else eval for a seeded
    round(eval_fraction * n) of the pairs that name none (`jsonl.split_rows`, as tasks are
    split). Returns the pairs per split. `launch.make_dataset --pairs` runs it."""
    pairs = read_preference_pairs(path)
    rows = split_rows([{"split": p.split, "pair": p} for p in pairs], eval_fraction, seed)
    out = [dataclasses.replace(row["pair"], split=split) for split in SPLITS
           for row in rows[split]]
    write_preference_pairs(out_path, out)
    return {split: len(rows[split]) for split in SPLITS}


def _unscored(score) -> bool:
    return score is None or (isinstance(score, numbers.Real) and math.isnan(score))


def pairs_from_scores(prompts: Sequence, replies: Sequence[Sequence],
                      scores: Sequence[Sequence]) -> list[PreferencePair]:
    """Best-vs-worst pairs: for prompt i with replies[i][j] scored scores[i][j], one pair
    (highest-scored reply, lowest-scored reply). Prompts and replies take the same forms as in
    the JSONL (text or message lists).

    Per prompt: a score of None or NaN means unscored (a crashed scorer; it says nothing about
    the reply) and that reply is neither chosen nor rejected; a prompt with fewer than two
    scored replies, or whose scored replies all tie, gives no pair. Among equal best (or worst)
    scores the earliest reply is taken, so the result does not depend on sort order. The two
    scores are kept in `extra` as chosen_score and rejected_score; margin stays None (a score
    gap is in the scorer's units, not a calibrated preference strength).
    """
    if not len(prompts) == len(replies) == len(scores):
        raise ValueError(f"pairs_from_scores needs one replies list and one scores list per "
                         f"prompt; got {len(prompts)} prompts, {len(replies)} reply lists, "
                         f"{len(scores)} score lists")
    pairs = []
    for i, (prompt, group, group_scores) in enumerate(zip(prompts, replies, scores)):
        where = f"prompt {i}"
        if len(group) != len(group_scores):
            raise ValueError(f"pairs_from_scores: {where} has {len(group)} replies but "
                             f"{len(group_scores)} scores")
        scored = []
        for j, score in enumerate(group_scores):
            if _unscored(score):
                continue
            if isinstance(score, bool) or not isinstance(score, numbers.Real) or \
                    not math.isfinite(score):
                raise ValueError(f"pairs_from_scores: {where} reply {j} has score {score!r}; "
                                 "a score is a finite number, or None/NaN for unscored")
            scored.append((float(score), j))
        if len(scored) < 2:
            continue
        best = max(scored, key=lambda s: s[0])   # max/min return the first of equals
        worst = min(scored, key=lambda s: s[0])
        if best[0] == worst[0]:
            continue
        pairs.append(PreferencePair(
            prompt=_messages(where, "prompt", prompt, reply=False),
            chosen=_messages(where, f"replies[{best[1]}]", group[best[1]], reply=True),
            rejected=_messages(where, f"replies[{worst[1]}]", group[worst[1]], reply=True),
            extra={"chosen_score": best[0], "rejected_score": worst[0]}, where=where))
    return pairs
