"""The pool from outside: many callers at once, close() leaving nothing behind, the unsafe
mode, and what make_sandbox says where bubblewrap cannot work."""

import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from sandbox_host_view import descendants, living, needs_bubblewrap, serves_correctly

from rl_tpu.sandbox import Limits, SandboxUnavailable, bubblewrap, make_sandbox


def bwrap_processes_below_us():
    found = set()
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() == "bwrap" and living(pid):
                    found.add(pid)
        except OSError:
            continue
    return found


def wait_until(condition, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@needs_bubblewrap
def test_close_leaves_no_bwrap_process_behind():
    before = bwrap_processes_below_us()
    sandbox = make_sandbox("bubblewrap", pool_size=3)
    serves_correctly(sandbox)
    # Three pooled sandboxes (bwrap and its init each) and one running a sleeper when closed.
    assert wait_until(lambda: len(bwrap_processes_below_us() - before) >= 6)
    results = []
    sleeper = threading.Thread(target=lambda: results.append(
        sandbox.run("import time\nprint('up', flush=True)\ntime.sleep(60)\n",
                    limits=Limits(wall_seconds=60))))
    sleeper.start()
    assert wait_until(lambda: len(bwrap_processes_below_us() - before) >= 8)
    ours = bwrap_processes_below_us() - before
    sandbox.close()
    sleeper.join(timeout=30)
    assert not sleeper.is_alive() and results[0].status == "killed"
    assert [pid for pid in ours if living(pid)] == []
    with pytest.raises(RuntimeError, match="closed"):
        sandbox.run("print(1)")
    sandbox.close()  # twice is fine


@needs_bubblewrap
def test_four_threads_at_once_all_get_their_own_right_answers():
    failures = []

    def caller(index):
        for round_ in range(5):
            number = index * 100 + round_
            execution = sandbox.run("import sys\nn = int(sys.stdin.read())\nprint(n * n)\n",
                                    stdin=str(number))
            if (execution.status, execution.stdout) != ("ok", f"{number * number}\n"):
                failures.append((number, execution))

    with make_sandbox("bubblewrap", pool_size=2) as sandbox:
        threads = [threading.Thread(target=caller, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert failures == [] and not any(thread.is_alive() for thread in threads)
        serves_correctly(sandbox)


@needs_bubblewrap
def test_a_pool_of_none_starts_a_sandbox_per_run():
    with make_sandbox("bubblewrap", pool_size=0) as sandbox:
        serves_correctly(sandbox)
        execution = sandbox.run("import sys\nsys.exit(7)\n")
        assert (execution.status, execution.exit_code) == ("error", 7)
        serves_correctly(sandbox)


def test_the_unsafe_mode_warns_and_runs_under_the_limits(caplog):
    with caplog.at_level(logging.WARNING, logger="rl_tpu.sandbox"):
        sandbox = make_sandbox("unsafe_no_isolation", pool_size=1)
    assert "unsafe_no_isolation" in caplog.text and "rlimits only" in caplog.text
    with sandbox:
        serves_correctly(sandbox)
        execution = sandbox.run("import os\nprint(os.getcwd())\nopen('here', 'w').write('x')\n")
        assert execution.ok and "rl_tpu-unsafe-sandbox-" in execution.stdout
        assert not os.path.exists(execution.stdout.strip())  # its temporary cwd is gone
        limits = Limits(cpu_seconds=1, wall_seconds=1, output_bytes=100)
        assert sandbox.run("while True:\n    pass\n",
                           limits=Limits(cpu_seconds=1, wall_seconds=30)).status == "cpu_limit"
        assert sandbox.run("import time\ntime.sleep(60)\n", limits=limits).status == "timeout"
        execution = sandbox.run("print('x' * 1000)\n", limits=limits)
        assert (execution.status, execution.stdout) == ("output_limit", "x" * 100)
        assert sandbox.run("x = bytearray(2**40)\n").status == "memory_limit"
        serves_correctly(sandbox)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unsafe_no_isolation"):
        make_sandbox("docker")
    with pytest.raises(ValueError, match="pool_size"):
        make_sandbox("unsafe_no_isolation", pool_size=-1)


def test_where_bubblewrap_cannot_work_make_sandbox_names_the_fix(monkeypatch):
    monkeypatch.setattr(bubblewrap, "sandbox_unavailable_reason", lambda: "no user namespaces")
    with pytest.raises(SandboxUnavailable) as raised:
        make_sandbox("bubblewrap")
    message = str(raised.value)
    assert "no user namespaces" in message and "apt-get install bubblewrap" in message
    assert "unsafe_no_isolation" in message


def test_a_missing_bwrap_binary_is_the_reason_given(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    reason = bubblewrap.sandbox_unavailable_reason.__wrapped__()  # past the per-process cache
    assert reason == "the `bwrap` binary is not on PATH"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the `bwrap` binary is not on PATH")
def test_a_bwrap_too_old_for_disable_userns_is_the_reason_given(monkeypatch):
    assert len(bubblewrap.bubblewrap_version()) == 3  # this machine's, e.g. (0, 8, 0)
    monkeypatch.setattr(bubblewrap, "bubblewrap_version", lambda: (0, 6, 1))
    reason = bubblewrap.sandbox_unavailable_reason.__wrapped__()
    assert reason == "bwrap 0.6.1 is older than 0.8.0 (needed for --disable-userns)"


REAPER_SCRIPT = """
import ctypes, os, sys
sys.path.insert(0, sys.argv[1])
# PR_SET_CHILD_SUBREAPER (36): orphans below this process become its children, as they do for
# pid 1 of a container without an init; bwrap leaves its init to exactly that.
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
from rl_tpu.sandbox import Limits, make_sandbox, sandbox_unavailable_reason
assert sandbox_unavailable_reason() is None
with make_sandbox(pool_size=2) as sandbox:
    statuses = [sandbox.run("print(1)").status for _ in range(3)]
    statuses.append(sandbox.run("import time; time.sleep(60)",
                                limits=Limits(wall_seconds=1)).status)
children = []
for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        continue
    if int(fields[1]) == os.getpid():
        children.append(fields[0])  # the state: "Z" for an unreaped zombie
print(statuses, children)
"""


@needs_bubblewrap
def test_where_this_process_inherits_the_orphans_it_reaps_every_sandboxs_init():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", REAPER_SCRIPT, root], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['ok', 'ok', 'ok', 'timeout'] []\n"
