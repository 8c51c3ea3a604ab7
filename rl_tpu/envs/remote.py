"""`RemoteEnv`: an `Env` whose episodes run in an env server (AgentGym HTTP API).

Talks to `rl_tpu.envs.server` (or any AgentGym `agentenv-*` server that has the routes used):
the first `reset` creates an instance with `POST /create`, later ones reuse it with
`POST /reset {id, data_idx}`, `step` is `POST /step {id, action}`, `close` is `POST /close`.
Tasks from the server's own task source (`RemoteEnv.tasks()`, or any task whose data carries
`split` and `index`) travel as a data index; other tasks travel whole as `{"task_id", "data"}`.

One persistent HTTP/1.1 connection per RemoteEnv (stdlib `http.client`, no extra dependency).
Failures are `RemoteEnvError`s that name the server URL, the request and what went wrong:

- connection refused (server down or not yet up): retried with exponential backoff, `retries`
  times, then raised; safe for every request since nothing reached the server;
- connection dropped after the request was sent: retried only for requests that are safe to
  repeat (GET, /reset, /close), plus once for any request on a reused keep-alive connection
  (a server-side idle close looks the same, and an action is then not applied twice in
  practice); a dropped `/step` on a fresh connection is raised, never replayed;
- no reply within `timeout` seconds: raised at once (a hung server is not helped by waiting
  longer);
- an HTTP error status: raised with the server's message (a 404 on `reset` re-creates the
  instance, since a new episode may start anywhere).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
import urllib.parse
from typing import Any, Optional

from rl_tpu.envs.base import Env, StepResult, Task, TaskSource

log = logging.getLogger(__name__)

_IDEMPOTENT = {"/reset", "/close"}


class RemoteEnvError(RuntimeError):
    """A request to an env server failed; `status` is the HTTP code, or None if there was no
    reply at all."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


class RemoteTaskSource(TaskSource):
    """The server's task source, read through `GET /info` and `GET /task`."""

    def __init__(self, env: "RemoteEnv"):
        self._env = env
        self.splits = tuple(env.server_info()["splits"]) or ("train", "eval")

    def size(self, split: str) -> Optional[int]:
        self.check_split(split)
        return self._env.server_info()["splits"].get(split)

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        query = urllib.parse.urlencode({"split": split, "index": int(index)})
        reply = self._env._request("GET", f"/task?{query}")
        return Task(task_id=reply["task_id"], data=reply["data"])


