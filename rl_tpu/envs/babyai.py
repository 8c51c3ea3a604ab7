"""BabyAI grid-world levels (minigrid) as a text environment.

The agent sees a sentence-level rendering of minigrid's partial (egocentric, 7x7) view, the
mission, and what it carries; it answers with one of seven primitive actions in plain words.
A task is `(level, seed)`: minigrid generates the same grid and mission for the same seed, so
train and eval splits are made disjoint by giving them disjoint seed ranges.

Reward: minigrid's own success reward, `1 - 0.9 * steps / max_steps`, on the step that
completes the mission, and 0 everywhere else (a strict-mode failure, e.g. opening the wrong
door, ends the episode with 0). `info["success"]` says whether the mission was completed, so a
caller that wants a flat 1.0 for success can read it from there.

Expert demonstrations come from minigrid's `BabyAIBot`, which plans over the true grid; its
primitive actions are mapped back to the same words the agent uses (`demonstrate`,
`expert_actions`).
"""

from __future__ import annotations

import logging
import re
from typing import Optional, Sequence

from rl_tpu.envs.base import (Env, StepResult, Task, TaskSource, action_line, invalid_action,
                              register)

log = logging.getLogger(__name__)

# Levels whose missions minigrid's bot completes on every seed we tried, in at most ~17 steps
# (mean 5-7), so a 20-turn horizon leaves room for a policy's detours. Multi-room levels
# (OpenDoor, GoToDoor) have large max_steps; the bot still needs only ~10.
DEFAULT_LEVELS: tuple[str, ...] = (
    "BabyAI-GoToRedBallGrey-v0",
    "BabyAI-GoToRedBall-v0",
    "BabyAI-GoToObj-v0",
    "BabyAI-GoToLocal-v0",
    "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDist-v0",
    "BabyAI-OpenDoor-v0",
    "BabyAI-GoToDoor-v0",
)

# Canonical action words, in minigrid's `Actions` order (index = minigrid action id).
ACTIONS: tuple[str, ...] = ("turn left", "turn right", "move forward", "pick up", "drop",
                            "toggle", "done")

# Lenient spellings a model is likely to produce. Keys are normalised (lowercase, single
# spaces, no punctuation); a phrase that *starts* with one of these (e.g. "pick up the red
# ball", "toggle the door") maps to it too, because minigrid's pickup/toggle act on whatever is
# in front of the agent and the trailing object name carries no extra information.
_ALIASES: dict[str, str] = {
    "turn left": "turn left", "left": "turn left", "rotate left": "turn left",
    "turn_left": "turn left", "go left": "turn left", "move left": "turn left",
    "turn right": "turn right", "right": "turn right", "rotate right": "turn right",
    "turn_right": "turn right", "go right": "turn right", "move right": "turn right",
    "move forward": "move forward", "forward": "move forward", "go forward": "move forward",
    "move ahead": "move forward", "go ahead": "move forward", "step forward": "move forward",
    "go straight": "move forward", "move_forward": "move forward", "move": "move forward",
    "pick up": "pick up", "pickup": "pick up", "pick": "pick up", "grab": "pick up",
    "take": "pick up", "pick_up": "pick up",
    "drop": "drop", "put down": "drop", "place": "drop", "release": "drop",
    "toggle": "toggle", "open": "toggle", "unlock": "toggle", "use": "toggle",
    "done": "done", "finish": "done", "stop": "done", "finished": "done",
}

_NOT_WORD = re.compile(r"[^a-z_ ]+")
_DIRECTIONS = ("east", "south", "west", "north")  # minigrid agent_dir 0..3

SYSTEM_PROMPT = (
    "You are an agent in a BabyAI grid world. Each turn you are told your mission, which way "
    "you face, what you carry, and what you can see, with positions relative to you (steps "
    "ahead, steps to your left or right). You see only a 7x7 square in front of you, and not "
    "through walls or closed doors.\n"
    "Actions: turn left, turn right, move forward, pick up (the object directly in front of "
    "you), drop (what you carry, onto the cell in front of you), toggle (open or close the door "
    "or box in front of you; a locked door opens only while you carry a key of its colour), "
    "done.\n"
    "Think briefly if you like, then end your reply with one line of the form\n"
    "Action: <action>\n"
    "Only the last such line is executed."
)


