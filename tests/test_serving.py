"""The HTTP limits, the API key and the docs switch that both servers share (rl_tpu/serving.py,
rl_tpu/http_limits.py), tried as a hostile client would on real servers on 127.0.0.1 with raw
sockets: half-sent and silent connections, a header over the cap, a body over the cap or
shorter than its Content-Length, more connections than the cap, JSON too deep or with a
5,000-digit integer, a missing key. Each is answered (or closed) within its limit, logs one
warning line, and leaves the server serving. The env server's tests run by default (about
12 s); the rollout server's, with a tiny model, are slow ones at the end, each checking that
its greedy output for a fixed prompt is unchanged after the abuse."""

import json
import logging
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time

import pytest

from rl_tpu import http_limits
from rl_tpu.core import env as env_lib
from rl_tpu.env_serving.remote import RemoteEnv, RemoteEnvError
from rl_tpu.env_serving.server import make_server
from rl_tpu.http_limits import HttpLimits, JSONLimitError, deeper_than, loads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small limits so that every abuse is quick to see through.
LIMITS = HttpLimits(max_header_bytes=4096, header_timeout_s=1.0, max_body_bytes=64 << 10,
                    body_timeout_s=1.0, keep_alive_s=30.0, max_connections=8,
                    max_json_depth=16)


class Echo(env_lib.Env):
    """Echoes; "win" ends the episode with reward 1."""
    name = "echo"

    def reset(self, task):
        return f"ready {task.task_id}"

    def step(self, action):
        won = action == "win"
        return env_lib.StepResult(f"echo {action}", reward=float(won), done=won)


@pytest.fixture()
def env_server(request):
    options = getattr(request, "param", {})
    srv = make_server(Echo, **{"limits": LIMITS, **options})
    srv.start()
    http_limits.warn._last.clear()  # each test sees its first warning of a kind
    http_limits.warn._held.clear()
    yield srv
    srv.shutdown()


# -- raw HTTP ---------------------------------------------------------------------------------


