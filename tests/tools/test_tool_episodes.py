"""Token-exact function-calling episodes through the REAL Qwen2.5-Instruct and Llama-3.1-Instruct
chat templates (tests/data/chat_templates/): a scripted policy calls the calculator in the
template's own call text, the env runs it, the result comes back as a tool message, and the
policy answers. The trajectory's ids must equal transformers' own rendering of the structured
conversation (assistant `tool_calls`, role "tool" results, `tools=`), and the loss mask must
cover exactly the ids the policy sampled.
"""

from pathlib import Path

import numpy as np
import pytest

from rl_tpu.agent import run_episodes
from rl_tpu.core.env import Env, StepResult, Task
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rollout.scripted import ScriptedEngine
from rl_tpu.tools import ToolEnv, ToolRegistry, calculator_tool, call_format_of
from rl_tpu.tools.template_tokenizer import build_family_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
# The text each template writes to open an assistant turn (the generation prompt's end).
ASSISTANT_HEADER = {"qwen2": "<|im_start|>assistant\n",
                    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n"}
QWEN_CALL = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n'
             '</tool_call>')
LLAMA_CALL = '{"name": "calculator", "parameters": {"expression": "17 * 23"}}'


class ProductTask(Env):
    """"What is 17 * 23?": an answer containing 391 is right (reward 1); any answer ends it."""

    name = "product"
    system_prompt = "Answer the question. Use the tools when they help."

    def reset(self, task):
        return "What is 17 * 23?"

    def step(self, action):
        right = "391" in action
        return StepResult("Right." if right else "Wrong.", float(right), True, {"success": right})


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def family_tok(request):
    name = {"qwen2": "qwen2_5_instruct.jinja", "llama3": "llama3_1_instruct.jinja"}[request.param]
    hf = build_family_tokenizer((TEMPLATES / name).read_text(), request.param)
    return request.param, hf, ChatTokenizer(hf)


def scripted(family, replies):
    """Policy: the reply for the assistant turn being generated (counted from the headers)."""
    def policy(text, _):
        turn = text.count(ASSISTANT_HEADER[family]) - 1
        return replies[min(turn, len(replies) - 1)]
    return policy


