"""Tests for rl_tpu.agent: the multi-turn loop's token accounting and its failure handling.

A scripted engine (canned action text per task and turn) and a small guess-the-number env
stand in for a model and a real environment, so every token of a trajectory is known.
benchmarks/agent_loop.py reuses both.
"""

import re
import threading
import time

import numpy as np
import pytest

from rl_tpu.agent import loop as agent  # the loop's internals too
from rl_tpu.core.engine import SamplingParams
from rl_tpu.core.env import Env, StepResult, Task, invalid_action
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rollout.scripted import ScriptedEngine

# --- toy env and scripted engine ------------------------------------------------------------


class GuessEnv(Env):
    """Guess a number in 0..9. "guess <n>" -> "Too low."/"Too high." (reward -0.1) or
    "Correct!" (reward 1, done, success). Task data can make it fail on purpose: `crash_at`
    (turn whose step raises), `hang_at` + `hang_s` (turn whose step sleeps), `reset_crash`,
    `pad` (words of filler appended to wrong-guess observations)."""

    name = "guess"
    system_prompt = "Guess the hidden number. Answer with 'guess <n>'."

    def __init__(self):
        self.actions, self.turn, self.closed, self.task = [], 0, False, None

    def reset(self, task):
        if task.data.get("reset_crash"):
            raise ConnectionError("env server unreachable")
        self.task, self.actions, self.turn = task, [], 0
        return f"Task {task.task_id}: the number is between 0 and 9."

    def step(self, action):
        data, turn = self.task.data, self.turn
        self.turn += 1
        if data.get("crash_at") == turn:
            raise RuntimeError("simulator crashed")
        if data.get("hang_at") == turn:
            time.sleep(data.get("hang_s", 1.0))
        self.actions.append(action)
        m = re.fullmatch(r"guess (\d+)", action)
        if not m:
            return invalid_action("expected 'guess <n>'")
        n, target = int(m.group(1)), data.get("target", 7)
        if n == target:
            return StepResult("Correct!", 1.0, True, {"success": True})
        pad = " filler" * data.get("pad", 0)
        return StepResult(("Too low." if n < target else "Too high.") + pad, -0.1, False,
                          {"success": False})

    def close(self):
        self.closed = True


def script_policy(scripts):
    """Policy from {task_id: [turn outputs]}; the last output repeats past the script's end."""
    def policy(text, turn):
        task_id = re.search(r"Task (\S+):", text).group(1)
        script = scripts[task_id]
        return script[min(turn, len(script) - 1)]
    return policy


# --- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(build_tokenizer(512))


class EnvFactory:
    def __init__(self):
        self.envs, self.lock = [], threading.Lock()

    def __call__(self):
        env = GuessEnv()
        with self.lock:
            self.envs.append(env)
        return env

    def by_task(self, task_id):
        return [e for e in self.envs if e.task is not None and e.task.task_id == task_id]


def run(tok, scripts, tasks, **kw):
    engine, factory = ScriptedEngine(tok, script_policy(scripts)), EnvFactory()
    kw = {"max_turns": 6, "max_new_tokens_per_turn": 32, "max_context_tokens": 1024,
          "step_timeout_s": 5.0, **kw}
    trajs = agent.run_episodes(engine, factory, tasks, tokenizer=tok, **kw)
    return trajs, engine, factory


def assistant_contents(traj):
    return [m["content"] for m in traj.messages if m["role"] == "assistant"]


def through_last_assistant(messages):
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last + 1]


