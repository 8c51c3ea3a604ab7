"""Serve any registered env over the AgentGym env-server HTTP API (FastAPI + uvicorn).

Wire format (JSON bodies; the routes and fields of AgentGym's BabyAI / TextCraft / SciWorld
servers, so `rl_tpu.env_serving.remote.RemoteEnv` and AgentGym's own clients read both alike):

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
instances created, steps taken and instances expired since start), `GET /info` (env name, its
AgentGym name or null, system prompt, split sizes), `GET /task?split=&index=` (a task's id and
data).

SearchQA's dialect, served for the AgentGym-mode SearchQA env (or `make_server(...,
dialect="searchqa")`):
the instance is `env_idx` and `id` is the item, `POST /create {"id": item}` -> env_idx (an
int), `POST /reset {"env_idx", "id"}` -> the first observation (a string), `POST /step
{"env_idx", "action"}` -> {"observation", "reward", "done", "info"}, `GET /observation?env_idx=`,
`POST /close {"env_idx"}`; the action goes to the env as sent (SearchQA sends the whole reply).

Errors, each answered and never fatal to the server, in one shape shared with rl_tpu's rollout
server: HTTP 4xx/5xx with `{"error": {"message": "..."}}`. A malformed request (bad JSON, JSON
nested deeper than the limit or holding an integer of more than 4300 digits, a missing or
mistyped field, named in the message) gets 400, as does a task the env cannot start from its
data; a body shorter than its Content-Length gets 408 once `body_timeout_s` has passed, one
over `max_body_bytes` 413 (the HTTP limits, `limits`: rl_tpu/http_limits.py); without the
server's `api_key`, 401; an unknown or expired id gets 404; past `max_instances` live envs
`/create` gets 503; an env that raises gets 500 with the exception's message, and that
instance is dropped (its state is suspect). With `error_style="agentgym"` (`--error_style
agentgym`) every error is instead HTTP 200 `{"error": "..."}`, as AgentGym's BabyAI, TextCraft
and SciWorld servers answer; `RemoteEnv` raises a `RemoteEnvError` either way, but only the
status codes let it re-create an instance the server dropped or expired.

Env calls are synchronous: they run on a thread pool (`threads`, by default one per instance
allowed), never on the event loop, so requests on different instances run in parallel and the
server keeps accepting connections while envs step; requests on one instance are serialised
by its lock (env_service.py).
Instances idle for `idle_timeout_s` are closed (see env_service.py).

Bind address defaults to loopback: an env server executes whatever actions it is sent, so
exposing it beyond the host is an explicit choice (`--host 0.0.0.0`), best made with an
`api_key` (`--api_key`, or RL_TPU_ENV_API_KEY): every request then needs `Authorization:
Bearer <key>`, which RemoteEnv sends from the same variable. The interactive docs (/docs,
/redoc, /openapi.json) are served only with `docs=True` (`--docs`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, Optional, Union

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl_tpu.core import env as env_lib
from rl_tpu.core.env import Env
from rl_tpu.env_serving.env_service import DIALECTS, PARSING_ENVS, EnvService, RequestError, jsonable
from rl_tpu.env_serving.server_wire import (ERROR_STYLES, Close, Create, JSONReply, Reset, SearchQAClose,
                                     SearchQACreate, SearchQAReset, SearchQAStep, Step,
                                     error_reply)
from rl_tpu.http_limits import ENV_LIMITS, HttpLimits
from rl_tpu.serving import (Server, answer_crashes, docs_routes, guard, validation_message,
                            where)

__all__ = ["API_KEY_ENV", "DIALECTS", "ENV_LIMITS", "ERROR_STYLES", "PARSING_ENVS",
           "EnvServer", "EnvService", "RequestError", "build_app", "make_server", "serve"]

log = logging.getLogger(__name__)

API_KEY_ENV = "RL_TPU_ENV_API_KEY"  # the key's variable, for the server and RemoteEnv alike

_POST = ("/close", "/create", "/reset", "/step")
_GET = ("/", "/health", "/info", "/observation", "/task")


def build_app(service: EnvService, error_style: str = "rl_tpu", threads: Optional[int] = None,
              *, limits: HttpLimits = ENV_LIMITS, api_key: Optional[str] = None,
              docs: bool = False) -> FastAPI:
    """The ASGI app serving `service`; see the module docstring for the routes and errors.
    `threads` run env calls; None: one per instance the service may hold, so a call never
    waits for a thread while another instance's env is busy (a thread is started only when
    calls overlap that much). Bodies are read within `limits` (its body and JSON limits);
    with `api_key` every request needs it; `docs` serves /docs, /redoc and /openapi.json."""
    if error_style not in ERROR_STYLES:
        raise ValueError(f"error_style must be one of {ERROR_STYLES}, got {error_style!r}")
    threads = service.max_instances if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="env")

    async def run(fn: Callable, *args, **kwargs) -> Any:
        """`fn` on the env thread pool, so a slow env never stalls the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            pool, functools.partial(fn, *args, **kwargs))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        reaper = asyncio.create_task(_expire_periodically(service, run))
        try:
            yield
        finally:
            reaper.cancel()
            # On this thread, not the pool: at interpreter exit the pool takes no new work.
            service.shutdown()
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title=f"rl_tpu env server: {service.env_name}", lifespan=lifespan,
                  default_response_class=JSONReply, **docs_routes(docs))
    _add_error_handlers(app, error_style)
    guard(app, limits, api_key, functools.partial(_refusal, style=error_style),
          key_hint=f"; RemoteEnv sends the key in {API_KEY_ENV}")

    def created(env_id: int, observation: str) -> dict:
        return {"id": env_id, "observation": observation, "reward": 0.0, "score": 0.0,
                "done": False}

    def stepped(result, reward: float) -> dict:
        return {"observation": result.observation, "reward": reward, "score": reward,
                "done": bool(result.done), "info": jsonable(result.info)}

    def task_spec(body) -> Optional[dict]:
        return body.task.model_dump() if body.task is not None else None

    if service.dialect == "searchqa":
        # SearchQA's routes: the instance is `env_idx`, `id` is the item (module docstring).
        @app.post("/create")
        async def create_searchqa(body: SearchQACreate) -> Any:
            env_id, _ = await run(service.create, data_idx=body.id)
            return env_id

        @app.post("/reset")
        async def reset_searchqa(body: SearchQAReset) -> Any:
            _, observation = await run(service.reset, body.env_idx, data_idx=body.id)
            return observation

        @app.post("/step")
        async def step_searchqa(body: SearchQAStep) -> Any:
            return stepped(*await run(service.step, body.env_idx, body.action))

        @app.get("/observation")
        async def observation_searchqa(env_idx: int) -> Any:
            return service.observation(env_idx)

        @app.post("/close")
        async def close_searchqa(body: SearchQAClose) -> Any:
            await run(service.close, body.env_idx)
            return {"id": body.env_idx, "closed": True}  # the reply rl_tpu always sent
    else:
        @app.post("/create")
        async def create(body: Optional[Create] = None) -> Any:
            body = body or Create()  # no body: AgentGym's bare create
            return created(*await run(service.create, body.data_idx, body.split,
                                      task_spec(body)))

        @app.post("/reset")
        async def reset(body: Reset) -> Any:
            task, observation = await run(service.reset, body.id, body.data_idx, body.split,
                                          task_spec(body))
            return {**created(body.id, observation), "task_id": task.task_id}

        @app.post("/step")
        async def step(body: Step) -> Any:
            return stepped(*await run(service.step, body.id, body.action, body.raw))

        @app.get("/observation")
        async def observation(id: int) -> Any:  # noqa: A002 - AgentGym's query parameter
            return service.observation(id)

        @app.post("/close")
        async def close(body: Close) -> Any:
            await run(service.close, body.id)
            return {"id": body.id, "closed": True}

    @app.get("/")
    async def hello() -> Any:
        return service.hello()

    @app.get("/health")
    async def health() -> Any:
        return service.health()

    @app.get("/info")
    async def info() -> Any:
        return await run(service.info)

    @app.get("/task")
    async def task(split: str = "train", index: int = Query()) -> Any:
        found = await run(service.get_task, split, index)
        return {"task_id": found.task_id, "data": jsonable(found.data)}

    return app


