"""The BabyAI env: minigrid's BabyAI levels as text (env "babyai", alias "babyai_agentgym").

Default (`actions="agentgym"`): BabyAI as AgentGym's server plays it, so results compare with
AgentGym-RL's (from its server's documented behaviour):
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
  - Observations: reset `Your goal: <mission>\n<description>\nAvailable actions: [...]`, step
    `<description or message>\nAvailable actions: [...]`; objects nearest first, as in
    `There is a red ball 1 right in front of you 1 steps away.`
  - reward = minigrid's `1 - 0.9 * moves / max_steps` on success (moves = primitive steps);
    done = terminated, but False when that reward is <= 0.5 (the text still ends with
    `\n The task is completed.`); the REPORTED reward is AgentGym's score, the running sum of
    every step's reward (a kept reward counts again).
  - The conversation opens with AgentGym's instruction and acknowledgement
    (`conversation_start`); AgentGym-RL uses 20 turns (MAX_TURNS).
What AgentGym's notes leave open, and what this env does (so outputs may differ there): the
level order (levels.py); wording beyond the one example sentence (positions off the line of
sight read `<a> steps in front of you and <r> steps to your left|right`, doors are named
`<colour> <open|closed|locked> door`, the description ends with what the agent carries, k
numbers visible objects of the same name, nearest first); what is listed (`pickup` for
visible keys, balls and boxes while the hands are empty, `drop` while carrying, `toggle` with a
door or box right ahead, `go to goal` with a goal in view, in the vocabulary's order); paths
(searched on the true grid, closed doors and objects block, tie-broken forward, left, right;
`go through` ends one cell past the door); `check` and "" keep the last reward too.

Option `actions="primitive"` (rl_tpu's own text BabyAI, primitive.py): the seven primitive
actions in words, read leniently; a system prompt; the view rendered as sentences with the
agent's heading; a sentence on what each action did; reward minigrid's success reward on the
completing step and 0 elsewhere (not a running score); done when minigrid terminates
(success, or a strict-mode failure with 0) or truncates. `demonstrate` / `expert_actions`
replay minigrid's BabyAIBot in this mode. `levels=PRIMITIVE_LEVELS` are the 8 levels the bot
solves in under 20 steps.

Other options: `levels` (AgentGym level numbers 1..40 or minigrid ids; the task source then
cycles through those only), `max_steps` (overrides each level's step limit; minigrid's success
reward scales with it), `train_size`, `eval_size`.

Tasks: `Task(f"babyai_{i}", {"data_idx": i})`, data_idx -> level (i mod 40) + 1, seed i div 40
(levels.py). Eval is data_idx 0.. (seeds 0..99), train from 4000 (seeds from 100), so the
splits never share a grid. A task may instead give `{"level": <minigrid id>, "seed": s}`.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import re
from typing import Optional, Sequence, Union

from rl_tpu.core.agentgym_parse import parse_action
from rl_tpu.envs.babyai import primitive
from rl_tpu.envs.babyai_teacher import BabyAITeacher
from rl_tpu.envs.babyai.levels import (BabyAITasks, data_idx_of, level_and_seed, level_numbers,
                                       silence_minigrid_sampling_prints)
from rl_tpu.core.env import Env, StepResult, Task, TaskSource, invalid_action, register

log = logging.getLogger(__name__)
ACTION_STYLES = ("agentgym", "primitive")

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


@register("babyai")
class BabyAIEnv(Env):
    """One BabyAI episode at a time, AgentGym's text, actions and scoring by default (see the
    module docstring for the options)."""

    name = "babyai"
    replayable = True  # reset(task) and the same actions reach the same state
    system_prompt = ""  # AgentGym-RL keeps Qwen's default system message
    max_turns = MAX_TURNS

    def __init__(self, actions: str = "agentgym", levels: Sequence[Union[int, str]] = (),
                 max_steps: Optional[int] = None, train_size: int = 100_000,
                 eval_size: int = 400):
        import gymnasium
        import minigrid  # noqa: F401  (registers the BabyAI-* ids with gymnasium)

        if actions not in ACTION_STYLES:
            raise ValueError(f"babyai: actions must be one of {ACTION_STYLES} ('agentgym': "
                             "AgentGym's listed macro actions; 'primitive': the seven "
                             f"minigrid actions), got {actions!r}")
        silence_minigrid_sampling_prints()
        self._gym = gymnasium
        self.actions = actions
        if actions == "primitive":
            self.system_prompt = primitive.SYSTEM_PROMPT
        self._tasks = BabyAITasks(train_size, eval_size, levels)
        self._max_steps = max_steps
        self._teacher = None  # the scripted teacher of the current episode (teacher_reply)
        self._levels: dict[str, object] = {}  # level id -> unwrapped env, reused across resets
        self._env = None     # the unwrapped minigrid env of the current episode
        self._done = True
        self._reward = 0.0   # the last step's reward, kept by steps that do not move
        self._score = 0.0    # AgentGym's score: the sum of every step's reward
        self.last_observation = ""
        self._view = ""  # primitive mode: the current view, rendered without any feedback

    @property
    def agentgym_name(self) -> str:
        """"babyai" while the env plays AgentGym's protocol, else "" (the env server reads it)."""
        return "babyai" if self.actions == "agentgym" else ""

    def tasks(self) -> TaskSource:
        return self._tasks

    def conversation_start(self) -> Optional[list[dict]]:
        """AgentGym-RL's opening: the instruction as the user, a fixed acknowledgement (None
        in the primitive mode, whose system prompt states the actions)."""
        if self.actions == "primitive":
            return None
        return [{"role": "user", "content": INSTRUCTION},
                {"role": "assistant", "content": ACK}]

    # -- episode --------------------------------------------------------------------------

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
        obs, _ = self._env.reset(seed=seed)
        self._done, self._reward, self._score = False, 0.0, 0.0
        self._teacher = None
        if self.actions == "primitive":
            self._view = self.last_observation = primitive.render(self._env, obs)
        else:
            self.last_observation = (f"Your goal: {self._env.mission}\n{self._describe()}\n"
                                     f"{self._listing()}")
        return self.last_observation

    def _level_and_seed(self, task: Task) -> tuple[str, int]:
        data = task.data or {}
        if "level" in data and "seed" in data:
            level_numbers(data["level"])  # a known level, or a clear error
            return str(data["level"]), int(data["seed"])
        if "data_idx" not in data and "split" in data and "index" in data:
            task = self._tasks.get(data["split"], int(data["index"]))
        return level_and_seed(data_idx_of(task))

    def step(self, reply: str) -> StepResult:
        if self._env is None or self._done:
            # AgentGym's server answers {"error"} here and AgentGym-RL then scores the episode 0.
            return StepResult("The episode is over; reset to start a new one.", 0.0, True,
                              {"invalid_action": True, "episode_over": True})
        if self.actions == "primitive":
            return self._step_primitive(reply)
        action, error = parse_action(reply if isinstance(reply, str) else "")
        if error is not None:  # not sent to the server at all: no move, no score change
            return StepResult(error, 0.0, False, {"invalid_action": True})
        action = action.lower().strip()
        if "check" in action:
            return self._no_move(self._describe(), invalid=False)
        if action == "":
            return self._no_move(NO_CHANGE, invalid=True)
        available = self.available_actions()
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

    def _step_primitive(self, reply: str) -> StepResult:
        name = primitive.parse_primitive(reply)
        if name is None:
            # The current view, without the previous step's feedback ("You moved forward."):
            # repeating that would read as if this reply had done it again.
            result = invalid_action(
                f"could not read an action from your reply, so nothing happened. End it with a "
                f"line 'Action: <action>' where <action> is one of: "
                f"{', '.join(primitive.ACTIONS)}.\n" + self._view)
            self.last_observation = result.observation
            return result
        env = self._env
        before = primitive.snapshot(env)
        obs, reward, terminated, truncated, _ = env.step(primitive.ACTIONS.index(name))
        success = bool(terminated and reward > 0)
        self._done = bool(terminated or truncated)
        feedback = primitive.feedback(env, name, before)
        if success:
            feedback += " Mission accomplished!"
        elif terminated:
            feedback += " The mission failed; the episode is over."
        elif truncated:
            feedback += " You ran out of steps; the episode is over."
        self._view = primitive.render(env, obs)
        self.last_observation = f"{feedback}\n{self._view}"
        info = {"success": success, "truncated": bool(truncated and not terminated),
                "action": name, "steps": int(env.step_count)}
        return StepResult(self.last_observation, float(reward) if success else 0.0,
                          self._done, info)

    def teacher_reply(self, task: Task, rng: random.Random, skill: float) -> str:
        """The imperfect scripted teacher's reply in the current state (babyai_teacher.py);
        its carelessness is drawn from `rng` on the episode's first call."""
        if self._teacher is None:
            self._teacher = BabyAITeacher(rng, skill)
        return self._teacher.reply(self)

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

    @property
    def mission(self) -> str:
        """The current episode's mission text (minigrid's), e.g. "pick up the red ball"."""
        return self._env.mission

    def available_actions(self) -> dict[str, tuple]:
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
        return "Available actions: " + json.dumps(list(self.available_actions()))

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


register("babyai_agentgym")(BabyAIEnv)


def demonstrate(task: Task, env: Optional[BabyAIEnv] = None,
                max_steps: int = 200) -> list[tuple[str, str]]:
    """Plays `task` with minigrid's BabyAIBot; returns the (observation, action) pairs.

    Each observation is the text the agent saw before acting; each action is one of
    `primitive.ACTIONS`. Uses `env` if given (a primitive-mode env; it is reset to the task),
    else a private one. The bot plans
    over the true grid, so the pairs are an expert's, not a partially-observing agent's.
    """
    from minigrid.utils.baby_ai_bot import BabyAIBot

    own = env is None
    if not own and env.actions != "primitive":
        raise ValueError("demonstrate plays primitive actions: give it an env made with "
                         "actions='primitive' (or none)")
    env = env or BabyAIEnv(actions="primitive")
    try:
        observation = env.reset(task)
        bot = BabyAIBot(env._env)
        pairs = []
        for _ in range(max_steps):
            try:
                action = primitive.ACTIONS[int(bot.replan())]
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
