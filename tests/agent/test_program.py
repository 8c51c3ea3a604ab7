"""Agent programs (rl_tpu/agent/program.py, recording.py): a program written only against the
`openai` client, played against the recording endpoint, becomes token-exact trajectories.

A scripted engine answers with known text, so every id of a trajectory is known: the ids the
engine received and sampled, the loss mask on the sampled ones only, the behaviour log-probs
it reported. The real sampler's log-probs against the trainer's: test_program_engine.py.
"""

import threading
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from rl_tpu.agent.program import play_programs, program_outcome
from rl_tpu.core import env as env_lib
from rl_tpu.envs.agent_programs import AgentProgramEnv, arithmetic_agent, load_object
from rl_tpu.core.env import Task
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.core.engine import GenerateResult, SamplingParams
from rl_tpu.rollout.scripted import ScriptedEngine

ARGS = dict(max_turns=4, max_new_tokens_per_turn=16, max_context_tokens=512)


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(build_tokenizer(512))


def env_of(program, **kwargs):
    """make_env for a program given as an object (the env itself takes "module:name")."""
    def make():
        env = AgentProgramEnv("rl_tpu.envs.agent_programs:arithmetic_agent", **kwargs)
        env.program = program
        return env
    return make


def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def arithmetic_policy(text, turn):
    """Right answers for a=3, b=4, c=3 (7, then 21); another sum is answered 7 anyway."""
    return "7" if turn == 0 else "21"


def test_two_calls_in_one_conversation_are_one_token_exact_trajectory(tok):
    engine = ScriptedEngine(tok, arithmetic_policy)
    tasks = [Task("t0", {"a": 3, "b": 4, "c": 3}), Task("t1", {"a": 1, "b": 2, "c": 5})]
    trajs = play_programs(engine, env_of(arithmetic_agent), tasks, tokenizer=tok,
                          samples_per_task=2, group_ids=[10, 11], batch_window_s=5.0, **ARGS)
    assert [t.group_id for t in trajs] == [10, 10, 11, 11]
    assert [t.info["sample_index"] for t in trajs] == [0, 1, 0, 1]
    # the 4 episodes' first calls went as one batch, their second calls as another (the
    # batch goes when every running program waits: no window had to pass)
    assert [len(c) for c in engine.calls] == [4, 4]
    right, wrong = trajs[0], trajs[2]
    assert right.reward == 1.0 and right.success and right.finish == "done"
    assert right.rewards == [0.0, 1.0] and right.num_turns == 2
    assert wrong.reward == 0.0 and not wrong.success  # 7 is not 1 + 2, 21 not 7 x 5
    for traj in trajs:
        # what the engine received for the last call + what it sampled == the trajectory
        # (a request's id names its episode: group id, sample, then the call's index)
        mine = [r for batch in engine.calls for r in batch
                if r.request_id.startswith(f"{traj.group_id}-{traj.info['sample_index']}-")]
        first, last = sorted(mine, key=lambda r: r.request_id)
        sampled = engine.results[tuple(last.prompt_ids)]
        assert list(traj.tokens) == list(last.prompt_ids) + sampled.output_ids
        first_ids = engine.results[tuple(first.prompt_ids)].output_ids
        n0, n1 = len(first.prompt_ids), len(last.prompt_ids)
        # the first reply's ids are in the second prompt as sampled (never re-tokenized)
        assert list(traj.tokens[n0:n0 + len(first_ids)]) == first_ids
        mask = np.zeros(len(traj), bool)
        mask[n0:n0 + len(first_ids)] = True
        mask[n1:] = True
        np.testing.assert_array_equal(traj.loss_mask, mask)  # sampled ids only
        behaviour = np.zeros(len(traj), np.float32)
        behaviour[n0:n0 + len(first_ids)] = engine.results[tuple(first.prompt_ids)].logprobs
        behaviour[n1:] = sampled.logprobs
        np.testing.assert_array_equal(traj.behaviour_logprobs, behaviour)
        assert list(traj.turn_ids) == [-1] * n0 + [0] * (n1 - n0) + [1] * (len(traj) - n1)
        assert traj.weight_versions == ["v0", "v1"]
    # the ids are the chat template's own: sampled "7<|im_end|>" is what the template writes
    messages = [{"role": "system", "content": "Reply with a number only."},
                {"role": "user", "content": "What is 3 + 4?"},
                {"role": "assistant", "content": "7"},
                {"role": "user", "content": "Multiply that by 3."},
                {"role": "assistant", "content": "21"}]
    assert list(right.tokens) + tok.encode("\n") == tok.apply_chat_template(messages)
    assert right.messages == messages
    assert right.info["calls"] == 2 and right.info["segments"] == 1
    assert right.info["dropped_sampled_tokens"] == 0


