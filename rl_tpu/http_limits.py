"""The HTTP limits of rl_tpu's servers (the rollout and env servers), below and around the app.

Nothing a client sends may hold a socket, memory or the event loop without bound:

- request line + headers: at most `max_header_bytes` (else 431), complete within
  `header_timeout_s` of the connection's start or of the request's first byte (else the
  connection is closed, with a 408 when part of a request came). This is what reaps half-sent
  connections: uvicorn's keep-alive timer is cancelled by the first byte of a request, and it
  is not armed at all before a connection's first request. Counted in `LimitedProtocol`
  before httptools sees the bytes, so a 64 MiB header is never buffered;
- body: at most `max_body_bytes` (a larger Content-Length is 413 before any of it is read),
  complete within `body_timeout_s` (else 408), read whole by `BodyGuard` before the app runs;
- JSON: nested at most `max_json_depth` deep (a bracket scan before the recursive parser ever
  sees the body) and no integer of more than MAX_INT_DIGITS digits, else 400 naming which;
- an idle keep-alive connection closes after `keep_alive_s` (uvicorn's timer);
- at most `max_connections` connections are served at once: a request on one beyond them is
  answered 503 and that connection closed (so service resumes as soon as others go).

A limit hit is answered (or the connection closed) at once and logged as one WARNING line
without a traceback; lines of one kind are kept to one a second under a flood, each saying how
many were left out since the last. The connection-level answers (408 for headers, 431, 503)
are rl_tpu's error shape with a real status whatever the app's error style; the body's (408,
413, 400) are shaped by the app (`refuse`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import sys
import time
from typing import Any, Callable, Optional

import numpy as np
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger(__name__)

# Python's own default (sys.int_max_str_digits): no request field of ours needs more digits,
# and converting a longer one is quadratic in its length.
MAX_INT_DIGITS = 4300
PARSED_JSON = "rl_tpu.json"  # the scope key BodyGuard leaves the parsed body under


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one client may make a server hold; see the module docstring. The defaults are the
    rollout server's (its biggest legitimate request, rows x tokens of input_ids, is tens of
    MiB); ENV_LIMITS are the env server's."""

    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    max_body_bytes: int = 64 << 20
    body_timeout_s: float = 60.0
    keep_alive_s: float = 75.0
    max_connections: int = 1024
    max_json_depth: int = 64

    def __post_init__(self):
        for name in ("max_header_bytes", "max_body_bytes", "max_connections", "max_json_depth"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name} must be > 0 seconds, got {getattr(self, name)!r}")


# An env server's bodies are actions and task specs, and an agent may think for minutes
# between two steps of one episode on the same connection.
ENV_LIMITS = HttpLimits(max_body_bytes=4 << 20, body_timeout_s=10.0, keep_alive_s=600.0)


# -- one warning line per limit hit -------------------------------------------------------


class _Warnings:
    """At most one line a second per kind of limit; the next line says how many were left out
    (a flood of 4,000 half-sent connections is 4,000 hits, not 4,000 lines)."""

    def __init__(self):
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < 1.0:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        suffix = f" (and {held} more like it since the last such line)" if held else ""
        log.warning(message + suffix, *args)


warn = _Warnings()


# -- JSON limits ----------------------------------------------------------------------------


class JSONLimitError(ValueError):
    """A JSON body over a limit of ours (depth, digits): the client's fault, a 400."""


_STEPS = np.zeros(256, np.int8)
_STEPS[[ord("["), ord("{")]] = 1
_STEPS[[ord("]"), ord("}")]] = -1
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'[]{}"')))
_CHUNK = 1 << 20
_DIGIT_COUNT = re.compile(r"has (\d+) digits")


def deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the JSON text `raw` nests arrays/objects more than `limit` deep, brackets inside
    strings not counted. Linear in len(raw) with bounded memory; most bodies end at the first
    line (fewer opening brackets than the limit), and a 30 MB list of token-id lists takes a
    few hundredths of a second (bytes methods, then numpy over its few brackets)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    if b"\\" in raw:
        # Escapes first, so every quote left delimits a string: an escaped backslash, then an
        # escaped quote (left to right, as JSON pairs them; outside strings a backslash is
        # invalid JSON anyway).
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Only brackets and quotes matter now: what is left is small for any legitimate body.
    text = np.frombuffer(raw.translate(None, _NOT_STRUCTURE), np.uint8)
    depth, quotes = 0, 0
    for start in range(0, len(text), _CHUNK):
        chunk = text[start:start + _CHUNK]
        quoted = np.cumsum(chunk == 34, dtype=np.int64) + quotes
        outside = quoted % 2 == 0  # an even count of quotes before it (a bracket is no quote)
        running = depth + np.cumsum(_STEPS[chunk] * outside, dtype=np.int64)
        if running.max() > limit:
            return True
        depth, quotes = int(running[-1]), int(quoted[-1])
    return False


