"""Tool-call parsing, case by case, with the expected calls and errors worked out by hand."""

import pytest

from rl_tpu.tools.calls import ParsedReply, ToolCall, call_format_of, parse_tool_calls

# --- hermes (Qwen2.5): JSON inside <tool_call> tags ----------------------------------------


def test_hermes_one_call():
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert parse_tool_calls(text, "hermes") == ParsedReply(
        "", (ToolCall("calculator", {"expression": "2+3"}),), ())


def test_hermes_two_calls_with_text_around():
    text = ('Let me look both up.\n<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n'
            '</tool_call>\nand\n<tool_call>\n{"name": "search", "arguments": '
            '{"query": "b", "k": 2}}\n</tool_call> done')
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == (ToolCall("search", {"query": "a"}),
                            ToolCall("search", {"query": "b", "k": 2}))
    # The text outside the blocks, joined and stripped:
    # "Let me look both up.\n" + "\nand\n" + " done".
    assert parsed.content == "Let me look both up.\n\nand\n done"
    assert parsed.errors == ()


def test_hermes_no_call_is_the_answer():
    assert parse_tool_calls("  The answer is 5. ", "hermes") == ParsedReply(
        "The answer is 5.", (), ())


def test_hermes_malformed_json_is_an_error_and_other_calls_survive():
    text = ('<tool_call>{"name": "calc", "arguments": {"x": 1}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": {"x": 2}}</tool_call>')
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == (ToolCall("calc", {"x": 2}),)
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 1 is not valid JSON")


def test_hermes_missing_name():
    parsed = parse_tool_calls('<tool_call>{"arguments": {"x": 1}}</tool_call>', "hermes")
    assert parsed.calls == ()
    assert parsed.errors == ('tool call 1 has no "name" (a non-empty string naming the tool): '
                             '{"arguments": {"x": 1}}',)


def test_hermes_arguments_not_an_object():
    parsed = parse_tool_calls('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>',
                              "hermes")
    assert parsed.calls == ()
    assert parsed.errors == ("tool call 1 to 'calc': \"arguments\" must be a JSON object of "
                             "argument names to values, got list: [1, 2]",)


def test_hermes_arguments_as_a_json_string_and_missing_arguments():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                              '<tool_call>{"name": "g"}</tool_call>', "hermes")
    assert parsed.calls == (ToolCall("f", {"a": 1}), ToolCall("g", {}))


def test_hermes_unclosed_call():
    parsed = parse_tool_calls('I will call it <tool_call>{"name": "f", "argum', "hermes")
    assert parsed.calls == ()
    assert parsed.content == "I will call it"
    assert parsed.errors[0].startswith("tool call 1 has no closing </tool_call>")


def test_hermes_not_an_object():
    parsed = parse_tool_calls("<tool_call>[1]</tool_call>", "hermes")
    assert parsed.errors == ("tool call 1 must be a JSON object, got list: [1]",)


# --- llama3_json (Llama 3.1): the reply is a JSON object with "parameters" ---------------


def test_llama_one_call():
    text = '{"name": "calculator", "parameters": {"expression": "6*7"}}'
    assert parse_tool_calls(text, "llama3_json") == ParsedReply(
        "", (ToolCall("calculator", {"expression": "6*7"}),), ())


def test_llama_python_tag_and_two_calls():
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "x"}}'
    parsed = parse_tool_calls(text, "llama3_json")
    assert parsed.calls == (ToolCall("a", {}), ToolCall("b", {"q": "x"}))
    assert parsed.errors == ()


def test_llama_plain_text_and_non_call_json_are_answers():
    assert parse_tool_calls("It is 42.", "llama3_json") == ParsedReply("It is 42.", (), ())
    assert parse_tool_calls('{"answer": 42}', "llama3_json") == ParsedReply(
        '{"answer": 42}', (), ())


def test_llama_malformed():
    bad_json = parse_tool_calls('{"name": "calc", "parameters": {"x": 1}', "llama3_json")
    assert bad_json.calls == () and bad_json.errors[0].startswith("tool call 1 is not valid JSON")
    no_name = parse_tool_calls('{"parameters": {"x": 1}}', "llama3_json")
    assert no_name.errors[0].startswith('tool call 1 has no "name"')
    not_object = parse_tool_calls('{"name": "calc", "parameters": 5}', "llama3_json")
    assert not_object.errors == ("tool call 1 to 'calc': \"parameters\" must be a JSON object of "
                                 "argument names to values, got int: 5",)
    trailing = parse_tool_calls('{"name": "calc", "parameters": {}} and then', "llama3_json")
    assert trailing.calls == (ToolCall("calc", {}),)
    assert trailing.errors == (
        "text after tool call 1 is neither another call nor a ';': 'and then'",)
    tag_no_json = parse_tool_calls("<|python_tag|>print(1)", "llama3_json")
    assert tag_no_json.errors[0].startswith("the text after <|python_tag|> is not a JSON call")


def test_never_raises_on_garbage():
    for text in ["", "<tool_call>", "</tool_call>", "{", '{"name": 1}', None, "<|python_tag|>",
                 '{"name": "x", "parameters": {"a": NaN}}', "\x00\ud800"]:
        for fmt in ("hermes", "llama3_json"):
            assert isinstance(parse_tool_calls(text, fmt), ParsedReply)


def test_unknown_format_is_a_config_error():
    with pytest.raises(ValueError, match="unknown call_format 'xml'"):
        parse_tool_calls("", "xml")


def test_message_call_form():
    assert ToolCall("f", {"a": 1}, id="c1").as_message_call() == {
        "type": "function", "function": {"name": "f", "arguments": {"a": 1}}, "id": "c1"}


# --- call_format_of -----------------------------------------------------------------------


def test_call_format_of_template_text():
    hermes = "{% if tools %}...<tool_call>\\n{{ tool_call.name }}{% endif %}"
    assert call_format_of(hermes) == "hermes"
    assert call_format_of('{% if tools %}{{ \'"parameters": \' }}{% endif %}') == "llama3_json"
    with pytest.raises(ValueError, match="no tool support"):
        call_format_of("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="no chat template"):
        call_format_of("")
    with pytest.raises(ValueError, match="does not parse"):
        call_format_of("{% if tools %}<functions>{% endif %}")


def test_call_format_of_a_chat_tokenizer_and_its_hf_tokenizer():
    from rl_tpu.models.tiny_tokenizer import build_tokenizer
    from rl_tpu.models.tokenizer import ChatTokenizer

    hf = build_tokenizer(300)  # its template writes calls between <tool_call> tags
    assert call_format_of(ChatTokenizer(hf)) == "hermes"
    assert call_format_of(hf) == "hermes"
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="no tool support"):
        call_format_of(ChatTokenizer(hf))
