"""AgentGym's reply parsing (rl_tpu.core.agentgym_parse) and the generic `action_line`.

The expected values are the ones AgentGym's own clients produce for these replies: BabyAI and
TextCraft take the one `Action:` line (case-sensitive marker, also inside a word, action on
the same or the next line), refuse two markers, and keep only ASCII letters, digits, commas and
spaces; SciWorld takes everything after the last marker, unfiltered; no marker gives "".
"""

import pytest

from rl_tpu.core.agentgym_parse import TOO_MANY_ACTIONS, parse_action, parse_sciworld_action
from rl_tpu.core.env import action_line

# --- BabyAI / TextCraft ------------------------------------------------------------------------


@pytest.mark.parametrize("reply,action", [
    # The answer format the instructions ask for: the action on the line after the marker.
    ("Thought:\nI need wood first.\n\nAction:\nget 1 oak logs", "get 1 oak logs"),
    ("Action: go to red ball 1", "go to red ball 1"),
    ("Action:go to red ball 1", "go to red ball 1"),
    # Any whitespace, blank lines included, may stand between the marker and the action.
    ("Action:\n\n\t  turn left", "turn left"),
    # Only the marker's own line counts; later lines are dropped.
    ("Thought: hmm\nAction: move forward\nI expect to see the door.", "move forward"),
    ("Action:\ncraft 1 stick using 2 oak planks\nthen more", "craft 1 stick using 2 oak planks"),
    # Stray characters vanish (not replaced by spaces), spaces collapse, case is kept.
    ("Action: Go to the red-ball_1.", "Go to the redball1"),
    ("Action: don't\ttoggle", "donttoggle"),
    ("Action:   get   2    oak   logs   ", "get 2 oak logs"),
    ("Action: craft 4 oak planks using 1 oak logs, 1 stick",
     "craft 4 oak planks using 1 oak logs, 1 stick"),
    ("Action: `inventory`", "inventory"),
    ("Action: go to ball é 1", "go to ball 1"),
    # The marker counts inside a word too, but only with its exact case.
    ("ReAction: turn right", "turn right"),
    ("Reaction: turn right", ""),
    # Lowercase or spaced markers are not markers: no action at all.
    ("action: turn left", ""),
    ("ACTION: turn left", ""),
    ("Action : turn left", ""),
    # No marker, empty reply, bare marker.
    ("turn left", ""),
    ("", ""),
    ("Action:", ""),
    ("Action:   \n", ""),
])
def test_parse_action_single_or_no_marker(reply, action):
    assert parse_action(reply) == (action, None)


@pytest.mark.parametrize("reply", [
    "Action: turn left\nAction: turn right",
    "Thought:\n...\n\nAction:\nget 1 oak logs\n\nAction:\ncraft 4 oak planks using 1 oak logs",
    "ReAction: x\nAction: y",  # one of them inside a word
])
def test_parse_action_two_markers_is_refused(reply):
    assert parse_action(reply) == (None, TOO_MANY_ACTIONS)


@pytest.mark.parametrize("reply,action", [
    # Markers are matched left to right without overlap, and a match runs to the end of its
    # line: a second marker on the same line is part of the first one's action, not a second
    # match (its colon is then filtered out) ...
    ("Action: toggle Action: drop", "toggle Action drop"),
    ("Action:Action:", "Action"),
    # ... and so is a marker on the line a bare marker's whitespace runs on to.
    ("Action:\nAction: turn left", "Action turn left"),
])
def test_parse_action_markers_swallowed_by_the_first(reply, action):
    assert parse_action(reply) == (action, None)


def test_too_many_actions_text():
    assert TOO_MANY_ACTIONS == ("Error: Only one 'Action' is allowed per response. "
                                "Please adjust your response.")


# --- SciWorld ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reply,action", [
    ("Thought:\nlook first\n\nAction:\nlook around", "look around"),
    ("Action: open door to kitchen", "open door to kitchen"),
    # The LAST marker wins; two markers are no error here.
    ("Action: look around\nAction: focus on thermometer", "focus on thermometer"),
    # Everything after it, over several lines, unfiltered (punctuation and case kept).
    ("Action: pour cup\ninto sink.\n ", "pour cup\ninto sink."),
    ("Action:  Move To Kitchen's door-1 ", "Move To Kitchen's door-1"),
    # Inside a word counts; lowercase does not.
    ("ReAction: wait", "wait"),
    ("action: wait", ""),
    ("wait", ""),
    ("", ""),
    ("Action:", ""),
])
def test_parse_sciworld_action(reply, action):
    assert parse_sciworld_action(reply) == action


# --- the generic action_line (rl_tpu's own envs) -----------------------------------------------


@pytest.mark.parametrize("text,line", [
    # AgentGym's answer format: the action on the line after a bare marker.
    ("Thought:\nI need wood first.\n\nAction:\nget 1 oak logs", "get 1 oak logs"),
    ("Action:\n\n  go to red ball 1  \nmore thoughts", "go to red ball 1"),
    ("Action: get 1 oak logs", "get 1 oak logs"),
    ("action: turn left", "turn left"),  # rl_tpu's own envs accept any case
    ("Action: turn left\nthinking more...\nAction: turn right", "turn right"),
    # The last marker wins, whether its action is on its line or the next.
    ("Action: turn left\nAction:\nturn right", "turn right"),
    ("Action:\nturn left\nAction: turn right", "turn right"),
    # A bare marker with nothing after it names no action.
    ("Action:", ""),
    ("turn left\nAction:", ""),
    # No marker: the last non-empty line, so a bare command works.
    ("I will turn.\nturn left\n\n", "turn left"),
])
def test_action_line(text, line):
    assert action_line(text) == line


@pytest.mark.parametrize("text", [None, 42, "", "  \n\n "])
def test_action_line_without_text(text):
    assert action_line(text) is None
