"""`RemoteEnv`: an `Env` whose episodes run in an env server (AgentGym's HTTP API).

One client for AgentGym's own `agentenv-*` servers and for rl_tpu's (`rl_tpu.env_serving.server`,
`python -m launch.serve_env`), which answers in the same shapes. Two protocols:

`protocol="agentgym"` (the default for env_name babyai, textcraft, sciworld, searchqa) does
what AgentGym's own client for that env does, on the routes AgentGym's servers have:

  env        first reset                          reset                     step body
  babyai     POST /create (no body) -> {"id"}     /reset {"id","data_idx"}  {"id","action"}
  sciworld   as babyai; the first observation is task_description + "\\n" + observation
  textcraft  POST /create {} -> {"id", ...}       /reset {"id","data_idx"}  {"id","action"}
  searchqa   POST /create {"id": item} -> env_idx /reset {"env_idx","id"}   {"env_idx","action"}
             (the reset reply is the prompt string itself)

  `reset(Task(f"{env}_{i}", {"data_idx": i}))` plays item i (a task id `<env>_<i>` alone works
  too, as does a task from an rl_tpu server's `tasks()`). `step(reply)` takes the model's WHOLE
  reply and parses it as AgentGym's client does (`rl_tpu.core.agentgym_parse`): BabyAI and
  TextCraft send the one `Action:` line, filtered, and a reply with two markers gets the
  TOO_MANY_ACTIONS observation, reward 0, not done, without a request; SciWorld sends the text
  after the last marker; SearchQA sends the reply whole. The reward is what AgentGym's client
  reports: the server's `score` where it sends one (BabyAI, SciWorld), else its `reward`.
  There is no system prompt (AgentGym's servers have no /info); pass `instruction` to get
  AgentGym-RL's conversation start (`conversation_start()`, used by `rl_tpu.agent`).

`protocol="rl_tpu"` (any other env_name, or none) is rl_tpu's generic one: the reply is sent
whole (the env parses it), tasks travel as a data index or whole (`{"task": {...}}`), and the
system prompt and task source come from the rl_tpu-only `GET /info` and `GET /task`.

Errors are `RemoteEnvError`s that name the server URL, the request and what went wrong; the
agent loop then ends that episode (`finish="env_error"`, reward 0 for the turn), which is what
AgentGym-RL does with an episode whose server answered an error (it scores it 0):

- an HTTP 200 `{"error": msg}` reply (AgentGym's BabyAI, TextCraft and SciWorld servers answer
  a bad id, a step after the end, or an env that raised this way): raised with `msg`;
- an HTTP error status: raised with the server's message (rl_tpu's servers send
  `{"error": {"message": ...}}`; SearchQA answers every failure with a bare 500 "Internal
  Server Error"; FastAPI's 404/422 carry a `detail`); a 404 on `reset` re-creates the
  instance (rl_tpu's server answers 404 for an instance it dropped or expired), since a new
  episode may start anywhere;
- connection refused (server down or not yet up): retried with exponential backoff, `retries`
  times, then raised; safe for every request since nothing reached the server;
- connection dropped after the request was sent: retried only for requests that are safe to
  repeat (GET, /reset, /close), plus once for any request on a reused keep-alive connection
  (a server-side idle close looks the same, and an action is then not applied twice in
  practice); a dropped `/step` on a fresh connection is raised, never replayed;
- no reply within `timeout` seconds: raised at once (a hung server is not helped by waiting).

A server started with a key (`launch.serve_env --api_key`, or RL_TPU_ENV_API_KEY) answers 401
without it: RemoteEnv sends `api_key`, by default the same environment variable, and a 401 is
a RemoteEnvError saying to set it.

HTTP goes through httpx (`rl_tpu.env_serving.remote_http`): keep-alive connections from a pool,
the RemoteEnv's own or one shared by every env a `RemoteEnvFactory` builds for that server, and
a lock that serialises the calls on one RemoteEnv (a timed-out step still running in its
worker thread and a later close, say), so one episode never has two requests in flight.

Training against servers (`env.remote_url`, docs/env_servers.md): `RemoteEnvFactory`.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import re
import threading
import urllib.parse
from typing import Any, Optional, Sequence

import httpx

from rl_tpu.core.agentgym_parse import parse_action, parse_sciworld_action
from rl_tpu.core.env import Env, StepResult, Task, TaskSource
from rl_tpu.env_serving.remote_http import RemoteEnvError, Transport, shared_client

__all__ = ["AGENTGYM_ENVS", "API_KEY_ENV", "RemoteEnv", "RemoteEnvError", "RemoteEnvFactory",
           "RemoteTaskSource", "agentgym_name", "parse_urls", "split_url"]

log = logging.getLogger(__name__)

AGENTGYM_ENVS = ("babyai", "textcraft", "sciworld", "searchqa")
API_KEY_ENV = "RL_TPU_ENV_API_KEY"  # the key `launch.serve_env` reads too
PROTOCOLS = ("agentgym", "rl_tpu")
# AgentGym-RL's fixed assistant turn after the instruction (rl_dataset.py).
ACKNOWLEDGEMENT = "OK. I'll follow your instructions and try my best to solve the task."
SEARCHQA_ACKNOWLEDGEMENT = "Ok."

_ITEM_SUFFIX = re.compile(r"_(\d+)$")


def split_url(url: str) -> urllib.parse.SplitResult:
    """`url` parsed, "http://" assumed when it names no scheme; ValueError unless it is an
    http(s) URL with a host, a numeric port if any, and no path (requests go to the root)."""
    url = url.strip() if isinstance(url, str) else ""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"env server url {url!r} has a bad port; want http://host:port")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
        raise ValueError(f"env server url must look like http://host:port, got {url!r}")
    return parts


def _serialised(method):
    """Runs `method` holding the env's lock (see RemoteEnv._lock)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class RemoteTaskSource(TaskSource):
    """An rl_tpu server's task source, read through `GET /info` and `GET /task`."""

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
      env_name: the env the server serves. One of AGENTGYM_ENVS selects that env's AgentGym
        client behaviour (see the module docstring); with the rl_tpu protocol it is checked
        against the server's `GET /info` on first contact.
      timeout: seconds to wait for one reply (connecting included).
      retries: extra attempts after a connection failure (see the module docstring).
      backoff: seconds before the first retry; doubles after each.
      protocol: "agentgym" or "rl_tpu"; default "agentgym" for AgentGym's env names, else
        "rl_tpu".
      instruction: the env's instruction (AgentGym client's `conversation_start[0]`); when
        given, `conversation_start()` returns it as a user turn and AgentGym-RL's fixed
        acknowledgement as the assistant turn.
      system_prompt, conversation, task_source: what a local definition of the env says
        (`RemoteEnvFactory` passes the local env's): returned by `system_prompt`,
        `conversation_start()` and `tasks()` in place of asking the server (`/info`, `/task`).
      tools, call_format: a function-calling env's tool schemas and call format, as its local
        definition states them (the loop renders the tools; the server runs the calls).
      client: an httpx.Client pool to send through, shared with other envs (never closed
        here; `remote_http.shared_client`); None: a pool of this env's own.
      api_key: sent as `Authorization: Bearer <key>` to a server started with a key; None:
        the environment variable RL_TPU_ENV_API_KEY, if set.
    """

    def __init__(self, url: str, env_name: Optional[str] = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 0.2, *, protocol: Optional[str] = None,
                 instruction: Optional[str] = None, system_prompt: Optional[str] = None,
                 conversation: Optional[Sequence[dict]] = None,
                 task_source: Optional[TaskSource] = None,
                 client: Optional[httpx.Client] = None, api_key: Optional[str] = None,
                 tools: Optional[Sequence[dict]] = None, call_format: Optional[str] = None):
        parts = split_url(url)
        if not timeout > 0 or retries < 0 or backoff < 0:
            raise ValueError(f"RemoteEnv needs timeout > 0, retries >= 0 and backoff >= 0 "
                             f"seconds; got {timeout}, {retries}, {backoff}")
        if protocol is None:
            protocol = "agentgym" if env_name in AGENTGYM_ENVS else "rl_tpu"
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if protocol == "agentgym" and env_name not in AGENTGYM_ENVS:
            raise ValueError(f"the agentgym protocol needs env_name in {AGENTGYM_ENVS} (it says "
                             f"which server's reply shapes and parsing to use), got {env_name!r}")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.name = env_name or "remote"
        self._expected_name = env_name
        self.protocol = protocol
        self.instruction = instruction
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self._transport = Transport(self.url, timeout, retries, backoff, client, api_key)
        self._id: Optional[int] = None
        self._info: Optional[dict] = None
        self._done = True
        self._system_prompt = system_prompt
        self._conversation = [dict(m) for m in conversation] if conversation else None
        self._task_source = task_source
        # A function-calling env's tool schemas and call format, as its local definition
        # states them: the agent loop renders the tools into the prompt here, while the
        # server parses and runs the calls and returns their results as observation messages.
        self.tools = [dict(t) for t in tools] if tools else None
        self.call_format = call_format
        # Held for a whole reset/step/close, so a second thread never interleaves requests
        # on this env's connection or sees its id half-updated.
        self._lock = threading.RLock()
        # SearchQA names the instance `env_idx` (its `id` is the item); the others `id`.
        self._id_key = "env_idx" if env_name == "searchqa" else "id"

    # -- transport --------------------------------------------------------------------------

    def _drop_connection(self) -> None:
        self._transport.drop_connection()

    @_serialised
    def _request(self, method: str, path: str, body: Optional[dict] = None) -> Any:
        """One API call; returns the decoded JSON reply or raises RemoteEnvError."""
        data = json.dumps(body).encode() if body is not None else None
        status, raw = self._transport.request(method, path, data)
        return self._decode(f"{method} {self.url}{path.split('?')[0]}", status, raw)

    def _decode(self, what: str, status: int, raw: bytes) -> Any:
        try:
            payload = json.loads(raw.decode("utf-8")) if raw else None
        except (UnicodeDecodeError, ValueError):
            if status == 200:
                raise RemoteEnvError(f"{what}: HTTP 200 with a reply that is not JSON: "
                                     f"{raw[:200]!r}; is {self.url} an env server?", status)
            # e.g. SearchQA's bare 500 "Internal Server Error"
            payload = raw[:500].decode("utf-8", "replace")
        if status != 200:
            message = payload
            if isinstance(payload, dict):
                message = payload.get("error", payload.get("detail", payload))
                if isinstance(message, dict) and "message" in message:
                    message = message["message"]  # rl_tpu's {"error": {"message": ...}}
            hint = ""
            if status == 401:
                raise RemoteEnvError(
                    f"{what}: the env server at {self.url} wants an API key ({message}): set "
                    f"{API_KEY_ENV} to the key it was started with", status,
                    message if isinstance(message, str) else None)
            if status == 404 and message == "Not Found":
                hint = (" (no such route: AgentGym's servers have no /info, /task or /health, "
                        "so an rl_tpu-only call such as tasks() or system_prompt cannot work "
                        "there; build tasks as Task(f'{env}_{i}', {'data_idx': i}))")
            elif status == 500 and self._expected_name == "searchqa":
                hint = (" (AgentGym's SearchQA server answers every failure, a bad env_idx "
                        "included, with HTTP 500; its log has the cause)")
            raise RemoteEnvError(f"{what} failed with HTTP {status}: {message}{hint}", status,
                                 message if isinstance(message, str) else None)
        if isinstance(payload, dict) and "error" in payload:
            # AgentGym's BabyAI, TextCraft and SciWorld servers answer failures with HTTP 200
            # (and so does rl_tpu's with --error_style agentgym).
            message = payload["error"]
            if isinstance(message, dict) and "message" in message:
                message = message["message"]
            raise RemoteEnvError(
                f"{what}: the env server answered with an error: {message}. The "
                "episode cannot go on (AgentGym-RL scores it 0); reset to start a new one",
                status, str(message))
        return payload

    def _reply(self, what: str, reply: Any, *keys: str) -> dict:
        """`reply` checked to be an object with `keys`; else an error that says so."""
        if not isinstance(reply, dict) or any(key not in reply for key in keys):
            raise RemoteEnvError(f"{what} on {self.url} answered {reply!r:.300}, not an object "
                                 f"with {list(keys)}; is it a {self.name} server "
                                 f"(env_name={self._expected_name!r}, protocol={self.protocol!r})?")
        return reply

    # -- Env --------------------------------------------------------------------------------

    @_serialised
    def server_info(self) -> dict:
        """`GET /info` (cached, rl_tpu servers only): env name, system prompt, split sizes."""
        if self._info is None:
            info = self._request("GET", "/info")
            served = info.get("env")
            # An rl_tpu server serving `babyai_agentgym` is what RemoteEnv(url, "babyai") wants.
            if self._expected_name is not None and served not in (
                    self._expected_name, f"{self._expected_name}_agentgym"):
                raise RemoteEnvError(f"the env server at {self.url} serves {served!r}, "
                                     f"not {self._expected_name!r}")
            self._info = info
            self.name = self._expected_name or info.get("env", "remote")
        return self._info

    @property
    def system_prompt(self) -> str:  # type: ignore[override]
        if self._system_prompt is not None:
            return self._system_prompt
        if self.protocol == "agentgym":
            return ""  # AgentGym states the format in the instruction (conversation_start)
        return self.server_info().get("system_prompt", "")

    def conversation_start(self) -> Optional[list[dict]]:
        """AgentGym-RL's first two turns when an `instruction` was given, else None (the
        agent loop then uses `system_prompt`); the `conversation` given, if any."""
        if self._conversation is not None:
            return [dict(m) for m in self._conversation]
        if self.instruction is None:
            return None
        ack = SEARCHQA_ACKNOWLEDGEMENT if self._expected_name == "searchqa" else ACKNOWLEDGEMENT
        return [{"role": "user", "content": self.instruction},
                {"role": "assistant", "content": ack}]

    def tasks(self) -> TaskSource:
        """The `task_source` given, else the server's (rl_tpu servers only; AgentGym's have
        none)."""
        if self._task_source is not None:
            return self._task_source
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

    @staticmethod
    def _item(task: Task) -> dict:
        """AgentGym's item for a task: `{"data_idx": i}` (plus the split of a task from an rl_tpu
        server's own source, which AgentGym's servers would ignore)."""
        data = task.data or {}
        index = data.get("data_idx")
        if isinstance(data.get("split"), str) and isinstance(data.get("index"), int):
            return {"data_idx": data["index"], "split": data["split"]}
        if index is None:
            match = _ITEM_SUFFIX.search(task.task_id)
            index = int(match.group(1)) if match else None
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"task {task.task_id!r} names no AgentGym item: give it data "
                             "{'data_idx': i} or an id '<env>_<i>' (i a non-negative int)")
        return {"data_idx": index}

    @_serialised
    def reset(self, task: Task) -> str:
        if self.protocol == "agentgym":
            return self._reset_agentgym(task)
        if self._expected_name is not None:
            self.server_info()
        body = self._task_body(task)
        reply = self._reset_known(body)
        if reply is None:
            reply = self._reply("POST /create", self._request("POST", "/create", body),
                                "id", "observation")
            self._id = int(reply["id"])
        reply = self._reply("POST /reset", reply, "observation")
        self._done = bool(reply.get("done", False))
        return reply["observation"]

    def _reset_known(self, body: dict) -> Any:
        """`POST /reset` on the instance this client holds, if any; None when there is none or
        the server no longer knows it (a 404 from an rl_tpu server that dropped it)."""
        if self._id is None:
            return None
        try:
            return self._request("POST", "/reset", {self._id_key: self._id, **body})
        except RemoteEnvError as e:
            if e.status != 404:  # anything but "that id is gone" is a real failure
                raise
            log.warning("env %s is gone from %s (%s); creating a new one", self._id, self.url, e)
            self._id = None
            return None

    def _reset_agentgym(self, task: Task) -> str:
        item = self._item(task)
        if self._expected_name == "searchqa":
            body = {"id": item["data_idx"]}
            reply = self._reset_known(body)
            if reply is None:
                created = self._request("POST", "/create", body)
                if not isinstance(created, int) or isinstance(created, bool):
                    raise RemoteEnvError(f"POST /create on {self.url} answered {created!r:.200}, "
                                         "not SearchQA's integer env_idx")
                self._id = created
                reply = self._request("POST", "/reset", {"env_idx": self._id, **body})
            if not isinstance(reply, str):
                raise RemoteEnvError(f"POST /reset on {self.url} answered {reply!r:.200}, not "
                                     "SearchQA's prompt string")
            self._done = False
            return reply
        reply = self._reset_known(item)
        if reply is None:
            # BabyAI and SciWorld create with no body; TextCraft's /create needs one.
            body = {} if self._expected_name == "textcraft" else None
            created = self._reply("POST /create", self._request("POST", "/create", body), "id")
            self._id = int(created["id"])
            reply = self._request("POST", "/reset", {"id": self._id, **item})
        reply = self._reply("POST /reset", reply, "observation")
        self._done = bool(reply.get("done", False))
        if "task_description" in reply:  # SciWorld: the client puts the task first
            return f"{reply['task_description']}\n{reply['observation']}"
        return reply["observation"]

    def _action(self, reply: str) -> tuple[Optional[str], Optional[str]]:
        """(action to send, None) or (None, observation to answer without sending)."""
        if self.protocol != "agentgym" or self._expected_name == "searchqa":
            return reply, None
        if self._expected_name == "sciworld":
            return parse_sciworld_action(reply), None
        return parse_action(reply)

    @_serialised
    def step(self, action: str) -> StepResult:
        if self._id is None or self._done:
            return StepResult(observation="The episode is over; reset to start a new one.",
                              reward=0.0, done=True,
                              info={"invalid_action": True, "episode_over": True})
        if not isinstance(action, str):  # same treatment as a local env: unreadable action
            action = ""
        sent, refusal = self._action(action)
        if refusal is not None:  # AgentGym's client answers this itself, sending nothing
            return StepResult(observation=refusal, reward=0.0, done=False,
                              info={"invalid_action": True, "too_many_actions": True})
        body = {self._id_key: self._id, "action": sent}
        if self.protocol == "rl_tpu":
            body["raw"] = True  # the whole reply: the served env parses it (see server.py)
        reply = self._reply("POST /step", self._request("POST", "/step", body),
                            "observation", "done")
        if "score" not in reply and "reward" not in reply:
            raise RemoteEnvError(f"POST /step on {self.url} answered {reply!r:.300} with "
                                 "neither 'score' nor 'reward'")
        self._done = bool(reply["done"])
        # AgentGym's clients report the running score where the server keeps one.
        reward = float(reply["score"] if "score" in reply else reply["reward"])
        info = dict(reply.get("info") or {})
        if self.protocol == "agentgym":
            info["action"] = sent
        return StepResult(observation=reply["observation"], reward=reward, done=self._done,
                          info=info)

    @_serialised
    def observation(self) -> str:
        """`GET /observation`: the instance's last observation."""
        if self._id is None:
            raise RemoteEnvError(f"no episode on {self.url} yet: call reset first")
        return self._request("GET", f"/observation?{self._id_key}={self._id}")

    @_serialised
    def close(self) -> None:
        """Frees the server-side instance. A dead server is logged, not raised: close runs in
        cleanup paths, where the error that killed the server is already being reported."""
        if self._id is not None:
            try:
                self._request("POST", "/close", {self._id_key: self._id})
            except RemoteEnvError as e:
                log.warning("closing env %s on %s failed: %s", self._id, self.url, e)
            self._id = None
        self._done = True
        self._drop_connection()


