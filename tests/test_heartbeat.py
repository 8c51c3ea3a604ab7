"""Heartbeat (rl_tpu/heartbeat.py): a line every `every_s` seconds while a phase runs, none
for a phase shorter than that, and it stops with the phase, however the phase ends."""

import io
import re
import threading
import time

import pytest

from rl_tpu.heartbeat import Heartbeat


def test_a_long_phase_prints_a_line_every_interval_and_stops_with_it():
    out = io.StringIO()
    with Heartbeat("warm-up", every_s=0.05, out=out, detail=lambda: "3 programs") as beat:
        time.sleep(0.32)
    lines = out.getvalue().splitlines()
    assert 3 <= len(lines) <= 7, lines  # ~6 on an idle machine; a busy one beats late
    assert all(re.fullmatch(r"warm-up, \d+ s, 3 programs", line) for line in lines), lines
    assert lines == beat.lines
    time.sleep(0.15)
    assert len(out.getvalue().splitlines()) == len(lines)  # nothing after the phase
    assert not any(t.name == "heartbeat" for t in threading.enumerate())


def test_a_short_phase_or_another_process_prints_nothing():
    out = io.StringIO()
    with Heartbeat("eval", every_s=5.0, out=out):
        pass
    with Heartbeat("eval", every_s=0.01, out=out, enabled=False):
        time.sleep(0.05)
    assert out.getvalue() == ""


def test_a_phase_that_raises_stops_the_lines_and_a_broken_detail_is_left_out():
    out = io.StringIO()
    with pytest.raises(KeyError):
        with Heartbeat("eval", every_s=0.02, out=out, detail=lambda: {}["x"]):
            time.sleep(0.07)
            raise KeyError("the phase's own error")
    lines = out.getvalue().splitlines()
    assert lines and all(re.fullmatch(r"eval, \d+ s", line) for line in lines), lines
    assert not any(t.name == "heartbeat" for t in threading.enumerate())
