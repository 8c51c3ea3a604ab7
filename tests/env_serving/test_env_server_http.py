"""The env server's HTTP edges with a real uvicorn server on 127.0.0.1 (slow: each test starts
one): bodies shorter than their Content-Length, negative and oversized lengths, idle expiry
seen by RemoteEnv, AgentGym's error style, parallel steps, and the launcher's help."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from rl_tpu.core import env as env_lib
from rl_tpu.envs import ENV_MODULES
from rl_tpu.env_serving.remote import RemoteEnv, RemoteEnvError
from rl_tpu.env_serving.server import make_server

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Sleepy(env_lib.Env):
    """Echoes; "sleep" takes 0.5 s (a slow env call, blocking its thread)."""
    name = "sleepy"

    def reset(self, task):
        return f"ready {task.task_id}"

    def step(self, action):
        if action == "sleep":
            time.sleep(0.5)
        return env_lib.StepResult(f"echo {action}")


@pytest.fixture()
def server(request):
    options = getattr(request, "param", {})
    srv = make_server(Sleepy, body_timeout_s=0.5, **options)
    srv.start()
    yield srv
    srv.shutdown()


def raw_exchange(server, data: bytes, timeout: float = 3.0) -> bytes:
    """Sends `data` on a fresh connection; what came back before the server closed it."""
    with socket.create_connection(server.server_address, timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def create(server) -> int:
    env = RemoteEnv(server.url, timeout=5)
    env.reset(env_lib.Task("t", {}))
    return env


def test_a_body_shorter_than_its_content_length_gets_408_not_a_hang(server):
    env = create(server)
    started = time.perf_counter()
    result = {}

    def stalled():
        result["reply"] = raw_exchange(server, b"POST /step HTTP/1.1\r\nHost: x\r\n"
                                               b"Content-Length: 100\r\n\r\n{\"id\": 0")
    thread = threading.Thread(target=stalled)
    thread.start()
    # Meanwhile the server answers everyone else at once.
    assert env.step("hi").observation == "echo hi"
    assert time.perf_counter() - started < 0.4
    thread.join(5)
    reply = result["reply"]
    assert status_of(reply) == 408 and b"incomplete body: 8 bytes of the 100" in reply
    assert time.perf_counter() - started < 2.5  # the 0.5 s body timeout, not the client's
    env.close()


def test_bad_content_lengths_are_refused_and_the_server_goes_on(server):
    reply = raw_exchange(server, b"POST /create HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n"
                                 b"\r\n{}")
    assert status_of(reply) == 400
    reply = raw_exchange(server, b"POST /create HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                 b"999999999\r\n\r\n{}")
    assert status_of(reply) == 413 and b"over this server's limit of 4194304" in reply
    env = create(server)
    assert env.step("after").observation == "echo after"
    env.close()


@pytest.mark.parametrize("server", [{"idle_timeout_s": 0.3}], indirect=True)
def test_idle_instances_expire_and_remote_env_recreates_on_reset(server):
    env = create(server)
    time.sleep(1.0)  # the server's sweep runs every 0.075 s at this timeout
    with pytest.raises(RemoteEnvError, match="expired after 0s without a request") as err:
        env.step("late")
    assert err.value.status == 404
    assert env.reset(env_lib.Task("u", {})) == "ready u"  # a new instance
    assert env.step("again").observation == "echo again"
    health = env._request("GET", "/health")
    assert health["expired"] == 1 and health["instances"] == 1
    env.close()


@pytest.mark.parametrize("server", [{"error_style": "agentgym"}], indirect=True)
def test_agentgym_error_style_is_a_remote_env_error_with_status_200(server):
    env = create(server)
    env._id = 12345  # an id the server never gave
    with pytest.raises(RemoteEnvError, match="answered with an error: no live env") as err:
        env.step("x")
    assert err.value.status == 200
    reply = raw_exchange(server, b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                 b"Connection: close\r\n\r\n{}")
    assert status_of(reply) == 200
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"].startswith("POST /step: 'id'")


def test_steps_on_different_instances_run_in_parallel(server):
    envs = [create(server) for _ in range(4)]
    threads = [threading.Thread(target=env.step, args=("sleep",)) for env in envs]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert time.perf_counter() - started < 1.5  # 4 x 0.5 s one after another would be 2 s
    for env in envs:
        env.close()


def test_serve_env_help_lists_the_envs_and_bad_kwargs_are_one_line():
    result = subprocess.run([sys.executable, "-m", "launch.serve_env", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    for name in ENV_MODULES:
        assert name in result.stdout, name
    assert "--error_style" in result.stdout and "--idle_timeout_s" in result.stdout
    result = subprocess.run([sys.executable, "-m", "launch.serve_env", "--env", "largest",
                             "--env_kwargs", '{"nope": 1}', "--port", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, lines
    assert "takes no keyword argument nope (its kwargs:" in lines[0]


def test_a_factory_reuses_one_pooled_connection_across_episodes(server):
    from rl_tpu.env_serving.remote import RemoteEnvFactory

    factory = RemoteEnvFactory(Sleepy(), [server.url], timeout=5)
    for i in range(5):  # one episode after another, each on a new RemoteEnv
        env = factory()
        env.reset(env_lib.Task(f"t{i}", {}))
        env.step("hi")
        env.close()
        assert len(server._uvicorn.server_state.connections) == 1
    assert env._request("GET", "/health")["created"] == 5
    factory.close()
