"""One trainer per workdir: a second process on a held workdir is refused naming the holder,
a killed holder (kill -9) leaves no stale lock, and a launcher refused so stops in one line
before it writes anything."""

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from multihost import start_job, wait_job
from rl_tpu.persistence import workdir_lock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOLDER = """
import sys, time
from rl_tpu.persistence import workdir_lock
with workdir_lock.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A real process holding tmp_path/run's lock (until the test kills it)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "run")], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_second_process_is_refused_and_a_killed_holder_leaves_no_stale_lock(tmp_path, holder):
    workdir = str(tmp_path / "run")
    with pytest.raises(workdir_lock.WorkdirLockedError) as refused:
        with workdir_lock.hold(workdir):
            pytest.fail("two holders of one workdir")
    message = str(refused.value)
    assert message.startswith(f"workdir {workdir} is in use by another trainer (pid "
                              f"{holder.pid} on {socket.gethostname()}, since ")
    assert "\n" not in message
    os.kill(holder.pid, signal.SIGKILL)  # pre-emption without notice: the kernel drops the lock
    holder.wait(timeout=30)
    with workdir_lock.hold(workdir):
        with open(os.path.join(workdir, workdir_lock.LOCK_FILE)) as f:
            assert f.read().startswith(f"pid {os.getpid()} on ")
    with open(os.path.join(workdir, workdir_lock.LOCK_FILE)) as f:
        assert f.read() == ""  # released cleanly: emptied


def test_holds_nest_within_a_process_and_the_outermost_releases(tmp_path):
    """A launcher's hold and a recipe's inside it share one lock, released with the outer
    one."""
    workdir = str(tmp_path / "run")
    with workdir_lock.hold(workdir):
        with workdir_lock.hold(workdir):
            pass
        assert _taken_elsewhere(workdir)  # still held by the outer one
    assert not _taken_elsewhere(workdir)


def _taken_elsewhere(workdir) -> bool:
    """Whether a flock on a file of its own (as another process's would be) is refused."""
    with open(os.path.join(workdir, workdir_lock.LOCK_FILE)) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_a_trainer_on_a_held_workdir_stops_in_one_line_writing_nothing(tmp_path, holder):
    workdir = tmp_path / "run"
    before = sorted(os.listdir(workdir))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
         "--workdir", str(workdir)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert f"workdir {workdir} is in use by another trainer (pid {holder.pid} on " in lines[0]
    assert sorted(os.listdir(workdir)) == before  # no metrics, no checkpoints


JOB_HOLDER = """
import os, sys, time
from rl_tpu.persistence import workdir_lock
workdir, release = sys.argv[1:]
try:
    with workdir_lock.hold(workdir):
        print("held", flush=True)
        deadline = time.time() + 120
        while not os.path.exists(release) and time.time() < deadline:
            time.sleep(0.05)
except workdir_lock.WorkdirLockedError as e:
    print(f"refused: {e}", flush=True)
    sys.exit(3)
"""


def _logs(log_dir, processes=2):
    out = []
    for i in range(processes):
        path = os.path.join(log_dir, f"process{i}.log")
        out.append(open(path).read() if os.path.exists(path) else "")
    return out


@pytest.mark.slow
def test_the_hosts_of_one_run_share_the_lock_and_a_second_run_is_refused_on_every_host(
        tmp_path):
    """Two 2-process jobs on one workdir: the first run's hosts both hold it (only process 0
    takes the lock, so they do not refuse each other); the second run stops on both hosts,
    its process 0 naming the first run's process 0."""
    script = tmp_path / "hold.py"
    script.write_text(JOB_HOLDER)
    workdir, release = str(tmp_path / "run"), str(tmp_path / "release")
    first = start_job([str(script), workdir, release], 2, 0, str(tmp_path / "a"), module=None)
    try:
        deadline = time.time() + 120
        while not all("held" in log for log in _logs(tmp_path / "a")):
            assert all(p.poll() is None for p in first), _logs(tmp_path / "a")
            assert time.time() < deadline, _logs(tmp_path / "a")
            time.sleep(0.1)
        second = wait_job(start_job([str(script), workdir, release], 2, 0,
                                    str(tmp_path / "b"), module=None),
                          str(tmp_path / "b"), timeout_s=120)
    finally:
        open(release, "w").close()
    assert second.returncodes == [3, 3], second.tail()
    assert f"(pid {first[0].pid} on " in second.logs[0]
    assert "(process 0 of this run was refused it)" in second.logs[1]
    done = wait_job(first, str(tmp_path / "a"), timeout_s=60)
    assert done.ok, done.tail()
