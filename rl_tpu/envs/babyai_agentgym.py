"""BabyAI as AgentGym's BabyAI server plays it: AgentGym's actions, observations, rewards and
task indexing, on minigrid's own levels (env name "babyai_agentgym").

rl_tpu's own BabyAI env (`rl_tpu.envs.babyai`) stays as it is; this module is the mode that
matches what AgentGym-RL trains and evaluates on, so results can be compared with theirs.

What follows AgentGym (from its server's documented behaviour):
  - `step(reply)` takes the model's whole reply; `agentgym_parse.parse_action` picks the action
    (two `Action:` markers: TOO_MANY_ACTIONS, reward 0, not done, nothing stepped). The server
    then lowercases and strips it.
  - Actions: `turn left`, `turn right`, `move forward` (listed unless a wall or box is right
    ahead), `pickup <colour> <type> <k>`, `drop`, `go to <obj> <k>`,
    `go through <colour> open door <k>`, `toggle and go through <colour> closed|locked door <k>`,
    `toggle`, `go to goal`, `check available actions`. Macros walk a shortest (BFS) path of
    primitive moves and stop at the first move that leaves the agent's view unchanged.
  - Anything containing "check" lists the actions; "" gives `No change in state.`; an unlisted
    action gives a reason, or `The action is not recognized. Please check valid actions.`,
    without moving, and the last reward is kept.
  - Observations: reset `Your goal: <mission>\\n<description>\\nAvailable actions: [...]`, step
    `<description or message>\\nAvailable actions: [...]`; objects nearest first, as in
    `There is a red ball 1 right in front of you 1 steps away.`
  - reward = minigrid's `1 - 0.9 * moves / max_steps` on success (moves = primitive steps);
    done = terminated, but False when that reward is <= 0.5 (the text still ends with
    `\\n The task is completed.`); the REPORTED reward is AgentGym's score, the running sum of
    every step's reward (a kept reward counts again).
  - data_idx -> level (data_idx mod 40) + 1, seed data_idx div 40. AgentGym-RL uses 20 turns.

What AgentGym's notes leave open, and what this module does (so outputs may differ there):
  - Level order. Only level 1 (GoToRedBallGrey) and level 40 (BossLevelNoUnlock) are known.
    minigrid registers exactly 40 BabyAI level classes, the first of them GoToRedBallGrey and
    the last BossLevelNoUnlock, so LEVELS is those classes in minigrid's registration order,
    each as its first registered id (PutNext as PutNextS4N1, OpenDoorsOrder as
    OpenDoorsOrderN2, MoveTwoAcross as MoveTwoAcrossS5N2: these classes have no default size).
  - Wording beyond the one example sentence: positions off the line of sight read
    `<a> steps in front of you and <r> steps to your left|right` (or only the side part);
    doors are named `<colour> <open|closed|locked> door`; the description ends with what
    the agent carries. k numbers visible objects of the same name, nearest first.
  - What is listed: `pickup` for visible keys, balls and boxes while the hands are empty;
    `drop` while carrying; `toggle` with a door or box right ahead; `go to goal` with a goal
    in view. Listed in the order of the vocabulary above.
  - Paths are searched on the true grid (closed doors and objects block), tie-broken by trying
    forward, then left, then right; `go through` ends one cell past the door.
  - `check` and "" keep the last reward like unlisted actions (stated only for the latter).
"""

from __future__ import annotations

import collections
import json
import re
from typing import Optional

from rl_tpu.envs.agentgym_parse import parse_action
from rl_tpu.envs.base import Env, StepResult, Task, TaskSource, register

