"""Serve any registered env over the AgentGym env-server HTTP API.

Wire format (JSON bodies; the routes and fields of AgentGym's BabyAI / TextCraft / SciWorld
servers, so `rl_tpu.envs.remote.RemoteEnv` and AgentGym's own clients read both alike):

  POST /create  no body, {} or {"data_idx": i, "split": "train"}
                                        -> {"id", "observation", "reward", "score", "done"}
  POST /step    {"id": n, "action": "..."}
                                        -> {"observation", "reward", "score", "done", "info"}
  POST /reset   {"id": n, "data_idx": i, "split": "train"}
                                        -> {"id", "observation", "reward", "score", "done"}
  GET  /observation?id=n                -> the last observation (a JSON string)
  POST /close   {"id": n}               -> {"id", "closed": true}
  GET  /                                -> a JSON string naming the server, as AgentGym's do

`score` is the env's reward, the number AgentGym's clients report (rl_tpu's AgentGym-mode envs
already report BabyAI's and SciWorld's running score as their reward). A data index without a
split is AgentGym's item number for an AgentGym-mode env (one whose tasks are numbered as
AgentGym's are, `Task(f"{name}_{i}", {"data_idx": i})`: see `remote.agentgym_name`), so
data_idx i plays the very task it plays on AgentGym's server and on the local env; for any
other env it is an index into the "train" split.

The `action` of `/step` is what AgentGym's client sends: the action already parsed out of the
model's reply. rl_tpu's AgentGym-mode BabyAI, TextCraft and SciWorld envs take the whole reply
and parse it themselves, so for them the server hands the env `"Action: " + action`, which
their parsers read back as exactly `action` (a parsed action has no `Action:` marker and
nothing the filter drops). Other envs get `action` as sent, and so does every env when the
body says `"raw": true` (rl_tpu's protocol, which sends the model's whole reply).

rl_tpu additions: `/create` and `/reset` also take `"task": {"task_id", "data"}` instead of a
data index (tasks that are not in the env's own task source); `GET /health` (live instances;
instances created and steps taken since start), `GET /info` (env name, its AgentGym name or
null, system prompt, split sizes), `GET /task?split=&index=` (a task's id and data).

SearchQA's dialect, served for the AgentGym-mode SearchQA env (or `make_server(...,
dialect="searchqa")`):
the instance is `env_idx` and `id` is the item, `POST /create {"id": item}` -> env_idx (an
int), `POST /reset {"env_idx", "id"}` -> the first observation (a string), `POST /step
{"env_idx", "action"}` -> {"observation", "reward", "done", "info"}, `GET /observation?env_idx=`,
`POST /close {"env_idx"}`; the action goes to the env as sent (SearchQA sends the whole reply).

Failure modes, each answered and never fatal to the server (AgentGym's servers answer HTTP 200
`{"error": ...}` instead; `RemoteEnv` raises a `RemoteEnvError` either way, and the status codes
let it re-create an instance the server dropped): a malformed request gets 400 with
what was wrong; an unknown id gets 404; past `max_instances` live envs, `/create` gets 503 until
some are closed; an env that raises gets 500 with the exception's message, and that instance is
dropped (its state is suspect). Requests on different instances run in parallel threads; requests
on the same instance are serialised by a per-instance lock.

Bind address defaults to loopback: an env server executes whatever actions it is sent, so
exposing it beyond the host is an explicit choice (`--host 0.0.0.0`).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import math
import socket
import threading
import traceback
import urllib.parse
from typing import Any, Callable, Optional, Union

from rl_tpu.envs.base import Env, Task, make
from rl_tpu.envs.remote import agentgym_name

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # far above any action; bounds what a broken client can make us read

# AgentGym names of the envs that parse AgentGym's whole reply themselves: the server gives
# them "Action: <action>" (SearchQA's client sends the whole reply, so its env gets it as is).
PARSING_ENVS = ("babyai", "textcraft", "sciworld")
DIALECTS = ("agentgym", "searchqa")


class RequestError(Exception):
    """A request the server refuses; `status` is the HTTP code sent back."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class _Instance:
    env: Env
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    observation: str = ""
    closed: bool = False


def _jsonable(value: Any) -> Any:
    """Info dicts may hold numpy scalars or other objects; the wire gets plain JSON."""
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)


