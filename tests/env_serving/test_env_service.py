"""The env server without a socket: EnvService's logic (idle expiry, errors, the cap) and the
FastAPI app driven in-process through httpx's ASGI transport (error shapes, the 422 -> 400
conversion, AgentGym's error style, SearchQA's dialect). Nothing here listens on a port; the
tests with real servers are in test_env_server.py and test_env_server_http.py (slow)."""

import asyncio
import json

import httpx
import pytest

from rl_tpu.core import env as env_lib
from rl_tpu.env_serving.env_service import EnvService, RequestError
from rl_tpu.env_serving.server import build_app


class Echo(env_lib.Env):
    """Echoes actions; a task whose data lacks "word" cannot start (bad data); "boom" raises."""
    name = "echo"

    def __init__(self):
        self.closed = False

    def reset(self, task):
        return f"say {task.data['word']}"

    def step(self, action):
        if action == "boom":
            raise RuntimeError("kaboom")
        return env_lib.StepResult(f"echo {action}", 1.0, action == "stop", {"n": 1})

    def close(self):
        self.closed = True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


GOOD = {"task_id": "t", "data": {"word": "hi"}}


def service(**kwargs) -> EnvService:
    return EnvService(Echo, **kwargs)


def test_idle_instances_expire_and_say_so():
    clock = Clock()
    svc = service(max_instances=2, idle_timeout_s=10, clock=clock)
    first, _ = svc.create(task=GOOD)
    second, _ = svc.create(task=GOOD)
    with pytest.raises(RequestError, match="instance limit") as err:
        svc.create(task=GOOD)
    assert err.value.status == 503
    clock.now += 5
    svc.step(second, "still here")  # touched: its idle time starts again
    clock.now += 6  # first idle 11 s, second 6 s
    third, _ = svc.create(task=GOOD)  # room made by expiring the first
    with pytest.raises(RequestError, match=f"env {first} expired after 11s without a "
                                           "request.*10s.*create a new one") as err:
        svc.step(first, "hello")
    assert err.value.status == 404
    assert svc.step(second, "x")[0].observation == "echo x"
    assert svc.health()["expired"] == 1 and svc.health()["instances"] == 2
    with pytest.raises(RequestError, match="never created") as err:
        svc.step(99, "x")
    assert err.value.status == 404
    svc.close(third)
    svc.shutdown()


def test_abandoned_creates_no_longer_fill_the_server():
    """The issue's case: a client that creates and never closes, 254 times, no longer leaves
    the server answering 503 for good."""
    clock = Clock()
    svc = service(max_instances=256, idle_timeout_s=600, clock=clock)
    for _ in range(256):
        svc.create(task=GOOD)
    with pytest.raises(RequestError):
        svc.create(task=GOOD)
    clock.now += 601
    svc.create(task=GOOD)
    assert svc.health()["instances"] == 1 and svc.health()["expired"] == 256
    svc.shutdown()


def test_a_call_in_flight_is_not_idle():
    clock = Clock()
    svc = service(idle_timeout_s=1, clock=clock)
    env_id, _ = svc.create(task=GOOD)
    instance = svc._instances[env_id]
    clock.now += 5
    with instance.lock:  # as during a long step
        assert svc.expire_idle() == 0
    assert svc.expire_idle() == 1 and instance.env.closed
    assert svc.expire_idle() == 0
    never = service(idle_timeout_s=None, clock=clock)
    never.create(task=GOOD)
    clock.now += 10**6
    assert never.expire_idle() == 0


def test_bad_task_data_is_400_naming_the_task_and_env_errors_are_500():
    svc = service()
    with pytest.raises(RequestError, match=r"cannot start task 'odd' with data "
                                           r"\{\"other\": 1\}: KeyError: 'word'") as err:
        svc.create(task={"task_id": "odd", "data": {"other": 1}})
    assert err.value.status == 400 and svc.health()["instances"] == 0
    env_id, _ = svc.create(task=GOOD)
    with pytest.raises(RequestError, match="cannot start task 'odd'") as err:
        svc.reset(env_id, task={"task_id": "odd", "data": {}})
    assert err.value.status == 400
    env_id, _ = svc.create(task=GOOD)
    with pytest.raises(RequestError, match="raised RuntimeError: kaboom.*dropped") as err:
        svc.step(env_id, "boom")
    assert err.value.status == 500
    with pytest.raises(RequestError, match="closed, dropped"):
        svc.step(env_id, "x")
    with pytest.raises(RequestError, match="no task source; send 'task'") as err:
        svc.create(data_idx=3)
    assert err.value.status == 400
    with pytest.raises(ValueError, match="idle_timeout_s"):
        service(idle_timeout_s=0)


