"""What rl_tpu's HTTP servers (the rollout and env servers) share: one error shape, reading a
JSON body into a pydantic model, the HTTP limits, the API key, and uvicorn bound to a socket,
served from a thread or a CLI.

Every error any rl_tpu server answers is `{"error": {"message": "..."}}` with a 4xx or 5xx
status, SGLang's shape (and OpenAI's): a request FastAPI cannot validate is a 400 naming the
field, not FastAPI's 422 list; an unknown route a 404; an exception a 500 with its type and
message, after which the server goes on serving. What a client may make a server hold (header
and body sizes and deadlines, JSON depth, connections) is bounded by `HttpLimits`
(rl_tpu/http_limits.py), each limit a flag of both launchers (`add_http_flags`).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import math
import os
import resource
import socket
import threading
import time
from typing import Any, Callable, Optional, TypeVar

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl_tpu.http_limits import (PARSED_JSON, BodyGuard, HttpLimits, JSONLimitError, KeyGuard,
                                Refusal, loads, protocol_for)

log = logging.getLogger(__name__)
ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


class BadRequest(ValueError):
    """The client's fault: answered with HTTP 400 and the message."""


# The widest integers a request's fields may hold: the sampler keeps lengths, top_k and stop ids
# in int32 arrays, and a seed goes on as SGLang's int64. A bigger number, taken as it came,
# would fail while the request's row is being built beside other requests', not at validation.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def bounded_int(value: Any, field: str, low: int, high: int) -> int:
    """`value` as an int in [low, high] (a number or a numeric string, as `int()` reads it),
    else BadRequest naming `field`, the bounds and what was sent."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError) as err:
        raise BadRequest(f"'{field}' must be an integer, got {shown(value, 80)}") from err
    if not low <= number <= high:
        raise BadRequest(f"'{field}' must be in [{low}, {high}], got {shown(value, 80)}")
    return number


def integer_field(value: Any, field: str, low: int, high: int) -> int:
    """`bounded_int`, but a bool or a fractional number is refused (int() would take True as 1
    and 2.5 as 2: a client that sends them has a bug worth seeing)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise BadRequest(f"'{field}' must be an integer, got {value!r}")
    return bounded_int(value, field, low, high)


def number_field(value: Any, field: str, low: float, high: float, low_open: bool = False) -> float:
    """A finite float in [low, high] ((low, high] with low_open), else BadRequest naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadRequest(f"'{field}' must be a number, got {shown(value)}")
    try:
        number = float(value)
    except (ValueError, OverflowError) as err:  # "x", or an int past float's range
        raise BadRequest(f"'{field}' must be a number, got {shown(value)}") from err
    inside = (low < number if low_open else low <= number) and number <= high
    if not (math.isfinite(number) and inside):
        bounds = f">= {low:g}" if high == math.inf else \
            f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise BadRequest(f"'{field}' must be a finite number {bounds}, got {shown(value)}")
    return number


def flag_field(value: Any, field: str) -> bool:
    """true or false (bool('false') would be True: a string is refused, not guessed at)."""
    if not isinstance(value, bool):
        raise BadRequest(f"'{field}' must be true or false, got {shown(value)}")
    return value


def text_field(value: str, field: str) -> str:
    """`value`, refused when it cannot be UTF-8 (a lone surrogate, which JSON's \\ud800 escape
    can carry): the tokenizer cannot encode it, and echoed back (a rid, a weight version) it
    would break every reply that carries it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRequest(f"'{field}' is not valid Unicode text: {err.reason} at character "
                         f"{err.start}") from err
    return value


