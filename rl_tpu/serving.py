"""What rl_tpu's HTTP servers (the rollout and env servers) share: one error shape, reading a
JSON body into a pydantic model, and uvicorn bound to a socket, served from a thread or a CLI.

Every error any rl_tpu server answers is `{"error": {"message": "..."}}` with a 4xx or 5xx
status, SGLang's shape (and OpenAI's): a request FastAPI cannot validate is a 400 naming the
field, not FastAPI's 422 list; an unknown route a 404; an exception a 500 with its type and
message, after which the server goes on serving.
"""

from __future__ import annotations

import atexit
import json
import logging
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
        raise BadRequest(f"'{field}' must be an integer, got {_clip(value)}") from err
    if not low <= number <= high:
        raise BadRequest(f"'{field}' must be in [{low}, {high}], got {_clip(value)}")
    return number


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
            parts.append(f"the body must be a JSON object (got {_clip(item.get('input'))})")
            continue
        name = (f"query parameter '{field}'" if source == "query" else f"'{field}'") if field \
            else "the body"
        text = f"{name}: {item.get('msg', 'invalid')}"
        if item.get("type") != "missing" and "input" in item:
            text += f" (got {_clip(item['input'])})"
        parts.append(text)
    more = len(errors) - len(parts)
    suffix = f" (and {more} more)" if more > 0 else ""
    return f"{where}: {'; '.join(parts)}{suffix}"


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def where(request: Request) -> str:
    return f"{request.method} {request.url.path}"


async def read_json(request: Request, model: type[ModelT]) -> ModelT:
    """The request's JSON body as `model`, whatever its Content-Type says (clients that send
    JSON as form data, as urllib does, are read too); an empty body is `{}`. BadRequest
    naming what is wrong otherwise."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"body is not JSON: {err}") from err
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as err:
        raise BadRequest(validation_message(err.errors(), where(request))) from err


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

    @app.exception_handler(Exception)
    async def _crash(request: Request, err: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"{type(err).__name__}: {err}")


def bearer_auth(app: FastAPI, api_key: Optional[str]) -> None:
    """With `api_key`, every request needs `Authorization: Bearer <api_key>` (SGLang's
    --api-key), else 401."""
    if not api_key:
        return

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if request.headers.get("authorization") != f"Bearer {api_key}":
            return error_response(401, "missing or wrong API key (Authorization: Bearer <key>)")
        return await call_next(request)


class Server:
    """A bound uvicorn server for `app`: `serve_forever()` blocks (Ctrl-C or SIGTERM stop it
    gracefully), `start()` serves on a background thread and returns the URL, `shutdown()`
    stops either. The socket is bound on construction, so `server_address` (and the port
    picked for port 0) is known before serving starts, and a taken port fails right away.
    Binds loopback unless told otherwise.

    Args:
      keep_alive_s: how long an idle client connection stays open (uvicorn's 5 s default
        would close a trainer's or an agent's connection between two of its calls).
      on_unserved_close: called by `shutdown()` when the server never served (the app's
        lifespan, which would clean up otherwise, never ran).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                 keep_alive_s: float = 75.0,
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
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_keep_alive=int(keep_alive_s), backlog=2048)
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