def check_invariants(tok, traj, engine):
    """Shape, mask and logprob invariants that hold for every trajectory."""
    T = len(traj)
    assert traj.tokens.dtype == np.int32 and traj.turn_ids.dtype == np.int32
    assert traj.loss_mask.dtype == bool and traj.behaviour_logprobs.dtype == np.float32
    assert traj.loss_mask.shape == traj.behaviour_logprobs.shape == traj.turn_ids.shape == (T,)
    assert len(traj.rewards) == traj.num_turns == len(traj.weight_versions)
    # Logprobs are nonzero exactly on the sampled ids; observations/prompt are never masked.
    np.testing.assert_array_equal(traj.behaviour_logprobs != 0, traj.loss_mask)
    assert not traj.loss_mask[traj.turn_ids == -1].any()
    # Turn k's generated ids are exactly what the engine returned for the history before them,
    # with the engine's logprobs.
    for k in range(traj.num_turns):
        pos = np.flatnonzero((traj.turn_ids == k) & traj.loss_mask)
        if not len(pos):
            continue
        assert np.all(np.diff(pos) == 1), "a turn's generated ids are contiguous"
        res = engine.results[tuple(traj.tokens[:pos[0]].tolist())]
        assert traj.tokens[pos].tolist() == res.output_ids
        np.testing.assert_array_equal(traj.behaviour_logprobs[pos], np.float32(res.logprobs))
        # Decoding the loss-masked ids gives the assistant message's text (+ the stop token).
        stop = "<|im_end|>" if res.finish_reason == "stop" else ""
        assert tok.decode(traj.tokens[pos]) == assistant_contents(traj)[k] + stop
        # Nothing after a turn's generation is masked until the next turn starts.
        rest = np.flatnonzero(traj.turn_ids == k)
        assert rest[0] == pos[0] and not traj.loss_mask[pos[-1] + 1:rest[-1] + 1].any()


# --- token accounting --------------------------------------------------------------------------


def test_multi_turn_tokens_match_chat_template(tok):
    scripts = {"a": ["guess 3", "hello there", "guess 9", "guess 7"]}
    (traj,), engine, factory = run(tok, scripts, [Task("a", {"target": 7})])
    check_invariants(tok, traj, engine)
    assert traj.finish == "done" and traj.success and traj.num_turns == 4
    assert assistant_contents(traj) == scripts["a"]
    assert factory.envs[0].actions == scripts["a"]
    # Invalid action came back as an observation; the episode went on.
    assert traj.messages[5] == {"role": "user", "content": "Invalid action: expected 'guess <n>'"}
    assert traj.rewards == pytest.approx([-0.1, 0.0, -0.1, 1.0])
    assert traj.reward == pytest.approx(0.8)
    assert traj.weight_versions == ["v0", "v1", "v2", "v3"]
    assert traj.messages[0] == {"role": "system", "content": GuessEnv.system_prompt}
    assert traj.messages[-1] == {"role": "user", "content": "Correct!"}
    assert traj.info["final_observation"] == "Correct!" and traj.info["env_steps"] == 4
    # Token history == chat template of the whole conversation (through the last action),
    # less the template's "\n" after the final <|im_end|>, which nothing was generated after.
    conv = through_last_assistant(traj.messages)
    assert traj.tokens.tolist() + tok.encode("\n") == tok.apply_chat_template(conv)
    # The prompt: template over [system, first observation] with the generation prompt.
    prompt = tok.apply_chat_template(traj.messages[:2], add_generation_prompt=True)
    assert traj.tokens[:len(prompt)].tolist() == prompt
    assert (traj.turn_ids[:len(prompt)] == -1).all() and traj.turn_ids[len(prompt)] == 0
    # Turn ids never decrease; the observation after turn k carries k.
    assert (np.diff(traj.turn_ids) >= 0).all() and traj.turn_ids[-1] == 3
    assert traj.num_generated == sum(len(tok.encode(c)) + 1 for c in scripts["a"])
    assert factory.envs[0].closed


def test_length_cut_turn(tok):
    # L=5 cuts "guess 12345678" (11 ids) after "guess 12"; the env gets the cut text.
    scripts = {"a": ["guess 12345678", "guess 7"]}
    (traj,), engine, factory = run(tok, scripts, [Task("a")], max_new_tokens_per_turn=5)
    check_invariants(tok, traj, engine)
    assert factory.envs[0].actions == ["guess 12", "guess 7"]
    assert assistant_contents(traj) == ["guess 12", "guess 7"]
    assert traj.finish == "done" and traj.num_turns == 2
    pos = np.flatnonzero((traj.turn_ids == 0) & traj.loss_mask)
    assert len(pos) == 5 and tok.decode(traj.tokens[pos]) == "guess 12"
    # The <|im_end|> the model never wrote follows, as unmasked template text of turn 0.
    after = pos[-1] + 1
    assert traj.tokens[after] == tok.eos_token_id
    assert not traj.loss_mask[after] and traj.behaviour_logprobs[after] == 0
    assert traj.turn_ids[after] == 0
    # Here the cut ids are the canonical encoding of the cut text, so the history still equals
    # the template; only the mask tells the appended <|im_end|> apart.
    assert tok.encode("guess 12") == traj.tokens[pos].tolist()
    conv = through_last_assistant(traj.messages)
    assert traj.tokens.tolist() + tok.encode("\n") == tok.apply_chat_template(conv)


