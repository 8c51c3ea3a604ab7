"""`HttpTransport`: JSON API calls to a pool of rollout servers, with retries and fail-over.

The part of the SGLang client that knows nothing of SGLang: HTTP on one pooled `httpx.Client`
(keep-alive connections shared by every thread, per-call timeouts), the retry/backoff/fail-over
policy, and the choice of the least-loaded server. `SGLangEngine` (sglang.py) and the weight
sync (weight_sync.py) speak to their servers only through it.

Failures never hang the caller; each ends in a `RolloutError` naming the server and what went
wrong, or in a fail-over:

- connection refused, connection dropped, or HTTP 5xx: retried on the same server
  `connect_retries` times with exponential backoff (`backoff_s`, doubling, capped at 30 s),
  then the call fails over to the next server (callers only send calls that are safe to repeat:
  a generation that never came back is simply drawn again);
- no reply within the timeout: fails over at once (a hung server is not helped by waiting
  longer on it);
- HTTP 4xx, or HTTP 200 with a body that is not JSON: raised at once with the server's message
  (the request is wrong; every server would say so). Calls that expect plain text (sglang-
  router's `/health` answers `OK`) say so with `text_ok=True`.

A server that failed is tried last for `failover_cooldown_s`. With one URL, the worst case
before the error is `(connect_retries + 1)` attempts of at most the timeout each plus the
backoff sleeps. The timeout bounds each step of a call (connecting, sending, each wait for
bytes of the reply), as a socket timeout does, not the whole transfer.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from typing import Any, Optional, Sequence

import httpx

from rl_tpu.core.engine import RolloutError

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
# Idle keep-alive connections kept per transport: one per request in flight behind a router
# (SGLangEngine's default 8 x 16); more only costs a reconnect.
MAX_IDLE_CONNECTIONS = 256
# Idle connections are dropped here before SGLang's server (uvicorn, 5 s keep-alive) closes
# them, so a request never goes out on a connection the server is closing at that moment (such
# a drop would cost a retry's backoff). rl_tpu's servers keep theirs 75 s; a reconnect is one
# TCP handshake, nothing next to a generation.
KEEPALIVE_S = 4.0

# httpx logs every request at INFO; under absl's INFO default that is one line per batch.
if logging.getLogger("httpx").level == logging.NOTSET:
    logging.getLogger("httpx").setLevel(logging.WARNING)


class ServerDown(Exception):
    """One server could not answer (after its retries); the caller may fail over."""


def normalise_url(url: str) -> str:
    """`host:port` or `http(s)://host:port[/...]` -> `scheme://host:port`; ValueError otherwise."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"rollout server url must look like http://host:port, got {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


def error_message(payload: Any, raw: bytes) -> str:
    """The server's own words: SGLang `{"error": {"message"}}`, FastAPI `{"detail"}`, or text."""
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail", payload.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)
    return raw[:300].decode("utf-8", "replace") if raw else "(empty reply)"


