"""The env server's logic, free of HTTP: a table of live env instances keyed by integer id.

`rl_tpu.env_serving.server` puts it behind FastAPI (the wire format is described there). Everything a
client can get wrong is a `RequestError` carrying the HTTP status to answer; an env that
raises is dropped (its state is suspect) and answered 500, except when it raised starting a
task the client itself named, or reached at a step for a data key the client's task lacks:
those are the task's fault and answered 400. A client's task is checked before it starts
against the data keys the env reads (`needed_keys`), so one lacking them is refused at
/create, not at its first /step.

Threads: every method may be called from many threads at once. The table is guarded by one
lock held only for dictionary work; each instance has its own lock held for the env call, so
requests on different instances run in parallel and those on one instance one at a time.

Idle expiry: an instance nobody has touched for `idle_timeout_s` is closed and forgotten
(`expire_idle`, run on every `/create` and periodically by the server), so clients that vanish
without `/close` cannot fill the table for good; its id then answers 404 saying it expired.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import threading
import time
import traceback
from typing import Any, Callable, Optional

from rl_tpu.core.env import Env, StepResult, Task
from rl_tpu.env_serving.remote import agentgym_name

log = logging.getLogger(__name__)

# AgentGym names of the envs that parse AgentGym's whole reply themselves: the server gives
# them "Action: <action>" (SearchQA's client sends the whole reply, so its env gets it as is).
PARSING_ENVS = ("babyai", "textcraft", "sciworld")
DIALECTS = ("agentgym", "searchqa")
# Ids of expired instances remembered for their 404 message; older ones get the generic one.
_EXPIRED_MEMORY = 65536


class RequestError(Exception):
    """A request the server refuses; `status` is the HTTP code sent back."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclasses.dataclass
class _Instance:
    env: Optional[Env]
    last_used: float
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    observation: str = ""
    closed: bool = False
    expired_after: Optional[float] = None  # idle seconds, once expired
    client_task: Optional[Task] = None  # the task it plays, when the client sent its data


class _KeysRead(dict):
    """A task's data that notes the keys an env reads from it: by subscript, unless the env
    looked first (`in`, `get`: a key it can do without)."""

    def __init__(self, data: dict):
        super().__init__(data)
        self.needed: set = set()
        self.optional: set = set()

    def __getitem__(self, key):
        if key not in self.optional:
            self.needed.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.optional.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.optional.add(key)
        return super().__contains__(key)


def jsonable(value: Any) -> Any:
    """Info dicts may hold numpy scalars or other objects; the wire gets plain JSON."""
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)