def test_non_canonical_ids_are_kept(tok):
    # The model spells "guess 7" one character per token: the text is the same, the ids are
    # not the tokenizer's; the history keeps the sampled ids (and their logprobs).
    spelled = [i for c in "guess 7" for i in tok.encode(c)]
    assert spelled != tok.encode("guess 7")
    (traj,), engine, factory = run(tok, {"a": [("ids", spelled)]}, [Task("a")])
    check_invariants(tok, traj, engine)
    assert factory.envs[0].actions == ["guess 7"] and traj.finish == "done"
    pos = np.flatnonzero(traj.loss_mask)
    assert traj.tokens[pos].tolist() == spelled + [tok.eos_token_id]
    conv = through_last_assistant(traj.messages)
    templ = tok.apply_chat_template(conv)
    assert traj.tokens.tolist() + tok.encode("\n") != templ
    assert tok.decode(traj.tokens.tolist() + tok.encode("\n")) == tok.decode(templ)


class OtherStopEngine(ScriptedEngine):
    """Ends every finished turn on `stop` instead of the tokenizer's eos, and says so in
    `matched_stop`, as an engine does whose stops the agent was never told about: an int
    replaces the trailing eos (Llama 3's `<|end_of_text|>` beside its `<|eot_id|>`); a str
    means the policy's text already ends with that stop string, so the eos goes."""

    def __init__(self, tok, policy, stop):
        super().__init__(tok, policy)
        self.stop = stop

    def generate(self, requests):
        results = super().generate(requests)
        for res in results:
            if res.finish_reason != "stop":
                continue
            if isinstance(self.stop, int):
                res.output_ids[-1] = self.stop
            else:
                res.output_ids.pop()
                res.logprobs.pop()
            res.matched_stop = self.stop
        return results


def run_other_stop(tok, scripts, stop):
    engine = OtherStopEngine(tok, script_policy(scripts), stop)
    factory = EnvFactory()
    (traj,) = agent.run_episodes(engine, factory, [Task("a")], tokenizer=tok, max_turns=4,
                                 max_new_tokens_per_turn=32, max_context_tokens=1024)
    return traj, engine, factory


def generated_runs(traj):
    """Positions of each turn's generated ids."""
    return [np.flatnonzero((traj.turn_ids == k) & traj.loss_mask) for k in range(traj.num_turns)]


def test_matched_stop_id_is_not_part_of_the_action(tok):
    # <|endoftext|> (id 0) ends the turns, as Llama 3's <|end_of_text|> may: a stop the engine
    # knows but that is not the tokenizer's eos (<|im_end|>, id 2). Nothing in the agent's
    # sampling params names it; the engine's matched_stop does.
    end_of_text = tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert end_of_text == 0 and tok.eos_token_id == 2
    (traj, engine, factory) = run_other_stop(tok, {"a": ["guess 3", "guess 7"]}, end_of_text)
    assert factory.envs[0].actions == ["guess 3", "guess 7"]
    assert assistant_contents(traj) == ["guess 3", "guess 7"]
    assert traj.finish == "done" and traj.rewards == pytest.approx([-0.1, 1.0])
    # The token history keeps every sampled id, the stop included, with its logprob.
    runs = generated_runs(traj)
    for k, (pos, text) in enumerate(zip(runs, ["guess 3", "guess 7"])):
        assert traj.tokens[pos].tolist() == tok.encode(text) + [end_of_text]
        assert traj.behaviour_logprobs[pos[-1]] != 0
    # After turn 0's <|endoftext|> the template's own end of turn follows as text without loss.
    after = runs[0][-1] + 1
    assert tok.decode(traj.tokens[after:after + 2]) == "<|im_end|>\n"
    assert not traj.loss_mask[after:after + 2].any() and (traj.turn_ids[after:after + 2] == 0).all()
    assert traj.tokens[-1] == end_of_text and traj.loss_mask[-1]