class HttpTransport:
    """JSON calls to `urls` (thread-safe).

    Args:
      urls: server base URLs, e.g. ["http://10.0.0.2:30000"] (normalised; no duplicates).
      request_timeout_s: default seconds to wait for one reply.
      connect_retries: extra attempts on one server after a failure (see the module doc).
      backoff_s: seconds before the first retry; doubles after each.
      failover_cooldown_s: how long a failed server is tried last.
      api_key: sent as `Authorization: Bearer ...` (SGLang's `--api-key`).
    """

    def __init__(self, urls: Sequence[str], *, request_timeout_s: float = 300.0,
                 connect_retries: int = 3, backoff_s: float = 0.5,
                 failover_cooldown_s: float = 30.0, api_key: Optional[str] = None):
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("a rollout client needs at least one server url")
        self.urls = [normalise_url(u) for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate server urls in {self.urls}")
        if connect_retries < 0:
            raise ValueError(f"connect_retries must be >= 0, got {connect_retries}")
        self.request_timeout_s = float(request_timeout_s)
        self.connect_retries, self.backoff_s = int(connect_retries), float(backoff_s)
        self.failover_cooldown_s = float(failover_cooldown_s)
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        # One pooled client for every thread (httpx's pool is thread-safe). No limit on
        # connections: the caller's thread pool already bounds the calls in flight, and a wait
        # for a free connection would read as a server timeout. trust_env=False: rollout
        # servers sit on the cluster's own network, and an HTTP(S)_PROXY meant for the internet
        # must not carry the trainer's traffic (the stdlib client this replaces used none).
        self._client = httpx.Client(
            headers=headers, timeout=self.request_timeout_s, trust_env=False,
            limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_S,
                                max_keepalive_connections=MAX_IDLE_CONNECTIONS))
        self._lock = threading.Lock()
        self._inflight = {u: 0 for u in self.urls}
        self._down_until = {u: 0.0 for u in self.urls}
        self._turn = 0

    def close(self) -> None:
        """Closes the pooled connections (later calls fail)."""
        self._client.close()

    def call_one(self, url: str, method: str, path: str, body: Any = None,
                 timeout: Optional[float] = None, retries: Optional[int] = None,
                 text_ok: bool = False) -> Any:
        """One API call to one server with retries; the decoded JSON reply (None if empty), or
        with `text_ok` a 200 reply that is not JSON as text.

        Raises RolloutError for answers no other server would change (4xx, a reply that is
        not JSON) and ServerDown when this server cannot answer."""
        data = json.dumps(body).encode() if body is not None else None
        what = f"{method} {url}{path}"
        timeout = self.request_timeout_s if timeout is None else timeout
        retries = self.connect_retries if retries is None else retries
        attempt = 0
        while True:
            try:
                response = self._client.request(method, url + path, content=data,
                                                timeout=timeout)
                raw, status = response.content, response.status_code
            except httpx.TimeoutException as e:  # connect, write or read: no retry here
                raise ServerDown(f"{what}: no reply within {timeout:g}s (server hung or "
                                 "overloaded)") from e
            except httpx.ConnectError as e:
                failure = f"{what}: cannot connect ({e})"
            except httpx.TransportError as e:  # dropped mid-call, or a reply that is not HTTP
                failure = f"{what}: {type(e).__name__}: {e}"
            else:
                try:
                    payload = json.loads(raw) if raw else None
                except ValueError:
                    payload = None
                    if status == 200:
                        if text_ok:
                            return raw.decode("utf-8", "replace")
                        raise RolloutError(f"{what}: HTTP 200 with a reply that is not JSON: "
                                           f"{raw[:200]!r}", url, status)
                if status == 200:
                    return payload
                message = error_message(payload, raw)
                if status < 500:
                    raise RolloutError(f"{what} failed with HTTP {status}: {message}", url, status)
                failure = f"{what}: HTTP {status}: {message}"
            if attempt >= retries:
                raise ServerDown(f"{failure} (after {attempt + 1} attempts)")
            delay = min(self.backoff_s * 2 ** attempt, MAX_BACKOFF_S)
            log.warning("%s; retrying in %.2fs", failure, delay)
            time.sleep(delay)
            attempt += 1

    def ordered_urls(self) -> list[str]:
        """Servers to try, best first: up ones by fewest in flight (ties rotate), then down ones."""
        with self._lock:
            now = time.monotonic()
            self._turn += 1
            n = len(self.urls)
            rotated = [self.urls[(self._turn + k) % n] for k in range(n)]
            return sorted(rotated, key=lambda u: (self._down_until[u] > now, self._inflight[u]))

    def call(self, method: str, path: str, body: Any = None, *,
             urls: Optional[Sequence[str]] = None, timeout: Optional[float] = None
             ) -> tuple[str, Any]:
        """(url, reply) from the first server in `urls` (default: all, best first) that answers;
        RolloutError naming every failure when none does."""
        urls = list(urls) if urls is not None else self.ordered_urls()
        failures = []
        for url in urls:
            with self._lock:
                self._inflight[url] += 1
            try:
                reply = self.call_one(url, method, path, body, timeout)
            except ServerDown as e:
                failures.append(str(e))
                with self._lock:
                    self._down_until[url] = time.monotonic() + self.failover_cooldown_s
                if url != urls[-1]:
                    log.warning("%s; failing over to another server", e)
                continue
            finally:
                with self._lock:
                    self._inflight[url] -= 1
            with self._lock:
                self._down_until[url] = 0.0
            return url, reply
        hint = ("Is the rollout server running? Check its log and restart it (more urls give "
                "fail-over)." if len(urls) == 1 else "Are the rollout servers running? Check "
                "their logs and restart them.")
        raise RolloutError("; ".join(failures) + ". " + hint, urls[0] if len(urls) == 1 else None)