class RemoteEnv(Env):
    """An env served over HTTP.

    Args:
      url: the server's base URL, e.g. "http://127.0.0.1:36001".
      env_name: the env the server must be serving; checked on first contact when given.
      timeout: seconds to wait for one reply (connecting included).
      retries: extra attempts after a connection failure (see the module docstring).
      backoff: seconds before the first retry; doubles after each.
    """

    def __init__(self, url: str, env_name: Optional[str] = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.2):
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"env server url must look like http://host:port, got {url!r}")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self.name = env_name or "remote"
        self._expected_name = env_name
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self._conn: Optional[http.client.HTTPConnection] = None
        self._id: Optional[int] = None
        self._info: Optional[dict] = None
        self._done = True

    # -- transport --------------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout)
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _request(self, method: str, path: str, body: Optional[dict] = None) -> Any:
        """One API call; returns the decoded JSON reply or raises RemoteEnvError."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        route = path.split("?")[0]
        repeatable = method == "GET" or route in _IDEMPOTENT
        what = f"{method} {self.url}{route}"
        for attempt in range(self.retries + 1):
            reused = self._conn is not None and self._conn.sock is not None
            try:
                conn = self._connection()
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                raw = response.read()
                status = response.status
            except (ConnectionRefusedError, socket.gaierror) as e:
                self._drop_connection()  # never reached the server: always safe to retry
                error, retry = e, True
            except TimeoutError as e:  # socket.timeout is TimeoutError on 3.10+
                self._drop_connection()
                raise RemoteEnvError(f"{what}: no reply within {self.timeout:g}s; the env "
                                     "server is hung or overloaded") from e
            except (http.client.HTTPException, OSError) as e:
                self._drop_connection()
                error, retry = e, repeatable or (reused and attempt == 0)
            else:
                return self._decode(what, status, raw)
            if not retry or attempt == self.retries:
                raise RemoteEnvError(
                    f"{what} failed after {attempt + 1} attempt(s): {type(error).__name__}: "
                    f"{error}. Is the env server at {self.url} running? (It may have died "
                    "mid-episode; restart it and reset the env.)") from error
            delay = self.backoff * 2**attempt
            log.warning("%s: %s; retrying in %.2fs", what, error, delay)
            time.sleep(delay)
        raise AssertionError("unreachable")

    @staticmethod
    def _decode(what: str, status: int, raw: bytes) -> Any:
        try:
            payload = json.loads(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, ValueError):
            raise RemoteEnvError(f"{what}: HTTP {status} with a reply that is not JSON: "
                                 f"{raw[:200]!r}", status)
        if status != 200:
            message = payload.get("error") if isinstance(payload, dict) else payload
            raise RemoteEnvError(f"{what} failed with HTTP {status}: {message}", status)
        if isinstance(payload, dict) and "error" in payload:
            # AgentGym's own servers answer 200 with {"error": ...}.
            raise RemoteEnvError(f"{what}: the server reported an error: {payload['error']}")
        return payload

    # -- Env --------------------------------------------------------------------------------

    def server_info(self) -> dict:
        """`GET /info` (cached): env name, system prompt, split sizes."""
        if self._info is None:
            info = self._request("GET", "/info")
            if self._expected_name is not None and info.get("env") != self._expected_name:
                raise RemoteEnvError(f"the env server at {self.url} serves {info.get('env')!r}, "
                                     f"not {self._expected_name!r}")
            self._info = info
            self.name = self._expected_name or info.get("env", "remote")
        return self._info

    @property
    def system_prompt(self) -> str:  # type: ignore[override]
        return self.server_info().get("system_prompt", "")

    def tasks(self) -> TaskSource:
        return RemoteTaskSource(self)

    @staticmethod
    def _task_body(task: Task) -> dict:
        data = task.data or {}
        if isinstance(data.get("split"), str) and isinstance(data.get("index"), int):
            return {"data_idx": data["index"], "split": data["split"]}
        try:
            json.dumps(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"task {task.task_id!r} has data that is not JSON ({e}); a remote "
                             "env needs JSON task data or a task from env.tasks()") from e
        return {"task": {"task_id": task.task_id, "data": data}}

    def reset(self, task: Task) -> str:
        if self._expected_name is not None:
            self.server_info()
        body = self._task_body(task)
        reply = None
        if self._id is not None:
            try:
                reply = self._request("POST", "/reset", {"id": self._id, **body})
            except RemoteEnvError as e:
                if e.status != 404:  # anything but "that id is gone" is a real failure
                    raise
                log.warning("env %s is gone from %s (%s); creating a new one", self._id,
                            self.url, e)
                self._id = None
        if reply is None:
            reply = self._request("POST", "/create", body)
            self._id = int(reply["id"])
        self._done = bool(reply.get("done", False))
        return reply["observation"]

    def step(self, action: str) -> StepResult:
        if self._id is None or self._done:
            return StepResult(observation="The episode is over; reset to start a new one.",
                              reward=0.0, done=True,
                              info={"invalid_action": True, "episode_over": True})
        if not isinstance(action, str):  # same treatment as a local env: unreadable action
            action = ""
        reply = self._request("POST", "/step", {"id": self._id, "action": action})
        self._done = bool(reply["done"])
        return StepResult(observation=reply["observation"], reward=float(reply["reward"]),
                          done=self._done, info=dict(reply.get("info") or {}))

    def observation(self) -> str:
        """`GET /observation`: the instance's last observation."""
        if self._id is None:
            raise RemoteEnvError(f"no episode on {self.url} yet: call reset first")
        return self._request("GET", f"/observation?id={self._id}")

    def close(self) -> None:
        """Frees the server-side instance. A dead server is logged, not raised: close runs in
        cleanup paths, where the error that killed the server is already being reported."""
        if self._id is not None:
            try:
                self._request("POST", "/close", {"id": self._id})
            except RemoteEnvError as e:
                log.warning("closing env %s on %s failed: %s", self._id, self.url, e)
            self._id = None
        self._done = True
        self._drop_connection()
