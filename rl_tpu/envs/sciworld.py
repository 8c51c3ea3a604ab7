"""ScienceWorld: 30 families of elementary-science tasks in a text simulator (a Scala program
that the `scienceworld` package ships as a jar and drives through py4j; it needs Java).

Tasks are (task name, variation). The package splits every task's variations into train, dev
and test; here `train` is train, `eval` is dev and `test` is test. Within a split the tasks
are interleaved round-robin over task names (all first variations, then all second ones...),
so the first 30 tasks of any split cover every task family once.

Actions are ScienceWorld's own commands ("open door to kitchen", "focus on water", ...).
Reward is the change of the task score, scaled to 0..1, so an episode's rewards sum to its
final score (a step that undoes progress, "reset task" say, gives a negative reward; a failed
task, which ScienceWorld scores -100, counts as 0). Success is a score
of 100. The episode ends when ScienceWorld says the task is completed (won or failed) or after
`max_steps` actions. The demonstration is the simulator's gold action sequence.

One env owns one JVM (about a second to start, started on first use). Use an env from one
thread at a time; for parallel rollouts make one env per worker.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

from rl_tpu.envs.base import (Env, StepResult, Task, TaskSource, invalid_action, out_of_steps,
                              register)

SYSTEM_PROMPT = """You are an agent in ScienceWorld, a text simulation of elementary science tasks.
Each turn, reply with exactly one command. Commands (OBJ is an object or place you can see):
  look around | look at OBJ | look in OBJ | inventory | task
  go to LOCATION | open OBJ | close OBJ | pick up OBJ | put down OBJ
  move OBJ to OBJ | pour OBJ in OBJ | dunk OBJ in OBJ | mix OBJ
  activate OBJ | deactivate OBJ | use OBJ on OBJ | connect OBJ to OBJ | disconnect OBJ
  eat OBJ | flush OBJ | read OBJ | focus on OBJ | wait | wait1
"focus on OBJ" tells the simulator which object the task is about: focusing on the wrong one
fails the task. If the game asks you to choose between numbered options, reply with the number."""

MAX_ACTION_CHARS = 300
_NO_MATCH = "No known action matches that input."
# Variation lists per task need each task loaded in the simulator (~10 s for all 30); they
# only change with the package version, so they are read once, kept for the process and
# written to a small JSON file under the cache dir for later processes.
_SPLITS_CACHE: dict[str, dict[str, list[int]]] = {}
_SPLITS_LOCK = threading.Lock()


def default_cache_dir() -> Path:
    return Path(os.environ.get("RL_TPU_SCIWORLD_CACHE", Path.home() / ".cache" / "rl_tpu" / "sciworld"))


def java_available() -> bool:
    return shutil.which("java") is not None


def _require_java():
    if not java_available():
        raise RuntimeError(
            "ScienceWorld runs on the JVM but no `java` is on PATH. Install a Java runtime "
            "(8 or newer), e.g. `apt-get install openjdk-17-jre-headless` on Debian/Ubuntu, "
            "`brew install openjdk` on macOS, or `conda install -c conda-forge openjdk`, "
            "then check `java -version`.")


def _import_scienceworld():
    try:
        from scienceworld import ScienceWorldEnv
    except ImportError as e:
        raise ImportError("the sciworld env needs ScienceWorld: pip install scienceworld "
                          "(and a Java runtime)") from e
    return ScienceWorldEnv


class SciWorldTasks(TaskSource):
    """(task name, variation) pairs of the package's train/dev/test variation lists."""

    splits = ("train", "eval", "test")

    def __init__(self, env: "SciWorldEnv"):
        self._env = env
        self._order: dict[str, list[tuple[str, int]]] = {}

    def _ordered(self, split: str) -> list[tuple[str, int]]:
        if split not in self._order:
            per_task = self._env.variations(split)
            names = [n for n in self._env.task_names if per_task.get(n)]
            order, depth = [], 0
            while True:  # round-robin: every task family appears early in the split
                row = [(n, per_task[n][depth]) for n in names if depth < len(per_task[n])]
                if not row:
                    break
                order.extend(row)
                depth += 1
            self._order[split] = order
        return self._order[split]

    def size(self, split: str) -> int:
        self.check_split(split)
        return len(self._ordered(split))

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        name, variation = self._ordered(split)[index]
        return Task(task_id=f"{name}/{variation}",
                    data={"task_name": name, "variation": variation, "split": split})


