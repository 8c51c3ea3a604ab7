"""How AgentGym's own clients turn a model's reply into the action they send (facts from
AgentGym's client code; the code here is rl_tpu's own).

A contract of rl_tpu.core: the AgentGym envs (rl_tpu/envs/) and the served AgentGym
environments (rl_tpu/env_serving/) parse a reply the same way; nothing here imports rl_tpu.

BabyAI and TextCraft (`parse_action`):
  - a marker is `Action:` (case-sensitive, also inside a word), then any whitespace including
    newlines, then the rest of that line; markers are found left to right without overlap;
  - two or more markers: nothing is sent; the observation is TOO_MANY_ACTIONS, reward 0, the
    episode goes on;
  - one marker: its line (`Action: go to red ball 1` and `Action:\\ngo to red ball 1` alike);
    lines after it are dropped; no marker: the empty action "";
  - then every character but ASCII letters, digits, comma and space is dropped (`.`, `-`,
    `'`, `_`, tabs vanish), runs of spaces collapse to one, and the ends are stripped; case is
    kept.
SciWorld (`parse_sciworld_action`): the text after the LAST `Action:`, stripped, possibly
several lines, unfiltered; no marker: "".
SearchQA: the whole reply is sent as it is.
"""

from __future__ import annotations

import re
from typing import Optional

TOO_MANY_ACTIONS = ("Error: Only one 'Action' is allowed per response. "
                    "Please adjust your response.")

_MARKER = re.compile(r"Action:\s*([^\n]*)")
_NOT_KEPT = re.compile(r"[^A-Za-z0-9, ]")
_SPACES = re.compile(r" +")


def parse_action(reply: str) -> tuple[Optional[str], Optional[str]]:
    """(action, None) for BabyAI / TextCraft replies, or (None, TOO_MANY_ACTIONS) when the
    reply names more than one action (the env is then not stepped)."""
    found = _MARKER.findall(reply)
    if len(found) > 1:
        return None, TOO_MANY_ACTIONS
    line = found[0] if found else ""
    return _SPACES.sub(" ", _NOT_KEPT.sub("", line)).strip(), None


def parse_sciworld_action(reply: str) -> str:
    """The text after the last `Action:`, stripped (may span lines); "" without one."""
    at = reply.rfind("Action:")
    return "" if at < 0 else reply[at + len("Action:"):].strip()