def connect(server, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(server.server_address, timeout=timeout)


def read_reply(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one reply; (0, b"") if the server closed (or reset) without one."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return 0, b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except ConnectionResetError:
        return 0, b""
    return int(head.split(b" ", 2)[1]), body


def closed(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the server closes `sock` within `timeout` s (what it sends first is dropped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def ask(server, request: bytes, key: str = "") -> tuple[int, bytes]:
    """One request on a fresh connection (`Host`, the key and `Connection: close` added)."""
    method_line, _, rest = request.partition(b"\r\n")
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    with connect(server) as sock:
        sock.sendall(method_line + b"\r\nHost: t\r\nConnection: close\r\n" + auth + rest)
        return read_reply(sock)


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


def healthy(server, key: str = "") -> bool:
    return ask(server, b"GET /health HTTP/1.1\r\n\r\n", key)[0] == 200


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]["message"]


# -- the JSON scan and parser -----------------------------------------------------------------


@pytest.mark.parametrize("text,depth", [
    ("1", 0), ("[]", 1), ('{"a": [[1], {"b": []}]}', 4),  # { [ { [
    ('["[[[[", "{{"]', 1),  # brackets inside strings do not nest
    ('["a\\"[[[", [2]]', 2),  # an escaped quote does not end the string
    ('["a\\\\", [[3]]]', 3),  # an escaped backslash does not escape the quote after it
    ('[' * 70 + ']' * 70, 70),
])
def test_deeper_than_counts_brackets_outside_strings(text, depth):
    raw = text.encode()
    assert not deeper_than(raw, depth) and (depth == 0 or deeper_than(raw, depth - 1))


def test_loads_names_the_limit_and_parses_what_is_within_it():
    with pytest.raises(JSONLimitError, match="^JSON nested deeper than 64 levels$"):
        loads(b"[" * 100_000 + b"]" * 100_000, 64)
    with pytest.raises(JSONLimitError, match="a number of 5000 digits; integers may have at "
                                             "most 4300 digits"):
        loads(b'{"seed": ' + b"7" * 5000 + b"}", 64)
    assert loads(b'{"a": [[1, 2]], "s": "[[[["}', 3) == {"a": [[1, 2]], "s": "[[[["}
    assert loads(b"1" * 4300, 64) == int("1" * 4300)
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # the interpreter's own limit off: ours still holds
    try:
        with pytest.raises(JSONLimitError, match="a number of 5001 digits"):
            loads(b"[-" + b"9" * 5001 + b"]", 64)
    finally:
        sys.set_int_max_str_digits(old)


def test_limits_refuse_a_bad_value_by_its_flag():
    with pytest.raises(ValueError, match="--max_body_bytes must be an integer >= 1, got 0"):
        HttpLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="--header_timeout_s must be > 0 seconds"):
        HttpLimits(header_timeout_s=0)


# -- the env server -------------------------------------------------------------------------


def test_half_sent_and_silent_connections_are_closed_by_the_header_deadline(env_server):
    sends = [b"", b"POST /st", b"POST /step HTTP/1.1\r\nHost: t\r\nX-A: 1"]
    selector = selectors.DefaultSelector()
    started = time.perf_counter()
    socks = []
    for i in range(201):
        sock = connect(env_server)
        sock.sendall(sends[i % 3])
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        socks.append(sock)
    replies, took = {}, []
    while len(took) < len(socks) and time.perf_counter() - started < 10:
        for key, _ in selector.select(timeout=0.5):
            try:
                data = key.fileobj.recv(65536)
            except ConnectionResetError:
                data = b""
            replies[key.fileobj] = replies.get(key.fileobj, b"") + data
            if not data:
                selector.unregister(key.fileobj)
                took.append(time.perf_counter() - started)
    assert len(took) == 201, f"{201 - len(took)} connections still open after 10 s"
    # 1 s deadline (measured: all closed 1.0-1.1 s after they opened)
    assert max(took) < 5.0 and min(took) > 0.9
    for i, sock in enumerate(socks):
        reply = replies.get(sock, b"")
        # part of a request came: told why; nothing came: just closed
        assert reply.startswith(b"HTTP/1.1 408 ") if sends[i % 3] else reply == b""
        sock.close()
    assert healthy(env_server)


def test_a_header_over_the_cap_is_431_and_one_within_it_is_served(env_server, caplog):
    big = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    started = time.perf_counter()
    with connect(env_server) as sock:
        try:
            sock.sendall(big)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: what it answered is still there to read
        status, body = read_reply(sock)
        assert closed(sock, 5.0)
    assert status == 431 and "limit of 4096 bytes (--max_header_bytes)" in error_of(body)
    assert time.perf_counter() - started < 3.0  # measured 0.01 s (the linger is 2 s at most)
    # Headers just under the cap with a body in the same packet: the body is not counted.
    status, body = ask(env_server, post("/create", b'{"task": {"task_id": "t"}}'))
    assert status == 200
    action = json.dumps({"id": json.loads(body)["id"], "action": "x" * 50_000}).encode()
    pad = b"X-Pad: " + b"p" * 3900 + b"\r\n"
    status, body = ask(env_server, b"POST /step HTTP/1.1\r\n" + pad +
                       post("/step", action).split(b"\r\n", 1)[1])
    assert status == 200 and json.loads(body)["observation"] == "echo " + "x" * 50_000
    records = [r for r in caplog.records if r.name == "rl_tpu.http_limits"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "431" in records[0].getMessage() and records[0].exc_info is None


def test_a_body_over_the_cap_is_413_before_any_of_it_is_read(env_server):
    for length in (10**18, (64 << 10) + 1):
        started = time.perf_counter()
        with connect(env_server) as sock:
            sock.sendall(f"POST /step HTTP/1.1\r\nHost: t\r\nContent-Length: {length}\r\n"
                         "\r\n".encode())  # and no body at all
            status, body = read_reply(sock)
            assert closed(sock, 5.0)
        assert status == 413 and f"a body of {length} bytes is over this server's limit of " \
            f"65536 (--max_body_bytes)" in error_of(body)
        assert time.perf_counter() - started < 1.0  # measured 0.003 s
    chunk = b"x" * 40_000  # chunked: no length to check first; refused once past the cap
    with connect(env_server) as sock:
        sock.sendall(b"POST /step HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" +
                     (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2)
        status, body = read_reply(sock)
    assert status == 413 and "the body is over this server's limit" in error_of(body)
    assert healthy(env_server)


def test_a_body_shorter_than_its_length_is_408_at_the_body_deadline(env_server, caplog):
    started = time.perf_counter()
    with connect(env_server) as sock:
        sock.sendall(b"POST /step HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"id\"")
        status, body = read_reply(sock)
        assert closed(sock, 5.0)
    took = time.perf_counter() - started
    assert status == 408 and 0.9 < took < 5.0  # 1 s deadline; measured 1.00 s
    assert "incomplete body: 5 bytes of the 100 its Content-Length announces arrived within " \
        "1s (--body_timeout_s)" in error_of(body)
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1 and records[0].exc_info is None
    assert healthy(env_server)


def test_connections_over_the_cap_get_503_and_service_resumes_when_they_go(env_server):
    held = []
    for _ in range(8):  # the cap: 8 kept-alive connections, each served once
        sock = connect(env_server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_reply(sock)[0] == 200
        held.append(sock)
    with connect(env_server) as sock:  # the ninth
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        status, body = read_reply(sock)
        assert closed(sock, 5.0)
    assert status == 503 and "over its limit of 8 (--max_connections)" in error_of(body)
    held.pop().close()
    deadline = time.monotonic() + 5
    while not healthy(env_server):  # once the server has seen that one go
        assert time.monotonic() < deadline, "no request served after a connection went"
        time.sleep(0.05)
    for sock in held:  # the ones kept are still served
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_reply(sock)[0] == 200
        sock.close()


@pytest.mark.parametrize("env_server", [{"limits": HttpLimits(keep_alive_s=0.5)}],
                         indirect=True)
def test_an_idle_kept_alive_connection_is_closed(env_server):
    with connect(env_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_reply(sock)[0] == 200
        started = time.perf_counter()
        assert closed(sock, 5.0)
    assert 0.4 < time.perf_counter() - started < 2.5  # 0.5 s; measured 0.50 s


def test_json_too_deep_or_with_a_huge_integer_is_a_400_naming_it(env_server):
    status, body = ask(env_server, post("/step", b"[" * 30_000 + b"]" * 30_000))  # < 64 KiB
    assert status == 400 and error_of(body) == "POST /step: JSON nested deeper than 16 levels"
    status, body = ask(env_server, post("/step", b'{"id": ' + b"9" * 5000 + b', "action": 1}'))
    assert status == 400 and "a number of 5000 digits; integers may have at most 4300" in \
        error_of(body)
    env = RemoteEnv(env_server.url, timeout=5)
    env.reset(env_lib.Task("t", {}))
    deep_text = "[" * 1000  # brackets in a string are text, at any count
    assert env.step(deep_text).observation == "echo " + deep_text
    env.close()


@pytest.mark.parametrize("env_server", [{"api_key": "k3y"}], indirect=True)
def test_a_keyed_env_server_wants_the_key_and_remote_env_sends_it(env_server, monkeypatch):
    assert ask(env_server, b"GET /health HTTP/1.1\r\n\r\n")[0] == 401
    status, body = ask(env_server, b"GET /health HTTP/1.1\r\n\r\n", key="wrong")
    assert status == 401 and "wrong API key" in error_of(body)
    assert healthy(env_server, key="k3y")
    started = time.perf_counter()  # refused before its body is waited for
    with connect(env_server) as sock:
        sock.sendall(b"POST /step HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n")
        assert read_reply(sock)[0] == 401
    assert time.perf_counter() - started < 0.5  # the body deadline is 1 s
    monkeypatch.delenv("RL_TPU_ENV_API_KEY", raising=False)
    with pytest.raises(RemoteEnvError, match="wants an API key .*set RL_TPU_ENV_API_KEY") as err:
        RemoteEnv(env_server.url, timeout=5).reset(env_lib.Task("t", {}))
    assert err.value.status == 401
    for env in (RemoteEnv(env_server.url, timeout=5, api_key="k3y"),
                monkeypatch.setenv("RL_TPU_ENV_API_KEY", "k3y") or RemoteEnv(env_server.url,
                                                                              timeout=5)):
        assert env.reset(env_lib.Task("t", {})) == "ready t"
        assert env.step("go").observation == "echo go"
        result = env.step("win")
        assert result.done and result.reward == 1.0
        env.close()


@pytest.mark.parametrize("docs", [False, True])
def test_interactive_docs_are_served_only_when_asked(docs):
    srv = make_server(Echo, docs=docs)
    srv.start()
    try:
        for path in (b"/docs", b"/redoc", b"/openapi.json"):
            status, _ = ask(srv, b"GET " + path + b" HTTP/1.1\r\n\r\n")
            assert status == (200 if docs else 404), path
    finally:
        srv.shutdown()


def test_serve_env_takes_the_limits_and_the_key_and_never_buffers_a_huge_header(tmp_path):
    """The launcher: flags and RL_TPU_ENV_API_KEY reach the server; a 64 MiB header is refused
    after 8 KiB (before: answered 200, peak RSS +129 MiB), the process's peak RSS flat."""
    env = dict(os.environ, RL_TPU_ENV_API_KEY="from-env", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.serve_env", "--env", "arithmetic", "--port", "0",
         "--max_header_bytes", "8192", "--header_timeout_s", "1"], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _read_line(proc, 60.0)
        host, port = re.search(r"http://([\d.]+):(\d+)", line).groups()

        class At:  # what the helpers above need of a server
            server_address = (host, int(port))

        assert "from-env" not in " ".join(proc.args)
        assert ask(At, b"GET /health HTTP/1.1\r\n\r\n")[0] == 401
        assert healthy(At, key="from-env")
        assert ask(At, b"GET /docs HTTP/1.1\r\n\r\n", key="from-env")[0] == 404
        before = _peak_rss_mib(proc.pid)
        with connect(At) as sock:
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX: " + b"a" * (64 << 20))
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert read_reply(sock)[0] in (431, 0)  # a reset if it ran past the 2 s linger
            assert closed(sock, 5.0)
        assert _peak_rss_mib(proc.pid) - before < 16  # measured +0-1 MiB
        with connect(At) as sock:  # --header_timeout_s
            sock.sendall(b"GET /hea")
            assert closed(sock, 5.0)
        assert healthy(At, key="from-env")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err


@pytest.mark.parametrize("launcher,args", [
    ("serve_env", ["--env", "arithmetic"]),
    pytest.param("serve_rollout", ["--model_path", "/nonexistent"], marks=pytest.mark.slow),
])
def test_the_launchers_help_exits_0_and_a_bad_limit_is_one_line(launcher, args):
    run = lambda *more: subprocess.run(  # noqa: E731
        [sys.executable, "-m", f"launch.{launcher}", *more], cwd=REPO, capture_output=True,
        text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    shown = run("--help")
    assert shown.returncode == 0 and "--max_header_bytes" in shown.stdout
    assert "--api_key" in shown.stdout and "--docs" in shown.stdout
    bad = run(*args, "--max_body_bytes", "0")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
        f"launch.{launcher}: --max_body_bytes must be an integer >= 1, got 0"]


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    result = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert result and result[0], f"no URL line within {timeout}s"
    return result[0]


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+)", status.read()).group(1)) / 1024


# -- the rollout server (slow: a tiny model) --------------------------------------------------

GREEDY = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {
    "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}).encode()


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from rl_tpu.models import hf, tiny
    from rl_tpu.models.tokenizer import load_tokenizer
    from rl_tpu.rollout.sampler import JaxSampler
    from rl_tpu.rollout.server import RolloutService, serve

    root = str(tmp_path_factory.mktemp("rollout"))
    tiny.write_tiny_model(root, "qwen2", vocab_size=320, seed=0)
    cfg, params = hf.load(root)
    tok = load_tokenizer(root)
    service = RolloutService(JaxSampler(cfg, params, tokenizer=tok), root, tok)
    srv = serve(service, "127.0.0.1", 0, api_key="k3y", limits=LIMITS)
    srv.start()
    srv.greedy = greedy(srv)
    yield srv
    srv.shutdown()
    service.batcher.close()


def greedy(server) -> list:
    status, body = ask(server, post("/generate", GREEDY), key="k3y")
    assert status == 200, body
    return json.loads(body)["output_ids"]


def refused(server, data: bytes) -> tuple[int, float]:
    """(status, seconds until the server closed) for `data` sent on a fresh connection."""
    started = time.perf_counter()
    with connect(server) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _ = read_reply(sock)
        assert closed(sock, 10.0)
    return status, time.perf_counter() - started


def over_the_connection_cap(server) -> tuple[int, float]:
    ask_health = b"GET /health HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k3y\r\n\r\n"
    held = [connect(server) for _ in range(LIMITS.max_connections)]
    try:
        for sock in held:
            sock.sendall(ask_health)
            assert read_reply(sock)[0] == 200
        return refused(server, ask_health)
    finally:
        for sock in held:
            sock.close()


KEY = b"Host: t\r\nAuthorization: Bearer k3y\r\n"
# name: (abuse, status answered (0: closed without one), most seconds it may take)
ROLLOUT_ABUSES = {
    "half-sent request": (lambda s: refused(s, b"POST /generate HTTP/1.1\r\nHost: t"), 408, 5.0),
    "silent connection": (lambda s: refused(s, b""), 0, 5.0),
    "64 KiB+ header": (lambda s: refused(s, b"GET /health HTTP/1.1\r\nX: " + b"a" * (1 << 20)),
                       431, 3.0),
    "Content-Length 1e18": (lambda s: refused(
        s, b"POST /generate HTTP/1.1\r\n" + KEY + b"Content-Length: 10" + b"0" * 17 +
        b"\r\n\r\n"), 413, 1.0),
    "short body": (lambda s: refused(s, b"POST /generate HTTP/1.1\r\n" + KEY +
                                     b"Content-Length: 100\r\n\r\n{\"input_ids\""), 408, 5.0),
    "no key": (lambda s: refused(s, b"POST /generate HTTP/1.1\r\nHost: t\r\nConnection: close"
                                    b"\r\nContent-Length: 1000000\r\n\r\n"), 401, 1.0),
    "connections over the cap": (over_the_connection_cap, 503, 1.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ROLLOUT_ABUSES))
def test_the_rollout_server_bounds_each_abuse_and_its_output_is_unchanged(rollout, name):
    abuse, status, most_s = ROLLOUT_ABUSES[name]
    answered, took = abuse(rollout)
    assert answered == status and took < most_s, (answered, took)
    assert healthy(rollout, key="k3y") and greedy(rollout) == rollout.greedy


@pytest.mark.slow
def test_the_rollout_server_answers_json_limits_400_and_keeps_its_docs_off(rollout):
    status, body = ask(rollout, post("/generate", b"[" * 30_000 + b"]" * 30_000), key="k3y")
    assert status == 400 and error_of(body) == "POST /generate: JSON nested deeper than 16 levels"
    status, body = ask(rollout, post("/generate", b'{"input_ids": [' + b"7" * 5000 + b"]}"),
                       key="k3y")
    assert status == 400 and "a number of 5000 digits" in error_of(body)
    for path in (b"/docs", b"/redoc", b"/openapi.json"):
        assert ask(rollout, b"GET " + path + b" HTTP/1.1\r\n\r\n", key="k3y")[0] == 404
    assert ask(rollout, b"GET /health HTTP/1.1\r\n\r\n", key="wrong")[0] == 401
    assert healthy(rollout, key="k3y") and greedy(rollout) == rollout.greedy


def test_a_route_that_crashes_is_one_500_and_one_logged_traceback(caplog):
    import httpx
    from fastapi import FastAPI

    from rl_tpu.serving import Server, install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bug")
    def bug():
        return {}["missing"]

    @app.get("/fine")
    def fine():
        return {"ok": True}

    server = Server(app)
    url = server.start()
    # uvicorn's loggers do not propagate to the root logger that caplog listens on
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            reply = httpx.get(f"{url}/bug", timeout=10)
            assert reply.status_code == 500
            assert reply.json() == {"error": {"message": "KeyError: 'missing'"}}
            assert httpx.get(f"{url}/fine", timeout=10).json() == {"ok": True}
        tracebacks = [r for r in caplog.records if r.exc_info]
        assert [r.getMessage() for r in tracebacks] == ["GET /bug failed"]
    finally:
        uvicorn_log.removeHandler(caplog.handler)
        server.shutdown()
