"""The tiny tokenizer's chat template with tools: what a function-calling smoke run renders."""

import json

import pytest

from rl_tpu.models.tiny_tokenizer import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def hf():
    return build_tokenizer(512)


def test_without_tools_the_template_is_plain_chatml(hf):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>assistant\n")


def test_tools_open_the_system_turn_and_calls_render_between_tags(hf):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c0", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "content": "2"}]
    text = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert text == (
        "<|im_start|>system\nsys\n\nYou can call these tools (JSON schemas):\n"
        + json.dumps(TOOLS[0]) + "\n"
        'To call one, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
        "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        "<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n")
    # Arguments given as an object render the same as the JSON string of it.
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"a": 1}
    assert hf.apply_chat_template(messages, tools=TOOLS, tokenize=False) == text


def test_tools_without_a_system_message_get_a_system_turn_of_their_own(hf):
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS,
                                  tokenize=False)
    assert text.startswith("<|im_start|>system\nYou can call these tools (JSON schemas):\n")
    assert text.endswith("<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
