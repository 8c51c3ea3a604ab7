"""ScienceWorld: 30 families of elementary-science tasks in a text simulator (a Scala program
that the `scienceworld` package ships as a jar and drives through py4j; it needs Java).

Env "sciworld" (alias "sciworld_agentgym"). Its default plays SciWorld as AgentGym's server
does: the same task list, first observation, action parsing, reported reward and episode end,
so returns and success rates compare with AgentGym-RL's.

Default (AgentGym's):
  tasks   one flat list over the package's task ids in their own order (1-1 boil, 1-2 melt,
          ... 8-2), leaving out 5-1, 5-2 (grow plant / fruit), 9-1..9-3 (inclined planes) and
          10-1, 10-2 (genetics), with every variation of each kept task. data_idx indexes it
          directly, no modulo (4639 tasks with scienceworld 1.2.3); task i is
          `Task(f"sciworld_{i}", {"data_idx": i})`. Splits: `all` is the flat list (index ==
          data_idx); `train`, `eval`, `test` the data_idx whose variation is in the package's
          train, dev and test variation lists, ascending (disjoint, covering `all`).
  reset   task_description + "\\n" + the observation of `look around`.
  step    takes the whole reply; the action is the text after its LAST `Action:`
          (`agentgym_parse.parse_sciworld_action`, unfiltered; none: ""), sent as it is.
          reward = the task's score so far, 0..100 (AgentGym's client reports the score, not
          its change); a failed task scores -100 and ends the episode.
  done    when the simulator says the task is complete (score 100, or failed), or when its
          move counter passes 100 (the package's default envStepLimit, which AgentGym keeps).
          The counter is the simulator's `getNumMoves`, not the number of replies: `look
          around`, `inventory`, `task` and unparsable input add 0, most actions 1, `wait1` 2
          and `wait` 11, so the agent loop's turn limit (AgentGym-RL: 20 to train, 30 to
          evaluate) is what ends an episode of free actions.
  An action the simulator throws on is, in AgentGym, an `{"error"}` reply that ends the
  episode with score 0; here it is an observation starting `Error:`, reward 0, done.
  The conversation opens with AgentGym's instruction and acknowledgement (`conversation_start`).

Options (rl_tpu's):
- `reward="delta"`: the change of the score scaled to 0..1, so an episode's rewards sum to its
  final score; a failed task counts as 0 (a step that undoes progress gives a negative reward).
- `prompt="system"`: rl_tpu's system prompt listing the commands; the whole reply, stripped,
  is the command; an empty, overlong, multi-line or unsendable command, or one the simulator
  does not know, is an `Invalid action: ...` observation (the episode goes on); a blank line
  separates the task description from the room in the first observation.
- `tasks="round_robin"`: every family (all 30, or those in `task_names`), tasks
  `Task(f"{name}/{variation}", {"task_name", "variation"})`; splits `train` / `eval` / `test`
  are the package's train / dev / test variations, interleaved round-robin over task names
  (all first variations, then all second ones...), so the first 30 of a split cover every
  family once.
- `max_steps` (replies; the step that uses them up ends the episode unsuccessfully),
  `move_limit` (None: no limit on the simulator's moves), `simplifications` (the package's).
`demonstration(task)` is the simulator's gold action sequence, in any mode.

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

from rl_tpu.core.agentgym_parse import parse_sciworld_action
from rl_tpu.core.env import (Env, StepResult, Task, TaskSource, invalid_action, out_of_steps,
                              register)
from rl_tpu.optional import require

# Task ids AgentGym leaves out of its list (the long plant-growing, inclined-plane and
# genetics families).
EXCLUDED_TASK_IDS = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
MOVE_LIMIT = 100  # the package's default envStepLimit, which AgentGym's server does not change
FAILED_SCORE = -100
TRAIN_TURNS, EVAL_TURNS = 20, 30  # AgentGym-RL's turn limits for SciWorld
MAX_ACTION_CHARS = 300
REWARDS, PROMPTS, TASK_STYLES = ("score", "delta"), ("agentgym", "system"), ("agentgym", "round_robin")
_NO_MATCH = "No known action matches that input."

ACK = "OK. I'll follow your instructions and try my best to solve the task."

# Written for rl_tpu; lists the command templates scienceworld 1.2.3 reports
# (`get_possible_actions`), less `reset task`, which only undoes progress.
INSTRUCTION = """You are acting in ScienceWorld, a text-based simulation of elementary science \
experiments. Each round you get an observation and must reply with one action that moves you \
toward finishing the task you were given. The actions you can use (OBJ is an object you can \
see, LOC a place you can go):
open OBJ: open a container or door
close OBJ: close a container or door
activate OBJ: switch a device on
deactivate OBJ: switch a device off
connect OBJ to OBJ: connect two electrical components
disconnect OBJ: disconnect an electrical component
use OBJ on OBJ: use a device or item on something
look around: describe the room you are in
look at OBJ: describe an object in detail
look in OBJ: describe what a container holds
read OBJ: read a book, note or sign
move OBJ to OBJ: put an object into a container or onto a surface
pick up OBJ: take an object into your inventory
put down OBJ: drop an object from your inventory
pour OBJ in OBJ: pour a liquid into a container
dunk OBJ in OBJ: dip a container into a liquid
mix OBJ: chemically mix what a container holds
go to LOC: walk to a connected location
eat OBJ: eat a food
flush OBJ: flush a toilet
focus on OBJ: say which object the task is about (focusing on the wrong one fails the task)
wait: let 10 time steps pass
wait1: let 1 time step pass
task: repeat the task description
inventory: list what you carry
When the game offers numbered choices, answer with the number.
Answer in exactly this format:
Thought:
your reasoning