def _checked_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONLimitError(f"the body holds a number of {len(text.lstrip('-'))} digits; "
                             f"integers may have at most {MAX_INT_DIGITS}")
    return int(text)


def loads(raw: bytes, max_depth: int) -> Any:
    """`json.loads(raw)` within the JSON limits: JSONLimitError naming the limit for a body
    nested deeper than `max_depth` (checked before parsing: the parser is recursive) or an
    integer of more than MAX_INT_DIGITS digits; a syntax error is json.JSONDecodeError (or
    UnicodeDecodeError) as usual."""
    if deeper_than(raw, max_depth):
        raise JSONLimitError(f"JSON nested deeper than {max_depth} levels")
    interpreter_digits = sys.get_int_max_str_digits()
    # With the interpreter's limit on (the default) int() refuses long numbers in linear time
    # and we only rename its error; with it raised or off, each integer is checked here.
    hook = _checked_int if interpreter_digits == 0 or interpreter_digits > MAX_INT_DIGITS \
        else None
    try:
        return json.loads(raw, parse_int=hook)
    except (json.JSONDecodeError, UnicodeDecodeError, JSONLimitError):
        raise
    except RecursionError as err:  # not reachable after the scan; never a 500 all the same
        raise JSONLimitError(f"JSON nested deeper than {max_depth} levels") from err
    except ValueError as err:  # "Exceeds the limit (4300 digits) for integer string ..."
        found = _DIGIT_COUNT.search(str(err))
        size = f"a number of {found.group(1)} digits" if found else "a number too long"
        raise JSONLimitError(f"the body holds {size}; integers may have at most "
                             f"{interpreter_digits} digits") from err


# -- the connection: header size, header deadline, connection cap --------------------------


def _raw_reply(status: int, message: str) -> bytes:
    body = json.dumps({"error": {"message": message}}).encode()
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


class LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the header limits and the connection cap of
    `limits` (set on a subclass by `protocol_for`)."""

    limits: HttpLimits = HttpLimits()
    linger_s = 2.0  # how long a refused sender's bytes are read and dropped before the close

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_headers = True  # the next bytes belong to a request line or its headers
        self._header_bytes = 0
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._dropping = False  # refused: read and drop what comes until the close

    # -- the header deadline ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()  # uvicorn arms nothing until a first response is sent

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                      self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_header_timer()  # a pipelined request behind one still running: wait
            return
        limit = self.limits.header_timeout_s
        if self._header_bytes:
            warn("header_timeout", "closed %s: its request line and headers were not complete "
                 "within %gs (%d bytes came; --header_timeout_s)", self._peer(), limit,
                 self._header_bytes)
            self.transport.write(_raw_reply(
                408, f"the request line and headers did not arrive within {limit:g}s"))
        else:
            warn("header_timeout", "closed %s: no request came within %gs of its connection "
                 "(--header_timeout_s)", self._peer(), limit)
        self.transport.close()

    # -- the header size -------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        while data and not self._dropping and not self.transport.is_closing():
            if not self._in_headers:
                super().data_received(data)
                return
            # Never hand httptools more header bytes than the limit: it buffers a header
            # until its end, so a 64 MiB one would be held whole.
            room = self.limits.max_header_bytes - self._header_bytes
            piece, data = data[:room], data[room:]
            self._header_bytes += len(piece)
            super().data_received(piece)
            if (self._in_headers and self._header_bytes >= self.limits.max_header_bytes
                    and not self.transport.is_closing()):
                self._refuse_headers()

    def _refuse_headers(self) -> None:
        limit = self.limits.max_header_bytes
        warn("header_bytes", "refused %s with 431: its request line and headers ran past "
             "%d bytes (--max_header_bytes)", self._peer(), limit)
        self._cancel_header_timer()
        self.transport.write(_raw_reply(
            431, f"the request line and headers are over this server's limit of {limit} "
                 "bytes (--max_header_bytes)"))
        # The sender may still be pushing its header: drop what comes for a moment, so it
        # reads the 431 rather than a reset, then close.
        self._dropping = True
        try:
            self.transport.write_eof()
        except (NotImplementedError, RuntimeError, OSError):
            pass
        self.loop.call_later(self.linger_s, self.transport.close)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()  # the first byte of a request on a kept-alive connection

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._cancel_header_timer()
        # uvicorn's own limit_concurrency counts this connection too (`>=`), so a cap of N
        # would serve N - 1; here the first N connections are served.
        if len(self.connections) > self.limits.max_connections:
            warn("max_connections", "answered 503 to %s and closed it: %d connections are "
                 "open, over the limit of %d (--max_connections)", self._peer(),
                 len(self.connections), self.limits.max_connections)
            app, self.app = self.app, self._busy
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_headers, self._header_bytes = True, 0  # what follows is the next request
        super().on_message_complete()

    async def _busy(self, scope, receive, send) -> None:
        body = json.dumps({"error": {"message": f"this server has {len(self.connections)} "
                                                f"connections open, over its limit of "
                                                f"{self.limits.max_connections} "
                                                "(--max_connections); retry later"}}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"


def protocol_for(limits: HttpLimits) -> type[LimitedProtocol]:
    """The protocol class (uvicorn.Config(http=...)) enforcing `limits`."""
    return type("LimitedProtocol", (LimitedProtocol,), {"limits": limits})


# -- the body, and the key: ASGI middleware -------------------------------------------------

# refuse(status, message) -> an ASGI response that also closes the connection
Refusal = Callable[[int, str], Any]


class BodyGuard:
    """ASGI middleware: reads a request's whole body before the app runs, so that

    - a body larger than `limits.max_body_bytes` is refused with 413 without reading it (a
      Content-Length over it) or as soon as it has gone past it (chunked);
    - a body shorter than its Content-Length (a client that stalls or lies) is answered 408
      once `limits.body_timeout_s` has passed, instead of holding the request open until the
      client gives up;
    - a JSON body over the JSON limits is answered 400 naming the limit; one that parses is
      left parsed in the scope (PARSED_JSON) so the app need not parse it again;
    - any non-empty body is read as JSON whatever its Content-Type says (`curl -d` sends a
      form type).

    Refusals close the connection (the body was not read to its end) and log one line.
    """

    def __init__(self, app, limits: HttpLimits, refuse: Refusal):
        self.app, self.limits, self.refuse = app, limits, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = int(value)  # the HTTP parser has checked it is a number >= 0
        cap = self.limits.max_body_bytes
        if declared is not None and declared > cap:
            return await self._refuse(413, f"a body of {declared} bytes is over this server's "
                                           f"limit of {cap} (--max_body_bytes)", scope,
                                      receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):  # no task per read, unlike wait_for
                    message = await receive()
            except TimeoutError:
                expected = f" of the {declared} its Content-Length announces" if declared else ""
                return await self._refuse(
                    408, f"incomplete body: {size} bytes{expected} arrived within "
                         f"{self.limits.body_timeout_s:g}s (--body_timeout_s)", scope, receive,
                    send)
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:  # a chunked body has no Content-Length to check first
                return await self._refuse(413, f"the body is over this server's limit of "
                                               f"{cap} bytes (--max_body_bytes)", scope,
                                          receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"]
                                         if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
            try:
                scope[PARSED_JSON] = loads(body, self.limits.max_json_depth)
            except JSONLimitError as err:
                return await self._refuse(400, str(err), scope, receive, send)
            except ValueError:  # not JSON: the app says what is wrong, as it always has
                pass
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages: a disconnect, passed on

        await self.app(scope, replay, send)

    async def _refuse(self, status, message, scope, receive, send):
        where = f"{scope['method']} {scope['path']}"
        client = scope.get("client")
        peer = "%s:%d" % tuple(client) if client else "a client"
        warn(f"body_{status}", "answered %d to %s on %s: %s", status, peer, where, message)
        await self.refuse(status, f"{where}: {message}")(scope, receive, send)


class KeyGuard:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer <api_key>`, compared in
    constant time, else 401 (before the body is read; the connection is then closed)."""

    def __init__(self, app, api_key: str, refuse: Refusal, hint: str = ""):
        self.app, self.refuse, self.hint = app, refuse, hint
        self.expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                sent = value
        if hmac.compare_digest(sent, self.expected):
            return await self.app(scope, receive, send)
        client = scope.get("client")
        warn("api_key", "answered 401 to %s on %s %s: %s API key", "%s:%d" % tuple(client)
             if client else "a client", scope["method"], scope["path"],
             "a wrong" if sent else "no")
        what = "wrong" if sent else "missing"
        await self.refuse(401, f"{what} API key: send 'Authorization: Bearer <key>'"
                               f"{self.hint}")(scope, receive, send)
