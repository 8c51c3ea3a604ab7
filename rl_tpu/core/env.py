"""The env contract: text in, text out. Envs know nothing of models or JAX.

A contract of rl_tpu.core: every env (rl_tpu/envs/), the env servers (rl_tpu/env_serving/),
the agent loop and the task sources build on these types; this module imports no other
rl_tpu package, so any of them can stand on it.

An `Env` plays one episode at a time: `reset(task)` returns the first observation, `step`
takes the agent's action text and returns a `StepResult`. A malformed or illegal action is
never an exception: it comes back as an observation that says what was wrong, so a policy can
learn from it and the agent loop never dies on model output.

A `TaskSource` lists an env's tasks per split, reproducibly (by seed or id), so the same
eval set is seen at every evaluation and across runs.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib
import inspect
import random
import re
import time
from typing import Any, Callable, Optional

from rl_tpu.optional import MissingDependency, install_hint


@dataclasses.dataclass
class StepResult:
    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)  # e.g. success, invalid_action


@dataclasses.dataclass(frozen=True)
class Task:
    """One episode's specification: an id unique within its env and whatever the env needs."""

    task_id: str
    data: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)


class TaskSource(abc.ABC):
    """Reproducible tasks of one env, by split."""

    splits: tuple[str, ...] = ("train", "eval")

    @abc.abstractmethod
    def size(self, split: str) -> Optional[int]:
        """Number of tasks in the split, or None for a procedural (unbounded) source."""

    @abc.abstractmethod
    def get(self, split: str, index: int) -> Task:
        """The index-th task of the split; the same task every time it is asked for."""

    def check_split(self, split: str):
        if split not in self.splits:
            raise ValueError(f"unknown split {split!r}; this source has {self.splits}")


class SeededTasks(TaskSource):
    """Task i of a split holds `draw(Random(split_seed + i), split, i)` (a dict) plus its seed,
    split and index, with the id "<prefix>/<split>/<i>"; the train and eval seed ranges must
    not overlap, so the eval set never shares a seed with training and is the same every time."""

    def __init__(self, prefix: str, draw: Callable[[random.Random, str, int], dict], train_seed: int,
                 eval_seed: int, train_size: int, eval_size: int):
        train = range(train_seed, train_seed + train_size)
        evals = range(eval_seed, eval_seed + eval_size)
        if train.start < evals.stop and evals.start < train.stop:
            raise ValueError(f"train seeds {train} and eval seeds {evals} overlap; move one "
                             "(task i of a split uses seed split_seed + i)")
        self.prefix, self.draw = prefix, draw
        self._splits = {"train": (train_seed, train_size), "eval": (eval_seed, eval_size)}

    def size(self, split: str) -> int:
        self.check_split(split)
        return self._splits[split][1]

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        seed, size = self._splits[split]
        if not 0 <= index < size:
            raise IndexError(f"split {split!r} has {size} tasks; index {index} is out of range")
        data = self.draw(random.Random(seed + index), split, index)
        data.update(seed=seed + index, split=split, index=index)
        return Task(f"{self.prefix}/{split}/{index}", data)


class Env(abc.ABC):
    """One episode at a time; reusable after `reset`."""

    name: str = "env"
    system_prompt: str = ""  # states the action format the env parses
    # True: reset(task) followed by the same actions always reaches the same state (the same
    # observations, rewards, done), so a branching rollout may restore a state by replaying
    # the actions in a fresh env (rl_tpu/agent/branching.py). Declare it only when that holds.
    replayable: bool = False

    @abc.abstractmethod
    def reset(self, task: Task) -> str:
        """Starts the task's episode; returns the first observation."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Applies the agent's action text. Bad actions are observations, never exceptions."""

    def close(self) -> None:
        """Releases processes, files or servers the env holds."""

    def tasks(self) -> TaskSource:
        """This env's task source (train/eval splits)."""
        raise TypeError(f"env {self.name!r} has no built-in tasks; pass tasks explicitly")


class OneReplyEnv(Env):
    """A question and one reply, over built-in seeded tasks with a teacher (largest, evens).
    A subclass sets `_tasks` (a TaskSource whose tasks hold `needs`), `question(task)`, and
    `score(task, reply)` (the reply stripped) -> StepResult, and `teacher(task, rng, skill)`."""

    needs: str = ""  # the key every task of `_tasks` holds
    _tasks: TaskSource
    _task: Optional[Task] = None

    def tasks(self) -> TaskSource:
        return self._tasks

    def teacher_reply(self, task: Task, rng, skill: float) -> str:
        """The env's imperfect teacher, for SFT demonstrations (its module says how)."""
        return self.teacher(task, rng, skill)

    def reset(self, task: Task) -> str:
        if self.needs not in task.data:
            raise ValueError(f"task {task.task_id!r} has no {self.needs!r}; take tasks from "
                             "env.tasks().get(split, index)")
        self._task = task
        return self.question(task)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        task, self._task = self._task, None
        return self.score(task, str(action).strip())

    @abc.abstractmethod
    def question(self, task: Task) -> str: ...

    @abc.abstractmethod
    def score(self, task: Task, reply: str) -> StepResult: ...

    @abc.abstractmethod
    def teacher(self, task: Task, rng, skill: float) -> str: ...


_ACTION_LINE = re.compile(r"action\s*[:：]\s*(.*)", re.IGNORECASE)