def test_a_rewritten_history_starts_a_new_conversation_and_only_the_last_trains(tok):
    def program(base_url, task):
        c = client(base_url)
        ask = [{"role": "user", "content": "Plan."}]
        plan = c.chat.completions.create(model="m", messages=ask).choices[0].message.content
        # a fresh conversation with the plan pasted in: extends nothing
        talk = [{"role": "user", "content": f"Plan was {plan}. Go."}]
        go = c.chat.completions.create(model="m", messages=talk).choices[0].message.content
        talk += [{"role": "assistant", "content": go}, {"role": "user", "content": "More."}]
        c.chat.completions.create(model="m", messages=talk)
        return 0.5

    engine = ScriptedEngine(tok, lambda text, turn: "abc")
    [traj] = play_programs(engine, env_of(program), [Task("t", {})], tokenizer=tok, **ARGS)
    prompts = [list(r.prompt_ids) for batch in engine.calls for r in batch]
    assert len(prompts) == 3
    assert prompts[1] == tok.apply_chat_template(
        [{"role": "user", "content": "Plan was abc. Go."}], add_generation_prompt=True)
    assert list(traj.tokens[:len(prompts[2])]) == prompts[2]  # the third extends the second
    assert list(traj.tokens[:len(prompts[1])]) == prompts[1]
    assert traj.num_turns == 2 and traj.rewards == [0.0, 0.5] and traj.reward == 0.5
    reply = len(tok.encode("abc")) + 1  # + eos
    assert traj.info["segments"] == 2 and traj.info["dropped_sampled_tokens"] == reply
    assert traj.num_generated == 2 * reply


def test_a_retry_from_an_earlier_turn_branches_off_its_recorded_ids(tok):
    def program(base_url, task):
        c = client(base_url)
        talk = [{"role": "user", "content": "Start."}]
        first = c.chat.completions.create(model="m", messages=talk).choices[0].message.content
        talk += [{"role": "assistant", "content": first}]
        c.chat.completions.create(model="m", messages=talk + [{"role": "user", "content": "A"}])
        # not happy with that: ask the second question again, another way
        c.chat.completions.create(model="m", messages=talk + [{"role": "user", "content": "B"}])
        return 1.0

    # a reply whose text re-tokenizes to other ids: only the recorded ids can stay exact
    odd = [i for ch in "number" for i in tok.encode(ch)]  # one id a letter
    assert tok.decode(odd) == "number" and tok.encode("number") != odd
    engine = ScriptedEngine(tok, lambda text, turn: ("ids", odd) if turn == 0 else "ok")
    [traj] = play_programs(engine, env_of(program), [Task("t", {})], tokenizer=tok, **ARGS)
    [[first], [second], [third]] = engine.calls
    n0 = len(first.prompt_ids)
    reply = odd + [tok.eos_token_id]
    assert list(third.prompt_ids[:n0 + len(reply)]) == list(first.prompt_ids) + reply
    assert list(third.prompt_ids) == list(second.prompt_ids[:n0 + len(reply)]) + \
        tok.encode("\n<|im_start|>user\nB<|im_end|>\n<|im_start|>assistant\n")
    assert list(traj.tokens[:len(third.prompt_ids)]) == list(third.prompt_ids)
    assert traj.num_turns == 2 and traj.info["segments"] == 2
    assert traj.info["dropped_sampled_tokens"] == len(tok.encode("ok")) + 1  # the "A" reply
    assert list(traj.loss_mask[n0:n0 + len(reply)]) == [True] * len(reply)