def test_matched_stop_string_is_cut_from_the_action(tok):
    # The engine stopped on the string " END" (SGLang's `stop`): its ids were sampled and stay
    # in the history, but the action and the message are the text before it.
    scripts = {"a": ["guess 3 END", "guess 7 END"]}
    traj, engine, factory = run_other_stop(tok, scripts, " END")
    assert factory.envs[0].actions == ["guess 3", "guess 7"]
    assert assistant_contents(traj) == ["guess 3", "guess 7"]
    assert traj.finish == "done"
    for pos, text in zip(generated_runs(traj), scripts["a"]):
        assert traj.tokens[pos].tolist() == tok.encode(text)
    after = generated_runs(traj)[0][-1] + 1
    assert tok.decode(traj.tokens[after:after + 2]) == "<|im_end|>\n"


@pytest.mark.parametrize("matched,ids,text", [
    (" END", "guess 3 END!", "guess 3"),  # text after the stop string goes too, as in SGLang
    ("nowhere", "guess 3", "guess 3"),  # an engine's match not in the text: nothing is cut
    (0, "guess 3<|endoftext|>", "guess 3"),
    (0, "guess 3", "guess 3"),  # matched id not at the end: the ids are left alone
    (None, "guess 3<|im_end|>", "guess 3"),  # no matched_stop: the tokenizer's eos
    (None, "guess 3<|im_start|>", "guess 3"),  # ... or a sampling stop id
    (None, "guess 3<|endoftext|>", "guess 3<|endoftext|>"),  # unknown, unreported: kept
])
def test_content_text(tok, matched, ids, text):
    stop_ids = {tok.eos_token_id, tok.hf.convert_tokens_to_ids("<|im_start|>")}
    assert agent.content_text(tok.encode(ids), matched, tok, stop_ids) == text


# --- episode endings, each confined to its own episode -------------------------------------------


def test_turn_limit(tok):
    scripts = {"slow": ["guess 1"], "fast": ["guess 7"]}
    trajs, engine, _ = run(tok, scripts, [Task("slow"), Task("fast")], max_turns=2)
    slow, fast = trajs
    assert slow.finish == "turn_limit" and slow.num_turns == 2 and not slow.success
    assert slow.rewards == pytest.approx([-0.1, -0.1])
    assert slow.messages[-1]["content"] == "Too low."  # in the transcript, not in the tokens
    assert slow.loss_mask[-1] and slow.tokens[-1] == tok.eos_token_id
    assert fast.finish == "done" and fast.num_turns == 1 and fast.success
    for t in trajs:
        check_invariants(tok, t, engine)
        # the horizon and budget it was played with, for a trainer steps later
        assert (t.info["max_turns"], t.info["max_new_tokens_per_turn"]) == (2, 32)


def test_context_limit_observation_does_not_fit(tok):
    # "big" answers wrong guesses with ~100 tokens of filler, which does not fit in 120.
    tasks = [Task("big", {"pad": 100}), Task("ok")]
    scripts = {"big": ["guess 1"], "ok": ["guess 2", "guess 7"]}
    (big, ok), engine, factory = run(tok, scripts, tasks, max_context_tokens=120)
    assert big.finish == "context_limit" and big.num_turns == 1 and len(big) <= 120
    assert big.loss_mask[-1], "the observation that did not fit is not in the tokens"
    assert big.messages[-1]["content"].startswith("Too low. filler")
    assert ok.finish == "done" and ok.num_turns == 2
    for t in (big, ok):
        check_invariants(tok, t, engine)


