"""Tokenizers dressed as Qwen2 / Llama 3, and ChatTokenizer's tools= and append_messages
through the real templates."""

from pathlib import Path

import pytest

from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.tools import ToolRegistry, calculator_tool
from rl_tpu.tools.template_tokenizer import build_family_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
TOOLS = ToolRegistry([calculator_tool()]).schemas


@pytest.fixture(scope="module")
def qwen():
    return ChatTokenizer(build_family_tokenizer(
        (TEMPLATES / "qwen2_5_instruct.jinja").read_text(), "qwen2"))


@pytest.fixture(scope="module")
def llama():
    return ChatTokenizer(build_family_tokenizer(
        (TEMPLATES / "llama3_1_instruct.jinja").read_text(), "llama3"))


def test_family_tokens_and_size(qwen, llama):
    assert qwen.vocab_size == llama.vocab_size == 512
    assert qwen.hf.eos_token == "<|im_end|>" and qwen.hf.bos_token is None
    assert llama.hf.eos_token == "<|eot_id|>" and llama.hf.bos_token == "<|begin_of_text|>"
    # <tool_call> is added but not special in Qwen2.5: decoding without specials keeps it.
    ids = qwen.encode("<tool_call>x</tool_call><|im_end|>")
    assert qwen.hf.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"
    with pytest.raises(ValueError, match="unknown tokenizer family 'gpt2'"):
        build_family_tokenizer("{{ x }}", "gpt2")
    with pytest.raises(ValueError, match="chat_template is empty"):
        build_family_tokenizer("  ", "qwen2")


def test_llama_chunking_keeps_a_blank_line_before_json_whole():
    # Trained on text full of blank lines, so "\n\n" is one merged token. Llama 3's split keeps
    # "\n\n" one chunk whatever follows, so the generation prompt's ids plus the call's ids
    # equal the ids of both texts encoded at once; GPT-2's split (the plain tiny tokenizer's)
    # cuts "\n\n{" into "\n", "\n", "{" and the two disagree.
    from rl_tpu.models.tiny_tokenizer import build_tokenizer

    corpus = ["a line that ends a paragraph.\n\n"] * 200
    llama = ChatTokenizer(build_family_tokenizer(
        (TEMPLATES / "llama3_1_instruct.jinja").read_text(), "llama3", extra_texts=corpus))
    gpt2 = ChatTokenizer(build_tokenizer(505, corpus))
    head, call = "ok\n\n", '{"name": "f", "parameters": {}}'
    for tok in (llama, gpt2):
        assert len(tok.encode("\n\n")) == 1
    assert llama.encode(head) + llama.encode(call) == llama.encode(head + call)
    assert gpt2.encode(head) + gpt2.encode(call) != gpt2.encode(head + call)


def test_render_with_tools(qwen, llama):
    messages = [{"role": "user", "content": "Hi"}]
    qwen_text = qwen.render(messages, tools=TOOLS)
    assert qwen_text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You "
                                "are a helpful assistant.\n\n# Tools\n\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "calculator", ' in qwen_text
    assert qwen.render(messages) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
                                     "You are a helpful assistant.<|im_end|>\n"
                                     "<|im_start|>user\nHi<|im_end|>\n")
    llama_text = llama.render(messages, tools=TOOLS)
    assert llama_text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                                 "Environment: ipython\nCutting Knowledge Date: December 2023\n"
                                 "Today Date: 26 Jul 2024\n\n<|eot_id|>")
    assert llama_text.endswith('\n\nHi<|eot_id|>')  # tools in the first user turn, then it
    assert llama.apply_chat_template(messages, tools=TOOLS) == llama.encode(llama_text)


def test_consecutive_tool_messages_need_append_messages(qwen):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": call}]
    history = qwen.apply_chat_template(messages[:1], add_generation_prompt=True, tools=TOOLS)
    history += qwen.encode(call) + [qwen.eos_token_id]
    one, two = {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}
    # The first tool message closes its user turn only when it is the last message: appending
    # one at a time would have to take back text already in the history.
    after_one = qwen.append_message(history, messages, one, add_generation_prompt=False,
                                    tools=TOOLS)
    with pytest.raises(ValueError, match="not prefix-stable"):
        qwen.append_message(after_one, messages + [one], two, tools=TOOLS)
    both = qwen.append_messages(history, messages, [one, two], tools=TOOLS)
    assert qwen.decode(both[len(history):]) == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert both == qwen.apply_chat_template(messages + [one, two], add_generation_prompt=True,
                                            tools=TOOLS)