def parse_action(text: str) -> Optional[str]:
    """The canonical action word in a model response, or None if there is none.

    The last line of the form `Action: ...` wins; without one, the last non-empty line is
    tried, so a bare "turn left" works too. Matching is case-insensitive and ignores
    punctuation, quotes and trailing object names.
    """
    candidate = action_line(text)
    if candidate is None or len(candidate) > 200:  # a real action is a few words
        return None
    words = _NOT_WORD.sub(" ", candidate.lower()).split()
    phrase = " ".join(words)
    if phrase in _ALIASES:
        return _ALIASES[phrase]
    # Longest alias that the phrase starts with ("pick up the ball" -> "pick up").
    for n in (2, 1):
        head = " ".join(words[:n])
        if len(words) > n and head in _ALIASES:
            return _ALIASES[head]
    return None


def _silence_minigrid_sampling_prints() -> None:
    """minigrid prints "Sampling rejected: ..." to stdout while it retries level generation.

    That chatter would corrupt anything that owns stdout (the env server's log, a progress
    bar). Rebinding `print` in that one module's globals routes it to our debug log instead,
    without touching stdout for anyone else (unlike `contextlib.redirect_stdout`, which is
    process-wide and so unsafe with threads).
    """
    from minigrid.envs.babyai.core import roomgrid_level

    roomgrid_level.print = lambda *args, **kwargs: log.debug(" ".join(map(str, args)))


class BabyAITasks(TaskSource):
    """Task i of a split is level `levels[i % L]` with seed `base + i // L`.

    Train seeds start at 0 and eval seeds at 10**9, so the splits never share a grid as long as
    train_size // L < 10**9.
    """

    EVAL_SEED_BASE = 10**9

    def __init__(self, levels: Sequence[str], train_size: int = 100_000, eval_size: int = 500):
        self.levels = tuple(levels)
        self._sizes = {"train": int(train_size), "eval": int(eval_size)}

    def size(self, split: str) -> Optional[int]:
        self.check_split(split)
        return self._sizes[split]

    def get(self, split: str, index: int) -> Task:
        self.check_split(split)
        if not 0 <= index < self._sizes[split]:
            raise IndexError(f"task index {index} out of range for split {split!r} "
                             f"of size {self._sizes[split]}")
        level = self.levels[index % len(self.levels)]
        base = 0 if split == "train" else self.EVAL_SEED_BASE
        seed = base + index // len(self.levels)
        return Task(task_id=f"{level}/{seed}",
                    data={"level": level, "seed": seed, "split": split, "index": index})


def _describe_object(type_name: str, color: str, state: int) -> str:
    if type_name == "door":
        door_state = ("open", "closed", "locked")[state] if 0 <= state <= 2 else "closed"
        return f"{'an' if door_state == 'open' else 'a'} {door_state} {color} door"
    if type_name == "goal":
        return "the green goal square"
    if type_name == "lava":
        return "lava"
    return f"a {color} {type_name}"


def _where(ahead: int, right: int) -> str:
    parts = []
    if ahead:
        parts.append(f"{ahead} step{'s' if ahead != 1 else ''} ahead")
    if right:
        side = "right" if right > 0 else "left"
        parts.append(f"{abs(right)} step{'s' if abs(right) != 1 else ''} to the {side}")
    return " and ".join(parts)


