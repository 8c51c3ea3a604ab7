"""Tests for rl_tpu.models.tokenizer and the tiny ChatML tokenizer builder."""

import json

import pytest
import transformers

from rl_tpu.models import tiny_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer, load_tokenizer

VOCAB = 512


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tok")
    tiny_tokenizer.build_tokenizer(VOCAB).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


UNICODE_TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  \n\n\ttabs",
    "Grüße, naïve café — 你好世界 🤖🚀 ∑ x² ≤ ∞",
    "def f(x):\n    return x ** 2  # 平方\n",
    "\x00\x7f control bytes \u200b zero width",
]


# --- tiny tokenizer builder -----------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [300, VOCAB, 4096])
def test_vocab_size_is_exact(vocab_size):
    hf = tiny_tokenizer.build_tokenizer(vocab_size)
    assert len(hf) == vocab_size
    assert ChatTokenizer(hf).vocab_size == vocab_size
    # Every id decodes (no holes in the id space an embedding table would index).
    assert sorted(hf.get_vocab().values()) == list(range(vocab_size))


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="too small"):
        tiny_tokenizer.build_tokenizer(299)


def test_build_is_deterministic():
    a, b = tiny_tokenizer.build_tokenizer(VOCAB), tiny_tokenizer.build_tokenizer(VOCAB)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_special_tokens(tok):
    hf = tok.hf
    assert hf.bos_token is None
    assert hf.eos_token == "<|im_end|>" and tok.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert hf.pad_token == "<|endoftext|>" and tok.pad_token_id == hf.convert_tokens_to_ids("<|endoftext|>")
    # Special tokens are single ids, never split into bytes.
    assert len(tok.encode("<|im_start|>")) == 1


def test_saved_dir_reloads_identically(tok_dir):
    built = tiny_tokenizer.build_tokenizer(VOCAB)
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    assert hf.get_vocab() == built.get_vocab()
    assert hf.chat_template == built.chat_template
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == (built.eos_token, built.pad_token, None)
    text = "<|im_start|>user\n" + UNICODE_TEXTS[2] + "<|im_end|>\n"
    assert hf.encode(text, add_special_tokens=False) == built.encode(text, add_special_tokens=False)


# --- ChatTokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_decode_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|endoftext|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_chat_template_ids_equal_encode_of_rendered_text(tok):
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "What is 2 + 3? Ünïcödé 🤖"}]
    text = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2 + 3? Ünïcödé 🤖<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == tok.encode(text)
    assert tok.render(messages) + "<|im_start|>assistant\n" == text


def test_append_message_multi_turn(tok):
    im_end = tok.eos_token_id
    system = {"role": "system", "content": "You are a maths tutor."}
    user1 = {"role": "user", "content": "What is 17 + 25?"}
    answer1 = "The sum is 42."
    user2 = {"role": "user", "content": "And 6 * 7? Explain."}
    answer2_full = "The product of 6 and 7 is"  # cut off by the length budget
    user3 = {"role": "user", "content": "You ran out of tokens; answer again."}

    # Turn 1: the prompt, then the model's own ids, ending with <|im_end|> but no "\n".
    ids = tok.append_message([], [], system, add_generation_prompt=False)
    assert ids == tok.apply_chat_template([system])
    ids = tok.append_message(ids, [system], user1)
    assert ids == tok.apply_chat_template([system, user1], add_generation_prompt=True)
    gen1 = tok.encode(answer1) + [im_end]
    ids = ids + gen1
    messages = [system, user1, {"role": "assistant", "content": answer1}]

    # Turn 2: the missing "\n" after <|im_end|> is prepended to the delta.
    before = list(ids)
    ids = tok.append_message(ids, messages, user2)
    assert ids[:len(before)] == before and len(ids) > len(before)
    assert tok.decode(ids[len(before):]).startswith("\n<|im_start|>user\n")
    gen2 = tok.encode(answer2_full)  # no <|im_end|>: cut by length
    ids = ids + gen2
    messages += [user2, {"role": "assistant", "content": answer2_full}]

    # Turn 3: the whole closing text "<|im_end|>\n" is missing and gets added.
    before = list(ids)
    ids = tok.append_message(ids, messages, user3)
    assert ids[:len(before)] == before
    new_ids = ids[len(before):]
    assert new_ids[0] == im_end
    assert tok.decode(new_ids).startswith("<|im_end|>\n<|im_start|>user\n")
    messages.append(user3)

    # Assistant ids were the tokenizer's own encoding, so the incremental history equals a
    # one-shot render of the whole conversation.
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True)


def test_append_message_history_already_has_closing_text(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    full = tok.apply_chat_template(messages)  # ends with "<|im_end|>\n"
    user = {"role": "user", "content": "bye"}
    ids = tok.append_message(full, messages, user)
    assert ids == tok.apply_chat_template(messages + [user], add_generation_prompt=True)


def test_append_message_keeps_non_canonical_generated_ids(tok):
    # The model may sample a tokenization BPE would never produce (here: one id per byte).
    messages = [{"role": "user", "content": "Say hello"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    odd = [tok.hf.convert_tokens_to_ids(c) for c in "hello"] + [tok.eos_token_id]
    assert odd[:-1] != tok.encode("hello")
    history = prompt + odd
    messages.append({"role": "assistant", "content": "hello"})
    ids = tok.append_message(history, messages, {"role": "user", "content": "again"})
    assert ids[:len(history)] == history
    assert tok.decode(ids[len(history):]) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


def test_append_message_text_spelling_of_special_token_is_not_closing(tok):
    # Generated text that ends in the characters "<|im" is not the <|im_end|> token.
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a <|im"}]
    history = tok.apply_chat_template(messages[:1], add_generation_prompt=True)
    history = history + tok.encode("a ") + [tok.hf.convert_tokens_to_ids(c) for c in "<|im"]
    ids = tok.append_message(history, messages, {"role": "user", "content": "r"})
    assert ids[len(history)] == tok.eos_token_id


def test_append_message_rejects_non_prefix_stable_template(tok):
    hf = tiny_tokenizer.build_tokenizer(VOCAB)
    # Renders only the last message: adding a message rewrites what came before.
    hf.chat_template = "{{ messages[-1]['content'] }}"
    bad = ChatTokenizer(hf)
    with pytest.raises(ValueError, match="not prefix-stable"):
        bad.append_message(bad.encode("a"), [{"role": "user", "content": "a"}],
                           {"role": "user", "content": "b"})


def test_missing_chat_template_error(tok_dir, tmp_path):
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    plain = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="has no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(tmp_path) in repr(plain)


def test_missing_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer in .*tokenizer\.json"):
        load_tokenizer(tmp_path)