# minigrid's 40 BabyAI level classes in its registration order (see the module docstring).
LEVELS: tuple[str, ...] = tuple(f"BabyAI-{name}-v0" for name in (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObj", "GoToLocal", "GoTo",
    "GoToImpUnlock", "GoToSeq", "GoToRedBlueBall", "GoToDoor", "GoToObjDoor", "Open",
    "OpenRedDoor", "OpenDoor", "OpenTwoDoors", "OpenDoorsOrderN2", "Pickup", "UnblockPickup",
    "PickupLoc", "PickupDist", "PickupAbove", "PutNextLocal", "PutNextS4N1", "Unlock",
    "UnlockLocal", "KeyInBox", "UnlockPickup", "BlockedUnlockPickup", "UnlockToUnlock",
    "ActionObjDoor", "FindObjS5", "KeyCorridor", "OneRoomS8", "MoveTwoAcrossS5N2", "Synth",
    "SynthLoc", "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock"))

MAX_TURNS = 20  # AgentGym-RL's BabyAI horizon (train and eval)
NOT_RECOGNIZED = "The action is not recognized. Please check valid actions."
NO_CHANGE = "No change in state."
COMPLETED = "\n The task is completed."
ACK = "OK. I'll follow your instructions and try my best to solve the task."

INSTRUCTION = (
    "You are an agent in a BabyAI grid world, a set of rooms joined by doors, holding keys, "
    "balls and boxes of several colours. Your goal is given at the start. Each turn you see "
    "what lies in front of you, nearest first, and the list of actions you may take.\n"
    "Actions:\n"
    "- turn left / turn right: face another way without moving.\n"
    "- move forward: step one cell ahead.\n"
    "- go to <object> <id>: walk until you face that object, e.g. `go to red ball 1`.\n"
    "- pickup <colour> <type> <id>: walk to that object and pick it up, e.g. "
    "`pickup red key 1`. You hold one thing at a time.\n"
    "- drop: put what you hold down in front of you.\n"
    "- go through <colour> open door <id>: walk through that open door.\n"
    "- toggle and go through <colour> closed door <id> (or locked door): open the door and "
    "walk through it; a locked door opens only while you hold a key of its colour.\n"
    "- toggle: open or close the door, or open the box, right in front of you.\n"
    "- go to goal: walk onto the goal square.\n"
    "- check available actions: list what you can do now.\n"
    "Use only actions from the current list, written exactly as listed. Answer in this "
    "format, with exactly one action:\n"
    "Thought:\nyour reasoning\n\nAction:\nthe action")

_DOOR_STATES = ("open", "closed", "locked")
_PICKABLE = ("key", "ball", "box")
_LEFT, _RIGHT, _FORWARD, _PICKUP, _DROP, _TOGGLE = 0, 1, 2, 3, 4, 5  # minigrid Actions ids
_DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))  # minigrid agent_dir 0..3 -> (dx, dy)
_NAMED = re.compile(r"^(go to|pickup|go through|toggle and go through) (.+) (\d+)$")


def data_idx_of(task: Task) -> int:
    """The task's AgentGym data_idx: `data["data_idx"]`, else the int after the last `_` of
    its id (AgentGym's item ids are `babyai_<n>`)."""
    data = task.data or {}
    if "data_idx" in data:
        return int(data["data_idx"])
    tail = task.task_id.rsplit("_", 1)[-1]
    if not tail.isdigit():
        raise ValueError(f"BabyAI task {task.task_id!r} has no data_idx: give it "
                         "data={'data_idx': n} or an id like 'babyai_<n>'")
    return int(tail)


def level_and_seed(data_idx: int) -> tuple[str, int]:
    """AgentGym's indexing: level (data_idx mod 40) + 1 (1-based), seed data_idx div 40."""
    if data_idx < 0:
        raise ValueError(f"data_idx must be >= 0, got {data_idx}")
    return LEVELS[data_idx % len(LEVELS)], data_idx // len(LEVELS)


