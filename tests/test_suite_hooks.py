"""The test run's own machinery (tests/conftest.py): real SGLang's tests carry their marker, and
go last in collection order so that the tests of rl_tpu's own server run during the venv
install."""

import os
import sys

import pytest

from suite_order import sglang_venv_tests_last

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout"))
from sglang_server import ensure_sglang_venv  # noqa: E402


class _Item:
    def __init__(self, name, marked):
        self.name, self.marked = name, marked

    def get_closest_marker(self, name):
        return object() if name == "sglang_venv" and self.marked else None


def test_marked_tests_go_last_and_both_sides_keep_their_order():
    items = [_Item("a", True), _Item("b", False), _Item("c", True), _Item("d", False)]
    assert sglang_venv_tests_last(items)
    assert [i.name for i in items] == ["b", "d", "a", "c"]
    unmarked = [_Item("x", False), _Item("y", False)]
    assert not sglang_venv_tests_last(unmarked)
    assert [i.name for i in unmarked] == ["x", "y"]


def test_a_test_without_the_marker_cannot_start_real_sglang():
    # refused before the venv is looked at: nothing is installed or started
    with pytest.raises(RuntimeError, match="test_a_test_without_the_marker.*sglang_venv"):
        ensure_sglang_venv()

