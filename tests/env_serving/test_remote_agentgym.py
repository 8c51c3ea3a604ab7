"""RemoteEnv's AgentGym protocol, against stand-ins for AgentGym's servers and rl_tpu's own.

The stand-ins answer exactly as AGENTGYM's BabyAI, TextCraft, SciWorld and SearchQA servers do
on the wire (routes, bodies, reply shapes, HTTP 200 `{"error"}` replies, SearchQA's bare 500,
FastAPI's 404 `{"detail": "Not Found"}` and 422), with scripted observations in place of the
games. They are stdlib HTTP servers on 127.0.0.1 in a thread (scripted, so that they can
answer exactly what AgentGym's answer, faults included); each records the requests it got, so
a test can check what the client sent. The tests that start one are marked slow.
"""

import http.server
import json
import socket
import threading

import pytest

from rl_tpu import agent
from rl_tpu.core.agentgym_parse import TOO_MANY_ACTIONS, parse_action
from rl_tpu.core.env import Env, StepResult, Task, TaskSource
from rl_tpu.env_serving.remote import (ACKNOWLEDGEMENT, RemoteEnv, RemoteEnvError, RemoteEnvFactory,
                                agentgym_name, parse_urls)
from rl_tpu.env_serving.server import make_server
from loopback import serve_in_background, stop  # noqa: E402
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rollout.scripted import ScriptedEngine

BABYAI_ACTIONS = ('["turn left", "turn right", "move forward", "go to red ball 1", '
                  '"check available actions"]')


class _Unprocessable(Exception):
    """A body FastAPI's validation would refuse (422)."""


