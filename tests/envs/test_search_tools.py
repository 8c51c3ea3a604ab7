"""Search env, function-calling style (`actions="tools"`): search is a tool the model calls in
its chat template's call format; an episode through the agent loop and the real Qwen2.5 and
Llama 3.1 templates."""

import json
from pathlib import Path

import numpy as np
import pytest

from rl_tpu.agent import run_episodes
from rl_tpu.core import env as env_lib
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rollout.scripted import ScriptedEngine
from rl_tpu.tools import call_format_of
from rl_tpu.tools.template_tokenizer import build_family_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


@pytest.fixture(scope="module")
def env():
    e = env_lib.make("search", actions="tools")
    yield e
    e.close()


def two_hop(env):
    return next(t for t in (env.tasks().get("eval", i) for i in range(50))
                if env.question(t)["type"] == "2hop")


def hermes(query):
    return ('<tool_call>\n{"name": "search", "arguments": ' + json.dumps({"query": query})
            + "}\n</tool_call>")


def test_schema_prompt_and_other_styles_have_no_tools(env):
    assert env.tools == [{"type": "function", "function": {
        "name": "search",
        "description": "Search the document collection; returns the best matching passages.",
        "parameters": {"type": "object", "properties": {"query": {
            "type": "string", "description": "what to look for, e.g. an entity's name"}},
            "required": ["query"]}}}]
    assert env.system_prompt.startswith("You answer questions by searching a document collection "
                                        "with the search tool.")
    assert env.conversation_start() is None
    assert env_lib.make("search").tools is None
    assert env_lib.make("search", actions="brackets").tools is None
    with pytest.raises(ValueError, match="call_format must be one of"):
        env_lib.make("search", actions="tools", call_format="xml")


def test_a_call_returns_the_passages_as_a_tool_message(env):
    task = two_hop(env)
    q = env.question(task)
    assert env.reset(task) == f"Question: {q['question']}"
    hop = q["hops"][0]
    result = env.step(f"I should look it up.\n{hermes(hop['query'])}")
    [message] = result.info["observation_messages"]
    assert message["role"] == "tool" and message["name"] == "search"
    lines = message["content"].split("\n")
    assert len(lines) == 3 and lines[0].startswith(f"[1] {hop['title']}: ")
    assert hop["evidence"] in lines[0]
    assert (result.reward, result.done, result.info["queries"]) == (0.0, False, [hop["query"]])


def test_answer_ends_the_episode_right_or_wrong(env):
    task = two_hop(env)
    env.reset(task)
    wrong = env.step("Nobody")
    assert (wrong.observation, wrong.reward, wrong.done, wrong.info["success"]) == (
        "Your answer 'Nobody' is incorrect.", 0.0, True, False)
    env.reset(task)
    gold = env.question(task)["answer"]
    right = env.step(f"  {gold} ")
    assert (right.observation, right.reward, right.done) == (f"Your answer {gold!r} is correct.",
                                                            1.0, True)


def test_bad_calls_are_error_tool_messages(env):
    env.reset(two_hop(env))
    result = env.step('<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>'
                      '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
                      '<tool_call>{"name": "search"</tool_call>')
    contents = [m["content"] for m in result.info["observation_messages"]]
    assert contents[0].startswith("Error: tool call 3 is not valid JSON")
    assert contents[1:] == ["Error: unknown tool 'lookup'; the tools are: search",
                            "Error: bad arguments for 'search': missing required argument 'query'"]
    assert result.info["tool_errors"] == 3 and not result.done
    empty = env.step("   ")
    assert empty.info["invalid_action"] and not empty.done


def test_llama_format(env):
    llama = env_lib.make("search", actions="tools", call_format="llama3_json")
    task = two_hop(llama)
    llama.reset(task)
    query = llama.question(task)["hops"][0]["query"]
    result = llama.step(json.dumps({"name": "search", "parameters": {"query": query}}))
    assert result.info["observation_messages"][0]["content"].startswith("[1] ")


@pytest.mark.parametrize("family, template", [("qwen2", "qwen2_5_instruct.jinja"),
                                              ("llama3", "llama3_1_instruct.jinja")])
def test_an_episode_through_the_tool(family, template):
    hf = build_family_tokenizer((TEMPLATES / template).read_text(), family)
    tok = ChatTokenizer(hf)
    fmt = call_format_of(tok)
    header = {"qwen2": "<|im_start|>assistant\n",
              "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[family]
    probe = env_lib.make("search", actions="tools")
    task = two_hop(probe)
    q = probe.question(task)
    hops = q["hops"]

    def call(query):
        if fmt == "hermes":
            return hermes(query)
        return json.dumps({"name": "search", "parameters": {"query": query}})

    replies = [call(h["query"]) for h in hops] + [q["answer"]]

    def policy(text, _):
        return replies[min(text.count(header) - 1, len(replies) - 1)]

    engine = ScriptedEngine(tok, policy)
    [traj] = run_episodes(engine, lambda: env_lib.make("search", actions="tools", call_format=fmt),
                          [task], tokenizer=tok, max_turns=5, max_new_tokens_per_turn=100,
                          max_context_tokens=8192, num_threads=0)
    assert traj.finish == "done" and traj.reward == 1.0 and traj.success
    assert traj.num_turns == len(hops) + 1
    tool_messages = [m for m in traj.messages if m["role"] == "tool"]
    assert len(tool_messages) == len(hops)
    for hop, message in zip(hops, tool_messages):
        assert hop["evidence"] in message["content"]

    # The trajectory is transformers' rendering of the structured conversation.
    structured = [{"role": "system", "content": probe.system_prompt},
                  {"role": "user", "content": f"Question: {q['question']}"}]
    for hop, message in zip(hops, tool_messages):
        structured += [{"role": "assistant", "content": "", "tool_calls": [{
            "type": "function", "function": {"name": "search",
                                             "arguments": {"query": hop["query"]}}}]},
            {"role": "tool", "content": message["content"]}]
    structured.append({"role": "assistant", "content": q["answer"]})
    expected = hf.apply_chat_template(structured, tools=probe.tools, tokenize=False)
    tokens = [int(t) for t in traj.tokens]
    assert tokens == tok.encode(expected)[:len(tokens)]
    assert tok.decode(tokens) + {"qwen2": "\n", "llama3": ""}[family] == expected
    sampled = [list(r.output_ids) for r in engine.results.values()]
    assert [t for t, m in zip(tokens, traj.loss_mask) if m] == sum(sampled, [])
    assert int(np.sum(traj.loss_mask)) == sum(len(s) for s in sampled)