@register("sciworld")
class SciWorldEnv(Env):
    """One ScienceWorld task variation per episode."""

    name = "sciworld"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, task_names: Optional[Sequence[str]] = None, simplifications: str = "",
                 max_steps: Optional[int] = 100, cache_dir: Optional[str] = None):
        _import_scienceworld()
        _require_java()  # fail at construction, not at the first reset of a long run
        self._task_filter = list(task_names) if task_names else None
        self.simplifications = simplifications
        self.max_steps = max_steps
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self._sim = None  # ScienceWorldEnv, started lazily (JVM start ~1 s)
        self._loaded: Optional[tuple[str, int, bool]] = None  # (name, variation, with gold)
        self._gold: dict[str, list[str]] = {}
        self._tasks = SciWorldTasks(self)
        self._score, self._steps, self._done = 0, 0, True

    # -- simulator ----------------------------------------------------------------------------

    @property
    def sim(self):
        if self._sim is None:
            ScienceWorldEnv = _import_scienceworld()
            # Our own max_steps ends episodes; the package's limit is set out of the way.
            self._sim = ScienceWorldEnv("", envStepLimit=10**9)
        return self._sim

    @property
    def task_names(self) -> list[str]:
        names = list(self.variations("train"))  # from the cache file when there is one: no JVM
        if self._task_filter is None:
            return names
        unknown = sorted(set(self._task_filter) - set(names))
        if unknown:
            raise ValueError(f"unknown ScienceWorld tasks {unknown}; known: {names}")
        return [n for n in names if n in self._task_filter]

    def variations(self, split: str) -> dict[str, list[int]]:
        """Variation ids of every task for a split ('train', 'eval' = dev, 'test')."""
        with _SPLITS_LOCK:
            if not _SPLITS_CACHE:
                _SPLITS_CACHE.update(self._read_split_file() or self._query_splits())
        return _SPLITS_CACHE[split]

    def _split_file(self) -> Path:
        from scienceworld.version import __version__

        return self.cache_dir / f"variations-{__version__}.json"

    def _read_split_file(self) -> Optional[dict]:
        try:
            table = json.loads(self._split_file().read_text())
            return table if set(table) == set(SciWorldTasks.splits) else None
        except (OSError, ValueError):
            return None

    def _query_splits(self) -> dict:
        getters = {"train": "getVariationsTrain", "eval": "getVariationsDev",
                   "test": "getVariationsTest"}
        table = {s: {} for s in getters}
        for name in self.sim.get_task_names():
            # Loading (without the costly gold path) is what fills the lists.
            self.sim.load(name, 0, "")
            for s, getter in getters.items():
                table[s][name] = list(getattr(self.sim.server, getter)())
        self._loaded = None  # the simulator now holds whatever task came last
        try:  # best effort: a read-only home only costs the query next time
            path = self._split_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
                json.dump(table, f)
            os.replace(f.name, path)
        except OSError:
            pass
        return table

    def tasks(self) -> SciWorldTasks:
        return self._tasks

    def _load(self, name: str, variation: int, gold: bool):
        want = (name, variation)
        if self._loaded is None or self._loaded[:2] != want or (gold and not self._loaded[2]):
            from py4j.protocol import Py4JJavaError

            self._loaded = None
            try:
                self.sim.load(name, variation, self.simplifications, generateGoldPath=gold)
            except Py4JJavaError as e:  # e.g. a variation index past the task's last one
                raise ValueError(f"ScienceWorld could not load task {name!r} variation "
                                 f"{variation}: {str(e.java_exception)[:200]}") from None
            self._loaded = (name, variation, gold)
        else:
            self.sim.server.reset()  # same task loaded: rewinding is ~10x cheaper than loading

    @staticmethod
    def _spec(task: Task) -> tuple[str, int]:
        if "task_name" in task.data:
            return task.data["task_name"], int(task.data.get("variation", 0))
        name, _, variation = task.task_id.rpartition("/")
        if not name or not variation.isdigit():
            raise ValueError(f"sciworld task {task.task_id!r}: want data task_name/variation "
                             "or an id like 'boil/14'")
        return name, int(variation)

    def demonstration(self, task: Task) -> list[str]:
        """The simulator's gold action sequence for `task`. Generating it means loading the
        task (seconds for the genetics tasks), so this ends the current episode; a `reset`
        of the same task right after reuses the load."""
        name, variation = self._spec(task)
        key = f"{name}/{variation}/{self.simplifications}"
        if key not in self._gold:
            self._load(name, variation, gold=True)
            self._done = True
            self._gold[key] = list(self.sim.get_gold_action_sequence())
        return list(self._gold[key])

    # -- episode ------------------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        name, variation = self._spec(task)
        self._load(name, variation, gold=False)
        self._score, self._steps, self._done = 0, 0, False
        look = self.sim.server.step("look around")
        return f"{self.sim.get_task_description()}\n\n{look}".strip()

    def step(self, action: str) -> StepResult:
        if self._loaded is None or self._done:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        action = (action if isinstance(action, str) else str(action)).strip()
        self._steps += 1
        problem = self._check(action)
        if problem is not None:
            result = invalid_action(problem)
        else:
            result = self._play(action)
        if not self._done and self.max_steps is not None and self._steps >= self.max_steps:
            self._done = True
            result = out_of_steps(result, self.max_steps)
        return result

    @staticmethod
    def _check(action: str) -> Optional[str]:
        if not action:
            return "the command is empty; reply with a command such as 'look around'"
        if len(action) > MAX_ACTION_CHARS:
            return f"the command is {len(action)} characters; keep it under {MAX_ACTION_CHARS}"
        if re.search(r"[\x00-\x1f\x7f]", action):
            return "one command per turn, on one line, without control characters"
        try:
            action.encode("utf-8")  # py4j sends UTF-8; lone surrogates would break the bridge
        except UnicodeEncodeError:
            return "the command is not valid text (it contains unpaired surrogate characters)"
        return None

    def _play(self, action: str) -> StepResult:
        from py4j.protocol import Py4JError, Py4JJavaError

        try:
            observation = self.sim.server.step(action)
            raw = int(round(100 * self.sim.server.getScore()))
            completed = bool(self.sim.server.getCompleted()) or raw < 0
        except Py4JJavaError as e:
            # The simulator threw on this input (not seen in practice, but the JVM side is not
            # ours): report it as a bad action; the episode stays usable.
            return invalid_action(f"the simulator could not process {action!r}: "
                                  f"{str(e.java_exception)[:200]}")
        except Py4JError as e:
            # Not the action's fault: the JVM died (killed, out of memory). Drop it so the
            # next reset starts a fresh one, and say so.
            sim, self._sim, self._loaded, self._done = self._sim, None, None, True
            _release(sim)
            raise RuntimeError(f"ScienceWorld's JVM stopped answering ({e}); call reset to "
                               "start a new one") from None
        score = max(0, raw)  # a failed task (-100) counts as 0, keeping rewards in 0..1
        reward = (score - self._score) / 100.0
        self._score = score
        self._done = completed
        info = {"success": raw >= 100, "score": raw / 100.0, "failed": raw < 0}
        if observation.strip() == _NO_MATCH:
            return invalid_action(f"{_NO_MATCH} Commands look like 'open door to kitchen', "
                                  "'pick up thermometer', 'focus on water'; 'look around' lists "
                                  "what is here.", **info)
        return StepResult(observation, reward, completed, info)

    def close(self) -> None:
        if self._sim is not None:
            sim, self._sim, self._loaded, self._done = self._sim, None, None, True
            _release(sim)