def _refusal(status: int, message: str, style: str) -> JSONReply:
    return error_reply(status, message, style, close=True)


async def _expire_periodically(service: EnvService, run: Callable) -> None:
    """Closes idle instances even when no /create comes to do it."""
    if service.idle_timeout_s is None:
        return
    period = min(30.0, max(0.05, service.idle_timeout_s / 4))
    while True:
        await asyncio.sleep(period)
        try:
            await run(service.expire_idle)
        except Exception:  # never let the reaper die: log and keep going
            log.exception("expiring idle envs")


def _add_error_handlers(app: FastAPI, style: str) -> None:
    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError):
        return error_reply(error.status, error.message, style)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return error_reply(400, validation_message(error.errors(), where(request)), style)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        what = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            message = (f"no route {what}; routes: POST {', '.join(_POST)}; "
                       f"GET {', '.join(_GET)}")
        elif error.status_code == 405:
            other = "POST" if request.url.path in _POST else "GET"
            message = f"{request.url.path} takes {other}, not {request.method}"
        elif error.status_code == 400:  # FastAPI's "There was an error parsing the body"
            message = f"{what}: the body is not valid JSON ({error.detail})"
        else:
            message = f"{what}: {error.detail}"
        return error_reply(error.status_code, message, style)

    # a bug of ours: answered 500, logged once, and the server keeps going
    answer_crashes(app, lambda message: error_reply(500, f"internal server error: {message}",
                                                    style))