# -- training against env servers -----------------------------------------------------------


def agentgym_name(env: Env) -> Optional[str]:
    """AgentGym's name for `env`'s tasks (one of AGENTGYM_ENVS), or None if it has none.

    An env may say so itself (a str attribute `agentgym_name`, "" for none); otherwise it is
    read off its task source: AgentGym-mode envs number their tasks as AgentGym's servers do,
    `Task(f"{name}_{i}", {"data_idx": i})`, whatever the env is registered as (so this stays
    right when envs are renamed)."""
    named = getattr(env, "agentgym_name", None)
    if isinstance(named, str):
        return named if named in AGENTGYM_ENVS else None
    try:
        source = env.tasks()
    except TypeError:  # an env without built-in tasks
        return None
    for split in source.splits:
        try:
            task = source.get(split, 0)
        except (IndexError, ValueError, KeyError):  # an empty split: try the next
            continue
        index = (task.data or {}).get("data_idx")
        prefix, _, tail = task.task_id.rpartition("_")
        if (isinstance(index, int) and not isinstance(index, bool) and tail == str(index)
                and prefix in AGENTGYM_ENVS):
            return prefix
        return None
    return None


def parse_urls(text: str, key: str = "env.remote_url") -> list[str]:
    """The URLs of a comma-separated list, each checked (`split_url`); ValueError naming `key`
    for an empty list or a bad URL."""
    urls = [u.strip() for u in (text or "").split(",") if u.strip()]
    if not urls:
        raise ValueError(f"{key}={text!r} names no env server; give http://host:port[,...]")
    checked = []
    for url in urls:
        try:
            parts = split_url(url)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        checked.append(f"{parts.scheme}://{parts.netloc}")
    return checked