def _release(sim) -> None:
    """Shuts a simulator down and frees what the package leaves to the garbage collector
    (the JVM's pipes, a temp dir: ResourceWarnings at some later, random point otherwise)."""
    # Against a dead JVM, py4j logs a traceback for every command it fails to send, including
    # the ones its finalizers send: mute it while the simulator's Java references go away.
    py4j_log = logging.getLogger("py4j")
    level = py4j_log.level
    py4j_log.setLevel(logging.CRITICAL)
    proc = getattr(getattr(sim, "_gateway", None), "java_process", None)
    try:
        sim.close()  # shuts py4j down and tells the JVM to exit
    except Exception:  # noqa: BLE001 - a dead JVM cannot be told anything; cleanup goes on
        pass
    try:
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - a JVM that lingers is killed
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        tmp = getattr(sim, "_obj_tree_tempdir", None)
        if tmp is not None:
            tmp.cleanup()
        # Drop the Java references now (their finalizers run muted), and leave the package's
        # __del__, which closes again, a gateway that is already shut.
        sim.server = None
        if hasattr(sim, "_gateway"):
            sim._gateway = _ShutGateway(proc)
        gc.collect()
    finally:
        py4j_log.setLevel(level)


class _ShutGateway:
    """Stands in for a closed py4j gateway: shutting it down again does nothing."""

    def __init__(self, java_process):
        self.java_process = java_process

    def shutdown(self):
        pass
