"""BabyAI's `actions="primitive"` mode (rl_tpu's own): minigrid's seven primitive actions in
plain words, read leniently from the reply's last `Action:` line; the agent's partial
(egocentric 7x7) view rendered as sentences, with positions relative to the agent; after each
action a sentence on what it did, so a no-op (walking into a wall, picking up air) is visible.
"""

from __future__ import annotations

import re
from typing import Optional

from rl_tpu.core.env import action_line

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


def parse_primitive(text: str) -> Optional[str]:
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


def snapshot(env) -> tuple:
    """What an action may change: position, direction, what is carried, what is in front."""
    front = env.grid.get(*env.front_pos)
    front_state = (front.type, front.color, getattr(front, "is_open", None),
                   getattr(front, "is_locked", None)) if front is not None else None
    return (tuple(env.agent_pos), env.agent_dir, env.carrying, front, front_state)


def feedback(env, name: str, before: tuple) -> str:
    """One sentence on what the action did, so a no-op (walking into a wall, picking up
    air) is visible to the agent instead of silently burning a step."""
    pos, _, carrying, front, front_state = before
    front_desc = (_describe_object(front.type, front.color, _state_of(front))
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


def _state_of(obj) -> int:
    if obj.type != "door":
        return 0
    return 0 if obj.is_open else (2 if obj.is_locked else 1)


def render(env, obs: dict) -> str:
    """The agent's partial view as sentences.

    minigrid's `image` is the agent's view with the agent at (size // 2, size - 1) facing
    "up" (decreasing j); cells it cannot see are encoded as `unseen`. So column offset from
    the centre is right/left, and `size - 1 - j` is the number of steps ahead.
    """
    from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT

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
    lines.append(_wall_sentence(walls))
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
