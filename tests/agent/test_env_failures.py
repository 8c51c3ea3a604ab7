"""Runs whose episodes all fail (rl_tpu/agent/env_failures.py): the warning, the stop after
env.max_failed_steps, W/env_errors.log with each error kind's traceback once."""

import importlib
import logging
import os
import sys

import pytest

from rl_tpu.agent.env_failures import EnvFailuresError, EnvFailureWatch, error_kind
from rl_tpu.agent.evaluation import evaluate
from rl_tpu.core.env import make, register
from rl_tpu.envs.evens import EvensEnv
from rl_tpu.envs.largest import LargestEnv
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes import rl
from rl_tpu.rollout.scripted import ScriptedEngine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DownServer(RuntimeError):
    pass


def _refuse(task):
    raise DownServer(f"the env server is down (task {task.task_id})")


@register("test_reset_fails_largest")
class ResetFailsLargest(LargestEnv):
    """The quickstart's env whose every reset fails, as a dead env server's would."""

    def reset(self, task):
        _refuse(task)


@register("test_reset_fails_evens")
class ResetFailsEvens(EvensEnv):
    def reset(self, task):
        _refuse(task)


def _failing_run_config(steps: int, max_failed_steps: int):
    sys.path.insert(0, REPO)
    try:
        c = importlib.import_module("configs.quickstart").get_config("smoke")
    finally:
        sys.path.remove(REPO)
    c.env.name, c.env.kwargs = "test_reset_fails_largest", {}
    c.sft.steps = 0  # no warm start: straight to the eval at step 0, then RL
    c.train.steps, c.env.max_failed_steps = steps, max_failed_steps
    c.eval.every = steps
    c.checkpoint.every = steps
    return c


def test_a_run_whose_episodes_all_fail_stops_naming_the_first_error(tmp_path, caplog):
    """env.max_failed_steps=1: step 1's rollout fails everywhere, the run stops there (no
    update), naming the error; the eval at step 0 warned first; the traceback is in the
    workdir once, though every episode of the eval and the step failed the same way."""
    c = _failing_run_config(steps=4, max_failed_steps=1)
    with caplog.at_level(logging.WARNING), \
            pytest.raises(EnvFailuresError) as raised:
        rl.run(c, str(tmp_path))
    message = str(raised.value)
    assert "\n" not in message
    assert "every episode of step 1 ended in an env error" in message
    assert "DownServer: the env server is down" in message
    assert str(tmp_path / "env_errors.log") in message
    assert f"eval at step 0: all {c.eval.num_tasks} episodes ended in an env error" \
        in caplog.text
    log_text = (tmp_path / "env_errors.log").read_text()
    assert log_text.count("=== step") == 1  # one kind, logged when first seen (step 0's eval)
    assert log_text.startswith("=== step 0: make_env/reset/conversation_start: DownServer")
    assert "Traceback (most recent call last)" in log_text and "in _refuse" in log_text
    assert not (tmp_path / rl.FINISHED_FILE).exists()


def test_a_short_run_that_never_played_fails_at_its_last_step(tmp_path):
    """Fewer steps than env.max_failed_steps (a smoke run): still no exit 0 having played no
    episode; the stop comes at the last step."""
    c = _failing_run_config(steps=1, max_failed_steps=3)
    with pytest.raises(EnvFailuresError, match="every episode of step 1 ended in an env error"):
        rl.run(c, str(tmp_path))


def test_max_failed_steps_zero_never_stops_and_must_be_an_int():
    watch = EnvFailureWatch("/nonexistent", max_failed_steps=0)
    for step in range(1, 5):
        watch.observe(step, [], episodes=8, errors=8)
        watch.stop_if_failing(step, last=step == 4)
    c = _failing_run_config(steps=1, max_failed_steps=3)
    c.env.max_failed_steps = -1
    with pytest.raises(ValueError, match="env.max_failed_steps=-1"):
        rl.check(c)


def test_steps_in_a_row_count_and_a_step_that_played_resets_them(tmp_path, caplog):
    """The counts are every host's sums: the same decision on each, even on a host whose own
    episodes all played (its message then says the first error was elsewhere)."""
    watch = EnvFailureWatch(str(tmp_path), max_failed_steps=2)
    with caplog.at_level(logging.WARNING):
        watch.observe(1, [], episodes=8, errors=8)
    assert "step 1: all 8 episodes ended in an env error, the first: (on another host)" \
        in caplog.text
    watch.stop_if_failing(1)
    watch.observe(2, [], episodes=8, errors=7)  # one episode played: the streak ends
    watch.stop_if_failing(2, last=True)  # and the run had played: its last step passes
    watch.observe(3, [], episodes=8, errors=8)
    watch.stop_if_failing(3)
    watch.observe(4, [], episodes=8, errors=8, eval_=True)  # an eval only warns
    watch.stop_if_failing(4)
    watch.observe(5, [], episodes=8, errors=8)
    with pytest.raises(EnvFailuresError, match="every episode of steps 4-5 ended"):
        watch.stop_if_failing(5)


def test_error_kinds_blank_numbers():
    assert error_kind("step (turn 3): timed out after 60 s") == \
        error_kind("step (turn 7): timed out after 60 s") == "step (turn N): timed out after N s"
    assert error_kind("make_env/reset/conversation_start: KeyError: 'x'") != \
        error_kind("make_env/reset/conversation_start: ValueError: bad")


def _evens_eval(tmp_path, failures=None):
    tok = ChatTokenizer(build_tokenizer(512))
    tasks = [make("evens").tasks().get("eval", i) for i in range(3)]
    return evaluate(ScriptedEngine(tok, lambda prompt, turn: "2"),
                    lambda: make("test_reset_fails_evens"), tasks, tokenizer=tok,
                    max_turns=1, max_new_tokens=4, max_context_tokens=128,
                    failures=failures, step=6)


def test_an_eval_whose_episodes_all_fail_warns(tmp_path, caplog):
    """launch.eval's path (no run watch) warns too, with the count and the first error; with
    a run's watch the eval is named by its step and its errors logged."""
    with caplog.at_level(logging.WARNING):
        out = _evens_eval(tmp_path)
    assert out["env_errors"] == out["num_tasks"] == 3
    assert ("eval: all 3 episodes ended in an env error, the first: make_env/reset/"
            "conversation_start: DownServer: the env server is down") in caplog.text
    caplog.clear()
    watch = EnvFailureWatch(str(tmp_path), max_failed_steps=1)
    with caplog.at_level(logging.WARNING):
        _evens_eval(tmp_path, failures=watch)
    assert "eval at step 6: all 3 episodes ended in an env error" in caplog.text
    watch.stop_if_failing(6, last=True)  # an eval alone never stops a run
    assert "=== step 6: make_env/reset/conversation_start: DownServer" in \
        (tmp_path / "env_errors.log").read_text()


def test_the_launchers_print_the_stop_in_one_line(monkeypatch, capsys):
    """launch.train and the other launchers: EnvFailuresError is one of their run errors, so
    the stop is one line on stderr and exit status 2, not a traceback."""
    from launch import DEBUG_ENV, one_line_errors, run_errors

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    watch = EnvFailureWatch("/w", max_failed_steps=1)
    watch.observe(1, [], episodes=4, errors=4)
    with pytest.raises(SystemExit) as exited:
        one_line_errors(run_errors(), lambda argv: watch.stop_if_failing(1), [])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: every episode of step 1 ended in an env error")
