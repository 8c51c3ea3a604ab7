"""Chat tokenizer: text <-> ids, chat templates, and token-exact multi-turn histories.

`load_tokenizer(path)` wraps the HF tokenizer of a local model directory in a `ChatTokenizer`.

Multi-turn RL trains on the tokens the policy actually produced. Re-rendering the whole
conversation through the chat template after every turn would re-tokenize the model's own
answers, and BPE does not round-trip: the text of a generated answer can tokenize to different
ids than the ones sampled (and their logprobs would then belong to the wrong tokens). So
`append_message` only ever tokenizes the *new* text that the template adds for a message and
appends it to the history, which is left exactly as it was.

Every path from text to ids goes through `ChatTokenizer.encode`, so the ids of a chat template
equal `encode(rendered text)` and an incremental history equals a one-shot render wherever the
tokenizer's merges do not cross the boundaries between turns (true of ChatML, whose turns are
separated by special tokens).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import transformers

Message = Mapping[str, Any]  # role and content strings; tool calls and ids too

# Files one of which a HF model directory must hold for AutoTokenizer to build a tokenizer:
# a `tokenizers` serialization, or the vocabularies a slow tokenizer can be converted from.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")

# Stands in for an assistant's content when rendering, to find where the template's closing
# text for that turn starts. Plain ASCII letters, so no template escapes or splits it.
_CONTENT_SENTINEL = "RLTPUCONTENTSENTINELx9q7"


def load_tokenizer(path: str | os.PathLike) -> "ChatTokenizer":
    """Load the tokenizer of the HF model directory `path` (never from a hub).

    Raises:
      FileNotFoundError: `path` is not a directory, or holds none of the tokenizer files.
      ValueError: the files are there but transformers cannot build a tokenizer from them.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"tokenizer directory {path!r} does not exist (or is not a directory); pass the local "
            "directory of a HF model (rl_tpu never downloads from a hub).")
    present = set(os.listdir(path))
    if not present.intersection(_TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {path!r}: expected one of {', '.join(_TOKENIZER_FILES)} (plus "
            f"tokenizer_config.json), found {sorted(present) or 'an empty directory'}. Save one "
            "there with `tokenizer.save_pretrained(path)`.")
    try:
        hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load the tokenizer in {path!r}: {e}") from e
    return ChatTokenizer(hf, name=path)


class ChatTokenizer:
    """A HF tokenizer with the few operations rl_tpu needs, all on plain `list[int]`.

    Args:
      hf: a `transformers` tokenizer (use `load_tokenizer` to get one from a model dir).
      name: where it came from, used in error messages.
    """

    def __init__(self, hf: transformers.PreTrainedTokenizerBase, name: str | None = None):
        self._hf = hf
        self._name = name or getattr(hf, "name_or_path", "") or type(hf).__name__

    def __repr__(self) -> str:
        return f"ChatTokenizer({self._name!r}, vocab_size={self.vocab_size})"

    # --- properties -----------------------------------------------------------------------

    @property
    def hf(self) -> transformers.PreTrainedTokenizerBase:
        """The wrapped `transformers` tokenizer."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit, added tokens included.

        (`hf.vocab_size` leaves added tokens such as `<|im_end|>` out, which is not what an
        embedding table or a logits mask needs.)
        """
        return len(self._hf)

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        """The pad id, or eos when the tokenizer defines no pad token (Llama-style)."""
        pad = self._hf.pad_token_id
        return self.eos_token_id if pad is None else pad

    # --- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with no bos/eos added: templates already write the ones they want."""
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`, byte-exact: no tokenization-space clean-up (it would edit the text)."""
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=False)

    # --- chat templates -------------------------------------------------------------------

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False,
               tools: Optional[Sequence[dict]] = None) -> str:
        """The chat template's text for `messages` (no tokenization).

        `tools`: OpenAI-style function schemas (`{"type": "function", "function": {"name",
        "description", "parameters"}}`) the template states to the model, as transformers'
        `apply_chat_template(tools=...)` does; None or empty: no tools.
        """
        if not self._hf.chat_template:
            raise ValueError(
                f"the tokenizer from {self._name!r} has no chat template, so chat messages cannot "
                "be rendered. Use an instruct/chat model's tokenizer, or set one with "
                "`tokenizer.chat_template = ...` and save it next to the model.")
        if not messages:
            # Templates may index messages[0] (e.g. to add a default system prompt); nothing to
            # render means no text.
            return ""
        text = self._hf.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] if tools else None)
        if not isinstance(text, str):  # Would mean transformers changed its return type.
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                            tools: Optional[Sequence[dict]] = None) -> list[int]:
        """Ids of the chat template applied to `messages`: `encode(render(messages))`."""
        return self.encode(self.render(messages, add_generation_prompt, tools=tools))

    def append_message(self, history_ids: Sequence[int], messages: Sequence[Message],
                       new_message: Message, add_generation_prompt: bool = True,
                       tools: Optional[Sequence[dict]] = None) -> list[int]:
        """Append one message to a token-exact conversation history: `append_messages` with
        one message."""
        return self.append_messages(history_ids, messages, [new_message],
                                    add_generation_prompt=add_generation_prompt, tools=tools)

    def append_messages(self, history_ids: Sequence[int], messages: Sequence[Message],
                        new_messages: Sequence[Message], add_generation_prompt: bool = True,
                        tools: Optional[Sequence[dict]] = None) -> list[int]:
        """Append messages to a token-exact conversation history, all at once.

        Several messages go in one call where the template renders a run of them as one turn:
        Qwen2.5's wraps consecutive "tool" messages in a single user turn, so the text it
        writes after the first one changes when a second follows, and appending them one at
        a time would not be prefix-stable.

        Args:
          history_ids: ids of the conversation `messages` so far. Assistant turns hold the
            model's own sampled ids, which usually end with the stop token (e.g. `<|im_end|>`)
            but not the template's trailing text (e.g. "\\n"), or end mid-answer when the turn
            hit its length budget.
          messages: the conversation so far, as text.
          new_messages: the messages to add (typically an environment observation, role
            "user", or the results of the tool calls of the last assistant turn, role "tool").
          add_generation_prompt: also append the assistant header the model continues from.
          tools: the tool schemas the conversation was rendered with (see `render`); the same
            for every call of one conversation.

        Returns:
          `history_ids + new_ids`; `history_ids` is never altered or re-tokenized. `new_ids` is
          `encode(missing + delta)`, where `delta` is the text the template adds for
          `new_messages` (plus the generation prompt), and `missing` is whatever part of the
          closing text of a final assistant turn (e.g. "<|im_end|>\\n") the history lacks.

        Raises:
          ValueError: the template is not prefix-stable (rendering more messages changes the
            text of earlier ones, as templates that drop past reasoning do), or has no template.
        """
        messages = list(messages)
        prefix = self.render(messages, add_generation_prompt=False, tools=tools)
        full = self.render(messages + list(new_messages), add_generation_prompt=add_generation_prompt,
                           tools=tools)
        if not full.startswith(prefix):
            cut = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), len(full))
            raise ValueError(
                f"the chat template of {self._name!r} is not prefix-stable: rendering one more "
                f"message changes earlier text (first difference at character {cut}: "
                f"{prefix[cut:cut + 40]!r} became {full[cut:cut + 40]!r}). Token-exact multi-turn "
                "histories need a template that only appends; use a template that keeps past turns "
                "verbatim (e.g. one that does not strip earlier reasoning).")
        delta = full[len(prefix):]

        missing = ""
        if messages and messages[-1].get("role") == "assistant":
            closing = self._assistant_closing_text(messages, tools)
            missing = closing[self._closing_prefix_present(history_ids, closing):]
        return list(history_ids) + self.encode(missing + delta)

    # --- helpers for append_message --------------------------------------------------------

    def _assistant_closing_text(self, messages: Sequence[Message],
                                tools: Optional[Sequence[dict]] = None) -> str:
        """The text the template writes after the content of the final (assistant) message.

        Rendered with a sentinel as the content so the end of the content is unambiguous even
        when the real content is empty or reappears in the closing text.
        """
        probe = [*messages[:-1], {**messages[-1], "content": _CONTENT_SENTINEL}]
        text = self.render(probe, add_generation_prompt=False, tools=tools)
        at = text.rfind(_CONTENT_SENTINEL)
        if at < 0:
            raise ValueError(
                f"the chat template of {self._name!r} does not write the content of a final "
                "assistant message verbatim, so the end of that turn cannot be located.")
        return text[at + len(_CONTENT_SENTINEL):]

    def _closing_prefix_present(self, history_ids: Sequence[int], closing: str) -> int:
        """Length of the longest prefix of `closing` that the history already ends with.

        The model may have emitted all of the closing text, its stop token only, or none of it
        (cut off by length). A prefix may not end inside a special token of the closing text:
        text that merely spells "<|im" is not the start of the `<|im_end|>` token, and the rest
        of the token could not be appended as text.
        """
        if not closing or not history_ids:
            return 0
        # Every token covers at least one byte and a character at most four, so this many tail
        # tokens decode to at least len(closing) characters. A window starting inside a multi-byte
        # character only garbles its first characters, far from the suffix compared.
        tail = self.decode(history_ids[-(4 * len(closing) + 4):])
        allowed = self._cut_points(closing)
        for k in range(len(closing), 0, -1):
            if k in allowed and tail.endswith(closing[:k]):
                return k
        return 0

    def _cut_points(self, text: str) -> set[int]:
        """Offsets in `text` that do not fall strictly inside an added (special) token."""
        points = set(range(len(text) + 1))
        for token in self._hf.get_added_vocab():
            start = text.find(token)
            while start >= 0:
                points.difference_update(range(start + 1, start + len(token)))
                start = text.find(token, start + 1)
        return points