def test_a_program_that_raises_ends_its_episode_only(tok):
    def program(base_url, task):
        client(base_url).chat.completions.create(model="m", messages=[
            {"role": "user", "content": "hi"}])
        if task["crash"]:
            raise KeyError("no such field")
        return {"reward": 1.0, "success": False, "note": "kept"}

    engine = ScriptedEngine(tok, lambda text, turn: "ok")
    ok, bad = play_programs(engine, env_of(program), [Task("a", {"crash": False}),
                                                      Task("b", {"crash": True})],
                            tokenizer=tok, **ARGS)
    assert ok.finish == "done" and ok.reward == 1.0 and not ok.success
    assert ok.info["program"] == {"note": "kept"}
    assert bad.finish == "env_error" and bad.reward == 0.0 and not bad.success
    assert "KeyError" in bad.info["error"] and "no such field" in bad.info["error"]
    assert bad.num_generated == len(tok.encode("ok")) + 1  # its call is still recorded


def test_turn_limit_context_limit_and_refused_requests(tok):
    seen = {}

    def program(base_url, task):
        c = client(base_url)
        messages = [{"role": "user", "content": task["text"]}]
        for name, kwargs in (("n", {"n": 2}), ("stream", {"stream": True})):
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(model="m", messages=messages, **kwargs)
            seen[name] = str(err.value)
        try:  # the second call for the short prompt, the first for the long one
            c.chat.completions.create(model="m", messages=messages)
            c.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError as err:
            seen[task["text"][:4]] = str(err)
        return 1.0

    engine = ScriptedEngine(tok, lambda text, turn: "ok")
    over_turns, over_context = play_programs(
        engine, env_of(program), [Task("a", {"text": "short"}), Task("b", {"text": "long " * 60})],
        tokenizer=tok, max_turns=1, max_new_tokens_per_turn=8, max_context_tokens=40)
    assert "n'=2" in seen["n"] and "streaming" in seen["stream"]
    assert "turn limit" in seen["shor"]
    assert over_turns.finish == "turn_limit" and over_turns.reward == 1.0
    assert over_turns.num_turns == 1
    assert "context_length_exceeded" in seen["long"]
    # no call answered: nothing to train on, and the episode says so
    assert over_context.finish == "env_error" and over_context.num_turns == 0
    assert "no model call" in over_context.info["error"]
    assert over_context.info["program_reward"] == 1.0


def test_a_reply_length_is_capped_by_max_tokens_and_the_context(tok):
    def program(base_url, task):
        reply = client(base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=task["max"])
        return float(reply.usage.completion_tokens)

    engine = ScriptedEngine(tok, lambda text, turn: "a b c d e f g h i j k l")
    capped, uncapped = play_programs(engine, env_of(program), [Task("a", {"max": 3}),
                                                               Task("b", {"max": 100})],
                                     tokenizer=tok, **ARGS)
    assert capped.reward == 3.0 and capped.num_generated == 3
    assert uncapped.num_generated == min(len(tok.encode("a b c d e f g h i j k l")) + 1, 16)
    requests = sorted((r for batch in engine.calls for r in batch), key=lambda r: r.request_id)
    assert [r.sampling.max_new_tokens for r in requests] == [3, 16]
    assert all(r.sampling.temperature == 1.0 for r in requests)  # the player's own


def test_tool_calls_round_trip_token_exactly(tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    call_text = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'

    def program(base_url, task):
        c = client(base_url)
        messages = [{"role": "user", "content": "Add."}]
        reply = c.chat.completions.create(model="m", messages=messages, tools=tools)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        [call] = message.tool_calls
        assert call.function.name == "add" and call.function.arguments == '{"a": 2}'
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "4"}]
        final = c.chat.completions.create(model="m", messages=messages, tools=tools)
        return float(final.choices[0].message.content == "4")

    engine = ScriptedEngine(tok, lambda text, turn: call_text if turn == 0 else "4")
    [traj] = play_programs(engine, env_of(program), [Task("t", {})], tokenizer=tok,
                           **{**ARGS, "max_new_tokens_per_turn": 64})
    assert traj.reward == 1.0 and traj.info["segments"] == 1 and traj.num_turns == 2
    first = [r for r in engine.calls[0]][0]
    first_ids = engine.results[tuple(first.prompt_ids)].output_ids
    assert first_ids == tok.encode(call_text) + [tok.eos_token_id]
    n0 = len(first.prompt_ids)
    assert list(traj.tokens[n0:n0 + len(first_ids)]) == first_ids  # the sampled call, as is
    [second] = engine.calls[1]
    assert list(traj.tokens[:len(second.prompt_ids)]) == list(second.prompt_ids)