def test_context_limit_cuts_generation(tok):
    tasks = [Task("long"), Task("ok")]
    scripts = {"long": ["guess " + "1234567890" * 10], "ok": ["guess 7"]}
    prompt_len = len(tok.apply_chat_template(
        [{"role": "system", "content": GuessEnv.system_prompt},
         {"role": "user", "content": "Task long: the number is between 0 and 9."}],
        add_generation_prompt=True))
    cap = prompt_len + 8
    (long, ok), engine, factory = run(tok, scripts, tasks, max_context_tokens=cap,
                                      max_new_tokens_per_turn=64)
    assert engine.calls[0][0].sampling.max_new_tokens == 8  # min(L, room)
    assert long.finish == "context_limit" and len(long) == cap and long.num_generated == 8
    assert factory.by_task("long")[0].actions == []  # an unfinished action is never sent
    assert long.rewards == [0.0] and long.num_turns == 1
    assert ok.finish == "done"
    for t in (long, ok):
        check_invariants(tok, t, engine)


def test_env_errors_and_timeouts_end_only_their_episode(tok):
    tasks = [Task("ok"), Task("crash", {"crash_at": 1}),
             Task("hang", {"hang_at": 0, "hang_s": 2.0}), Task("nostart", {"reset_crash": True})]
    scripts = {k: ["guess 1", "guess 7"] for k in ("ok", "crash", "hang", "nostart")}
    start = time.monotonic()
    trajs, engine, factory = run(tok, scripts, tasks, step_timeout_s=0.25)
    elapsed = time.monotonic() - start
    ok, crash, hang, nostart = trajs
    assert elapsed < 1.5, "the loop does not wait for a hung step"
    assert ok.finish == "done" and ok.num_turns == 2 and ok.success
    assert crash.finish == "env_error" and "RuntimeError: simulator crashed" in crash.info["error"]
    assert crash.num_turns == 2 and crash.rewards == pytest.approx([-0.1, 0.0])
    assert hang.finish == "env_error" and "timed out" in hang.info["error"] and hang.num_turns == 1
    assert nostart.finish == "env_error" and "ConnectionError" in nostart.info["error"]
    assert nostart.num_turns == 0 and len(nostart) == 0 and not nostart.success
    for t in (ok, crash, hang):
        check_invariants(tok, t, engine)
    # The envs that answered are closed; the hung one is closed once its step returns.
    assert all(e.closed for e in factory.envs if e.task is None or e.task.task_id != "hang")
    hung = factory.by_task("hang")[0]
    deadline = time.monotonic() + 4
    while not hung.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hung.closed


def test_hung_step_does_not_hold_up_steps_queued_behind_it(tok):
    # One worker thread: "ok"'s step is queued behind "hang"'s, which runs 2 s. Once the hung
    # step times out, the queued one runs on a fresh thread instead of waiting out the 2 s.
    tasks = [Task("hang", {"hang_at": 0, "hang_s": 2.0}), Task("ok")]
    scripts = {k: ["guess 7"] for k in ("hang", "ok")}
    start = time.monotonic()
    (hang, ok), _, factory = run(tok, scripts, tasks, step_timeout_s=0.25, num_threads=1)
    assert time.monotonic() - start < 1.5
    assert hang.finish == "env_error" and "timed out" in hang.info["error"]
    assert ok.finish == "done" and ok.success
    hung = factory.by_task("hang")[0]
    deadline = time.monotonic() + 4
    while not hung.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hung.closed


def test_engine_abort_ends_episode(tok):
    scripts = {"a": [("abort", "gue")], "b": ["guess 7"]}
    (a, b), engine, factory = run(tok, scripts, [Task("a"), Task("b")])
    assert a.finish == "abort" and a.num_turns == 1 and factory.by_task("a")[0].actions == []
    assert b.finish == "done"
    check_invariants(tok, a, engine)


# --- batching, groups, options ------------------------------------------------------------------


