"""Pre-emption: SIGTERM or SIGINT ends a run after the step in progress, with a checkpoint of
that step, on one process and on two; the rerun resumes there and repeats the uninterrupted
run number for number. A second signal exits at once."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from multihost import start_job, wait_job
from rl_tpu.metrics import read_metrics
from rl_tpu.persistence.preemption import PreemptionGuard, Preempted
from test_rl import (KILL_STEPS, REPO, _cpu_env, _final_params, _finite,  # noqa: F401
                     resumed_from, uninterrupted_run)  # the fixture, used by name

EVERY = 5  # checkpoints on schedule at 5, 10: a stop at any other step writes its own


def test_guard_records_the_signal_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread
        time.sleep(0.05)
        assert guard.should_stop()
        error = guard.preempted(7, "/w")
    assert signal.getsignal(signal.SIGTERM) is before
    assert isinstance(error, Preempted) and error.exit_code == 128 + signal.SIGTERM
    assert str(error) == ("stopped on SIGTERM after step 7, checkpointed in /w; rerun the "
                          "same command to resume from there")


def test_guards_nest_and_the_outermost_restores():
    before = signal.getsignal(signal.SIGINT)
    with PreemptionGuard():
        installed = signal.getsignal(signal.SIGINT)
        with PreemptionGuard() as inner:
            assert signal.getsignal(signal.SIGINT) is installed
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is installed  # still the outer guard's
        assert inner.should_stop()  # seen by every guard
    assert signal.getsignal(signal.SIGINT) is before
    assert not PreemptionGuard().should_stop()  # no guard: nothing recorded


def test_guard_off_the_main_thread_installs_nothing():
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def body():
        with PreemptionGuard() as guard:
            seen.append(signal.getsignal(signal.SIGINT))
            seen.append(guard.signum)
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before, None]


def _command(workdir):
    return [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
            "--workdir", str(workdir), f"--config.train.steps={KILL_STEPS}",
            f"--config.checkpoint.every={EVERY}", "--config.sft.steps=30"]


def _logged_steps(workdir) -> int:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((r["step"] for r in read_metrics(str(workdir))), default=0)


def _signal_after_step(procs, workdir, step, signum, timeout_s=300):
    """Sends `signum` (None: nothing, just wait) to procs[-1] once step `step` is in the
    metrics file (mid-run)."""
    deadline = time.time() + timeout_s
    while _logged_steps(workdir) < step:
        assert all(p.poll() is None for p in procs), "the run ended before the signal"
        assert time.time() < deadline, f"step {step} not logged after {timeout_s} s"
        time.sleep(0.02)
    if signum is not None:
        procs[-1].send_signal(signum)


def _sft_command(workdir):
    return [sys.executable, "-m", "launch.sft", "--config", "configs/quickstart.py:smoke",
            "--workdir", str(workdir), "--config.sft.steps=400", "--config.checkpoint.every=1000"]


def _stopped_at(log: str) -> int:
    found = re.findall(r"after step (\d+), checkpointed in", log)
    assert len(found) == 1, log[-3000:]
    return int(found[0])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [
    signal.SIGTERM,
    # SIGINT takes the same path (the guard tests above show its handler); in the multihost
    # set to keep CI's time
    pytest.param(signal.SIGINT, marks=pytest.mark.multihost)], ids=["TERM", "INT"])
def test_signal_checkpoints_the_step_and_the_rerun_repeats_the_run(tmp_path, signum,
                                                                   uninterrupted_run):
    workdir = tmp_path / "run"
    procs = start_job(_command(workdir)[3:], 1, 0, str(tmp_path / "logs"))
    _signal_after_step(procs, workdir, 2, signum)
    job = wait_job(procs, str(tmp_path / "logs"), timeout_s=300)
    assert job.returncodes == [128 + signum], job.tail()
    k = _stopped_at(job.logs[0])
    assert 2 <= k < KILL_STEPS
    assert (workdir / "checkpoints" / str(k)).is_dir()

    result = subprocess.run(_command(workdir), cwd=REPO, env=_cpu_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert resumed_from(result) == k
    a = [_finite(r) for r in read_metrics(str(uninterrupted_run))]
    b = [_finite(r) for r in read_metrics(str(workdir))]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra == rb, f"step {ra['step']} differs after the pre-emption"
    straight, resumed = _final_params(uninterrupted_run), _final_params(workdir)
    for key in straight:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


@pytest.mark.slow
def test_sft_stops_on_a_signal_with_a_checkpoint_and_resumes_there(tmp_path):
    """SFT (launch.sft; the loops' fine-tunes use the same hook) checkpoints the step it
    stopped after, off its checkpoint.every schedule, and the rerun resumes from it."""
    workdir = tmp_path / "run"
    procs = start_job(_sft_command(workdir)[3:], 1, 0, str(tmp_path / "logs"),
                      module="launch.sft")
    _signal_after_step(procs, workdir, 20, signal.SIGTERM)
    job = wait_job(procs, str(tmp_path / "logs"), timeout_s=300)
    assert job.returncodes == [128 + signal.SIGTERM], job.tail()
    k = _stopped_at(job.logs[0])
    assert 20 <= k < 400
    result = subprocess.run(_sft_command(workdir), cwd=REPO, env=_cpu_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r["step"] for r in read_metrics(str(workdir)) if "sft/loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 400, steps[-5:]


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tmp_path):
    """Each env step waits 2 s (env.step_latency_s; no warm start, whose demonstrations would
    wait too). Both signals land while step 2 plays its episodes (1 s and 1.5 s after step 1
    was logged): the run exits at the second, not at the step's end."""
    workdir = tmp_path / "run"
    args = _command(workdir)[3:] + ["--config.env.step_latency_s=2.0", "--config.sft.steps=0"]
    procs = start_job(args, 1, 0, str(tmp_path / "logs"))
    _signal_after_step(procs, workdir, 1, None)
    for _ in range(2):
        time.sleep(1.0 if _ == 0 else 0.5)
        procs[0].send_signal(signal.SIGTERM)
    job = wait_job(procs, str(tmp_path / "logs"), timeout_s=60)
    assert job.returncodes == [128 + signal.SIGTERM], job.tail()
    assert "again: exiting at once" in job.logs[0]
    assert "checkpointed in" not in job.logs[0]  # it did not wait for the step to end


@pytest.mark.slow
def test_two_processes_stop_at_the_same_step_when_one_is_signalled(tmp_path):
    """SIGTERM reaches process 1 only: both stop after the same step (agreed; on several
    processes JAX's pre-emption notifier takes the signal and names the step), that step's
    checkpoint is written, and the rerun on two processes resumes there and ends as an
    uninterrupted two-process run does, metric for metric and weight for weight."""
    workdir, logs = tmp_path / "run", str(tmp_path / "logs")
    straight = tmp_path / "straight"
    flags = ["--config.rollout.sampler_devices=1"]
    uninterrupted = start_job(_command(straight)[3:] + flags, 2, 2, str(tmp_path / "s"))
    args = _command(workdir)[3:] + flags
    procs = start_job(args, 2, 2, logs)
    _signal_after_step(procs, workdir, 2, signal.SIGTERM)
    job = wait_job(procs, logs, timeout_s=300)
    assert job.returncodes == [128 + signal.SIGTERM] * 2, job.tail()
    k0, k1 = _stopped_at(job.logs[0]), _stopped_at(job.logs[1])
    assert k0 == k1 and 2 <= k0 < KILL_STEPS
    assert (workdir / "checkpoints" / str(k0)).is_dir()

    again = wait_job(start_job(args, 2, 2, str(tmp_path / "rerun")), str(tmp_path / "rerun"),
                     timeout_s=600)
    assert again.ok, again.tail()
    for log in again.logs:
        assert re.findall(r"resumed from step (\d+)", log) == [str(k0)]
    steps = [r["step"] for r in read_metrics(str(workdir)) if "rollout/reward" in r]
    assert steps == list(range(1, KILL_STEPS + 1))
    done = wait_job(uninterrupted, str(tmp_path / "s"), timeout_s=600)
    assert done.ok, done.tail()
    assert [_finite(r) for r in read_metrics(str(straight))] == \
        [_finite(r) for r in read_metrics(str(workdir))]
    a, b = _final_params(straight), _final_params(workdir)
    for key in a:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)


