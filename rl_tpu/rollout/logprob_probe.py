"""What a rollout server's reported logprobs are the log of, measured with one tiny request.

`GenerateResult.logprob_convention` says whether a sample's behaviour logprobs are those of the
full softmax(logits / T) ("full") or of the distribution renormalised over the top-p / top-k
tokens it was drawn from ("truncated"); the two differ by -log(kept mass) per token, which
biases importance weights if the trainer takes one for the other. Which one a server reports is
an implementation detail that has changed across SGLang versions (see sglang.py's docstring:
0.5.23 reports "full" on every backend; older releases renormalised over top-p on the
flashinfer backend) and launch settings (`SGLANG_RETURN_ORIGINAL_LOGPROB=1` makes 0.5.23 report
log_softmax(logits) *before* temperature, which no convention covers when T != 1).

So `SGLangEngine(logprob_convention="auto")` asks each server once, at first contact, with one
`POST /generate` of four one-token rows of the same prompt, each returning its top-2 logprobs
(`top_logprobs_num`, which SGLang computes from the same tensor as the sampled token's):

    A: temperature 1, no truncation   -> a1 >= a2, the reference (log p1, log p2)
    P: temperature 1, top_p = 0.05    -> the top token's logprob rises by -log Z_p if truncated
    K: temperature 1, top_k = 2       -> rises by -log(p1 + p2) if truncated
    D: temperature 0.5                -> the top-2 gap doubles if temperature-scaled

A comparison decides only when the effect it looks for is large (> 0.05 nats) next to the
numerical noise of two rows of one batch; it then picks the nearer hypothesis. Undecided
questions (a peaked next-token distribution, a server that does not return top logprobs, like
rl_tpu's own, which documents "full") fall back to "full" and temperature-scaled, the contract
of `GenerateResult`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from rl_tpu.core.engine import LOGPROB_CONVENTIONS, SamplingParams

PROBE_PROMPT = (10, 11, 12)  # SGLang's own warm-up ids: every model it serves accepts them
PROBE_TOP_P, PROBE_TOP_K, PROBE_TEMPERATURE = 0.05, 2, 0.5
_MIN_EFFECT = 0.05  # nats; below this a comparison is too close to numerical noise to decide


@dataclasses.dataclass(frozen=True)
class ServerLogprobs:
    """What one server's logprobs are the log of.

    top_p / top_k: the convention of samples drawn with that truncation ("full" | "truncated").
    temperature_scaled: False when the server reports log_softmax(logits) whatever the
      temperature (SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1).
    source: "declared" (the engine was told), "probed", or "assumed" (the probe could not
      tell; `notes` says why).
    """

    top_p: str = "full"
    top_k: str = "full"
    temperature_scaled: bool = True
    source: str = "assumed"
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("top_p", "top_k"):
            if getattr(self, name) not in LOGPROB_CONVENTIONS:
                raise ValueError(f"{name} convention {getattr(self, name)!r} not in "
                                 f"{LOGPROB_CONVENTIONS}")

    def convention(self, sp: SamplingParams) -> str:
        """The convention of a sample drawn with `sp` on this server. Untruncated and greedy
        samples are "full" (the two conventions are then the same number); a sample truncated
        by both top-p and top-k on a server that renormalises over only one of them is labelled
        "truncated", the nearer of the two."""
        if sp.greedy:
            return "full"
        if (sp.top_p < 1.0 and self.top_p == "truncated") or (
                sp.top_k >= 1 and self.top_k == "truncated"):
            return "truncated"
        return "full"

    def refuses(self, sp: SamplingParams) -> bool:
        """True when this server's logprobs for `sp` would be at the wrong temperature."""
        return not self.temperature_scaled and not sp.greedy and sp.temperature != 1.0

    def describe(self) -> str:
        scaled = "temperature-scaled" if self.temperature_scaled else (
            "NOT temperature-scaled (log_softmax(logits) whatever the temperature)")
        text = f"top-p: {self.top_p}, top-k: {self.top_k}, {scaled} ({self.source})"
        return text + (f"; {'; '.join(self.notes)}" if self.notes else "")


def declared(convention: str) -> ServerLogprobs:
    if convention not in LOGPROB_CONVENTIONS:
        raise ValueError(f"logprob_convention {convention!r}: use 'auto' or one of "
                         f"{LOGPROB_CONVENTIONS}")
    return ServerLogprobs(convention, convention, True, "declared")


def probe_body(prompt=PROBE_PROMPT) -> dict:
    """The one `/generate` request of the probe (rows A, P, K, D of the module doc)."""
    base = {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 1,
            "ignore_eos": True}
    rows = [dict(base), dict(base, top_p=PROBE_TOP_P), dict(base, top_k=PROBE_TOP_K),
            dict(base, temperature=PROBE_TEMPERATURE)]
    return {"input_ids": [list(prompt)] * len(rows), "sampling_params": rows,
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1}


def _top_logprobs(item: Any) -> Optional[dict[int, float]]:
    """token id -> logprob of the first output position's top logprobs, None if absent."""
    try:
        entries = item["meta_info"]["output_top_logprobs"][0]
        out = {int(e[1]): float(e[0]) for e in entries if e[0] is not None}
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return out if len(out) >= 1 else None


def _rise(row: Optional[dict], token: int, reference: float, expected: float,
          what: str, notes: list) -> Optional[str]:
    """"truncated" if the token's logprob rose by about `expected`, "full" if it stayed, None
    when the probe cannot tell."""
    if expected < _MIN_EFFECT:
        notes.append(f"{what}: next-token distribution too peaked to tell (-log Z = "
                     f"{expected:.3g})")
        return None
    if row is None or token not in row:
        notes.append(f"{what}: no top logprob for the probe token")
        return None
    rise = row[token] - reference
    return "truncated" if abs(rise - expected) < abs(rise) else "full"


def read_probe(reply: Any) -> ServerLogprobs:
    """Decides what the probe's reply says (module doc); undecided parts stay at the contract."""
    items = reply if isinstance(reply, list) else [reply]
    rows = [_top_logprobs(item) if isinstance(item, dict) else None for item in items]
    if len(rows) != 4 or rows[0] is None or len(rows[0]) < 2:
        return ServerLogprobs(notes=("the server returns no top logprobs (top_logprobs_num)",))
    a, p, k, d = rows
    (id1, a1), (id2, a2) = sorted(a.items(), key=lambda kv: -kv[1])[:2]
    notes: list[str] = []
    # Top-p 0.05 keeps the top token alone when p1 > 0.05 (Z = p1); otherwise a few tokens of
    # at most 0.05 each plus the last one, so Z <= 0.1: -log Z >= min(-a1, log 10).
    top_p = _rise(p, id1, a1, min(-a1, math.log(10.0)), "top-p", notes)
    top_k = _rise(k, id1, a1, -math.log(math.exp(a1) + math.exp(a2)), "top-k", notes)
    scaled = None
    gap = a1 - a2
    if gap < _MIN_EFFECT:
        notes.append(f"temperature: top-2 logprobs too close to tell (gap {gap:.3g})")
    elif d is None or id1 not in d or id2 not in d:
        notes.append("temperature: no top-2 logprobs at temperature "
                     f"{PROBE_TEMPERATURE}")
    else:
        gap_d = d[id1] - d[id2]
        scaled = abs(gap_d - gap / PROBE_TEMPERATURE) < abs(gap_d - gap)
    decided = [x for x in (top_p, top_k, scaled) if x is not None]
    return ServerLogprobs(top_p or "full", top_k or "full", True if scaled is None else scaled,
                          "probed" if decided else "assumed", tuple(notes))