def test_groups_and_one_generate_call_per_turn(tok):
    # Task k is solved at turn k: live episodes per turn are 12, 8, 4.
    tasks = [Task(f"t{k}") for k in range(3)]
    scripts = {f"t{k}": ["guess 1"] * k + ["guess 7"] for k in range(3)}
    sampling = SamplingParams(temperature=0.7, seed=123)
    trajs, engine, _ = run(tok, scripts, tasks, samples_per_task=4, sampling=sampling,
                           max_new_tokens_per_turn=16, group_id_offset=100)
    assert [len(c) for c in engine.calls] == [12, 8, 4]
    assert [t.task_id for t in trajs] == [f"t{k}" for k in range(3) for _ in range(4)]
    assert [t.group_id for t in trajs] == [100 + k for k in range(3) for _ in range(4)]
    assert [t.info["sample_index"] for t in trajs] == [0, 1, 2, 3] * 3
    assert [t.num_turns for t in trajs] == [1] * 4 + [2] * 4 + [3] * 4
    first = engine.calls[0]
    assert all(r.sampling.max_new_tokens == 16 and r.sampling.n == 1 for r in first)
    assert all(r.sampling.temperature == 0.7 for r in first)
    assert len({r.sampling.seed for r in first}) == 12, "each sample gets its own seed"
    assert len({r.request_id for c in engine.calls for r in c}) == 24
    for t in trajs:
        check_invariants(tok, t, engine)


def test_inline_env_calls_match_threads(tok):
    scripts = {"a": ["guess 2", "nope", "guess 7"], "b": ["guess 9", "guess 7"]}
    tasks = [Task("a"), Task("b")]
    threaded, _, _ = run(tok, scripts, tasks, samples_per_task=2)
    inline, _, _ = run(tok, scripts, tasks, samples_per_task=2, num_threads=0)
    for x, y in zip(threaded, inline):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
        assert x.messages == y.messages and x.finish == y.finish


def test_parse_action_value_error_is_an_observation(tok):
    def parse(text):
        if not text.startswith("guess"):
            raise ValueError("say 'guess <n>'")
        return text.strip()

    (traj,), engine, factory = run(tok, {"a": ["hmm", "guess 7"]}, [Task("a")], parse_action=parse)
    assert factory.envs[0].actions == ["guess 7"]  # the env never saw "hmm"
    assert traj.messages[3]["content"] == "Invalid action: say 'guess <n>'"
    assert traj.info["env_steps"] == 1 and traj.finish == "done"
    check_invariants(tok, traj, engine)


def test_rollout_env_steps_count_the_env_steps_not_the_turns(tok):
    """Replies the env could not parse take turns but step no env: the RL step's
    rollout/env_steps (and episode_stats' env_steps) add up the episodes' own counts."""
    from types import SimpleNamespace

    from rl_tpu.agent.evaluation import episode_stats
    from rl_tpu.recipes.config import base_config
    from rl_tpu.recipes.rl import Trainer

    def parse(text):
        if not text.startswith("guess"):
            raise ValueError("say 'guess <n>'")
        return text.strip()

    scripts = {"a": ["hmm", "what", "guess 7"], "b": ["guess 3", "?", "guess 7"]}
    trajs, _, _ = run(tok, scripts, [Task("a"), Task("b")], parse_action=parse)
    assert [t.info["env_steps"] for t in trajs] == [1, 2]  # of 3 turns each
    assert episode_stats(trajs)["env_steps"] == 3
    # _rollout_metrics reads only the config (the horizon and budget schedules)
    trainer = SimpleNamespace(config=base_config(), reward_mix=None)
    assert Trainer._rollout_metrics(trainer, trajs, step=1)["rollout/env_steps"] == 3.0


@pytest.mark.parametrize("reduce,expected", [("sum", 0.8), ("last", 1.0), ("max", 1.0),
                                             (lambda r: len(r), 3.0)])
def test_reward_reduce(tok, reduce, expected):
    (traj,), _, _ = run(tok, {"a": ["guess 1", "guess 2", "guess 7"]}, [Task("a")],
                        reward_reduce=reduce)
    assert traj.reward == pytest.approx(expected)


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="samples_per_task"):
        run(tok, {}, [Task("a")], sampling=SamplingParams(n=4))
    with pytest.raises(ValueError, match="max_turns"):
        run(tok, {}, [Task("a")], max_turns=0)
    with pytest.raises(ValueError, match="reward_reduce"):
        run(tok, {}, [Task("a")], reward_reduce="mean-ish")
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        run(tok, {}, [Task("a")], step_timeout_s=0)
    with pytest.raises(ValueError, match="num_threads must be >= 0"):
        run(tok, {}, [Task("a")], num_threads=-2)