class EnvService:
    """Live env instances built by `env_factory()`, at most `max_instances` at once, each
    expired after `idle_timeout_s` seconds without a request (None: never). See the module
    docstring of `rl_tpu.env_serving.server` for `action_prefix` and `dialect`."""

    def __init__(self, env_factory: Callable[[], Env], max_instances: int = 256,
                 env_name: Optional[str] = None, action_prefix: Optional[str] = None,
                 dialect: Optional[str] = None, idle_timeout_s: Optional[float] = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, got {max_instances}")
        if dialect not in DIALECTS + (None,):
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0 seconds (or None: never), got "
                             f"{idle_timeout_s}")
        self._factory = env_factory
        self.max_instances = max_instances
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._instances: dict[int, _Instance] = {}
        self._expired: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._next_id = 0
        # Since start, for /health (tests, monitoring).
        self.created = self.steps = self.expired = 0
        # One env kept aside to answer task-source and metadata queries without touching any
        # instance a client is stepping.
        self._meta_env = env_factory()
        self.env_name = env_name or self._meta_env.name
        # Told by the env's tasks, not its registered name (see rl_tpu.env_serving.server).
        self.agentgym = agentgym_name(self._meta_env)
        if dialect is None:
            dialect = "searchqa" if self.agentgym == "searchqa" else "agentgym"
        if action_prefix is None:
            action_prefix = "Action: " if self.agentgym in PARSING_ENVS else ""
        self.dialect = dialect
        self.id_key = "env_idx" if dialect == "searchqa" else "id"
        self.action_prefix = action_prefix
        self._needed_keys: Optional[tuple[frozenset, list]] = None  # see needed_keys
        self._needed_lock = threading.Lock()

    # -- tasks ------------------------------------------------------------------------------

    def task_for(self, data_idx: Optional[int] = None, split: Optional[str] = None,
                 task: Optional[dict] = None) -> tuple[Task, bool]:
        """(the task a request names, whether the client supplied it rather than the env's
        own task source). `task` is `{"task_id": str, "data": dict}`, already type-checked."""
        if task is not None:
            built = Task(task_id=task["task_id"], data=dict(task.get("data") or {}))
            self.check_client_task(built)
            return built, True
        index = 0 if data_idx is None else data_idx
        if split is None and self.agentgym is not None:
            # AgentGym's item number: the env itself says whether it has item i (at reset).
            return Task(f"{self.agentgym}_{index}", {"data_idx": index}), True
        return self.get_task("train" if split is None else split, index), False

    def needed_keys(self) -> tuple[frozenset, list]:
        """(the data keys this env cannot do without, every key its own tasks' data has),
        learnt once: a fresh env plays the first task of its own task source through a reset
        and one step (an empty action), noting which data keys it reads by subscript (see
        `_KeysRead`). A client task lacking one would be accepted at /create and fail at
        /step, when the env reaches for it; `check_client_task` refuses it at /create
        instead. An env without a task source, or one the probe fails on, is not checked."""
        with self._needed_lock:
            if self._needed_keys is None:
                self._needed_keys = (frozenset(), [])
                try:
                    self._needed_keys = self._probe_keys()
                except Exception as e:  # noqa: BLE001 - the check is a help, not a gate
                    log.warning("could not learn which task data env %r needs (%s: %s); "
                                "client tasks are not checked at /create", self.env_name,
                                type(e).__name__, e)
            return self._needed_keys

    def _probe_keys(self) -> tuple[frozenset, list]:
        try:
            source = self._meta_env.tasks()
        except TypeError:
            return frozenset(), []
        split = next((s for s in source.splits if source.size(s) != 0), None)
        if split is None:
            return frozenset(), []
        reference = source.get(split, 0)
        data = _KeysRead(reference.data)
        env = self._factory()
        try:
            env.reset(Task(reference.task_id, data))
            env.step(self.action_prefix)
        finally:
            env.close()
        return frozenset(data.needed), sorted(map(str, reference.data))

    def check_client_task(self, task: Task) -> None:
        """RequestError 400 naming what a client's task lacks that the env reads."""
        needed, known = self.needed_keys()
        missing = sorted(map(str, needed - set(task.data)))
        if missing:
            raise RequestError(400, f"task {task.task_id!r}: 'data' lacks {missing}, which env "
                                    f"{self.env_name!r} reads (its own tasks' data has keys "
                                    f"{known}); send them in the task's data")

    def get_task(self, split: str, index: int) -> Task:
        try:
            source = self._meta_env.tasks()
        except TypeError as e:
            raise RequestError(400, f"env {self.env_name!r} has no task source; send 'task' "
                                    f"instead of 'data_idx' ({e})")
        if split not in source.splits:
            raise RequestError(400, f"unknown split {split!r}; this env has {source.splits}")
        size = source.size(split)
        if index < 0 or (size is not None and index >= size):
            raise RequestError(400, f"task index {index} is out of range for split {split!r}, "
                                    f"which has {size} tasks (data_idx, or /task's index, "
                                    f"must be in [0, {size}))")
        return source.get(split, index)

    # -- the instance table -----------------------------------------------------------------

    def _gone(self, env_id: int) -> RequestError:
        with self._lock:
            idle = self._expired.get(env_id)
        if idle is not None:
            return RequestError(404, f"env {env_id} expired after {idle:.0f}s without a "
                                     f"request (the server's idle timeout is "
                                     f"{self.idle_timeout_s:g}s); create a new one")
        return RequestError(404, f"no live env with id {env_id}: it was closed, dropped "
                                 "after an error, or never created (POST /create)")

    def _instance(self, env_id: int) -> _Instance:
        with self._lock:
            instance = self._instances.get(env_id)
            if instance is not None:
                instance.last_used = self._clock()
        if instance is None:
            raise self._gone(env_id)
        return instance

    def _check_open(self, env_id: int, instance: _Instance) -> None:
        """Checks, with `instance.lock` held, that it was not closed or expired meanwhile."""
        if instance.closed:
            raise self._gone(env_id)

    def _drop(self, env_id: int, instance: _Instance) -> None:
        """Removes an instance whose env raised (call with its lock held)."""
        with self._lock:
            self._instances.pop(env_id, None)
        instance.closed = True
        try:
            instance.env.close()
        except Exception:  # already failing; the original error is what matters
            log.exception("closing failed env %d", env_id)

    def _failed(self, env_id: int, instance: _Instance, error: BaseException, task: Task,
                client_task: bool, starting: bool) -> RequestError:
        """Drops the instance; the error to answer: 400 when the env refused a task the client
        named (its data, or an item number the env lacks), 500 when the env itself failed."""
        self._drop(env_id, instance)
        if starting and client_task:
            log.info("env %d refused task %r: %s", env_id, task.task_id, error)
            return RequestError(400, f"env {self.env_name!r} cannot start task "
                                     f"{task.task_id!r} with data {_short(task.data)}: "
                                     f"{type(error).__name__}: {error}")
        if client_task:  # a step reached for a data key the client's task lacks
            log.info("env %d: task %r lacks data key %s", env_id, task.task_id, error)
            return RequestError(400, f"env {self.env_name!r} needs data key {error} that task "
                                     f"{task.task_id!r} lacks (its data: {_short(task.data)});"
                                     " the instance was dropped, create it with that key")
        log.error("env %d raised and was dropped:\n%s", env_id,
                  "".join(traceback.format_exception(error)))
        return RequestError(500, f"env {env_id} raised {type(error).__name__}: {error}; "
                                 "the instance was dropped, create a new one")

    def expire_idle(self) -> int:
        """Closes the instances idle for longer than `idle_timeout_s`; how many."""
        if self.idle_timeout_s is None:
            return 0
        now = self._clock()
        with self._lock:
            stale = [(env_id, instance) for env_id, instance in self._instances.items()
                     if now - instance.last_used > self.idle_timeout_s
                     and not instance.lock.locked()]  # a call in flight is not idle
            for env_id, instance in stale:
                del self._instances[env_id]
                self._expired[env_id] = now - instance.last_used
                while len(self._expired) > _EXPIRED_MEMORY:
                    self._expired.popitem(last=False)
            self.expired += len(stale)
        for env_id, instance in stale:
            with instance.lock:  # a request that found it just before waits, then sees closed
                instance.closed = True
                try:
                    instance.env.close()
                except Exception as e:
                    log.warning("env %d raised on close after expiring: %s", env_id, e)
        if stale:
            log.info("expired %d idle env(s): %s", len(stale), [i for i, _ in stale][:20])
        return len(stale)

    # -- the API ----------------------------------------------------------------------------

    def create(self, data_idx: Optional[int] = None, split: Optional[str] = None,
               task: Optional[dict] = None) -> tuple[int, str]:
        """A new instance reset to the named task: (its id, the first observation)."""
        task, client_task = self.task_for(data_idx, split, task)
        self.expire_idle()  # abandoned instances make room before the cap is checked
        with self._lock:
            if len(self._instances) >= self.max_instances:
                raise RequestError(503, f"instance limit reached: {len(self._instances)} live "
                                        f"envs (max_instances={self.max_instances}); close some "
                                        "with POST /close, wait for idle ones to expire, or "
                                        "restart with a higher --max_instances")
            env_id = self._next_id
            self._next_id += 1
            self.created += 1
            # Reserve the slot (so the cap counts envs being built) with the instance already
            # locked, so a request racing on this id waits until the env exists.
            instance = _Instance(env=None, last_used=self._clock())
            instance.lock.acquire()
            self._instances[env_id] = instance
        try:
            try:
                instance.env = self._factory()
            except Exception as e:
                with self._lock:
                    self._instances.pop(env_id, None)
                instance.closed = True
                log.exception("creating env %d failed", env_id)
                raise RequestError(500, f"creating the env failed with {type(e).__name__}: {e}")
            try:
                instance.observation = instance.env.reset(task)
            except Exception as e:
                raise self._failed(env_id, instance, e, task, client_task, starting=True)
            instance.client_task = task if client_task else None
        finally:
            instance.last_used = self._clock()
            instance.lock.release()
        return env_id, instance.observation

    def reset(self, env_id: int, data_idx: Optional[int] = None, split: Optional[str] = None,
              task: Optional[dict] = None) -> tuple[Task, str]:
        """Instance `env_id` reset to the named task: (the task, the first observation)."""
        instance = self._instance(env_id)
        task, client_task = self.task_for(data_idx, split, task)
        with instance.lock:
            self._check_open(env_id, instance)
            try:
                instance.observation = instance.env.reset(task)
            except Exception as e:
                raise self._failed(env_id, instance, e, task, client_task, starting=True)
            instance.client_task = task if client_task else None
            instance.last_used = self._clock()
        return task, instance.observation

    def step(self, env_id: int, action: str, raw: bool = False) -> tuple[StepResult, float]:
        """(the env's result, its reward as a finite float). `raw`: the model's whole reply,
        never prefixed (rl_tpu's own protocol)."""
        instance = self._instance(env_id)
        with instance.lock:
            self._check_open(env_id, instance)
            with self._lock:
                self.steps += 1
            prefix = "" if raw else self.action_prefix
            try:
                result = instance.env.step(prefix + action)
                reward = float(result.reward)
                if not math.isfinite(reward):
                    raise ValueError(f"non-finite reward {result.reward!r}")
            except Exception as e:
                raise self._failed(env_id, instance, e, instance.client_task or Task(""),
                                   _lacked_key(e, instance.client_task), starting=False)
            instance.observation = result.observation
            instance.last_used = self._clock()
        return result, reward

    def observation(self, env_id: int) -> str:
        return self._instance(env_id).observation

    def close(self, env_id: int) -> None:
        instance = self._instance(env_id)
        with self._lock:
            self._instances.pop(env_id, None)
        with instance.lock:  # waits for a step in flight on this instance
            instance.closed = True
            try:
                instance.env.close()
            except Exception as e:
                log.warning("env %d raised on close: %s", env_id, e)

    def hello(self) -> str:
        """`GET /`: a JSON string, as AgentGym's servers answer."""
        return f"This is rl_tpu's env server for {self.env_name}."

    def health(self) -> dict:
        with self._lock:
            return {"env": self.env_name, "instances": len(self._instances),
                    "max_instances": self.max_instances, "created": self.created,
                    "steps": self.steps, "expired": self.expired,
                    "idle_timeout_s": self.idle_timeout_s}

    def info(self) -> dict:
        splits = {}
        try:
            source = self._meta_env.tasks()
            splits = {split: source.size(split) for split in source.splits}
        except TypeError:
            pass
        return {"env": self.env_name, "agentgym_name": self.agentgym,
                "system_prompt": self._meta_env.system_prompt, "splits": splits}

    def shutdown(self) -> None:
        with self._lock:
            instances = list(self._instances.values())
            self._instances.clear()
        for env in [i.env for i in instances] + [self._meta_env]:
            try:
                if env is not None:
                    env.close()
            except Exception:
                log.exception("closing an env at shutdown")


def _lacked_key(error: BaseException, task: Optional[Task]) -> bool:
    """Whether `error` is the env reaching for a data key that the client's `task` lacks."""
    return (task is not None and type(error) is KeyError and len(error.args) == 1
            and error.args[0] not in task.data)


def _short(data: Any, limit: int = 200) -> str:
    text = json.dumps(jsonable(data))
    return text if len(text) <= limit else text[:limit] + "..."
