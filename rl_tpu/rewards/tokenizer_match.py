"""Whether a reward model reads the policy's token ids as the policy means them.

A reward model (`reward.model_path`, or the servers of `reward.urls`) scores a trajectory's
token ids as they are: nothing is re-tokenized on the way. Were its tokenizer another's (a
model of another family), every id would stand for some other text, and the rewards would be
finite, smooth and meaningless. So at a run's start the policy's tokenizer and the reward
model's are compared, and a mismatch is refused with one error naming both. (A judge,
`reward.judge_model_path`, reads the transcript's text with its own tokenizer: it is the one
re-tokenising path, and needs no such match.)

The comparison is a `fingerprint` each side can compute and a reward server can report in its
/get_model_info: the vocabulary's size, the special tokens' ids, and the ids of a probe text
that exercises words, numbers, code, whitespace runs, accents, CJK and emoji. Two tokenizers
match when the probe encodes to the same ids, each of the policy's special tokens has the
same id in the reward model's, and the reward model's vocabulary holds the policy's (a
reward model whose tokenizer only added tokens, a pad token say, still reads every id the
policy writes as the policy does).
"""

from __future__ import annotations

from typing import Optional

from rl_tpu.models.tokenizer import ChatTokenizer

PROBE = ("The quick brown fox jumps over 13 lazy dogs; 2 + 2 = 4, 3.14159, 1e-9, -42.\n\n"
         "def area(r):\n    return 3.14 * r ** 2  # comment\n\t{\"key\": [1, 2, 3]}\n"
         "Naïve café, Größe, résumé, Ελληνικά, русский, 日本語のテキスト, 数学题, 한국어, "
         "emoji 🙂🚀, symbols ±×÷≤≥→∑√∞ and    several     spaces.\n"
         "<think>Let me check: 17 * 23 = 391.</think> The answer is \\boxed{391}.")


def fingerprint(tokenizer: ChatTokenizer) -> dict:
    """What `check_match` compares (JSON-able: a reward server sends it)."""
    hf = tokenizer.hf
    specials = sorted(set(hf.all_special_tokens))
    return {"vocab_size": tokenizer.vocab_size,
            "special_ids": dict(zip(specials, (int(i) for i in
                                               hf.convert_tokens_to_ids(specials)))),
            "probe_ids": [int(i) for i in tokenizer.encode(PROBE)]}


def mismatch(policy: dict, reward: dict) -> Optional[str]:
    """What differs between two fingerprints (policy's, reward model's), or None."""
    if reward.get("probe_ids") != policy["probe_ids"]:
        got, want = reward.get("probe_ids") or [], policy["probe_ids"]
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                  min(len(got), len(want)))
        return (f"a probe text encodes to {len(want)} ids with the policy's tokenizer and "
                f"{len(got)} with the reward model's, first differing at id {at} "
                f"({want[at:at + 4]} vs {got[at:at + 4]})")
    special = reward.get("special_ids") or {}
    for token, id_ in policy["special_ids"].items():
        if special.get(token) != id_:
            return (f"the policy's special token {token!r} is id {id_}, the reward model's "
                    f"{special.get(token)}")
    if int(reward.get("vocab_size") or 0) < policy["vocab_size"]:
        return (f"the reward model's vocabulary has {reward.get('vocab_size')} ids, fewer "
                f"than the policy's {policy['vocab_size']}")
    return None


def check_match(policy: ChatTokenizer, reward: dict, where: str) -> None:
    """ValueError naming `where` (the config key of the reward model) when the reward model's
    tokenizer, by its fingerprint `reward`, is not the policy's."""
    different = mismatch(fingerprint(policy), reward)
    if different:
        raise ValueError(
            f"{where}: the reward model's tokenizer is not the policy's ({different}). A reward "
            "model scores the policy's token ids as they are (nothing is re-tokenized), so it "
            "must share the policy's tokenizer: use a reward model trained from the policy's "
            "family, or a judge (reward.judge_model_path), which reads the text with its own "
            "tokenizer")