Action:
your next action"""

SYSTEM_PROMPT = """You are an agent in ScienceWorld, a text simulation of elementary science tasks.
Each turn, reply with exactly one command. Commands (OBJ is an object or place you can see):
  look around | look at OBJ | look in OBJ | inventory | task
  go to LOCATION | open OBJ | close OBJ | pick up OBJ | put down OBJ
  move OBJ to OBJ | pour OBJ in OBJ | dunk OBJ in OBJ | mix OBJ
  activate OBJ | deactivate OBJ | use OBJ on OBJ | connect OBJ to OBJ | disconnect OBJ
  eat OBJ | flush OBJ | read OBJ | focus on OBJ | wait | wait1
"focus on OBJ" tells the simulator which object the task is about: focusing on the wrong one
fails the task. If the game asks you to choose between numbered options, reply with the number."""

# Variation lists per task need each task loaded in the simulator (~10 s for all 30); they
# only change with the package version, so they are read once, kept for the process and
# written to a small JSON file under the cache dir for later processes. The flat task list
# (AgentGym's) needs a running simulator and is kept per package version.
_SPLITS_CACHE: dict[str, dict[str, list[int]]] = {}
_SPLITS_LOCK = threading.Lock()
_GAMES: dict[str, list[tuple[str, int]]] = {}
_GAMES_LOCK = threading.Lock()


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
    return require("scienceworld", extra="envs", needed_by="the sciworld env").ScienceWorldEnv


def _package_version() -> str:
    from scienceworld.version import __version__

    return __version__


def flat_task_list(sim) -> list[tuple[str, int]]:
    """AgentGym's (task name, variation) for every data_idx, from a running simulator."""
    with _GAMES_LOCK:
        version = _package_version()
        if version not in _GAMES:
            games = []
            for task_id, name in sim.tasks.items():  # the package's id order: 1-1, 1-2, ...
                if task_id not in EXCLUDED_TASK_IDS:
                    games.extend((name, v) for v in range(sim.get_max_variations(name)))
            _GAMES[version] = games
        return _GAMES[version]


class FlatTasks(TaskSource):
    """AgentGym's: `all` = the flat list (index = data_idx); train/eval/test = the package's
    train/dev/test variations as data_idx, ascending."""

    splits = ("train", "eval", "test", "all")

    def __init__(self, env: "SciWorldEnv"):
        self._env = env
        self._members: dict[str, list[int]] = {}

    def _indices(self, split: str) -> list[int]:
        if split not in self._members:
            games = self._env.games
            if split == "all":
                self._members[split] = list(range(len(games)))
            else:
                per_task = {n: set(vs) for n, vs in self._env.variations(split).items()}
                self._members[split] = [i for i, (name, v) in enumerate(games)
                                        if v in per_task.get(name, ())]
        return self._members[split]

    def size(self, split: str) -> int:
        self.check_split(split)
        return len(self._indices(split))

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        members = self._indices(split)
        if not 0 <= index < len(members):
            raise IndexError(f"sciworld split {split!r} has {len(members)} tasks; "
                             f"index {index} is out of range")
        return Task(f"sciworld_{members[index]}", {"data_idx": members[index]})


