"""What rl_tpu's HTTP servers share: one error shape, and uvicorn run from a thread or a CLI.

Every error any rl_tpu server answers is `{"error": {"message": "..."}}` with a 4xx or 5xx
status, SGLang's shape (and OpenAI's): a request FastAPI cannot validate is a 400 naming the
field, not FastAPI's 422 list; an unknown route a 404; an exception a 500 with its type and
message, after which the server goes on serving.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Optional, TypeVar

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


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def validation_message(err) -> str:
    """FastAPI's list of validation errors -> one line naming each bad field."""
    parts = []
    for e in err.errors():
        if e.get("type") == "json_invalid":
            return f"body is not JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        where = where.split(".function-after", 1)[0]
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "bad request: " + "; ".join(parts[:5])


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
        raise BadRequest(validation_message(err)) from err


def install_error_handlers(app: FastAPI) -> None:
    """Every error in the one shape (module doc)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return error_response(400, validation_message(err))

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
    """uvicorn serving `app` on a socket bound at construction (port 0 picks a free one,
    `server_address` says which), from the calling thread (`serve_forever`) or a background
    one (`start`); `shutdown` stops it. Binds loopback unless told otherwise."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as err:
            self.socket.close()
            raise OSError(f"cannot bind {host}:{port}: {err.strerror}; is another server on "
                          "that port? pick another --port") from err
        self.server_address = self.socket.getsockname()[:2]
        # keep-alive a while: trainers reuse their connections between steps
        config = uvicorn.Config(app, log_level="warning", access_log=False,
                                timeout_keep_alive=75, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    def serve_forever(self) -> None:
        self._server.run(sockets=[self.socket])

    def start(self, timeout_s: float = 30.0) -> "Server":
        """Serves from a daemon thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        name="http-server")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.socket.close()