@register("babyai")
class BabyAIEnv(Env):
    """One minigrid BabyAI episode at a time, in words.

    Args:
      levels: gymnasium ids of the BabyAI levels the task source cycles through.
      max_steps: overrides each level's own step limit (minigrid's truncation) when given;
        minigrid's success reward scales with it.
      train_size, eval_size: number of tasks in each split.
    """

    name = "babyai"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, levels: Sequence[str] = DEFAULT_LEVELS, max_steps: Optional[int] = None,
                 train_size: int = 100_000, eval_size: int = 500):
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI-* ids with gymnasium)

        _silence_minigrid_sampling_prints()
        if isinstance(levels, str):
            levels = [levels]
        unknown = [level for level in levels if level not in gymnasium.registry]
        if unknown or not levels:
            known = sorted(k for k in gymnasium.registry if k.startswith("BabyAI-"))
            raise ValueError(f"unknown BabyAI level(s) {unknown or levels!r}; known: {known}")
        self._gym = gymnasium
        self._task_source = BabyAITasks(levels, train_size, eval_size)
        self._max_steps = max_steps
        self._levels: dict[str, object] = {}  # level id -> unwrapped minigrid env (reused)
        self._env = None       # the unwrapped env of the current episode
        self._obs = None       # minigrid's last observation dict
        self._task: Optional[Task] = None
        self._done = True
        self.last_observation = ""

    # -- episode ------------------------------------------------------------------------

    def tasks(self) -> TaskSource:
        return self._task_source

    def reset(self, task: Task) -> str:
        level, seed = self._level_and_seed(task)
        if level not in self._levels:
            # We step the unwrapped env: the gymnasium wrappers only re-check what minigrid
            # already guarantees, and cost a few microseconds a step.
            env = self._gym.make(level).unwrapped
            if self._max_steps is not None:
                # RoomGridLevel recomputes max_steps from the layout on every reset unless
                # told the limit is fixed.
                env.fixed_max_steps = True
                env.max_steps = int(self._max_steps)
            self._levels[level] = env
        self._env = self._levels[level]
        self._obs, _ = self._env.reset(seed=seed)
        self._task = task
        self._done = False
        self.last_observation = self._render(self._obs)
        return self.last_observation

    def _level_and_seed(self, task: Task) -> tuple[str, int]:
        data = task.data or {}
        if "level" in data and "seed" in data:
            level, seed = data["level"], data["seed"]
        elif "split" in data and "index" in data:
            resolved = self._task_source.get(data["split"], int(data["index"])).data
            level, seed = resolved["level"], resolved["seed"]
        else:
            raise ValueError(f"BabyAI task {task.task_id!r} needs data with 'level' and 'seed' "
                             "(or 'split' and 'index'); build tasks with env.tasks().get(...)")
        if level not in self._gym.registry:
            raise ValueError(f"BabyAI task {task.task_id!r} names unknown level {level!r}")
        return str(level), int(seed)

    def step(self, action: str) -> StepResult:
        if self._env is None or self._done:
            return StepResult(observation="The episode is over; reset to start a new one.",
                              reward=0.0, done=True,
                              info={"invalid_action": True, "episode_over": True})
        name = parse_action(action)
        if name is None:
            return invalid_action(
                f"could not read an action from your reply. End it with a line "
                f"'Action: <action>' where <action> is one of: {', '.join(ACTIONS)}.\n"
                + self.last_observation)
        env = self._env
        before = self._snapshot()
        self._obs, reward, terminated, truncated, _ = env.step(ACTIONS.index(name))
        success = bool(terminated and reward > 0)
        self._done = bool(terminated or truncated)
        feedback = self._feedback(name, before)
        if success:
            feedback += " Mission accomplished!"
        elif terminated:
            feedback += " The mission failed; the episode is over."
        elif truncated:
            feedback += " You ran out of steps; the episode is over."
        self.last_observation = f"{feedback}\n{self._render(self._obs)}"
        info = {"success": success, "truncated": bool(truncated and not terminated),
                "action": name, "steps": int(env.step_count),
                "level": self._task.data.get("level") if self._task else None}
        return StepResult(self.last_observation, float(reward) if success else 0.0,
                          self._done, info)

    def close(self) -> None:
        for env in self._levels.values():
            env.close()
        self._levels.clear()
        self._env = None
        self._done = True

    # -- text rendering -----------------------------------------------------------------

    def _snapshot(self) -> tuple:
        env = self._env
        front = env.grid.get(*env.front_pos)
        front_state = (front.type, front.color, getattr(front, "is_open", None),
                       getattr(front, "is_locked", None)) if front is not None else None
        return (tuple(env.agent_pos), env.agent_dir, env.carrying, front, front_state)

    def _feedback(self, name: str, before: tuple) -> str:
        """One sentence on what the action did, so a no-op (walking into a wall, picking up
        air) is visible to the agent instead of silently burning a step."""
        env = self._env
        pos, _, carrying, front, front_state = before
        front_desc = (_describe_object(front.type, front.color, self._state_of(front))
                      if front is not None else "nothing")
        if name in ("turn left", "turn right"):
            return f"You turned {name.split()[1]}."
        if name == "move forward":
            if tuple(env.agent_pos) != pos:
                return "You moved forward."
            return f"You could not move forward: {front_desc} is in the way."
        if name == "pick up":
            if carrying is None and env.carrying is not None:
                return f"You picked up a {env.carrying.color} {env.carrying.type}."
            if carrying is not None:
                return (f"You are already carrying a {carrying.color} {carrying.type}; drop it "
                        "before picking up something else.")
            return f"There is nothing you can pick up in front of you ({front_desc})."
        if name == "drop":
            if carrying is not None and env.carrying is None:
                return f"You dropped the {carrying.color} {carrying.type}."
            if carrying is None:
                return "You are not carrying anything to drop."
            return f"You cannot drop here: {front_desc} is in front of you."
        if name == "toggle":
            now = env.grid.get(*env.front_pos)
            now_state = (now.type, now.color, getattr(now, "is_open", None),
                         getattr(now, "is_locked", None)) if now is not None else None
            if front is None:
                return "There is nothing in front of you to toggle."
            if now_state != front_state or now is not front:
                if front.type == "door":
                    return (f"You {'opened' if now.is_open else 'closed'} the "
                            f"{front.color} door.")
                return f"You opened the {front.color} {front.type}."
            if front.type == "door" and front_state[3]:
                return (f"The {front.color} door is locked; you need to carry a "
                        f"{front.color} key to open it.")
            return f"Nothing happened when you toggled {front_desc}."
        return "You declared the mission done."

    @staticmethod
    def _state_of(obj) -> int:
        if obj.type != "door":
            return 0
        return 0 if obj.is_open else (2 if obj.is_locked else 1)

    def _render(self, obs: dict) -> str:
        """The agent's partial view as sentences.

        minigrid's `image` is the agent's view with the agent at (size // 2, size - 1) facing
        "up" (decreasing j); cells it cannot see are encoded as `unseen`. So column offset from
        the centre is right/left, and `size - 1 - j` is the number of steps ahead.
        """
        from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT

        env = self._env
        image = obs["image"]
        size = image.shape[0]
        cx, cy = size // 2, size - 1
        seen, walls = [], []
        for i in range(size):
            for j in range(size):
                type_name = IDX_TO_OBJECT[int(image[i, j, 0])]
                if type_name in ("unseen", "empty", "floor", "agent") or (i, j) == (cx, cy):
                    continue
                ahead, right = cy - j, i - cx
                if type_name == "wall":
                    walls.append((ahead, right))
                    continue
                desc = _describe_object(type_name, IDX_TO_COLOR[int(image[i, j, 1])],
                                        int(image[i, j, 2]))
                seen.append((ahead + abs(right), ahead, right, desc))
        seen.sort()
        carrying = env.carrying
        lines = [f"Mission: {obs['mission']}.",
                 f"You are facing {_DIRECTIONS[env.agent_dir]}. You are carrying "
                 + (f"a {carrying.color} {carrying.type}." if carrying else "nothing.")]
        if seen:
            lines.append("You see:")
            lines.extend(f"- {desc} {_where(ahead, right)}" for _, ahead, right, desc in seen)
        else:
            lines.append("You see no objects.")
        lines.append(self._wall_sentence(walls))
        front = image[cx, cy - 1]
        front_type = IDX_TO_OBJECT[int(front[0])]
        if front_type in ("empty", "floor"):
            lines.append("Directly in front of you: an empty cell.")
        elif front_type == "wall":
            lines.append("Directly in front of you: a wall.")
        elif front_type != "unseen":
            lines.append("Directly in front of you: " + _describe_object(
                front_type, IDX_TO_COLOR[int(front[1])], int(front[2])) + ".")
        return "\n".join(lines)

    @staticmethod
    def _wall_sentence(walls: list[tuple[int, int]]) -> str:
        ahead = min((a for a, r in walls if r == 0 and a > 0), default=None)
        parts = []
        if ahead is not None:
            parts.append(f"{ahead} step{'s' if ahead != 1 else ''} ahead")
        if (0, -1) in walls:
            parts.append("directly to your left")
        if (0, 1) in walls:
            parts.append("directly to your right")
        return ("Walls: " + "; ".join(parts) + ".") if parts else "No wall in sight ahead."