class RemoteEnvFactory:
    """`make_env` for training and evaluating against env servers: each call returns a
    RemoteEnv on the next of `urls` (round robin per env instance, so the episodes of a
    rollout spread evenly over the servers).

    `local` is the env as defined here (built once by the caller; it is not stepped): its task
    source (the same data_idx numbering and train/eval splits as training locally), system
    prompt and conversation start go to every RemoteEnv, since AgentGym's servers have no
    /info to ask. Its AgentGym name (`agentgym_name`) picks the protocol: "agentgym" (the
    model's reply parsed here as AgentGym's client parses it; works against AgentGym's own
    servers and `launch.serve_env`), else "rl_tpu" (the reply sent whole; `launch.serve_env`
    serving an env of the same name). `api_key` goes to every server (None: the environment
    variable RL_TPU_ENV_API_KEY, if set)."""

    def __init__(self, local: Env, urls: Sequence[str], *, env_name: Optional[str] = None,
                 timeout: float = 30.0, retries: int = 3, backoff: float = 0.5,
                 api_key: Optional[str] = None):
        if not urls:
            raise ValueError("RemoteEnvFactory needs at least one env server url")
        self.urls = [f"{p.scheme}://{p.netloc}" for p in map(split_url, urls)]
        self.env_name = env_name or getattr(local, "name", None)
        self.agentgym = agentgym_name(local)
        self.protocol = "agentgym" if self.agentgym else "rl_tpu"
        try:
            self.task_source: Optional[TaskSource] = local.tasks()
        except TypeError:
            self.task_source = None  # tasks come from env.dataset_dir (or the server)
        self.system_prompt = getattr(local, "system_prompt", "") or ""
        start = getattr(local, "conversation_start", None)
        self.conversation = start() if callable(start) else None
        self._kwargs = dict(timeout=timeout, retries=retries, backoff=backoff, api_key=api_key,
                            tools=getattr(local, "tools", None),
                            call_format=getattr(local, "call_format", None))
        self._next = itertools.count()
        self._next_lock = threading.Lock()  # make_env runs in the agent loop's worker threads
        # One connection pool per server, shared by the envs built for it: an episode that
        # starts reuses a connection an earlier one left open.
        self._clients = {url: shared_client(timeout) for url in self.urls}

    def __call__(self) -> RemoteEnv:
        with self._next_lock:
            url = self.urls[next(self._next) % len(self.urls)]
        return self._env(url)

    def _env(self, url: str) -> RemoteEnv:
        return RemoteEnv(url, self.agentgym or self.env_name, protocol=self.protocol,
                         system_prompt=self.system_prompt, conversation=self.conversation,
                         task_source=self.task_source, client=self._clients[url],
                         **self._kwargs)

    def close(self) -> None:
        """Closes the connection pools (envs built since then fail to send)."""
        for client in self._clients.values():
            client.close()

    def check_servers(self) -> None:
        """Asks every server whether it is up and serves this env, before any compute: `GET /`
        (every AgentGym server answers it) and, where the server has it, `GET /info`. Raises
        ValueError naming the url and what to do."""
        for url in self.urls:
            env = self._env(url)
            try:
                env._request("GET", "/")
                try:
                    info = env._request("GET", "/info")
                except RemoteEnvError as e:
                    if e.status != 404:
                        raise
                    info = None  # AgentGym's own servers have no /info
            except RemoteEnvError as e:
                if e.status == 401:
                    raise ValueError(f"env.remote_url: {e}") from None
                raise ValueError(f"env.remote_url: the env server at {url} does not answer "
                                 f"({e})") from None
            finally:
                env.close()
            self._check_served(url, info)

    def _check_served(self, url: str, info: Optional[dict]) -> None:
        if info is None:
            if self.protocol == "rl_tpu":
                raise ValueError(
                    f"env.remote_url: {url} has no /info, so it is not rl_tpu's env server; env "
                    f"{self.env_name!r} has no AgentGym task name, so only `python -m "
                    f"launch.serve_env --env {self.env_name}` can serve it")
            return  # an AgentGym server: its name cannot be asked; its replies are checked
        served = info.get("env") if isinstance(info, dict) else None
        served_agentgym = info.get("agentgym_name") if isinstance(info, dict) else None
        same = served == self.env_name or (self.agentgym is not None
                                           and served_agentgym == self.agentgym)
        if not same:
            raise ValueError(
                f"env.remote_url: the env server at {url} serves {served!r}, but env.name is "
                f"{self.env_name!r}; serve it with `python -m launch.serve_env --env "
                f"{self.env_name}`, or set env.name to the served env")
