"""ScienceWorld as AgentGym's SciWorld server plays it (`sciworld_agentgym`): the same task
list, first observation, action parsing, reported reward and episode end, so returns and
success rates compare with AgentGym-RL's. rl_tpu's own variant is `sciworld` (rl_tpu/envs/
sciworld.py: split-ordered tasks, 0..1 rewards); this module reuses its JVM handling.

Tasks: one flat list over the `scienceworld` package's task ids in their own order (1-1 boil,
1-2 melt, ... 8-2), leaving out 5-1, 5-2 (grow plant / fruit), 9-1..9-3 (inclined planes) and
10-1, 10-2 (genetics) as AgentGym does, and every variation of each kept task
(0..max_variations-1). data_idx indexes that list directly, no modulo: 4639 tasks with
scienceworld 1.2.3. Task i is Task(f"sciworld_{i}", {"data_idx": i}).
Splits: `all` is the flat list itself (index == data_idx); `train`, `eval` and `test` are the
data_idx values whose variation is in the package's train, dev and test variation lists, in
ascending order (the package partitions every task's variations, so the three are disjoint and
cover `all`).

Episode:
  reset   loads the task (a fresh load each time, as AgentGym does) and returns
          task_description + "\\n" + the observation of `look around`;
  step    takes the model's whole reply; the action is the text after its LAST `Action:`
          (`agentgym_parse.parse_sciworld_action`, unfiltered; none: ""), sent to the simulator
          as it is. reward = the task's score so far, 0..100 (AgentGym's client reports the
          score, not its change; AgentGym-RL keeps it unscaled). A failed task scores -100 and
          ends the episode.
  done    when the simulator says the task is complete (score 100, or failed), or when its
          move counter passes 100 (the package's default envStepLimit, which AgentGym keeps).
          That counter is the simulator's own `getNumMoves`, not the number of replies:
          `look around`, `inventory`, `task` and unparsable input add 0, most actions add 1,
          `wait1` adds 2 and `wait` 11 (measured with scienceworld 1.2.3), so an episode of
          only `look around` never ends by moves; the agent loop's turn limit (AgentGym-RL:
          20 turns to train, 30 to evaluate) ends it.
An action the simulator throws on is, in AgentGym, an `{"error"}` reply that ends the episode
with score 0; here it is an observation starting `Error:` with reward 0 and done.

The instruction and the assistant's acknowledgement that open AgentGym's conversation come
from `conversation_start()`; there is no system prompt (AgentGym-RL keeps the chat model's
default one).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

from rl_tpu.envs import sciworld as _sciworld
from rl_tpu.envs.agentgym_parse import parse_sciworld_action
from rl_tpu.envs.base import Env, StepResult, Task, TaskSource, register

# Task ids AgentGym leaves out of its list (the long plant-growing, inclined-plane and
# genetics families).
EXCLUDED_TASK_IDS = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
# The package's default envStepLimit, which AgentGym's server does not change.
MOVE_LIMIT = 100
FAILED_SCORE = -100
TRAIN_TURNS, EVAL_TURNS = 20, 30  # AgentGym-RL's turn limits for SciWorld

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

# Flat task lists per package version: loading them needs a JVM (about a second), the lists
# change only with the package.
_GAMES: dict[str, list[tuple[str, int]]] = {}
_GAMES_LOCK = threading.Lock()


def _package_version() -> str:
    from scienceworld.version import __version__

    return __version__


def flat_task_list(sim) -> list[tuple[str, int]]:
    """(task name, variation) for every data_idx, from a running simulator."""
    with _GAMES_LOCK:
        version = _package_version()
        if version not in _GAMES:
            games = []
            for task_id, name in sim.tasks.items():  # the package's id order: 1-1, 1-2, ...
                if task_id not in EXCLUDED_TASK_IDS:
                    games.extend((name, v) for v in range(sim.get_max_variations(name)))
            _GAMES[version] = games
        return _GAMES[version]


class SciWorldAgentGymTasks(TaskSource):
    """`all` = the flat list (index = data_idx); train/eval/test = the package's
    train/dev/test variations as data_idx, ascending."""

    splits = ("train", "eval", "test", "all")

    def __init__(self, env: "SciWorldAgentGymEnv"):
        self._env = env
        self._members: dict[str, list[int]] = {}

    def _indices(self, split: str) -> list[int]:
        if split not in self._members:
            games = self._env.games
            if split == "all":
                self._members[split] = list(range(len(games)))
            else:
                # sciworld.py's variation lists (cached on disk; a JVM only on first use).
                helper = _sciworld.SciWorldEnv(cache_dir=self._env.cache_dir)
                try:
                    per_task = {n: set(vs) for n, vs in helper.variations(split).items()}
                finally:
                    helper.close()
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
            raise IndexError(f"sciworld_agentgym split {split!r} has {len(members)} tasks; "
                             f"index {index} is out of range")
        i = members[index]
        return Task(f"sciworld_{i}", {"data_idx": i})


@register("sciworld_agentgym")
class SciWorldAgentGymEnv(Env):
    """AgentGym's SciWorld: one flat task list, score-valued rewards, its move limit."""

    name = "sciworld_agentgym"
    system_prompt = ""  # AgentGym's instruction is the first user turn: conversation_start()

    def __init__(self, cache_dir: Optional[str] = None):
        _sciworld._import_scienceworld()
        _sciworld._require_java()  # fail at construction, not at the first reset of a long run
        self.cache_dir = Path(cache_dir or _sciworld.default_cache_dir())
        self._sim = None  # started on first use (about a second)
        self._tasks = SciWorldAgentGymTasks(self)
        self._active = False
        self._score = 0

    @property
    def sim(self):
        if self._sim is None:
            ScienceWorldEnv = _sciworld._import_scienceworld()
            self._sim = ScienceWorldEnv("", envStepLimit=MOVE_LIMIT)
        return self._sim

    @property
    def games(self) -> list[tuple[str, int]]:
        """(task name, variation) per data_idx."""
        return flat_task_list(self.sim)

    def tasks(self) -> SciWorldAgentGymTasks:
        return self._tasks

    def conversation_start(self) -> list[dict]:
        """AgentGym's opening turns: the instruction (user), then the fixed acknowledgement."""
        return [{"role": "user", "content": INSTRUCTION},
                {"role": "assistant", "content": ACK}]

    @staticmethod
    def data_idx(task: Task) -> int:
        """The task's index into the flat list: data["data_idx"], else the int after the last
        `_` of its id (AgentGym-RL's item ids, e.g. `sciworld_12`)."""
        if "data_idx" in task.data:
            return int(task.data["data_idx"])
        tail = task.task_id.rpartition("_")[2]
        if not tail.isdigit():
            raise ValueError(f"sciworld_agentgym task {task.task_id!r}: want data "
                             "{'data_idx': i} or an id like 'sciworld_12'")
        return int(tail)

    # -- episode ------------------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        i = self.data_idx(task)
        games = self.games
        if not 0 <= i < len(games):
            raise ValueError(f"sciworld_agentgym data_idx {i} is out of range: the flat list "
                             f"has {len(games)} tasks (0..{len(games) - 1}); AgentGym does not "
                             "wrap indices around")
        name, variation = games[i]
        self._active = False
        self.sim.load(name, variation, "")  # resets the score and the move counter
        description = self.sim.get_task_description()
        look = self.sim.server.step("look around")  # a free action: no move, no score
        self._score = 0
        self._active = True
        return description + "\n" + look

    def step(self, action: str) -> StepResult:
        if not self._active:
            return StepResult("The episode is over; call reset to start a new one.", 0.0, True,
                              {"invalid_action": True})
        reply = action if isinstance(action, str) else str(action)
        command = parse_sciworld_action(reply)
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
            # AgentGym's server answers {"error": ...}; its client raises and AgentGym-RL ends
            # the episode with score 0.
            self._active = False
            why = e.java_exception if isinstance(e, Py4JJavaError) else e
            return StepResult(f"Error: ScienceWorld could not process the action {command!r:.200}"
                              f" ({str(why)[:200]}); the episode ends with score 0.", 0.0, True,
                              {"error": True, "score": 0, "success": False})
        except Py4JError as e:
            # Not the action's fault: the JVM died. Drop it so the next reset starts another.
            sim, self._sim, self._active = self._sim, None, False
            _sciworld._release(sim)
            raise RuntimeError(f"ScienceWorld's JVM stopped answering ({e}); call reset to "
                               "start a new one") from None
        done = completed or moves > MOVE_LIMIT or score < 0
        delta, self._score = score - self._score, score
        self._active = not done
        info = {"score": score, "delta": delta, "moves": moves, "action": command,
                "success": score >= 100, "failed": score < 0,
                "truncated": done and not completed and score >= 0}
        return StepResult(observation, float(score), done, info)

    def close(self) -> None:
        self._active = False
        if self._sim is not None:
            sim, self._sim = self._sim, None
            _sciworld._release(sim)