class StandIn:
    """One AgentGym env server, scripted. `requests` lists (path, body) in arrival order, body
    None when the request had none."""

    def __init__(self, kind: str):
        self.kind, self.requests, self.envs, self.lock = kind, [], {}, threading.Lock()
        self.next_id = 0
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, status, payload, text=None):
                body = (text or json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                path = self.path.split("?")[0]
                body = json.loads(raw) if raw else None
                with stand_in.lock:
                    stand_in.requests.append((path, body))
                route = getattr(stand_in, f"{method}_{path.strip('/') or 'root'}", None)
                if route is None:
                    return self._answer(404, {"detail": "Not Found"})
                try:
                    return self._answer(200, route(body))
                except _Unprocessable as e:
                    return self._answer(422, {"detail": [{"msg": str(e)}]})
                except Exception:  # FastAPI's answer to an exception the route did not catch
                    return self._answer(500, None, text="Internal Server Error")

            def do_GET(self):
                self._handle("get")

            def do_POST(self):
                self._handle("post")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = serve_in_background(self.server)

    def close(self):
        stop(self.server)

    def sent(self, path):
        return [body for p, body in self.requests if p == path]

    # -- routes -------------------------------------------------------------------------------

    def get_root(self, body):
        return f"This is environment {self.kind}."

    def _new(self):
        self.next_id += 1
        return self.next_id - 1

    def post_create(self, body):
        if self.kind == "searchqa":
            env_idx = self._new()
            self.envs[env_idx] = {"item": body["id"], "done": False}
            return env_idx
        if self.kind == "textcraft":
            if body is None:
                raise _Unprocessable("field required: body")  # TextCraft's /create needs {}
            env_id = self._new()
            self.envs[env_id] = {"data_idx": env_id, "done": False}  # resets to data_idx = id
            return {"id": env_id, **self._textcraft_start(env_id)}
        env_id = self._new()
        self.envs[env_id] = {"done": True}
        return {"id": env_id}

    def _textcraft_start(self, data_idx):
        return {"observation": f"Crafting commands:\ncraft 4 oak planks using 1 oak logs\n\n"
                               f"Goal: craft oak planks (item {data_idx}).",
                "done": False, "reward": 0}

    def post_reset(self, body):
        key = "env_idx" if self.kind == "searchqa" else "id"
        if not isinstance(body, dict) or key not in body:
            raise _Unprocessable(f"field required: {key}")
        env = self.envs.get(body[key])
        if env is None:
            if self.kind == "searchqa":
                raise KeyError(body[key])  # a bare 500
            return {"error": f"The id {body[key]} is not valid."}
        env.update(done=False, score=0.0, moves=0)
        if self.kind == "searchqa":
            env["item"] = body["id"]
            return f"Answer the question: who wrote item {body['id']}?"
        if self.kind == "textcraft":
            return {"id": body["id"], **self._textcraft_start(body["data_idx"])}
        if self.kind == "sciworld":
            return {"task_name": "boil", "var_num": body["data_idx"],
                    "task_description": "Your task is to boil water.",
                    "observation": "This room is called the kitchen.", "reward": 0, "score": 0,
                    "deleted": False, "done": False}
        return {"observation": f"Your goal: go to the red ball\nThere is a red ball 1 2 steps "
                               f"in front of you.\nAvailable actions: {BABYAI_ACTIONS}",
                "reward": 0, "score": 0, "deleted": False, "done": False}

    def post_step(self, body):
        key = "env_idx" if self.kind == "searchqa" else "id"
        env = self.envs.get(body[key])
        if env is None:
            if self.kind == "searchqa":
                raise KeyError(body[key])
            return {"error": f"The id {body[key]} is not valid."}
        action = body["action"]
        if self.kind == "searchqa":
            if "<answer>" in action:
                right = "<answer>Ada</answer>" in action
                return {"observation": "" if right else "Sorry, your answer is incorrect. "
                        "Please try again.", "reward": int(right), "done": right, "info": None}
            return {"observation": "<information>Doc 1(Title: Ada) ...</information>",
                    "reward": 0, "done": False, "info": None}
        if self.kind == "textcraft":  # stepping after done is allowed here
            if action == "craft 4 oak planks using 1 oak logs":
                return {"observation": "Crafted 4 minecraft:oak_planks", "reward": 1, "done": True}
            if action == "get 1 oak logs":
                return {"observation": "Got 1 oak logs", "reward": 0, "done": False}
            return {"observation": f"Could not execute {action}", "reward": 0, "done": False}
        if env["done"]:
            return {"error": "The environment has been done."}
        if action == "crash":
            return {"error": "'NoneType' object has no attribute 'step'"}
        if self.kind == "sciworld":
            env["score"] += 25
            env["done"] = action == "focus on water"
            return {"observation": f"You did: {action}", "reward": 25, "score": env["score"],
                    "done": env["done"]}
        # BabyAI: the reward is the step's; the score adds it up; done only when it is > 0.5.
        reward = 0.9 if action == "go to red ball 1" else 0.0
        env["score"] += reward
        env["done"] = reward > 0.5
        text = "The task is completed." if env["done"] else (
            "No change in state." if action == "" else f"You did: {action}")
        return {"observation": f"{text}\nAvailable actions: {BABYAI_ACTIONS}", "reward": reward,
                "score": env["score"], "done": env["done"]}

    def post_close(self, body):
        key = "env_idx" if self.kind == "searchqa" else "id"
        return self.envs.pop(body.get(key), None) is not None


@pytest.fixture()
def stand_in(request):
    server = StandIn(request.param)
    yield server
    server.close()


def only(kind):
    return pytest.mark.parametrize("stand_in", [kind], indirect=True)


# --- AgentGym's servers --------------------------------------------------------------------------


@pytest.mark.slow  # starts a server thread
@only("babyai")
def test_babyai_episode(stand_in):
    env = RemoteEnv(stand_in.url, "babyai", timeout=5)
    assert env.system_prompt == "" and env.conversation_start() is None  # no request made
    first = env.reset(Task("babyai_3", {"data_idx": 3}))
    assert first.startswith("Your goal: go to the red ball\n") and "Available actions" in first
    assert stand_in.requests == [("/create", None), ("/reset", {"id": 0, "data_idx": 3})]

    result = env.step("Thought:\nThe ball is ahead.\n\nAction:\nmove forward")
    assert stand_in.sent("/step")[-1] == {"id": 0, "action": "move forward"}
    assert (result.reward, result.done) == (0.0, False)
    assert result.observation.startswith("You did: move forward")

    # Two markers: AgentGym's client answers itself and sends nothing.
    before = len(stand_in.requests)
    result = env.step("Action: turn left\nAction: turn right")
    assert (result.observation, result.reward, result.done) == (TOO_MANY_ACTIONS, 0.0, False)
    assert len(stand_in.requests) == before
    # No marker: the empty action is sent; stray characters are filtered out of an action.
    env.step("I turn left.")
    env.step("Action: Go to red-ball 1.")
    assert [b["action"] for b in stand_in.sent("/step")] == ["move forward", "", "Go to redball 1"]

    result = env.step("Thought: there.\nAction: go to red ball 1")
    # The client reports the server's running score, not the step's reward.
    assert result.done and result.reward == pytest.approx(0.9)
    assert result.info["action"] == "go to red ball 1"
    before = len(stand_in.requests)
    assert env.step("Action: turn left").info["episode_over"]  # no request after the end
    assert len(stand_in.requests) == before

    # The next episode reuses the instance; an item can be named by the task id alone.
    assert env.reset(Task("babyai_41")).startswith("Your goal")
    assert stand_in.requests[-1] == ("/reset", {"id": 0, "data_idx": 41})
    env.close()
    assert stand_in.requests[-1] == ("/close", {"id": 0})


@pytest.mark.slow  # starts a server thread
@only("babyai")
def test_babyai_error_reply_is_a_remote_env_error(stand_in):
    env = RemoteEnv(stand_in.url, "babyai", timeout=5)
    env.reset(Task("babyai_0", {"data_idx": 0}))
    with pytest.raises(RemoteEnvError, match="answered with an error: 'NoneType'") as err:
        env.step("Action: crash")
    assert err.value.status == 200 and "NoneType" in err.value.server_error
    assert stand_in.url in str(err.value) and "/step" in str(err.value)
    # An unknown id on reset is an {"error"} too (not a 404): raised, not silently re-created.
    env._id = 17
    with pytest.raises(RemoteEnvError, match="The id 17 is not valid"):
        env.reset(Task("babyai_0", {"data_idx": 0}))


@pytest.mark.slow  # starts a server thread
@only("babyai")
def test_rl_tpu_only_calls_fail_clearly_on_agentgym_servers(stand_in):
    env = RemoteEnv(stand_in.url, "babyai", timeout=5)
    with pytest.raises(RemoteEnvError, match=r"HTTP 404: Not Found.*no /info") as err:
        env.tasks()
    assert err.value.status == 404
    with pytest.raises(ValueError, match="names no AgentGym item"):
        env.reset(Task("some task", {"seed": 3}))
    with pytest.raises(ValueError, match="env_name in"):
        RemoteEnv(stand_in.url, "minecraft", protocol="agentgym")


@pytest.mark.slow  # starts a server thread
@only("textcraft")
def test_textcraft_episode(stand_in):
    env = RemoteEnv(stand_in.url, "textcraft", timeout=5)
    first = env.reset(Task("textcraft_7", {"data_idx": 7}))
    assert first.endswith("Goal: craft oak planks (item 7).")
    # /create needs a JSON body there; it resets to data_idx = id, so the client resets again.
    assert stand_in.requests == [("/create", {}), ("/reset", {"id": 0, "data_idx": 7})]
    assert env.step("Thought:\nI need wood first.\n\nAction:\nget 1 oak logs").observation \
        == "Got 1 oak logs"
    assert env.step("Action:\nAction: get 1 oak logs").observation \
        == "Could not execute Action get 1 oak logs"  # one marker swallowed the other
    result = env.step("Action: craft 4 oak planks using 1 oak logs")
    assert (result.reward, result.done) == (1.0, True)
    env.close()


@pytest.mark.slow  # starts a server thread
@only("sciworld")
def test_sciworld_episode(stand_in):
    env = RemoteEnv(stand_in.url, "sciworld", timeout=5)
    first = env.reset(Task("sciworld_12", {"data_idx": 12}))
    assert first == "Your task is to boil water.\nThis room is called the kitchen."
    assert stand_in.requests == [("/create", None), ("/reset", {"id": 0, "data_idx": 12})]
    # The text after the LAST marker, unfiltered, even over several lines.
    result = env.step("Action: look around\nThought: no.\nAction: move to\nkitchen's door.")
    assert stand_in.sent("/step")[-1]["action"] == "move to\nkitchen's door."
    assert (result.reward, result.done) == (25.0, False)
    result = env.step("Action: focus on water")
    assert (result.reward, result.done) == (50.0, True)  # the score, not the step's delta
    env.close()


@pytest.mark.slow  # starts a server thread
@only("searchqa")
def test_searchqa_episode_and_500(stand_in):
    instruction = "Answer the question; search with <search>query</search>."
    env = RemoteEnv(stand_in.url, "searchqa", timeout=5, instruction=instruction)
    assert env.conversation_start() == [{"role": "user", "content": instruction},
                                        {"role": "assistant", "content": "Ok."}]
    assert env.reset(Task("searchqa_51713")) == "Answer the question: who wrote item 51713?"
    assert stand_in.requests == [("/create", {"id": 51713}),
                                 ("/reset", {"env_idx": 0, "id": 51713})]
    reply = "I should search.\n<search>who is Ada</search>"
    assert env.step(reply).observation.startswith("<information>")
    assert stand_in.sent("/step")[-1] == {"env_idx": 0, "action": reply}  # the whole reply
    result = env.step("Action: nothing <answer>Bob</answer>")
    assert (result.reward, result.done) == (0.0, False)
    result = env.step("<answer>Ada</answer>")
    assert (result.reward, result.done) == (1.0, True)
    # SearchQA answers failures with a bare HTTP 500.
    env.reset(Task("searchqa_1"))
    env._id = 99
    with pytest.raises(RemoteEnvError, match="HTTP 500: Internal Server Error.*SearchQA") as err:
        env.step("<search>x</search>")
    assert err.value.status == 500
    env._id = 0
    env.close()
    assert stand_in.requests[-1] == ("/close", {"env_idx": 0})


@pytest.mark.slow  # starts a server thread
@only("babyai")
def test_agent_loop_over_an_agentgym_server(stand_in):
    """run_episodes with AgentGym-RL's conversation start, against the BabyAI stand-in."""
    tok = ChatTokenizer(build_tokenizer(512))
    instruction = "You are an exploration master. Answer in the format Thought: ... Action: ..."
    replies = ["(the ack)", "Thought:\nahead\n\nAction:\nmove forward",
               "Action: turn left\nAction: go to red ball 1", "Action: go to red ball 1"]
    engine = ScriptedEngine(tok, lambda text, turn: replies[min(turn, len(replies) - 1)])
    (traj,) = agent.run_episodes(
        engine, lambda: RemoteEnv(stand_in.url, "babyai", timeout=5, instruction=instruction),
        [Task("babyai_5", {"data_idx": 5})], tokenizer=tok, max_turns=5,
        max_new_tokens_per_turn=48, max_context_tokens=2048, reward_reduce="last")
    assert traj.messages[0] == {"role": "user", "content": instruction}
    assert traj.messages[1] == {"role": "assistant", "content": ACKNOWLEDGEMENT}
    assert traj.messages[2]["content"].startswith("Your goal")
    prompt = tok.apply_chat_template(traj.messages[:3], add_generation_prompt=True)
    assert traj.tokens[:len(prompt)].tolist() == prompt
    assert traj.messages[6] == {"role": "user", "content": TOO_MANY_ACTIONS}
    assert traj.finish == "done" and traj.reward == pytest.approx(0.9) and traj.num_turns == 3
    assert [b["action"] for b in stand_in.sent("/step")] == ["move forward", "go to red ball 1"]
    assert stand_in.requests[-1] == ("/close", {"id": 0})


# --- rl_tpu's own server, the same client ---------------------------------------------------


class _Items(TaskSource):
    """Item i of AgentGym's numbering, in every split."""

    def size(self, split):
        return None

    def get(self, split, index):
        return Task(f"toy_{index}", {"data_idx": index})


class AgentGymStyleEnv(Env):
    """An env that, like rl_tpu's AgentGym-mode envs, takes the model's whole reply and parses
    it with AgentGym's parser; it reports a running score as its reward."""

    name = "toy_agentgym"

    def __init__(self):
        self.seen, self.score = [], 0.0

    def tasks(self):
        return _Items()

    def reset(self, task):
        self.score = 0.0
        return f"Item {task.data.get('data_idx', task.task_id)}: say 'open door 1'."

    def step(self, reply):
        action, refusal = parse_action(reply)
        assert refusal is None, "the client refuses two markers before sending"
        self.seen.append(action)
        self.score += 0.5 if action == "open door 1" else 0.0
        return StepResult(f"You did: {action}", self.score, action == "open door 1")


def _serve(env, **kwargs):
    server = make_server(env, **kwargs)
    return server, serve_in_background(server)


@pytest.mark.slow  # starts a server thread
def test_rl_tpu_server_answers_in_agentgym_shapes():
    envs = []

    def factory():
        envs.append(AgentGymStyleEnv())
        return envs[-1]

    server, url = _serve(factory, action_prefix="Action: ")
    try:
        env = RemoteEnv(url, "babyai", timeout=5)
        assert env.reset(Task("babyai_2", {"data_idx": 2})) == "Item 2: say 'open door 1'."
        result = env.step("Thought:\nthe door.\n\nAction:\nopen door 1.")
        # The env got "Action: open door 1" and parsed it back to exactly the sent action.
        assert envs[-1].seen == ["open door 1"]
        assert (result.observation, result.reward, result.done) == ("You did: open door 1",
                                                                    0.5, True)
        env.close()
    finally:
        stop(server)


def _registered(prefix: str, agentgym: str) -> str:
    """The registered env named `prefix...` that plays AgentGym's `agentgym` (read at run
    time: envs get renamed)."""
    from rl_tpu.core import env as env_lib
    from rl_tpu.envs import ENV_MODULES
    for name in sorted(n for n in ENV_MODULES if n.startswith(prefix)):
        env = env_lib.make(name)
        try:
            if agentgym_name(env) == agentgym:
                return name
        finally:
            env.close()
    pytest.skip(f"no registered env plays AgentGym's {agentgym}")


@pytest.mark.slow  # starts a server thread
def test_rl_tpu_server_plays_an_agentgym_env_like_the_local_one():
    pytest.importorskip("minigrid")
    from rl_tpu.core import env as env_lib

    name = _registered("babyai", "babyai")
    server, url = _serve(name)
    try:
        local, env = env_lib.make(name), RemoteEnv(url, "babyai", timeout=10)
        task = local.tasks().get("train", 4)  # data_idx 4004 or so: AgentGym's item number
        assert env.reset(task) == local.reset(task)
        for reply in ["Thought:\nturning.\n\nAction:\nturn left", "Action: move forward",
                      "Action: turn left\nAction: turn right", "no marker at all"]:
            remote_result, local_result = env.step(reply), local.step(reply)
            assert remote_result.observation == local_result.observation
            assert remote_result.reward == local_result.reward
            assert remote_result.done == local_result.done
        # The rl_tpu-only extras still work on an rl_tpu server.
        assert env.tasks().get("train", 4) == task
        env.close()
        local.close()
    finally:
        stop(server)


class ToySearchEnv(Env):
    """SearchQA-like: the whole reply arrives; `<answer>Ada</answer>` solves it."""

    name = "toy_searchqa"

    def tasks(self):
        return _Items()

    def reset(self, task):
        self.replies = []
        return f"Question {task.data['data_idx']}: who was the first programmer?"

    def step(self, reply):
        self.replies.append(reply)
        right = "<answer>Ada</answer>" in reply
        return StepResult("" if right else "Sorry, your answer is incorrect. Please try again.",
                          float(right), right)


@pytest.mark.slow  # starts a server thread
def test_rl_tpu_server_speaks_searchqa():
    envs = []

    def factory():
        envs.append(ToySearchEnv())
        return envs[-1]

    server, url = _serve(factory, dialect="searchqa")
    try:
        env = RemoteEnv(url, "searchqa", timeout=5)
        assert env.reset(Task("searchqa_60000")) == "Question 60000: who was the first programmer?"
        reply = "Thought: I know.\nAction: answer\n<answer>Bob</answer>"
        assert env.step(reply).observation.startswith("Sorry")
        result = env.step("<answer>Ada</answer>")
        assert (result.reward, result.done) == (1.0, True)
        assert envs[-1].replies == [reply, "<answer>Ada</answer>"]  # sent whole, as AgentGym
        assert env.observation() == ""
        assert env.reset(Task("searchqa_3")).startswith("Question 3:")  # same instance
        assert len(envs) == 2  # the server's metadata env and one instance
        env.close()
        with pytest.raises(RemoteEnvError, match="env_idx"):
            env._request("POST", "/step", {"id": 0, "action": "x"})
    finally:
        stop(server)


# --- RemoteEnvFactory: what training against servers builds ------------------------------------


class _BabyAIItems(TaskSource):
    """AgentGym's numbering, as rl_tpu's AgentGym-mode BabyAI has it: train from 4000."""

    def size(self, split):
        return 100

    def get(self, split, index):
        i = index if split == "eval" else 4000 + index
        return Task(f"babyai_{i}", {"data_idx": i})


class ToyAgentGymBabyAI(AgentGymStyleEnv):
    """A local definition with AgentGym's BabyAI numbering and conversation start, under a
    name of its own (the factory must not care what an env is registered as)."""

    name = "toy_babyai"

    def tasks(self):
        return _BabyAIItems()

    def conversation_start(self):
        return [{"role": "user", "content": "Reach the goal."},
                {"role": "assistant", "content": ACKNOWLEDGEMENT}]


def test_agentgym_name_is_read_off_the_task_numbering():
    assert agentgym_name(ToyAgentGymBabyAI()) == "babyai"
    assert agentgym_name(AgentGymStyleEnv()) is None  # "toy_<i>": not an AgentGym env
    assert agentgym_name(ToySearchEnv()) is None
    assert agentgym_name(_NoTasks()) is None  # no task source at all
    # An env's own word wins: "" for a mode that does not speak AgentGym's protocol.
    primitive = ToyAgentGymBabyAI()
    primitive.agentgym_name = ""
    assert agentgym_name(primitive) is None
    named = _NoTasks()
    named.agentgym_name = "textcraft"
    assert agentgym_name(named) == "textcraft"


class _NoTasks(Env):
    name = "no_tasks"

    def reset(self, task):
        return ""

    def step(self, action):
        return StepResult("")


@pytest.mark.slow  # starts a server thread
def test_factory_spreads_envs_round_robin_with_the_local_definition():
    served = []

    def factory():
        served.append(ToyAgentGymBabyAI())
        return served[-1]

    (s1, url1), (s2, url2) = _serve(factory), _serve(factory)
    try:
        local = ToyAgentGymBabyAI()
        make_env = RemoteEnvFactory(local, [url1, url2 + "/"], timeout=5, retries=1)
        make_env.check_servers()
        assert (make_env.protocol, make_env.agentgym) == ("agentgym", "babyai")
        envs = [make_env() for _ in range(4)]
        assert [e.url for e in envs] == [url1, url2, url1, url2]
        task = envs[0].tasks().get("train", 2)  # the local source: no request
        assert task == Task("babyai_4002", {"data_idx": 4002})
        for env in envs:
            assert env.reset(task) == "Item 4002: say 'open door 1'."  # the same item
            assert env.conversation_start() == local.conversation_start()
            assert env.system_prompt == ""
            assert env.step("Thought: go.\nAction: open door 1").done
            env.close()
        assert [s.service.health()["created"] for s in (s1, s2)] == [2, 2]
        assert [s.service.health()["instances"] for s in (s1, s2)] == [0, 0]
    finally:
        for server in (s1, s2):
            stop(server)


@pytest.mark.slow  # starts a server thread
@only("babyai")
def test_factory_checks_servers_before_any_compute(stand_in):
    # AgentGym's server has no /info: fine for an env with an AgentGym name ...
    RemoteEnvFactory(ToyAgentGymBabyAI(), [stand_in.url], timeout=5).check_servers()
    # ... but an env without one needs rl_tpu's server, which can play its tasks.
    with pytest.raises(ValueError, match=r"no /info.*launch.serve_env --env toy_agentgym"):
        RemoteEnvFactory(AgentGymStyleEnv(), [stand_in.url], timeout=5).check_servers()
    server, url = _serve(ToySearchEnv)  # serves toy_searchqa
    try:
        with pytest.raises(ValueError, match=r"serves 'toy_searchqa', but env.name is "
                                             r"'toy_babyai'"):
            RemoteEnvFactory(ToyAgentGymBabyAI(), [stand_in.url, url],
                             timeout=5).check_servers()
    finally:
        stop(server)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(ValueError, match=rf"{dead} does not answer"):
        RemoteEnvFactory(ToyAgentGymBabyAI(), [dead], timeout=1, retries=1,
                         backoff=0.01).check_servers()


@pytest.mark.parametrize("text,problem", [
    ("", "names no env server"), (" , ", "names no env server"),
    ("ftp://host:1", "http://host:port"), ("http://host:port", "bad port"),
    ("http://127.0.0.1:1,http://", "http://host:port"), ("http://h:1/api", "http://host:port")])
def test_bad_server_urls_are_named(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_urls(text)
    assert parse_urls("127.0.0.1:36001, http://h:2/") == ["http://127.0.0.1:36001",
                                                          "http://h:2"]