def test_a_hostile_tool_call_reply_is_an_answer_with_errors_not_a_failed_step(tok):
    """The model's own reply nests its call 1,200 deep (Python's JSON decoder recursed into a
    RecursionError): the program gets the reply with its call errors, and plays on."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    hostile = "<tool_call>" + "[" * 1200 + "</tool_call>"
    seen = {}

    def program(base_url, task):
        reply = client(base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Add."}], tools=tools)
        seen["calls"] = reply.choices[0].message.tool_calls
        seen["errors"] = reply.choices[0].model_extra["tool_call_errors"]
        # and a program's own body past the JSON limits: a 400, the episode unharmed
        for body in (b'{"messages": ' + b"[" * 3000, b'{"n": ' + b"9" * 5000 + b"}"):
            request = urllib.request.Request(base_url + "/chat/completions", data=body)
            try:
                urllib.request.urlopen(request, timeout=60)
            except urllib.error.HTTPError as err:
                seen.setdefault("refused", []).append((err.code, err.read().decode()))
        return 1.0

    engine = ScriptedEngine(tok, lambda text, turn: hostile)
    [traj] = play_programs(engine, env_of(program), [Task("t", {})], tokenizer=tok,
                           **{**ARGS, "max_new_tokens_per_turn": 2048,
                              "max_context_tokens": 4096})
    assert traj.finish == "done" and traj.reward == 1.0 and traj.num_turns == 1
    assert seen["calls"] is None and "nests more than 64 levels" in seen["errors"][0]
    [(deep, deep_text), (long, long_text)] = seen["refused"]
    assert (deep, long) == (400, 400)
    assert "nested deeper than 64" in deep_text and "5000 digits" in long_text


def test_the_engine_failing_fails_the_play_after_the_programs_end(tok):
    class Broken(ScriptedEngine):
        def generate(self, requests):
            raise RuntimeError("device lost")

    errors = []

    def program(base_url, task):
        try:
            client(base_url).chat.completions.create(model="m", messages=[
                {"role": "user", "content": "x"}])
        except openai.InternalServerError as err:
            errors.append(str(err))
            raise
        return 1.0

    with pytest.raises(RuntimeError, match="device lost"):
        play_programs(Broken(tok, None), env_of(program), [Task("a", {})] * 2, tokenizer=tok,
                      **ARGS)
    assert len(errors) == 2 and all("device lost" in e for e in errors)


def test_a_program_past_its_time_limit_is_abandoned(tok):
    release = threading.Event()

    def program(base_url, task):
        if task["stuck"]:
            release.wait(30)
        return 1.0

    engine = ScriptedEngine(tok, lambda text, turn: "ok")
    try:
        fast, stuck = play_programs(engine, env_of(program, timeout_s=0.5),
                                    [Task("a", {"stuck": False}), Task("b", {"stuck": True})],
                                    tokenizer=tok, **ARGS)
    finally:
        release.set()
    assert stuck.finish == "env_error" and "timeout_s=0.5" in stuck.info["error"]
    assert fast.finish == "env_error" and "no model call" in fast.info["error"]


def test_seeds_differ_per_episode_and_call_and_repeat_across_plays(tok):
    engine = ScriptedEngine(tok, arithmetic_policy)
    task = Task("t0", {"a": 3, "b": 4, "c": 3})
    seeds = []
    for _ in range(2):
        engine.calls = []
        play_programs(engine, env_of(arithmetic_agent), [task], tokenizer=tok,
                      samples_per_task=2, sampling=SamplingParams(seed=5), **ARGS)
        # (group, sample, call) -> seed; a request id is "<group>-<sample>-<server>-<call>"
        seeds.append({r.request_id.rsplit("-", 2)[0] + r.request_id[-2:]: r.sampling.seed
                      for batch in engine.calls for r in batch})
    assert sorted(seeds[0]) == ["0-0-0", "0-0-1", "0-1-0", "0-1-1"]
    assert seeds[0] == seeds[1]  # the same on a rerun
    assert len(set(seeds[0].values())) == 4  # 2 samples x 2 calls


def test_the_env_names_program_and_tasks_and_refuses_to_be_stepped():
    env = env_lib.make("agent_program", program="rl_tpu.envs.agent_programs:guessing_agent",
                    tasks="rl_tpu.envs.agent_programs:guessing_tasks")
    assert env.program.__name__ == "guessing_agent"
    task = env.tasks().get("eval", 0)
    assert task.task_id == "agent_guessing/eval/0" and 1 <= task.data["secret"] <= 16
    with pytest.raises(RuntimeError, match="play_programs"):
        env.reset(task)
    with pytest.raises(ValueError, match="'package.module:attribute'"):
        load_object("no_colon", "program")
    with pytest.raises(ValueError, match="has no 'nope'"):
        env_lib.make("agent_program", program="rl_tpu.envs.agent_programs:nope")
    with pytest.raises(TypeError, match="env.kwargs.tasks"):
        env_lib.make("agent_program", program="rl_tpu.envs.agent_programs:guessing_agent").tasks()


@pytest.mark.parametrize("value,expected", [
    (1, (1.0, None, {})), (True, (1.0, None, {})),
    ({"reward": 0.25, "success": 1, "k": "v"}, (0.25, True, {"k": "v"}))])
def test_program_outcomes(value, expected):
    assert program_outcome(value) == expected


@pytest.mark.parametrize("value", [None, "1", float("nan"), {"success": True}])
def test_bad_program_outcomes_are_refused(value):
    with pytest.raises(ValueError):
        program_outcome(value)


def test_an_aborted_call_ends_the_episode_unscored(tok):
    class AbortsSecond(ScriptedEngine):
        def generate(self, requests):
            return [GenerateResult([5], [-0.1], "abort") if "again" in self.tok.decode(
                r.prompt_ids) else out for r, out in zip(requests, super().generate(requests))]

    def program(base_url, task):
        c = client(base_url)
        messages = [{"role": "user", "content": "x"}]
        first = c.chat.completions.create(model="m", messages=messages).choices[0].message
        messages += [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": "again"}]
        with pytest.raises(openai.BadRequestError, match="aborted"):
            c.chat.completions.create(model="m", messages=messages)
        return 1.0

    [traj] = play_programs(AbortsSecond(tok, lambda text, turn: "ok"), env_of(program),
                           [Task("a", {})], tokenizer=tok, **ARGS)
    assert traj.finish == "abort" and traj.num_turns == 1  # unscored by the batch builder
    assert traj.info["refused"] == ["the engine aborted this call"]


def test_parallel_tool_calls_through_qwen25s_template_are_token_exact():
    from pathlib import Path

    from rl_tpu.tools import ToolRegistry, calculator_tool
    from rl_tpu.tools.template_tokenizer import build_family_tokenizer

    template = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / \
        "qwen2_5_instruct.jinja"
    qwen = ChatTokenizer(build_family_tokenizer(template.read_text(), "qwen2"))
    tools = ToolRegistry([calculator_tool()]).schemas
    reply = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
             '"2*3"}}\n</tool_call>')

    def program(base_url, task):
        c = client(base_url)
        messages = [{"role": "user", "content": "Compute both."}]
        message = c.chat.completions.create(model="m", messages=messages,
                                            tools=tools).choices[0].message
        assert [call.function.arguments for call in message.tool_calls] == [
            '{"expression": "1+1"}', '{"expression": "2*3"}']
        # two tool results: Qwen2.5 wraps them in ONE user turn (appended at once)
        messages += [message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": call.id, "content": str(value)}
            for call, value in zip(message.tool_calls, (2, 6))]
        c.chat.completions.create(model="m", messages=messages, tools=tools)
        return 1.0

    engine = ScriptedEngine(qwen, lambda text, turn: reply if turn == 0 else "2 and 6")
    [traj] = play_programs(engine, env_of(program), [Task("t", {})], tokenizer=qwen,
                           **{**ARGS, "max_new_tokens_per_turn": 256, "max_context_tokens": 2048})
    assert traj.info["segments"] == 1 and traj.num_turns == 2, traj.info.get("error")
    [[first], [second]] = engine.calls
    conversation = [{"role": "user", "content": "Compute both."},
                    {"role": "assistant", "content": reply},
                    {"role": "tool", "content": "2"}, {"role": "tool", "content": "6"}]
    # the sampled ids are the canonical encoding here, so the prompt is the template's own
    assert list(second.prompt_ids) == qwen.apply_chat_template(
        conversation, add_generation_prompt=True, tools=tools)
    assert list(traj.tokens) == list(second.prompt_ids) + \
        engine.results[tuple(second.prompt_ids)].output_ids
    n0 = len(first.prompt_ids)
    assert list(traj.tokens[n0:n0 + len(qwen.encode(reply)) + 1]) == \
        qwen.encode(reply) + [qwen.eos_token_id]