def shown(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut at `limit` characters, for an error message that quotes a request."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def validation_message(errors: list, where: str) -> str:
    """One line naming each bad field (at most three) and what was sent, from pydantic's
    `errors()`, after `where` (e.g. "POST /generate")."""
    parts = []
    for item in errors[:3]:
        loc = [str(p) for p in item.get("loc", ())]
        # FastAPI's locations start with where the value came from; pydantic's own do not
        source, path = (loc[0], loc[1:]) if loc and loc[0] in ("body", "query") else \
            ("body", loc)
        if item.get("type") == "json_invalid":
            reason = (item.get("ctx") or {}).get("error", item.get("msg"))
            parts.append(f"the body is not valid JSON ({reason})")
            continue
        field = ".".join(path)
        if not field and item.get("type") in ("model_attributes_type", "dict_type"):
            parts.append(f"the body must be a JSON object (got {shown(item.get('input'), 80)})")
            continue
        name = (f"query parameter '{field}'" if source == "query" else f"'{field}'") if field \
            else "the body"
        text = f"{name}: {item.get('msg', 'invalid')}"
        if item.get("type") != "missing" and "input" in item:
            text += f" (got {shown(item['input'], 80)})"
        parts.append(text)
    more = len(errors) - len(parts)
    suffix = f" (and {more} more)" if more > 0 else ""
    return f"{where}: {'; '.join(parts)}{suffix}"


def where(request: Request) -> str:
    return f"{request.method} {request.url.path}"


async def read_json(request: Request, model: type[ModelT],
                    max_depth: int = HttpLimits.max_json_depth) -> ModelT:
    """The request's JSON body as `model`, whatever its Content-Type says (clients that send
    JSON as form data, as urllib does, are read too); an empty body is `{}`. BadRequest
    naming what is wrong otherwise, a body over the JSON limits included. The body as
    `BodyGuard` parsed it is used when there is one (no second parse)."""
    if PARSED_JSON in request.scope:
        data = request.scope[PARSED_JSON]
    else:
        raw = await request.body()
        try:
            data = loads(raw, max_depth) if raw.strip() else {}
        except JSONLimitError as err:
            raise BadRequest(str(err)) from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BadRequest(f"body is not JSON: {err}") from err
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as err:
        raise BadRequest(validation_message(err.errors(), where(request))) from err


async def client_disconnected(request: Request) -> None:
    """Returns once the client of `request`, whose body has been read, disconnects: a task
    waiting on it sees the client leave the moment its connection closes (waiting on the ASGI
    receive() for `http.disconnect`: the body has been read, so that is all it can bring),
    where polling is_disconnected() would see it only at its next poll."""
    messages = 0
    while (await request.receive())["type"] != "http.disconnect":
        # the body again first (BodyGuard hands the app its body on the first receive, and
        # the app read the parsed copy instead); after that uvicorn waits for the disconnect,
        # but a server that answered at once would be polled at the old pace, not spun on
        messages += 1
        if messages >= 2:
            await asyncio.sleep(0.25)


def install_error_handlers(app: FastAPI) -> None:
    """Every error in the one shape (module doc)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return error_response(400, validation_message(err.errors(), where(request)))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, err: BadRequest):
        return error_response(400, str(err))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        message = err.detail if isinstance(err.detail, str) else str(err.detail)
        if err.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(err.status_code, message)

    answer_crashes(app, lambda message: error_response(500, message))


def answer_crashes(app: FastAPI, render: Callable[[str], Any]) -> None:
    """An exception that escapes a route (a bug of ours) is answered 500 with `render(its type
    and message)` and logged once, with its traceback. (Starlette's handler for `Exception`
    re-raises after answering, so uvicorn logged each crash a second time.)"""
    app.add_middleware(_AnswerCrashes, render=render)


class _AnswerCrashes:
    def __init__(self, app, render: Callable[[str], Any]):
        self.app, self.render = app, render

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_noting_start(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as err:  # noqa: BLE001 - a route's bug; the server goes on
            if started:  # half a reply is out: only closing the connection can end it
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await self.render(f"{type(err).__name__}: {err}")(scope, receive, send)


def closing_error(status: int, message: str) -> JSONResponse:
    """`error_response` that also ends the connection (its request was not read to its end)."""
    return JSONResponse({"error": {"message": message}}, status_code=status,
                        headers={"connection": "close"})


def guard(app: FastAPI, limits: HttpLimits, api_key: Optional[str] = None,
          refuse: Refusal = closing_error, key_hint: str = "") -> None:
    """Every request to `app` read whole within `limits` first (`BodyGuard`, its refusals
    shaped by `refuse`), and with `api_key` checked before that (`KeyGuard`: a client without
    the key cannot make the server read a body; `key_hint` ends its 401 message). Call once,
    after the app's other middleware."""
    app.add_middleware(BodyGuard, limits=limits, refuse=refuse)
    if api_key:  # a real 401 in rl_tpu's shape whatever `refuse` says: not an app error
        app.add_middleware(KeyGuard, api_key=api_key, refuse=closing_error, hint=key_hint)


def docs_routes(docs: bool) -> dict:
    """FastAPI(...) arguments: the interactive docs (/docs, /redoc, /openapi.json) only when
    asked for (`--docs`): they describe every route and field to anyone who can connect."""
    return {} if docs else dict(docs_url=None, redoc_url=None, openapi_url=None)


def api_key_from(flag_value: Optional[str], env_var: str) -> Optional[str]:
    """The key a launcher's --api_key gives, else the environment variable `env_var` (which
    keeps it out of process lists); None for neither (or an empty one)."""
    return flag_value or os.environ.get(env_var) or None


def add_http_flags(flags, defaults: HttpLimits) -> None:
    """Defines a launcher's HTTP-limit flags (absl `flags`), defaulting to `defaults`."""
    d = defaults
    flags.DEFINE_integer("max_header_bytes", d.max_header_bytes, "Request line + headers "
                         "may be at most this many bytes; more is answered 431.")
    flags.DEFINE_float("header_timeout_s", d.header_timeout_s, "A connection's request line "
                       "+ headers must arrive within this many seconds of its start (or of "
                       "the request's first byte), else it is closed.")
    flags.DEFINE_integer("max_body_bytes", d.max_body_bytes, "A request body may be at most "
                         "this many bytes; a bigger Content-Length is answered 413 at once.")
    flags.DEFINE_float("body_timeout_s", d.body_timeout_s, "A request body must arrive "
                       "within this many seconds of its headers, else 408.")
    flags.DEFINE_float("keep_alive_s", d.keep_alive_s, "An idle connection is closed after "
                       "this many seconds without a request.")
    flags.DEFINE_integer("max_connections", d.max_connections, "Connections served at once; "
                         "a request on one beyond them is answered 503 and it is closed.")
    flags.DEFINE_integer("max_json_depth", d.max_json_depth, "JSON bodies nested deeper than "
                         "this are answered 400.")
    flags.DEFINE_bool("docs", False, "Serve the interactive API docs (/docs, /redoc, "
                      "/openapi.json).")


def http_limits_from_flags(flag_values) -> HttpLimits:
    """The HttpLimits `add_http_flags`' flags give; ValueError naming a bad one."""
    f = flag_values
    return HttpLimits(max_header_bytes=f.max_header_bytes, header_timeout_s=f.header_timeout_s,
                      max_body_bytes=f.max_body_bytes, body_timeout_s=f.body_timeout_s,
                      keep_alive_s=f.keep_alive_s, max_connections=f.max_connections,
                      max_json_depth=f.max_json_depth)


def _allow_open_files(needed: int) -> None:
    """Raises this process's open-file limit towards `needed` (as far as the hard limit lets
    it): past it, accept() fails before --max_connections is reached."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as err:  # not allowed here: the cap may then not be reached
        log.warning("could not raise the open-file limit to %d: %s", needed, err)


class Server:
    """A bound uvicorn server for `app`: `serve_forever()` blocks (Ctrl-C or SIGTERM stop it
    gracefully), `start()` serves on a background thread and returns the URL, `shutdown()`
    stops either. The socket is bound on construction, so `server_address` (and the port
    picked for port 0) is known before serving starts, and a taken port fails right away.
    Binds loopback unless told otherwise.

    Args:
      limits: the HTTP limits (rl_tpu/http_limits.py) enforced on every connection; its
        keep_alive_s is how long an idle client connection stays open (uvicorn's 5 s default
        would close a trainer's or an agent's connection between two of its calls). The body
        limits are the app's own (`guard`).
      on_unserved_close: called by `shutdown()` when the server never served (the app's
        lifespan, which would clean up otherwise, never ran).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                 limits: HttpLimits = HttpLimits(),
                 on_unserved_close: Optional[Callable[[], None]] = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as err:
            self.socket.close()
            raise OSError(err.errno, f"cannot bind {host}:{port}: {err.strerror}; is another "
                                     "server on that port? pick another --port") from err
        self.server_address = self.socket.getsockname()[:2]
        shown = f"[{self.server_address[0]}]" if family == socket.AF_INET6 else \
            self.server_address[0]
        self.url = f"http://{shown}:{self.server_address[1]}"
        self.limits = limits
        _allow_open_files(limits.max_connections + 256)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                http=protocol_for(limits), timeout_keep_alive=limits.keep_alive_s,
                                backlog=2048)
        self._uvicorn = uvicorn.Server(config)
        self._on_unserved_close = on_unserved_close
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()

    def serve_forever(self) -> None:
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.socket.close()
            self._done.set()

    def start(self, timeout: float = 30.0) -> str:
        """Serves on a daemon thread; returns the URL once requests are answered."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        name="http-server")
        self._thread.start()
        # A script that ends without shutdown() would otherwise tear the interpreter down
        # under a running event loop (seen once as a segfault at exit).
        atexit.register(self.shutdown, 5.0)
        deadline = time.monotonic() + timeout
        while not (self._uvicorn.started or self._done.is_set()):
            if time.monotonic() > deadline:
                break
            self._done.wait(0.01)
        if not self._uvicorn.started:
            raise RuntimeError(f"the server at {self.url} did not start within {timeout}s")
        return self.url

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops serving, waiting up to `timeout` s for requests in flight."""
        atexit.unregister(self.shutdown)
        self._uvicorn.should_exit = True
        if self._uvicorn.started or self._thread is not None:
            self._done.wait(timeout)
        else:  # never served
            self.socket.close()
            if self._on_unserved_close is not None:
                self._on_unserved_close()