def action_line(text: str) -> Optional[str]:
    """The action a free-form response states: its last `Action: ...` line, else its last
    non-empty line (so a bare command works too). None for no text at all.

    A marker with nothing after it on its line takes the next non-empty line: AgentGym's
    answer format is `Thought:\n...\n\nAction:\n<action>`, with the action on its own line.
    A bare marker with no line after it gives "" (the response named no action)."""
    if not isinstance(text, str):
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    for at in range(len(lines) - 1, -1, -1):
        match = _ACTION_LINE.search(lines[at])
        if match:
            if match.group(1).strip() or at + 1 == len(lines):
                return match.group(1)
            return lines[at + 1].strip()
    return lines[-1] if lines else None


def out_of_steps(result: StepResult, max_steps: int) -> StepResult:
    """`result` of the step that used up the episode's step budget: it ends the episode,
    unsuccessfully, and says why."""
    return StepResult(result.observation + f"\n\nOut of steps ({max_steps}).", result.reward,
                      True, {**result.info, "success": False, "truncated": True})


def invalid_action(message: str, **info) -> StepResult:
    """The observation for an action the env could not apply; the episode goes on."""
    return StepResult(observation=f"Invalid action: {message}", reward=0.0, done=False,
                      info={"invalid_action": True, **info})


_REGISTRY: dict[str, Callable[..., Env]] = {}


def register(name: str):
    """Decorator: `@register("babyai")` on an Env class or factory. Registering a name again
    is refused unless it is the same definition run again (same module and qualified name: a
    notebook cell re-run), which replaces it."""
    def add(factory):
        old = _REGISTRY.get(name)
        if old is not None and _definition(old) != _definition(factory):
            raise ValueError(f"env {name!r} is registered twice: by {_definition(old)} and "
                             f"{_definition(factory)}; pick another name")
        _REGISTRY[name] = factory
        return factory
    return add


def _definition(factory) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


def factory(name: str) -> Callable[..., Env]:
    """The registered factory of env `name`, importing only its own module (one env's optional
    dependency, a JVM for ScienceWorld say, never stops the others from loading)."""
    modules = _builtin_env_modules()
    if name not in _REGISTRY and name in modules:
        with _missing_package_named(name):
            importlib.import_module(f"{_BUILTIN_ENVS}.{modules[name]}")
    if name not in _REGISTRY:
        known = sorted(set(modules) | set(_REGISTRY))
        raise ValueError(f"unknown env {name!r}; known envs: {known}")
    return _REGISTRY[name]


_BUILTIN_ENVS = "rl_tpu.envs"


def _builtin_env_modules() -> dict[str, str]:
    """rl_tpu's own envs: name -> the module under rl_tpu.envs that registers it on import
    (`rl_tpu.envs.ENV_MODULES`). The contract sits below the envs that implement it, so it
    names their package by string and looks the table up only when an env is asked for by
    name (as a plugin registry reads its entry points): `make("babyai")` works from anywhere
    without this module importing the envs, or their optional packages, up front."""
    return importlib.import_module(_BUILTIN_ENVS).ENV_MODULES


def kwargs_of(name: str) -> Optional[dict[str, inspect.Parameter]]:
    """The keyword arguments env `name` takes (annotations resolved where they can be), or
    None for a factory that takes any (`**kwargs`)."""
    try:
        params = inspect.signature(factory(name), eval_str=True).parameters.values()
    except NameError:  # an annotation naming what only a type checker imports: keep it a string
        params = inspect.signature(factory(name)).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_kwargs(name: str, kwargs: dict) -> None:
    """Fails naming env `name` and listing its kwargs when `kwargs` has one it does not take,
    or lacks (or leaves None) one it needs."""
    known = kwargs_of(name)
    if known is None:
        return
    unknown = sorted(set(kwargs) - set(known))
    missing = [k for k, p in known.items() if p.default is p.empty and kwargs.get(k) is None]
    if unknown or missing:
        problem = (f"takes no keyword argument {', '.join(unknown)}" if unknown
                   else f"needs the keyword argument {', '.join(missing)}")
        raise ValueError(f"env {name!r} {problem} (its kwargs: {', '.join(known) or 'none'})")


def make(name: str, **kwargs: Any) -> Env:
    """Builds an env by name. A package the env needs that is not installed fails naming it
    and the pip extra that installs it (env modules import their packages when first used)."""
    build = factory(name)
    check_kwargs(name, kwargs)
    with _missing_package_named(name):
        return build(**kwargs)


@contextlib.contextmanager
def _missing_package_named(name: str):
    try:
        yield
    except MissingDependency:  # already names the package and its extra
        raise
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] == "rl_tpu":  # our own module: a bug, not a setup
            raise
        raise MissingDependency(
            f"env {name!r} needs the Python package {e.name!r}, which is not installed: "
            f"{install_hint('envs')} installs every env's packages", name=e.name) from e


class DelayedEnv(Env):
    """`env` with `latency_s` seconds of waiting added to every reset and step: the round trip
    of an env server in another process or host, for measuring what overlapping rollouts with
    training buys (`env.step_latency_s`). Everything else is the wrapped env's."""

    def __init__(self, env: Env, latency_s: float):
        if latency_s < 0:
            raise ValueError(f"env.step_latency_s={latency_s} must be >= 0 seconds")
        self.env, self.latency_s = env, float(latency_s)
        self.name = getattr(env, "name", type(env).__name__)
        self.system_prompt = env.system_prompt  # a class attribute of Env: not forwarded
        self.replayable = getattr(env, "replayable", False)  # likewise

    def __getattr__(self, attr):  # system_prompt, teacher_reply, conversation_start...
        return getattr(self.env, attr)

    def tasks(self) -> TaskSource:
        return self.env.tasks()

    def reset(self, task: Task) -> str:
        time.sleep(self.latency_s)
        return self.env.reset(task)

    def step(self, action: str) -> StepResult:
        time.sleep(self.latency_s)
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()