def test_engine_contract_violation_raises_and_closes_envs(tok):
    class Broken(ScriptedEngine):
        def generate(self, requests):
            return super().generate(requests)[:-1]

    factory = EnvFactory()
    with pytest.raises(RuntimeError, match="2 requests"):
        agent.run_episodes(Broken(tok, script_policy({"a": ["guess 7"]})), factory,
                           [Task("a")] * 2, tokenizer=tok, max_turns=2,
                           max_new_tokens_per_turn=8, max_context_tokens=512)
    assert len(factory.envs) == 2 and all(e.closed for e in factory.envs)


def test_episode_stats(tok):
    scripts = {"a": ["guess 7"], "b": ["guess 1"]}
    trajs, _, _ = run(tok, scripts, [Task("a"), Task("b")], samples_per_task=2, max_turns=3)
    stats = agent.EpisodeStats.of(trajs, wall_s=2.0)
    assert stats.num_episodes == 4 and stats.success_rate == 0.5
    assert stats.mean_turns == 2.0 and stats.env_steps == 8 and stats.env_steps_per_s == 4.0
    assert stats.mean_reward == pytest.approx((1.0 + 1.0 - 0.3 - 0.3) / 4)
    assert stats.tokens_generated == sum(t.num_generated for t in trajs)
    assert stats.finish_counts == {"done": 2, "turn_limit": 2}
    d = stats.as_dict()
    assert d["rollout/success_rate"] == 0.5 and d["rollout/finish/turn_limit"] == 0.5
    assert agent.EpisodeStats.of([]).num_episodes == 0


# --- conversation start (AgentGym-RL's prompt) ---------------------------------------------

ACK = "OK. I'll follow your instructions and try my best to solve the task."


class InstructedGuessEnv(GuessEnv):
    """GuessEnv that starts its conversations as AgentGym-RL does: instruction, then ack."""

    instruction = "You are playing guess the number. Answer with 'guess <n>'."

    def conversation_start(self):
        return [{"role": "user", "content": self.instruction},
                {"role": "assistant", "content": ACK}]


def test_conversation_start_builds_the_prompt(tok):
    # The scripted engine counts assistant turns in the prompt, the ack among them.
    engine = ScriptedEngine(tok, script_policy({"a": ["(never asked)", "guess 2", "guess 7"]}))
    (traj,) = agent.run_episodes(engine, InstructedGuessEnv, [Task("a")], tokenizer=tok,
                                 max_turns=4, max_new_tokens_per_turn=32,
                                 max_context_tokens=1024)
    first = "Task a: the number is between 0 and 9."
    start = [{"role": "user", "content": InstructedGuessEnv.instruction},
             {"role": "assistant", "content": ACK},
             {"role": "user", "content": first}]
    assert traj.messages[:3] == start  # no system message: the env's start replaces it
    prompt = tok.apply_chat_template(start, add_generation_prompt=True)
    assert traj.tokens[:len(prompt)].tolist() == prompt
    assert (traj.turn_ids[:len(prompt)] == -1).all() and traj.turn_ids[len(prompt)] == 0
    assert not traj.loss_mask[:len(prompt)].any()  # the fixed ack is prompt, not a sample
    # The rest of the loop is unchanged: the history is still the template of the whole talk.
    assert traj.finish == "done" and traj.num_turns == 2
    assert tok.decode(traj.tokens[traj.loss_mask]) == "guess 2<|im_end|>guess 7<|im_end|>"
    assert assistant_contents(traj) == [ACK, "guess 2", "guess 7"]
    conv = through_last_assistant(traj.messages)
    assert traj.tokens.tolist() + tok.encode("\n") == tok.apply_chat_template(conv)


def test_conversation_start_none_keeps_the_system_prompt(tok):
    class Default(GuessEnv):
        def conversation_start(self):
            return None

    engine = ScriptedEngine(tok, script_policy({"a": ["guess 7"]}))
    (traj,) = agent.run_episodes(engine, Default, [Task("a")], tokenizer=tok, max_turns=2,
                                 max_new_tokens_per_turn=32, max_context_tokens=1024)
    assert traj.messages[0] == {"role": "system", "content": GuessEnv.system_prompt}
    prompt = tok.apply_chat_template(traj.messages[:2], add_generation_prompt=True)
    assert traj.tokens[:len(prompt)].tolist() == prompt