def hf_ids(hf, messages, tools):
    """transformers' own ids of the structured conversation (its apply_chat_template)."""
    out = hf.apply_chat_template(messages, tools=tools, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def play(tok, family, replies, registry=None):
    registry = registry or ToolRegistry([calculator_tool()])
    engine = ScriptedEngine(tok, scripted(family, replies))
    make_env = lambda: ToolEnv(ProductTask(), registry, call_format_of(tok))  # noqa: E731
    [traj] = run_episodes(engine, make_env, [Task("p0")], tokenizer=tok, max_turns=4,
                          max_new_tokens_per_turn=200, max_context_tokens=4096, num_threads=0)
    return traj, engine, registry


def test_the_templates_name_their_call_formats(family_tok):
    family, hf, tok = family_tok
    assert call_format_of(tok) == {"qwen2": "hermes", "llama3": "llama3_json"}[family]
    added = set(hf.get_added_vocab())
    needed = {"qwen2": {"<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"},
              "llama3": {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>", "<|python_tag|>", "<|eom_id|>"}}[family]
    assert needed <= added
    for token in needed:  # each is one id, never split
        assert len(tok.encode(token)) == 1


def test_a_tool_call_and_its_result_are_token_exact(family_tok):
    family, hf, tok = family_tok
    call = QWEN_CALL if family == "qwen2" else LLAMA_CALL
    traj, engine, registry = play(tok, family, [call, "17 * 23 = 391."])

    assert traj.finish == "done" and traj.reward == 1.0 and traj.success
    assert traj.num_turns == 2
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "tool",
                                                 "assistant", "user"]
    assert traj.messages[3] == {"role": "tool", "content": "391", "name": "calculator"}

    structured = [
        {"role": "system", "content": ProductTask.system_prompt},
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": {"expression": "17 * 23"}}}]},
        {"role": "tool", "content": "391"},
        {"role": "assistant", "content": "17 * 23 = 391."},
    ]
    expected = hf_ids(hf, structured, registry.schemas)
    tokens = [int(t) for t in traj.tokens]
    # The history ends at the policy's last eos; the template adds "\n" after Qwen's <|im_end|>
    # and nothing after Llama's <|eot_id|>.
    assert tokens == expected[:len(tokens)]
    assert tok.decode(expected[len(tokens):]) == {"qwen2": "\n", "llama3": ""}[family]

    # The tool's result, as each template wraps it (Llama 3.1's writes a string as JSON).
    text = tok.decode(tokens)
    wrapped = {"qwen2": "<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n",
               "llama3": '<|start_header_id|>ipython<|end_header_id|>\n\n"391"<|eot_id|>'}[family]
    assert text.count(wrapped) == 1

    # Loss on exactly the sampled ids: the call (plus eos), then the answer (plus eos).
    sampled = [list(r.output_ids) for r in engine.results.values()]
    assert len(sampled) == 2
    assert [t for t, m in zip(tokens, traj.loss_mask) if m] == sampled[0] + sampled[1]
    assert int(np.sum(traj.loss_mask)) == len(sampled[0]) + len(sampled[1])
    assert tok.decode(sampled[0][:-1]) == call
    # The first masked run starts right after the generation prompt.
    first = int(np.argmax(traj.loss_mask))
    assert tok.decode(tokens[:first]).endswith(ASSISTANT_HEADER[family])


def test_qwen_two_calls_in_one_reply_come_back_in_one_user_turn(family_tok):
    family, hf, tok = family_tok
    if family != "qwen2":
        pytest.skip("Llama 3.1's template renders one call per assistant message")
    two = (QWEN_CALL + "\n"
           + '<tool_call>\n{"name": "calculator", "arguments": {"expression": "391 + 9"}}\n'
           '</tool_call>')
    traj, _, registry = play(tok, family, [two, "391, and 400 with 9 more."])
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["391", "400"]
    structured = [
        {"role": "system", "content": ProductTask.system_prompt},
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator",
                                              "arguments": {"expression": "17 * 23"}}},
            {"type": "function", "function": {"name": "calculator",
                                              "arguments": {"expression": "391 + 9"}}}]},
        {"role": "tool", "content": "391"},
        {"role": "tool", "content": "400"},
        {"role": "assistant", "content": "391, and 400 with 9 more."},
    ]
    expected = hf_ids(hf, structured, registry.schemas)
    tokens = [int(t) for t in traj.tokens]
    assert tokens == expected[:len(tokens)] and tok.decode(expected[len(tokens):]) == "\n"
    assert tok.decode(tokens).count(
        "<|im_start|>user\n<tool_response>\n391\n</tool_response>\n<tool_response>\n400\n"
        "</tool_response><|im_end|>\n") == 1


def test_a_bad_call_is_an_error_observation_and_the_episode_goes_on(family_tok):
    family, _, tok = family_tok
    unknown = {"qwen2": '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>',
               "llama3": '{"name": "weather", "parameters": {}}'}[family]
    traj, _, _ = play(tok, family, [unknown, "391"])
    assert traj.finish == "done" and traj.reward == 1.0
    [tool_message] = [m for m in traj.messages if m["role"] == "tool"]
    assert tool_message["content"] == "Error: unknown tool 'weather'; the tools are: calculator"
    assert traj.info["step_infos"][0]["tool_errors"] == 1


class Malformed(ProductTask):
    """Bad function-calling output: `tools` not a list of dicts, or observation messages
    without a string content."""

    def __init__(self, bad_tools=False):
        self.tools = "calculator" if bad_tools else None

    def step(self, action):
        return StepResult("x", 0.0, False, {"observation_messages": [{"role": "tool"}]})


@pytest.mark.parametrize("bad_tools, error", [
    (True, "Malformed.tools is 'calculator'; it must be a list of tool schemas"),
    (False, "Malformed's step returned info['observation_messages'] = [{'role': 'tool'}]"),
])
def test_malformed_tools_or_observation_messages_end_the_episode(bad_tools, error):
    from rl_tpu.models.tiny_tokenizer import build_tokenizer

    tok = ChatTokenizer(build_tokenizer(300))
    [traj] = run_episodes(ScriptedEngine(tok, lambda text, turn: "hi"),
                          lambda: Malformed(bad_tools), [Task("p0")], tokenizer=tok,
                          max_turns=3, max_new_tokens_per_turn=20, max_context_tokens=2048,
                          num_threads=0)
    assert traj.finish == "env_error" and error in traj.info["error"]