class EnvServer(Server):
    """`Server` (rl_tpu/serving.py) for an env app: its connections stay open as long as an
    agent may think between two steps of one episode, and a server that never served still
    closes its envs on shutdown."""

    def __init__(self, app: FastAPI, service: EnvService, host: str = "127.0.0.1",
                 port: int = 0, limits: HttpLimits = ENV_LIMITS):
        super().__init__(app, host, port, limits=limits, on_unserved_close=service.shutdown)
        self.app, self.service = app, service


def make_server(env: Union[str, Callable[[], Env]], host: str = "127.0.0.1", port: int = 0,
                max_instances: int = 256, env_kwargs: Optional[dict] = None,
                action_prefix: Optional[str] = None, dialect: Optional[str] = None, *,
                error_style: str = "rl_tpu", idle_timeout_s: Optional[float] = 600.0,
                threads: Optional[int] = None, limits: HttpLimits = ENV_LIMITS,
                body_timeout_s: Optional[float] = None, api_key: Optional[str] = None,
                docs: bool = False) -> EnvServer:
    """A bound (not yet serving) server for `make(env, **env_kwargs)`, or for envs built by
    `env()` when it is a factory; port 0 picks a free port (`server.url`). Serve it with
    `start()` (a background thread) or `serve_forever()`, stop it with `shutdown()`.
    `action_prefix` goes before every `/step` action (default: "Action: " for the envs of
    PARSING_ENVS' AgentGym names, "" otherwise), `dialect` is "searchqa" (the default for
    AgentGym's SearchQA) or "agentgym", `error_style` "rl_tpu" or "agentgym"; an instance
    idle for `idle_timeout_s` seconds is closed (None: never); env calls run on `threads`
    threads (None: one per instance); `limits` are the HTTP limits (`body_timeout_s`, when
    given, replaces theirs), `api_key` the key every request needs (None: none), `docs` serves
    the interactive docs; see the module docstring."""
    if body_timeout_s is not None:
        limits = dataclasses.replace(limits, body_timeout_s=body_timeout_s)
    if isinstance(env, str):
        env_kwargs = dict(env_kwargs or {})
        env_lib.check_kwargs(env, env_kwargs)  # unknown env or kwarg: one line naming the valid
        name = env
        factory = functools.partial(env_lib.make, env, **env_kwargs)
    else:
        name, factory = None, env
    service = EnvService(factory, max_instances, name, action_prefix, dialect,
                         idle_timeout_s=idle_timeout_s)
    try:
        app = build_app(service, error_style, threads, limits=limits, api_key=api_key,
                        docs=docs)
        return EnvServer(app, service, host, port, limits)
    except BaseException:
        service.shutdown()
        raise


def serve(env_name: str, host: str = "127.0.0.1", port: int = 36001, max_instances: int = 256,
          env_kwargs: Optional[dict] = None, ready: Optional[Callable[[str], None]] = None,
          **options) -> None:
    """Serves until interrupted; `ready(url)` is called once the socket is listening.
    `options` are `make_server`'s keyword-only ones."""
    server = make_server(env_name, host, port, max_instances, env_kwargs, **options)
    if ready is not None:
        # The socket is bound and listening starts with serve_forever: connections made
        # meanwhile wait in the backlog, so the URL is usable from this point.
        server.socket.listen(2048)
        ready(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