@pytest.mark.parametrize("start,match", [
    ("instructions", "list of"),
    ([{"role": "user"}], "list of"),
    ([{"role": "user", "content": "do it"}], "ends with a user message"),
])
def test_bad_conversation_start_is_an_env_error(tok, start, match):
    class Bad(GuessEnv):
        def conversation_start(self):
            return start

    engine = ScriptedEngine(tok, script_policy({"a": ["guess 7"]}))
    trajs = agent.run_episodes(engine, Bad, [Task("a")], tokenizer=tok, max_turns=2,
                               max_new_tokens_per_turn=32, max_context_tokens=1024)
    assert trajs[0].finish == "env_error" and re.search(match, trajs[0].info["error"])
    assert trajs[0].num_turns == 0 and engine.calls == []


def test_play_episodes_hands_on_each_group_when_it_ends(tok):
    # Task k is solved at turn k (k + 1 generate calls): groups finish in the order t0, t1, t2,
    # each handed on right after the turn that ends it, its envs closed by then.
    tasks = [Task(f"t{k}") for k in (2, 0, 1)]
    scripts = {f"t{k}": ["guess 1"] * k + ["guess 7"] for k in range(3)}
    engine, factory = ScriptedEngine(tok, script_policy(scripts)), EnvFactory()
    stream = agent.play_episodes(engine, factory, tasks, tokenizer=tok, max_turns=6,
                                 max_new_tokens_per_turn=16, max_context_tokens=1024,
                                 samples_per_task=2, group_id_offset=10)
    seen = []
    for group in stream:
        seen.append(([t.task_id for t in group], [t.group_id for t in group], len(engine.calls)))
        assert all(env.closed for env in factory.by_task(group[0].task_id))
    assert seen == [(["t0", "t0"], [11, 11], 1), (["t1", "t1"], [12, 12], 2),
                    (["t2", "t2"], [10, 10], 3)]


# --- versions of tokens sampled across a weight update --------------------------------------


class SwapMidTurnEngine(ScriptedEngine):
    """Reports what the sampler reports when new weights land between decode chunks: turn 0's
    generation starts under version 3 and gets version 5 after its first 2 ids; turn 1 (a new
    generation, its prompt prefilled afresh) runs under version 5 alone."""

    def generate(self, requests):
        out = super().generate(requests)
        for res in out:
            n = len(res.output_ids)
            if res.weight_version == "v0":
                res.weight_version = "5"
                res.info = {"weight_versions": [{"version": "3", "start": 0, "end": 2},
                                                {"version": "5", "start": 2, "end": n}]}
            else:
                res.weight_version = "5"
                res.info = {"weight_versions": [{"version": "5", "start": 0, "end": n}]}
        return out


def test_tokens_after_a_mid_generation_swap_keep_the_generations_first_version(tok):
    # Ids 2.. of turn 0 were sampled by version 5 but attended to K/V that version 3 computed
    # (the prompt's and ids 0..1's), so they count as version 3: staleness, the trainer's
    # stale-token mask and the producer's drops see them as that old. Turn 1 is a new
    # generation whose K/V version 5 computed whole: version 5.
    engine, factory = SwapMidTurnEngine(tok, script_policy({"a": ["guess 3", "guess 7"]})), \
        EnvFactory()
    (traj,) = agent.run_episodes(engine, factory, [Task("a", {"target": 7})], tokenizer=tok,
                                 max_turns=4, max_new_tokens_per_turn=32,
                                 max_context_tokens=1024)
    assert traj.num_turns == 2
    turn0 = traj.loss_mask & (traj.turn_ids == 0)
    turn1 = traj.loss_mask & (traj.turn_ids == 1)
    assert turn0.sum() > 2 and turn1.sum() > 0
    assert set(traj.token_versions[turn0].tolist()) == {3}
    assert set(traj.token_versions[turn1].tolist()) == {5}
    assert (traj.token_versions[~traj.loss_mask] == -1).all()
    assert traj.oldest_version == 3
