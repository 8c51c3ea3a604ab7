"""Tiny tokenizers that carry a real model family's chat template and special tokens.

Function calling is only as right as the chat template it renders through: where the tool
schemas go, how a call and its result are wrapped, which turn a tool result becomes. Tests
and smoke runs cannot download Qwen2.5's or Llama 3.1's tokenizer, so `build_family_tokenizer`
takes the tiny byte-level BPE of `rl_tpu.models.tiny_tokenizer` and dresses it as the family:

  qwen2   Qwen2 / Qwen2.5: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos), and
          `<tool_call>` / `</tool_call>` as added tokens; no bos.
  llama3  Llama 3 / 3.1: `<|begin_of_text|>` (bos, which the template writes itself),
          `<|end_of_text|>`, `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>` (eos of
          the instruct models), `<|eom_id|>`, `<|python_tag|>`.

Each family also gets its own pre-tokenizer split (the regexes the real tokenizers publish in
their tokenizer.json), because where text is cut into chunks decides whether the ids of a
conversation built turn by turn equal the ids of the whole conversation rendered at once:
Llama 3 keeps "\\n\\n" together before a "{", GPT-2's split does not.

The template text itself is the caller's (tests keep the real ones as fixtures under
tests/data/chat_templates/). The merges are the tiny corpus's, not the real model's, so ids
are not Qwen's or Llama's ids; the special tokens, the chunking and the template are.
"""

from __future__ import annotations

from typing import Sequence

import tokenizers
import transformers
from tokenizers import pre_tokenizers

from rl_tpu.models.tiny_tokenizer import build_tokenizer

# The pre-tokenizer patterns of the real tokenizers (tokenizer.json, "pre_tokenizer").
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

FAMILIES = {
    "qwen2": dict(split=_QWEN2_SPLIT, special=[], added=["<tool_call>", "</tool_call>"],
                  bos=None, eos="<|im_end|>", pad="<|endoftext|>"),
    "llama3": dict(split=_LLAMA3_SPLIT,
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                            "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                   added=[], bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>"),
}


def build_family_tokenizer(chat_template: str, family: str, vocab_size: int = 512,
                           extra_texts: Sequence[str] = ()) -> transformers.PreTrainedTokenizerFast:
    """A tiny tokenizer with `family`'s special tokens and chunking, and `chat_template`.

    Args:
      chat_template: the Jinja chat template (e.g. a model's tokenizer_config.json
        "chat_template", or its chat_template.jinja).
      family: "qwen2" or "llama3" (see the module docstring).
      vocab_size: ids in all, added tokens included (at least the tiny tokenizer's minimum
        plus the family's added tokens).
      extra_texts: more training text (as `build_tokenizer`'s), for merges a test needs.

    Raises:
      ValueError: an unknown family, or an empty template.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; known: {sorted(FAMILIES)}")
    if not chat_template or not chat_template.strip():
        raise ValueError("chat_template is empty; pass the model's Jinja chat template text")
    spec = FAMILIES[family]
    extra = spec["special"] + spec["added"]
    base = build_tokenizer(vocab_size - len(extra), extra_texts)
    # A copy of the trained tokenizer, so the cached tiny tokenizer is never altered.
    backend = tokenizers.Tokenizer.from_str(base.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(spec["split"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    if spec["special"]:
        backend.add_special_tokens(spec["special"])
    if spec["added"]:
        # Added but not special, as in Qwen2.5: never split, and kept by skip_special_tokens.
        backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                            for t in spec["added"]])
    got = backend.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:  # a bug here, not a user error
        raise RuntimeError(f"built a {family} tokenizer with {got} ids, wanted {vocab_size}")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=spec["bos"], eos_token=spec["eos"],
        pad_token=spec["pad"], unk_token=None, chat_template=chat_template,
        clean_up_tokenization_spaces=False, model_max_length=1 << 20)