def _warm_start_command(workdir):
    return [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
            "--workdir", str(workdir), "--config.train.steps=1", "--config.sft.steps=120",
            "--config.checkpoint.every=1000"]


@pytest.mark.slow
def test_a_signal_in_the_warm_start_checkpoints_its_step_and_the_rerun_resumes_there(tmp_path):
    """SIGTERM while the RL recipe's SFT warm start runs: the run stops after that SFT step
    (not after RL step 1), with the step in W/warm_start/checkpoints and no RL checkpoint; the
    rerun resumes the warm start there and ends as an uninterrupted run does, metric for metric
    (the SFT lines logged once each) and weight for weight."""
    straight = tmp_path / "straight"
    done = subprocess.run(_warm_start_command(straight), cwd=REPO, env=_cpu_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    workdir, logs = tmp_path / "run", str(tmp_path / "logs")
    procs = start_job(_warm_start_command(workdir)[3:], 1, 0, logs)
    deadline = time.time() + 300
    while not any("sft/loss" in r for r in (read_metrics(str(workdir)) if (
            workdir / "metrics.jsonl").exists() else [])):
        assert procs[0].poll() is None, "the run ended before the signal"
        assert time.time() < deadline, "no SFT step logged after 300 s"
        time.sleep(0.02)
    procs[0].send_signal(signal.SIGTERM)
    job = wait_job(procs, logs, timeout_s=300)
    assert job.returncodes == [128 + signal.SIGTERM], job.tail()
    k = _stopped_at(job.logs[0])
    assert 10 <= k < 120
    assert f"checkpointed in {workdir / 'warm_start' / 'checkpoints'};" in job.logs[0]
    assert (workdir / "warm_start" / "checkpoints" / str(k)).is_dir()
    assert not any(p.name.isdigit() for p in (workdir / "checkpoints").iterdir())

    result = subprocess.run(_warm_start_command(workdir), cwd=REPO, env=_cpu_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed the SFT warm start from its step {k}" in result.stdout
    a = [_finite(r) for r in read_metrics(str(straight))]
    b = [_finite(r) for r in read_metrics(str(workdir))]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra == rb, f"step {ra['step']} differs after the pre-emption"
    straight_params, resumed = _final_params(straight), _final_params(workdir)
    for key in straight_params:
        np.testing.assert_array_equal(resumed[key], straight_params[key], err_msg=key)