class AgentGymBabyAITasks(TaskSource):
    """Task j of a split is Task(f"babyai_{i}", {"data_idx": i}) with
    eval: i = j, for 0 <= j < eval_size (<= TRAIN_START): seeds 0.. of all 40 levels in turn;
    train: i = TRAIN_START + j: seeds from 100 on, so the splits never share a grid."""

    TRAIN_START = 4000  # = 100 seeds x 40 levels reserved for eval

    def __init__(self, train_size: int = 100_000, eval_size: int = 400):
        if not 0 < eval_size <= self.TRAIN_START:
            raise ValueError(f"eval_size must be in 1..{self.TRAIN_START} so eval data_idx "
                             f"stay below the train range; got {eval_size}")
        self._sizes = {"train": int(train_size), "eval": int(eval_size)}

    def size(self, split: str) -> Optional[int]:
        self.check_split(split)
        return self._sizes[split]

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        if not 0 <= index < self._sizes[split]:
            raise IndexError(f"task index {index} out of range for split {split!r} of size "
                             f"{self._sizes[split]}")
        i = index if split == "eval" else self.TRAIN_START + index
        return Task(f"babyai_{i}", {"data_idx": i})


@register("babyai_agentgym")
class AgentGymBabyAIEnv(Env):
    """One BabyAI episode at a time, with AgentGym's text, actions and scoring."""

    name = "babyai_agentgym"
    system_prompt = ""  # AgentGym-RL keeps Qwen's default system message
    max_turns = MAX_TURNS

    def __init__(self, train_size: int = 100_000, eval_size: int = 400):
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI-* ids with gymnasium)
        from rl_tpu.envs.babyai import _silence_minigrid_sampling_prints

        _silence_minigrid_sampling_prints()
        self._gym = gymnasium
        self._tasks = AgentGymBabyAITasks(train_size, eval_size)
        self._levels: dict[str, object] = {}  # level id -> unwrapped env, reused across resets
        self._env = None
        self._done = True
        self._reward = 0.0   # the last step's reward, kept by steps that do not move
        self._score = 0.0    # AgentGym's score: the sum of every step's reward

    def tasks(self) -> TaskSource:
        return self._tasks

    def conversation_start(self) -> list[dict]:
        """AgentGym-RL's opening: the instruction as the user, a fixed acknowledgement."""
        return [{"role": "user", "content": INSTRUCTION},
                {"role": "assistant", "content": ACK}]

    # -- episode --------------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        level, seed = level_and_seed(data_idx_of(task))
        if level not in self._levels:
            self._levels[level] = self._gym.make(level).unwrapped
        self._env = self._levels[level]
        self._env.reset(seed=seed)
        self._done, self._reward, self._score = False, 0.0, 0.0
        return f"Your goal: {self._env.mission}\n{self._describe()}\n{self._listing()}"

    def step(self, reply: str) -> StepResult:
        if self._env is None or self._done:
            # AgentGym's server answers {"error"} here and AgentGym-RL then scores the episode 0.
            return StepResult("The episode is over; reset to start a new one.", 0.0, True,
                              {"invalid_action": True, "episode_over": True})
        action, error = parse_action(reply if isinstance(reply, str) else "")
        if error is not None:  # not sent to the server at all: no move, no score change
            return StepResult(error, 0.0, False, {"invalid_action": True})
        action = action.lower().strip()
        if "check" in action:
            return self._no_move(self._describe(), invalid=False)
        if action == "":
            return self._no_move(NO_CHANGE, invalid=True)
        available = self._available()
        if action not in available:
            return self._no_move(self._reason(action), invalid=True)
        reward, terminated = self._perform(action, available[action])
        self._reward = reward
        self._score += reward
        text = f"{self._describe()}\n{self._listing()}"
        if terminated:
            text += COMPLETED
        self._done = bool(terminated and reward > 0.5)
        info = {"success": bool(terminated and reward > 0), "step_reward": reward,
                "moves": int(self._env.step_count), "action": action}
        return StepResult(text, self._score, self._done, info)

    def _no_move(self, message: str, invalid: bool) -> StepResult:
        self._score += self._reward  # AgentGym adds the kept reward to the score again
        return StepResult(f"{message}\n{self._listing()}", self._score, False,
                          {"invalid_action": invalid, "step_reward": self._reward})

    def close(self) -> None:
        for env in self._levels.values():
            env.close()
        self._levels.clear()
        self._env, self._done = None, True

    # -- what the agent sees ----------------------------------------------------------------

    def _visible(self) -> list[tuple[str, tuple[int, int], int, int]]:
        """(name, world position, steps ahead, steps right) of each object in view, nearest
        first (fewest steps, then straight ahead before the sides, left before right)."""
        env = self._env
        _, vis_mask = env.gen_obs_grid()
        size = env.agent_view_size
        found = []
        for x in range(env.grid.width):
            for y in range(env.grid.height):
                cell = env.grid.get(x, y)
                if cell is None or cell.type in ("wall", "floor", "empty"):
                    continue
                coords = env.relative_coords(x, y)
                if coords is None or not vis_mask[coords[0], coords[1]]:
                    continue
                ahead, right = size - 1 - coords[1], coords[0] - size // 2
                found.append((abs(ahead) + abs(right), ahead, abs(right), right,
                              _name(cell), (x, y)))
        found.sort(key=lambda f: f[:4])
        return [(name, pos, ahead, right) for _, ahead, _, right, name, pos in found]

    def _numbered(self) -> list[tuple[str, tuple[int, int], int, int]]:
        """Visible objects with `k` appended to the name: 1, 2, ... per name, nearest first."""
        counts: dict[str, int] = collections.Counter()
        out = []
        for name, pos, ahead, right in self._visible():
            counts[name] += 1
            out.append((f"{name} {counts[name]}", pos, ahead, right))
        return out

    def _describe(self) -> str:
        lines = []
        for label, _, ahead, right in self._numbered():
            if label.startswith("goal"):
                label = "goal"
            lines.append(f"There is a {label} {_where(ahead, right)}.")
        carrying = self._env.carrying
        lines.append(f"You are carrying a {carrying.color} {carrying.type}." if carrying
                     else "You are not carrying anything.")
        return "\n".join(lines)

    def _available(self) -> dict[str, tuple]:
        """Listed action -> its plan: ("prim", action id) or (macro kind, target position)."""
        env = self._env
        front = env.grid.get(*env.front_pos)
        acts: dict[str, tuple] = {"turn left": ("prim", _LEFT), "turn right": ("prim", _RIGHT)}
        if front is None or front.type not in ("wall", "box"):
            acts["move forward"] = ("prim", _FORWARD)
        objects = self._numbered()
        if env.carrying is None:
            for label, pos, _, _ in objects:
                if label.split()[1] in _PICKABLE:
                    acts[f"pickup {label}"] = ("pickup", pos)
        if env.carrying is not None:
            acts["drop"] = ("prim", _DROP)
        for label, pos, _, _ in objects:
            if not label.startswith("goal"):
                acts[f"go to {label}"] = ("go to", pos)
        for label, pos, _, _ in objects:
            if label.split()[1:3] == ["open", "door"]:
                acts[f"go through {label}"] = ("through", pos)
        for label, pos, _, _ in objects:
            if label.split()[1] in ("closed", "locked") and label.split()[2] == "door":
                acts[f"toggle and go through {label}"] = ("toggle through", pos)
        if front is not None and front.type in ("door", "box"):
            acts["toggle"] = ("prim", _TOGGLE)
        goal = next((pos for label, pos, _, _ in objects if label.startswith("goal")), None)
        if goal is not None:
            acts["go to goal"] = ("goal", goal)
        acts["check available actions"] = ("check", None)
        return acts

    def _listing(self) -> str:
        return "Available actions: " + json.dumps(list(self._available()))

    def _reason(self, action: str) -> str:
        """Why an unlisted action cannot be taken now, or AgentGym's generic message."""
        env = self._env
        front = env.grid.get(*env.front_pos)
        if action == "move forward":
            return f"You cannot move forward: there is a {front.type} right in front of you."
        if action == "drop":
            return "You are not carrying anything to drop."
        if action == "toggle":
            return "There is nothing to toggle right in front of you."
        if action == "go to goal":
            return "There is no goal in view."
        named = _NAMED.match(action)
        if named:
            if named.group(1) == "pickup" and env.carrying is not None:
                return (f"You are already carrying a {env.carrying.color} "
                        f"{env.carrying.type}; drop it first.")
            label = f"{named.group(2)} {named.group(3)}"
            if any(seen == label for seen, _, _, _ in self._numbered()):
                return (f"You cannot {named.group(1)} the {label}; the actions listed for it "
                        "are the ones it allows.")
            return f"There is no {label} in view."
        return NOT_RECOGNIZED

    # -- acting ---------------------------------------------------------------------------

    def _perform(self, action: str, plan: tuple) -> tuple[float, bool]:
        """Runs the primitive moves of `action`; returns (last reward, terminated)."""
        kind, arg = plan
        if kind == "prim":
            moves = [arg]
        elif kind == "goal":
            moves = self._path(arg, onto=True)
        else:
            moves = self._path(arg, onto=False)
            if moves is not None:
                moves += {"go to": [], "pickup": [_PICKUP], "through": [_FORWARD, _FORWARD],
                          "toggle through": [_TOGGLE, _FORWARD, _FORWARD]}[kind]
        reward, terminated = 0.0, False
        for move in moves or []:
            before = self._env.gen_obs()["image"]
            _, reward, terminated, _, _ = self._env.step(move)
            if terminated or (self._env.gen_obs()["image"] == before).all():
                break  # success ends the macro; a move that changed nothing means blocked
        return float(reward), bool(terminated)

    def _path(self, target: tuple[int, int], onto: bool) -> Optional[list[int]]:
        """Shortest list of turns and forward moves that ends facing `target` from an adjacent
        cell (or standing on it, `onto`), over cells that are empty or passable (open doors,
        goals); None when there is no such path."""
        env = self._env
        grid = env.grid
        start = (int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir))
        target = (int(target[0]), int(target[1]))

        def arrived(state):
            x, y, d = state
            if onto:
                return (x, y) == target
            dx, dy = _DIR_VEC[d]
            return (x + dx, y + dy) == target

        parent = {start: None}
        queue = collections.deque([start])
        while queue:
            state = queue.popleft()
            if arrived(state):
                moves = []
                while parent[state] is not None:
                    state, move = parent[state]
                    moves.append(move)
                return moves[::-1]
            x, y, d = state
            dx, dy = _DIR_VEC[d]
            nx, ny = x + dx, y + dy
            cell = grid.get(nx, ny) if 0 <= nx < grid.width and 0 <= ny < grid.height else None
            steps = [(_LEFT, (x, y, (d - 1) % 4)), (_RIGHT, (x, y, (d + 1) % 4))]
            if (0 <= nx < grid.width and 0 <= ny < grid.height
                    and (cell is None or cell.can_overlap())):
                steps.insert(0, (_FORWARD, (nx, ny, d)))
            for move, nxt in steps:
                if nxt not in parent:
                    parent[nxt] = (state, move)
                    queue.append(nxt)
        return None


def _name(cell) -> str:
    if cell.type == "door":
        state = "open" if cell.is_open else ("locked" if cell.is_locked else "closed")
        return f"{cell.color} {state} door"
    if cell.type == "goal":
        return "goal"
    return f"{cell.color} {cell.type}"


def _where(ahead: int, right: int) -> str:
    side = f"{abs(right)} steps to your {'right' if right > 0 else 'left'}"
    if right == 0:
        return f"right in front of you {ahead} steps away"
    if ahead == 0:
        return side
    return f"{ahead} steps in front of you and {side}"