# --- the app, in process ---------------------------------------------------------------------


def call(app, method: str, path: str, body=None, content=None) -> tuple[int, object]:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.request(method, path, json=body, content=content)
            return response.status_code, response.json()
    return asyncio.run(go())


@pytest.fixture()
def app():
    return build_app(service(max_instances=4), threads=2)


def test_errors_have_one_shape_and_name_the_field(app):
    status, created = call(app, "POST", "/create", {"task": GOOD})
    assert status == 200 and created == {"id": 0, "observation": "say hi", "reward": 0.0,
                                         "score": 0.0, "done": False}
    cases = [
        (("POST", "/step", {"id": 0}), 400, "POST /step: 'action': Field required"),
        (("POST", "/step", {"id": "0", "action": "x"}), 400, "'id': Input should be a valid "
                                                            "integer (got '0')"),
        (("POST", "/create", {"data_idx": -1}), 400, "'data_idx': Input should be greater "
                                                     "than or equal to 0 (got -1)"),
        (("POST", "/create", {"task": {"data": {}}}), 400, "'task.task_id': Field required"),
        (("POST", "/create", [1, 2]), 400, "the body must be a JSON object (got [1, 2])"),
        (("POST", "/create", None, b"{not json"), 400, "the body is not valid JSON"),
        (("GET", "/observation?id=abc"), 400, "query parameter 'id': Input should be a valid "
                                              "integer"),
        (("POST", "/step", {"id": 7, "action": "x"}), 404, "no live env with id 7"),
        (("GET", "/nowhere"), 404, "no route GET /nowhere; routes: POST /close"),
        (("GET", "/step"), 405, "/step takes POST, not GET"),
        (("POST", "/step", {"id": 0, "action": "boom"}), 500, "kaboom"),
    ]
    for args, want_status, want_text in cases:
        status, reply = call(app, *args)
        assert status == want_status, (args, reply)
        assert list(reply) == ["error"] and list(reply["error"]) == ["message"], reply
        assert want_text in reply["error"]["message"], (args, reply)


def test_routes_answer_in_agentgym_shapes(app):
    status, created = call(app, "POST", "/create", None, json.dumps({"task": GOOD}).encode())
    env_id = created["id"]
    status, stepped = call(app, "POST", "/step", {"id": env_id, "action": "stop"})
    assert (status, stepped) == (200, {"observation": "echo stop", "reward": 1.0, "score": 1.0,
                                       "done": True, "info": {"n": 1}})
    assert call(app, "GET", f"/observation?id={env_id}") == (200, "echo stop")
    status, reset = call(app, "POST", "/reset", {"id": env_id, "task": GOOD})
    assert reset["observation"] == "say hi" and reset["task_id"] == "t"
    assert call(app, "POST", "/close", {"id": env_id}) == (200, {"id": env_id, "closed": True})
    assert call(app, "GET", "/")[1] == "This is rl_tpu's env server for echo."
    health = call(app, "GET", "/health")[1]
    assert health["instances"] == 0 and health["steps"] == 1


def test_agentgym_error_style_answers_200_with_a_string():
    app = build_app(service(), error_style="agentgym", threads=1)
    for args in [("POST", "/step", {"id": 3, "action": "x"}), ("POST", "/step", {"id": 0}),
                 ("GET", "/nowhere")]:
        status, reply = call(app, *args)
        assert status == 200 and list(reply) == ["error"] and isinstance(reply["error"], str)
    with pytest.raises(ValueError, match="error_style"):
        build_app(service(), error_style="loud")


def test_searchqa_dialect():
    class Search(Echo):
        agentgym_name = "searchqa"  # SearchQA's items: the dialect by default

        def reset(self, task):
            return f"item {task.data['data_idx']}"

    app = build_app(EnvService(Search), threads=1)
    status, env_idx = call(app, "POST", "/create", {"id": 5})
    assert status == 200 and env_idx == 0
    assert call(app, "POST", "/reset", {"env_idx": env_idx, "id": 6}) == (200, "item 6")
    status, stepped = call(app, "POST", "/step", {"env_idx": env_idx, "action": "<answer>"})
    assert stepped["observation"] == "echo <answer>"
    assert call(app, "GET", f"/observation?env_idx={env_idx}") == (200, "echo <answer>")
    status, reply = call(app, "POST", "/step", {"id": env_idx, "action": "x"})
    assert status == 400 and "'env_idx': Field required" in reply["error"]["message"]
    assert call(app, "POST", "/close", {"env_idx": env_idx})[1]["closed"] is True
