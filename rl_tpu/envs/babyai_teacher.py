"""A scripted, deliberately imperfect BabyAI teacher over AgentGym's macro actions.

The multi-turn counterpart of the quickstart's `largest` teacher: the SFT warm start imitates
it, and RL must then beat it. It reads the mission and the env's current view (the numbered
objects and the listed actions the agent sees) and answers one action a turn:

  - the mission's object is in view: the macro that completes it, e.g. `go to red ball 1`,
    `pickup grey key 1`, `toggle and go through red closed door 1` (for "open ... door");
  - nothing that matches is in view: explore, turning left three times, then moving forward
    (or turning right when a wall blocks), so a full turn on the spot sees the whole room.

A reply is `Thought: <the mission>.` then `Action: <action>`, AgentGym's format.

Its mistake is systematic, as the quickstart's is: with probability `1 - skill` an episode's
teacher is *careless* and, whatever the mission names, acts on the NEAREST object in view
that the mission's verb applies to (goes to it, picks it up, opens it). That is right only
when the nearest object happens to be the mission's, so imitation learns a habit that a
verifiable reward can correct: read the colour and type in the goal. The carelessness is
drawn once per episode from `rng`, so one episode is consistent with itself.

Missions handled: `go to the|a [colour] <type>`, `pick up the|a [colour] <type|object>`,
`open the|a [colour] door` (the single-room levels of `EASY_LEVELS`); other missions get the
exploring fallback and rarely succeed, which is fine for an imperfect teacher.
"""

from __future__ import annotations

import random
import re
from typing import Optional

# 1-based AgentGym levels (data_idx mod 40 + 1) of single-room missions the teacher knows:
# GoToRedBallGrey, GoToRedBall, GoToRedBallNoDists, GoToObj, GoToLocal, GoToDoor,
# OpenRedDoor, PickupDist.
EASY_LEVELS = (1, 2, 3, 4, 5, 10, 13, 20)

_COLOURS = ("red", "green", "blue", "purple", "yellow", "grey")
_MISSION = re.compile(r"^(go to|pick up|open) (?:the|a) (?:(\w+) )?(\w+)$")
_VERB_ACTION = {"go to": "go to", "pick up": "pickup", "open": "toggle and go through"}


def parse_mission(mission: str) -> Optional[tuple[str, Optional[str], str]]:
    """(verb, colour or None, type) of a simple mission, or None for any other mission.
    `pick up a grey object` gives type "object" (any pickable thing)."""
    m = _MISSION.match(mission.strip())
    if not m:
        return None
    verb, colour, kind = m.groups()
    if colour is not None and colour not in _COLOURS:
        return None
    return verb, colour, kind


def _matches(label: str, colour: Optional[str], kind: str) -> bool:
    """Whether a numbered label (`red ball 1`, `blue closed door 2`) is the mission's object."""
    words = label.split()
    if colour is not None and words[0] != colour:
        return False
    return kind == "object" or kind in words[1:-1]


class BabyAITeacher:
    """The teacher of ONE episode: its carelessness is drawn when it is made (after reset);
    `reply(env)` answers each turn from the env's current view (see the module docstring)."""

    def __init__(self, rng: random.Random, skill: float):
        self._careless = rng.random() >= skill
        self._turns_in_place = 0

    def reply(self, env) -> str:
        # The thought restates the goal each turn, so the words an action must copy sit right
        # before it instead of turns back in the first observation (a tiny model's attention
        # copies from near far more easily than it finds the mission line).
        return f"Thought: {env.mission}.\nAction: {self._action(env)}"

    def _action(self, env) -> str:
        available = env.available_actions()
        mission = parse_mission(env.mission)
        if mission is not None:
            verb, colour, kind = mission
            prefix = _VERB_ACTION[verb]
            candidates = [a for a in available if a.startswith(prefix + " ")
                          and not a.startswith("go to goal")]
            if verb == "go to" and kind != "door":  # `go to` lists doors too; keep objects
                candidates = [a for a in candidates if "door" not in a.split()]
            if verb == "open":
                candidates = [a for a in candidates if a.split()[-2] == "door"]
            if self._careless and candidates:
                self._turns_in_place = 0
                return candidates[0]  # the nearest such object, whatever the mission says
            for action in candidates:
                if _matches(action[len(prefix) + 1:], colour, kind):
                    self._turns_in_place = 0
                    return action
        return self._explore(available)

    def _explore(self, available: dict) -> str:
        if self._turns_in_place < 3:
            self._turns_in_place += 1
            return "turn left"
        self._turns_in_place = 0
        return "move forward" if "move forward" in available else "turn right"