def demonstrate(task: Task, env: Optional[BabyAIEnv] = None,
                max_steps: int = 200) -> list[tuple[str, str]]:
    """Plays `task` with minigrid's BabyAIBot; returns the (observation, action) pairs.

    Each observation is the text the agent saw before acting; each action is one of `ACTIONS`.
    Uses `env` if given (it is reset to the task), else a private `BabyAIEnv`. The bot plans
    over the true grid, so the pairs are an expert's, not a partially-observing agent's.
    """
    from minigrid.utils.baby_ai_bot import BabyAIBot

    own = env is None
    env = env or BabyAIEnv(levels=[task.data.get("level", DEFAULT_LEVELS[0])])
    try:
        observation = env.reset(task)
        bot = BabyAIBot(env._env)
        pairs = []
        for _ in range(max_steps):
            try:
                action = ACTIONS[int(bot.replan())]
            except Exception as e:  # the bot gives up on a few layouts (e.g. opened boxes)
                log.warning("BabyAIBot failed on %s: %s", task.task_id, e)
                break
            pairs.append((observation, action))
            result = env.step(f"Action: {action}")
            observation = result.observation
            if result.done:
                break
        return pairs
    finally:
        if own:
            env.close()


def expert_actions(task: Task, env: Optional[BabyAIEnv] = None) -> list[str]:
    """The bot's action words for `task` (see `demonstrate`)."""
    return [action for _, action in demonstrate(task, env)]