class EnvService:
    """The API's logic, free of HTTP: a table of live env instances keyed by integer id."""

    def __init__(self, env_factory: Callable[[], Env], max_instances: int = 256,
                 env_name: Optional[str] = None, action_prefix: Optional[str] = None,
                 dialect: Optional[str] = None):
        if max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, got {max_instances}")
        if dialect not in DIALECTS + (None,):
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        self._factory = env_factory
        self.max_instances = max_instances
        self._instances: dict[int, _Instance] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self.created = self.steps = 0  # since start, for /health (tests, monitoring)
        # One env kept aside to answer task-source and metadata queries without touching any
        # instance a client is stepping.
        self._meta_env = env_factory()
        self.env_name = env_name or self._meta_env.name
        # Told by the env's tasks, not its registered name (see the module docstring).
        self.agentgym = agentgym_name(self._meta_env)
        if dialect is None:
            dialect = "searchqa" if self.agentgym == "searchqa" else "agentgym"
        if action_prefix is None:
            action_prefix = "Action: " if self.agentgym in PARSING_ENVS else ""
        self.searchqa = dialect == "searchqa"
        self._id_key = "env_idx" if self.searchqa else "id"
        self.action_prefix = action_prefix  # see the module docstring

    # -- helpers ----------------------------------------------------------------------------

    def _task_from(self, body: dict) -> Task:
        if "task" in body:
            spec = body["task"]
            if not isinstance(spec, dict) or not isinstance(spec.get("task_id"), str):
                raise RequestError(400, "'task' must be an object with a string 'task_id' and "
                                        "an optional object 'data'")
            data = spec.get("data", {})
            if not isinstance(data, dict):
                raise RequestError(400, "'task.data' must be an object")
            return Task(task_id=spec["task_id"], data=data)
        index = body.get("data_idx", 0)
        split = body.get("split")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise RequestError(400, f"'data_idx' must be a non-negative integer, got {index!r}")
        if split is None and self.agentgym is not None:
            # AgentGym's item number: the env itself says whether it has item i (at reset).
            return Task(f"{self.agentgym}_{index}", {"data_idx": index})
        return self.get_task("train" if split is None else split, index)

    def get_task(self, split: Any, index: Any) -> Task:
        try:
            source = self._meta_env.tasks()
        except TypeError as e:
            raise RequestError(400, f"env {self.env_name!r} has no task source; send 'task' "
                                    f"instead of 'data_idx' ({e})")
        if not isinstance(split, str) or split not in source.splits:
            raise RequestError(400, f"unknown split {split!r}; this env has {source.splits}")
        size = source.size(split)
        if not isinstance(index, int) or index < 0 or (size is not None and index >= size):
            raise RequestError(400, f"data_idx {index!r} out of range for split {split!r} "
                                    f"(size {size})")
        return source.get(split, index)

    def _instance(self, body: dict) -> tuple[int, _Instance]:
        env_id = body.get(self._id_key)
        if not isinstance(env_id, int) or isinstance(env_id, bool):
            raise RequestError(400, f"'{self._id_key}' must be an integer env id, "
                                    f"got {env_id!r}")
        with self._lock:
            instance = self._instances.get(env_id)
        if instance is None:
            raise RequestError(404, f"no live env with id {env_id}: it was closed, dropped "
                                    "after an error, or never created (POST /create)")
        return env_id, instance

    def _drop(self, env_id: int, instance: _Instance, error: BaseException) -> RequestError:
        """Removes an instance whose env raised; returns the 500 to send."""
        with self._lock:
            self._instances.pop(env_id, None)
        instance.closed = True
        try:
            instance.env.close()
        except Exception:  # already failing; the original error is what matters
            log.exception("closing failed env %d", env_id)
        log.error("env %d raised and was dropped:\n%s", env_id,
                  "".join(traceback.format_exception(error)))
        return RequestError(500, f"env {env_id} raised {type(error).__name__}: {error}; "
                                 "the instance was dropped, create a new one")

    # -- routes -----------------------------------------------------------------------------

    def _searchqa_item(self, body: dict) -> dict:
        """SearchQA's `id` is the item: the same request in rl_tpu's terms."""
        if "id" not in body:
            raise RequestError(400, "SearchQA's /create and /reset need the item as 'id'")
        return {"data_idx": body["id"]}

    def create(self, body: dict) -> Any:
        task = self._task_from(self._searchqa_item(body) if self.searchqa else body)
        with self._lock:
            if len(self._instances) >= self.max_instances:
                raise RequestError(503, f"instance limit reached: {len(self._instances)} live "
                                        f"envs (max_instances={self.max_instances}); close some "
                                        "with POST /close or restart with a higher "
                                        "--max_instances")
            env_id = self._next_id
            self._next_id += 1
            self.created += 1
            # Reserve the slot (so the cap counts envs being built) with the instance already
            # locked, so a request racing on this id waits until the env exists.
            instance = _Instance(env=None)
            instance.lock.acquire()
            self._instances[env_id] = instance
        try:
            instance.env = self._factory()
            instance.observation = instance.env.reset(task)
        except Exception as e:
            with self._lock:
                self._instances.pop(env_id, None)
            instance.closed = True
            log.exception("creating env %d failed", env_id)
            raise RequestError(500, f"creating the env failed with {type(e).__name__}: {e}")
        finally:
            instance.lock.release()
        if self.searchqa:
            return env_id
        return {"id": env_id, "observation": instance.observation, "reward": 0.0, "score": 0.0,
                "done": False}

    def step(self, body: dict) -> dict:
        action = body.get("action")
        if not isinstance(action, str):
            raise RequestError(400, f"'action' must be a string, got {type(action).__name__}")
        env_id, instance = self._instance(body)
        with instance.lock:
            if instance.closed:
                raise RequestError(404, f"env {env_id} was closed")
            with self._lock:
                self.steps += 1
            # rl_tpu's own protocol sends the model's whole reply ("raw"): never prefixed.
            prefix = "" if body.get("raw") is True else self.action_prefix
            try:
                result = instance.env.step(prefix + action)
                reward = float(result.reward)
                if not math.isfinite(reward):
                    raise ValueError(f"non-finite reward {result.reward!r}")
            except Exception as e:
                raise self._drop(env_id, instance, e)
            instance.observation = result.observation
        return {"observation": result.observation, "reward": reward, "score": reward,
                "done": bool(result.done), "info": _jsonable(result.info)}

    def reset(self, body: dict) -> Any:
        env_id, instance = self._instance(body)
        task = self._task_from(self._searchqa_item(body) if self.searchqa else body)
        with instance.lock:
            if instance.closed:
                raise RequestError(404, f"env {env_id} was closed")
            try:
                instance.observation = instance.env.reset(task)
            except Exception as e:
                raise self._drop(env_id, instance, e)
        if self.searchqa:
            return instance.observation
        return {"id": env_id, "observation": instance.observation, "reward": 0.0, "score": 0.0,
                "done": False, "task_id": task.task_id}

    def observation(self, query: dict) -> str:
        try:
            env_id = int(query.get(self._id_key, [""])[0])
        except ValueError:
            raise RequestError(400, f"GET /observation needs an integer ?{self._id_key}=")
        _, instance = self._instance({self._id_key: env_id})
        return instance.observation

    def close(self, body: dict) -> dict:
        env_id, instance = self._instance(body)
        with self._lock:
            self._instances.pop(env_id, None)
        with instance.lock:  # waits for a step in flight on this instance
            instance.closed = True
            try:
                instance.env.close()
            except Exception as e:
                log.warning("env %d raised on close: %s", env_id, e)
        return {"id": env_id, "closed": True}

    def hello(self) -> str:
        """`GET /`: a JSON string, as AgentGym's servers answer."""
        return f"This is rl_tpu's env server for {self.env_name}."

    def health(self) -> dict:
        with self._lock:
            live = len(self._instances)
            created, steps = self.created, self.steps
        return {"env": self.env_name, "instances": live, "max_instances": self.max_instances,
                "created": created, "steps": steps}

    def info(self) -> dict:
        splits = {}
        try:
            source = self._meta_env.tasks()
            splits = {split: source.size(split) for split in source.splits}
        except TypeError:
            pass
        return {"env": self.env_name, "agentgym_name": self.agentgym,
                "system_prompt": self._meta_env.system_prompt, "splits": splits}

    def task(self, query: dict) -> dict:
        split = query.get("split", ["train"])[0]
        try:
            index = int(query.get("index", [""])[0])
        except ValueError:
            raise RequestError(400, "GET /task needs an integer ?index=")
        task = self.get_task(split, index)
        return {"task_id": task.task_id, "data": _jsonable(task.data)}

    def shutdown(self) -> None:
        with self._lock:
            instances = list(self._instances.values())
            self._instances.clear()
        for instance in instances + [_Instance(env=self._meta_env)]:
            try:
                if instance.env is not None:
                    instance.env.close()
            except Exception:
                log.exception("closing an env at shutdown")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client reuses one connection per episode
    timeout = 600                  # an idle keep-alive connection frees its thread after this
    service: EnvService            # set on the subclass `make_server` builds

    _POST = {"/create": "create", "/step": "step", "/reset": "reset", "/close": "close"}
    _GET = {"/": "hello", "/health": "health", "/info": "info", "/observation": "observation",
            "/task": "task"}

    def setup(self):
        super().setup()
        # Headers and body go out in two writes; with Nagle's algorithm on, the second waits
        # for the client's delayed ACK (~40 ms a request on Linux loopback).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):  # route access logs to logging, not stderr
        log.debug("%s %s", self.address_string(), fmt % args)

    def _send(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _dispatch(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        routes = self._POST if method == "POST" else self._GET
        try:
            # Read the body before anything can fail: an unread body left on a keep-alive
            # connection would be parsed as the next request.
            raw = self._read_body() if method == "POST" else b""
            if url.path not in routes:
                other = self._GET if method == "POST" else self._POST
                if url.path in other:
                    raise RequestError(405, f"{url.path} takes {'GET' if method == 'POST' else 'POST'}")
                raise RequestError(404, f"no route {method} {url.path}; routes: POST "
                                        f"{sorted(self._POST)}, GET {sorted(self._GET)}")
            handler = getattr(self.service, routes[url.path])
            if method == "POST":
                payload = handler(self._parse_json(raw))
            elif url.path in ("/observation", "/task"):
                payload = handler(urllib.parse.parse_qs(url.query))
            else:
                payload = handler()
            self._send(200, payload)
        except RequestError as e:
            self._send(e.status, {"error": str(e)})
        except Exception as e:  # a bug of ours: report it, keep serving
            log.exception("unhandled error on %s %s", method, url.path)
            self._send(500, {"error": f"internal server error: {type(e).__name__}: {e}"})

    def _read_body(self) -> bytes:
        length_text = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise RequestError(411, "chunked bodies are not supported; send Content-Length")
        try:
            length = int(length_text or 0)
        except ValueError:
            self.close_connection = True
            raise RequestError(400, f"bad Content-Length {length_text!r}")
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True  # we will not read it, so the stream is out of sync
            raise RequestError(413, f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
        return self.rfile.read(length) if length else b""

    @staticmethod
    def _parse_json(raw: bytes) -> dict:
        raw = raw or b"{}"  # an empty body means "no arguments" (AgentGym's bare /create)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, absurd nesting
            raise RequestError(400, f"body is not valid UTF-8 JSON: {e}")
        if not isinstance(body, dict):
            raise RequestError(400, f"body must be a JSON object, got {type(body).__name__}")
        return body

    def do_POST(self):
        self._dispatch("POST")

    def do_GET(self):
        self._dispatch("GET")


class EnvHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True       # a hung client connection never blocks shutdown
    allow_reuse_address = True
    request_queue_size = 128


def make_server(env: Union[str, Callable[[], Env]], host: str = "127.0.0.1", port: int = 0,
                max_instances: int = 256, env_kwargs: Optional[dict] = None,
                action_prefix: Optional[str] = None,
                dialect: Optional[str] = None) -> EnvHTTPServer:
    """A bound (not yet serving) server for `make(env, **env_kwargs)`, or for envs built by
    `env()` when it is a factory; port 0 picks a free port (see `server.server_address`).
    Run it with `serve_forever()` (in a thread, say) and stop it with `shutdown()`.
    `action_prefix` goes before every `/step` action (default: "Action: " for the envs of
    PARSING_ENVS' AgentGym names, "" otherwise) and `dialect` is "searchqa" (the default for
    AgentGym's SearchQA) or "agentgym"; see the module docstring."""
    env_kwargs = dict(env_kwargs or {})
    if isinstance(env, str):
        service = EnvService(lambda: make(env, **env_kwargs), max_instances, env, action_prefix,
                             dialect)
    else:
        service = EnvService(env, max_instances, action_prefix=action_prefix, dialect=dialect)
    handler = type("EnvHandler", (_Handler,), {"service": service})
    server = EnvHTTPServer((host, port), handler)
    server.service = service
    return server


def serve(env_name: str, host: str = "127.0.0.1", port: int = 36001, max_instances: int = 256,
          env_kwargs: Optional[dict] = None, ready: Optional[Callable[[str], None]] = None) -> None:
    """Serves until interrupted; `ready(url)` is called once the socket is listening."""
    server = make_server(env_name, host, port, max_instances, env_kwargs)
    url = "http://{}:{}".format(*server.server_address[:2])
    if ready is not None:
        ready(url)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.service.shutdown()