class RoundRobinTasks(TaskSource):
    """`tasks="round_robin"`: (task name, variation) pairs of the package's train/dev/test
    variation lists, interleaved over task names."""

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
    """One ScienceWorld task variation per episode (see the module docstring for the options)."""

    name = "sciworld"
    system_prompt = ""  # AgentGym's instruction is the first user turn: conversation_start()
    prompt = "agentgym"

    def __init__(self, reward: str = "score", prompt: str = "agentgym", tasks: str = "agentgym",
                 task_names: Optional[Sequence[str]] = None, max_steps: Optional[int] = None,
                 move_limit: Optional[int] = MOVE_LIMIT, simplifications: str = "",
                 cache_dir: Optional[str] = None):
        if reward not in REWARDS or prompt not in PROMPTS or tasks not in TASK_STYLES:
            raise ValueError(f"sciworld: reward must be one of {REWARDS}, prompt one of "
                             f"{PROMPTS}, tasks one of {TASK_STYLES}; got reward={reward!r}, "
                             f"prompt={prompt!r}, tasks={tasks!r}")
        if task_names and tasks != "round_robin":
            raise ValueError("sciworld: task_names picks families of tasks='round_robin'; "
                             "AgentGym's flat list (tasks='agentgym') is fixed")
        _import_scienceworld()
        _require_java()  # fail at construction, not at the first reset of a long run
        self.reward, self.prompt = reward, prompt
        if prompt == "system":
            self.system_prompt = SYSTEM_PROMPT
        self._task_filter = list(task_names) if task_names else None
        self.max_steps, self.move_limit = max_steps, move_limit
        self.simplifications = simplifications
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self._sim = None  # ScienceWorldEnv, started lazily (JVM start ~1 s)
        self._loaded: Optional[tuple[str, int, bool]] = None  # (name, variation, with gold)
        self._gold: dict[str, list[str]] = {}
        self._tasks = FlatTasks(self) if tasks == "agentgym" else RoundRobinTasks(self)
        self._score, self._steps, self._active = 0, 0, False

    # -- simulator ----------------------------------------------------------------------------

    @property
    def sim(self):
        if self._sim is None:
            ScienceWorldEnv = _import_scienceworld()
            self._sim = ScienceWorldEnv("", envStepLimit=self.move_limit or 10**9)
        return self._sim

    @property
    def games(self) -> list[tuple[str, int]]:
        """AgentGym's flat list: (task name, variation) per data_idx."""
        return flat_task_list(self.sim)

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
        return self.cache_dir / f"variations-{_package_version()}.json"

    def _read_split_file(self) -> Optional[dict]:
        try:
            table = json.loads(self._split_file().read_text())
            return table if set(table) == set(RoundRobinTasks.splits) else None
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

    def tasks(self) -> TaskSource:
        return self._tasks

    @property
    def agentgym_name(self) -> str:
        """"sciworld" while the env plays AgentGym's protocol, else "" (the env server reads it)."""
        return "sciworld" if self.prompt == "agentgym" else ""

    def conversation_start(self) -> Optional[list[dict]]:
        """AgentGym's opening turns (the instruction, then the fixed acknowledgement); None
        with `prompt="system"` (the system prompt states the commands)."""
        if self.prompt == "system":
            return None
        return [{"role": "user", "content": INSTRUCTION}, {"role": "assistant", "content": ACK}]

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

    def spec(self, task: Task) -> tuple[str, int]:
        """(task name, variation): data task_name/variation, an id like 'boil/14', or a
        data_idx into AgentGym's flat list (data["data_idx"] or an id like 'sciworld_12')."""
        if "task_name" in task.data:
            return task.data["task_name"], int(task.data.get("variation", 0))
        name, _, variation = task.task_id.rpartition("/")
        if name and variation.isdigit() and "data_idx" not in task.data:
            return name, int(variation)
        value = task.data.get("data_idx", task.task_id.rpartition("_")[2])
        if not str(value).isdigit():
            raise ValueError(f"sciworld task {task.task_id!r}: want data {{'data_idx': i}}, an "
                             "id like 'sciworld_12', data task_name/variation or an id like "
                             "'boil/14'")
        games = self.games
        if not int(value) < len(games):
            raise ValueError(f"sciworld data_idx {value} is out of range: the flat list has "
                             f"{len(games)} tasks (0..{len(games) - 1}); AgentGym does not "
                             "wrap indices around")
        return games[int(value)]

    def demonstration(self, task: Task) -> list[str]:
        """The simulator's gold action sequence for `task`. Generating it means loading the
        task (seconds for the genetics tasks), so this ends the current episode; a `reset`
        of the same task right after reuses the load."""
        name, variation = self.spec(task)
        key = f"{name}/{variation}/{self.simplifications}"
        if key not in self._gold:
            self._load(name, variation, gold=True)
            self._active = False
            self._gold[key] = list(self.sim.get_gold_action_sequence())
        return list(self._gold[key])

    # -- episode ------------------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        name, variation = self.spec(task)
        self._active = False
        self._load(name, variation, gold=False)  # resets the score and the move counter
        description = self.sim.get_task_description()
        look = self.sim.server.step("look around")  # a free action: no move, no score
        self._score, self._steps, self._active = 0, 0, True
        if self.prompt == "system":
            return f"{description}\n\n{look}".strip()
        return description + "\n" + look

    def step(self, action: str) -> StepResult:
        if not self._active:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        reply = action if isinstance(action, str) else str(action)
        self._steps += 1
        if self.prompt == "system":
            command = reply.strip()
            problem = _check(command)
            result = invalid_action(problem) if problem else self._play(command)
        else:
            result = self._play(parse_sciworld_action(reply))
        if self._active and self.max_steps is not None and self._steps >= self.max_steps:
            self._active = False
            result = out_of_steps(result, self.max_steps)
        return result

    def _play(self, command: str) -> StepResult:
        from py4j.protocol import Py4JError, Py4JJavaError

        try:
            command.encode("utf-8")  # py4j sends UTF-8; unpaired surrogates cannot go
            observation = self.sim.server.step(command)
            # The package's own step() does these same reads and checks; calling the server
            # directly skips the look/inventory/valid-action lists it also builds every step.
            score = int(round(100 * self.sim.server.getScore()))
            completed = bool(self.sim.server.getCompleted())
            moves = int(self.sim.server.getNumMoves())
        except (UnicodeEncodeError, Py4JJavaError) as e:
            why = e.java_exception if isinstance(e, Py4JJavaError) else e
            if self.prompt == "system":  # a bad command; the episode stays usable
                return invalid_action(f"the simulator could not process {command!r:.200}: "
                                      f"{str(why)[:200]}")
            # AgentGym's server answers {"error": ...}; its client raises and AgentGym-RL ends
            # the episode with score 0.
            self._active = False
            return StepResult(f"Error: ScienceWorld could not process the action {command!r:.200}"
                              f" ({str(why)[:200]}); the episode ends with score 0.", 0.0, True,
                              {"error": True, "score": 0, "success": False})
        except Py4JError as e:
            # Not the action's fault: the JVM died (killed, out of memory). Drop it so the
            # next reset starts a fresh one, and say so.
            sim, self._sim, self._loaded, self._active = self._sim, None, None, False
            _release(sim)
            raise RuntimeError(f"ScienceWorld's JVM stopped answering ({e}); call reset to "
                               "start a new one") from None
        over_moves = self.move_limit is not None and moves > self.move_limit
        done = completed or over_moves or score < 0
        delta, previous, self._score = score - self._score, self._score, score
        self._active = not done
        info = {"score": score, "delta": delta, "moves": moves, "action": command,
                "success": score >= 100, "failed": score < 0,
                "truncated": done and not completed and score >= 0}
        # reward="delta": progress scaled to 0..1; a failure (-100) counts as a score of 0.
        reward = float(score) if self.reward == "score" else (
            max(0, score) - max(0, previous)) / 100.0
        if self.prompt == "system" and observation.strip() == _NO_MATCH:
            return invalid_action(f"{_NO_MATCH} Commands look like 'open door to kitchen', "
                                  "'pick up thermometer', 'focus on water'; 'look around' lists "
                                  "what is here.", **info)
        return StepResult(observation, reward, done, info)

    def close(self) -> None:
        self._active = False
        if self._sim is not None:
            sim, self._sim, self._loaded = self._sim, None, None
            _release(sim)


register("sciworld_agentgym")(SciWorldEnv)


def _check(command: str) -> Optional[str]:
    """What is wrong with a `prompt="system"` command before it goes to the simulator."""
    if not command:
        return "the command is empty; reply with a command such as 'look around'"
    if len(command) > MAX_ACTION_CHARS:
        return f"the command is {len(command)} characters; keep it under {MAX_ACTION_CHARS}"
    if re.search(r"[\x00-\x1f\x7f]", command):
        return "one command per turn, on one line, without control characters"
    try:
        command.encode("utf-8")  # py4j sends UTF-8; lone surrogates would break the bridge
    except UnicodeEncodeError:
        return "the command is not valid text (it contains unpaired surrogate characters)"
    return None


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
