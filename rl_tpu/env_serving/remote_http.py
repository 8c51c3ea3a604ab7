"""The HTTP under `RemoteEnv`: httpx connection pools, timeouts, and which failures are retried.

A `Transport` sends one env server's requests through an `httpx.Client`: its own (a pool
that keeps the episode's connection alive between calls) or one shared by every env of a
`RemoteEnvFactory` on that server (`shared_client`), so an episode that starts reuses a
connection an earlier episode left open instead of opening one of its own.

Failures, with the semantics the stdlib client had (docs/env_servers.md, "When a server
fails"):

- connection refused or a name that does not resolve: nothing reached the server, so it is
  retried `retries` times with exponential backoff (`backoff`, doubled each time);
- no reply within `timeout` seconds (connecting included): raised at once, never retried (a
  hung server is not helped by waiting, and a step may be running there);
- the connection dropped after the request went out: retried for requests that are safe to
  repeat (GET, /reset, /close), and once for any request that went out on a reused
  keep-alive connection (a server's idle close looks the same, and then the action was not
  applied); a `/step` lost on a fresh connection is raised, never replayed. Whether the
  connection was fresh is read from httpx's trace events (a TCP connect during the request).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import httpx

log = logging.getLogger(__name__)

_IDEMPOTENT = {"/reset", "/close"}
# How long an idle pooled connection is kept: servers close theirs on their own schedule
# (uvicorn's default is 5 s, rl_tpu's env server 600 s); httpx notices a closed one before
# reusing it, and the retry-once rule above covers the moment in between.
KEEPALIVE_S = 60.0


class RemoteEnvError(RuntimeError):
    """A request to an env server failed. `status` is the HTTP code (200 for AgentGym's
    `{"error": ...}` replies), or None if there was no reply at all; `server_error` is the
    message the server sent, if any."""

    def __init__(self, message: str, status: Optional[int] = None,
                 server_error: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.server_error = server_error


def shared_client(timeout: float, connections: int = 512) -> httpx.Client:
    """A pool for many envs on one server at once (thread-safe); up to `connections` idle
    connections are kept for reuse."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=connections,
                          keepalive_expiry=KEEPALIVE_S)
    return httpx.Client(timeout=httpx.Timeout(timeout), limits=limits)


class Transport:
    """Requests to the env server at `url` (scheme://host:port), each retried as the module
    docstring says. `client`: a shared pool (never closed here); None builds one of this
    transport's own on first use. `api_key`: sent as `Authorization: Bearer <key>`."""

    def __init__(self, url: str, timeout: float, retries: int, backoff: float,
                 client: Optional[httpx.Client] = None, api_key: Optional[str] = None):
        self.url = url
        # sent with every request (`launch.serve_env --api_key`); never logged
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self._shared = client
        self._own: Optional[httpx.Client] = None
        self._lock = threading.Lock()  # guards building and closing the own client

    def _client(self) -> httpx.Client:
        if self._shared is not None:
            return self._shared
        with self._lock:
            if self._own is None:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=1,
                                      keepalive_expiry=KEEPALIVE_S)
                self._own = httpx.Client(timeout=httpx.Timeout(self.timeout), limits=limits)
            return self._own

    def drop_connection(self) -> None:
        """Closes this transport's own connection (a shared pool is left to its owner); the
        next request opens a fresh one."""
        with self._lock:
            own, self._own = self._own, None
        if own is not None:
            own.close()

    close = drop_connection

    def request(self, method: str, path: str, body: Optional[bytes] = None
                ) -> tuple[int, bytes]:
        """(status, raw reply body) of one API call; RemoteEnvError when no reply came."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        headers.update(self._auth)
        route = path.split("?")[0]
        repeatable = method == "GET" or route in _IDEMPOTENT
        what = f"{method} {self.url}{route}"
        for attempt in range(self.retries + 1):
            connects: list[str] = []

            def trace(event: str, info: dict) -> None:
                if event.startswith("connection.connect_tcp."):
                    connects.append(event)

            try:
                response = self._client().request(method, self.url + path, content=body,
                                                  headers=headers,
                                                  extensions={"trace": trace})
                return response.status_code, response.content
            except httpx.ConnectError as e:  # never reached the server: always safe to retry
                error, retry = e, True
            except httpx.TimeoutException as e:
                self.drop_connection()
                raise RemoteEnvError(f"{what}: no reply within {self.timeout:g}s; the env "
                                     "server is hung or overloaded") from e
            except httpx.TransportError as e:  # dropped mid-request: retry only where safe
                self.drop_connection()
                reused = not connects
                error, retry = e, repeatable or (reused and attempt == 0)
            if not retry or attempt == self.retries:
                raise RemoteEnvError(
                    f"{what} failed after {attempt + 1} attempt(s): {type(error).__name__}: "
                    f"{error}. Is the env server at {self.url} running? (It may have died "
                    "mid-episode; restart it and reset the env.)") from error
            delay = self.backoff * 2**attempt
            log.warning("%s: %s; retrying in %.2fs", what, error, delay)
            time.sleep(delay)
        raise AssertionError("unreachable")
