"""A code env on a machine without bubblewrap: the launcher's last word is one line naming the
override (--config.env.kwargs.sandbox=unsafe_no_isolation) and why it is unsafe, exit 2."""

import pytest

import launch
from rl_tpu.core.env import make
from rl_tpu.sandbox import sandbox_unavailable_reason


@pytest.fixture
def no_bwrap_on_path(tmp_path, monkeypatch):
    """PATH without bwrap, and the sandbox's availability check asked afresh (it caches its
    answer for the process), before and after."""
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox_unavailable_reason.cache_clear()
    yield
    monkeypatch.undo()
    sandbox_unavailable_reason.cache_clear()


def test_a_code_env_without_bubblewrap_ends_the_run_in_one_line_naming_the_override(
        no_bwrap_on_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch.one_line_errors(launch.run_errors(), lambda argv: make("code"), ["train"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "the `bwrap` binary is not on PATH" in lines[0]
    assert "--config.env.kwargs.sandbox=unsafe_no_isolation" in lines[0]
    assert "unsafe" in lines[0] and "read and write this machine's files" in lines[0]
    assert 'mode="unsafe_no_isolation"' not in lines[0]  # the Python API is not the fix here
