"""Hostile programs: each ends within its limit with the right status, the host is unchanged
afterwards (files, processes, listeners), and the pool answers correctly right after."""

import os
import signal
import socket
import subprocess
import threading
import uuid

from sandbox_host_view import (BOUND_SECONDS, HOSTILE, living, living_in_namespace,
                               needs_bubblewrap, serves_correctly)

from rl_tpu.sandbox import Limits

pytestmark = needs_bubblewrap
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# First line of every hostile program: its pid namespace, for the host to look for leftovers.
SAY_NAMESPACE = "import os\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\n"


def namespace_of(execution):
    namespace = execution.stdout.splitlines()[0]
    assert namespace.startswith("pid:[") and namespace != os.readlink("/proc/self/ns/pid")
    return namespace


def test_a_fork_bomb_is_capped_ended_at_the_wall_limit_and_leaves_nothing(sandbox):
    bomb = SAY_NAMESPACE + ("while True:\n    try:\n        os.fork()\n"
                            "    except OSError:\n        pass\n")
    execution = sandbox.run(bomb, limits=HOSTILE)
    assert execution.status == "timeout" and execution.exit_code is None
    assert execution.seconds < BOUND_SECONDS
    assert living_in_namespace(namespace_of(execution)) == []
    serves_correctly(sandbox)


def test_the_process_limit_counts_the_program_and_its_children(sandbox):
    # processes=8: the program plus 7 children; the 8th fork fails with EAGAIN.
    forks = ("import os, time\nborn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
             "            time.sleep(60)\n            os._exit(0)\n        born += 1\n"
             "except BlockingIOError:\n    print(born)\n")
    execution = sandbox.run(forks, limits=Limits(processes=8))
    assert (execution.status, execution.stdout) == ("ok", "7\n")
    serves_correctly(sandbox)


def test_an_infinite_loop_ends_at_the_cpu_limit(sandbox):
    execution = sandbox.run("while True:\n    pass\n",
                            limits=Limits(cpu_seconds=1, wall_seconds=BOUND_SECONDS))
    assert execution.status == "cpu_limit" and execution.exit_code is None
    assert execution.seconds < BOUND_SECONDS
    serves_correctly(sandbox)


def test_a_sleeper_ends_at_the_wall_limit(sandbox):
    execution = sandbox.run("import time\ntime.sleep(120)\n", limits=Limits(wall_seconds=1))
    assert execution.status == "timeout" and 1.0 <= execution.seconds < 10.0
    serves_correctly(sandbox)


def test_a_memory_hog_ends_at_the_memory_limit(sandbox):
    hog = "hoard = []\nwhile True:\n    hoard.append(bytearray(2**24))\n"
    execution = sandbox.run(hog, limits=HOSTILE)
    assert execution.status == "memory_limit" and execution.exit_code == 1
    assert execution.stderr.rstrip().endswith("MemoryError")
    assert execution.seconds < BOUND_SECONDS
    serves_correctly(sandbox)


def test_the_network_is_unreachable_even_the_hosts_loopback(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        probe = ("import socket\nfor address in [('127.0.0.1', %d), ('1.1.1.1', 53), "
                 "('8.8.8.8', 443)]:\n    try:\n        socket.create_connection(address, "
                 "timeout=1).close()\n        print('reached', address)\n"
                 "    except OSError as error:\n        print('refused', error.errno)\n") % port
        execution = sandbox.run(probe, limits=HOSTILE)
        assert execution.status == "ok" and "reached" not in execution.stdout
        assert execution.stdout.count("refused") == 3
        try:
            listener.accept()
            raise AssertionError("the sandbox reached the host's listener")
        except BlockingIOError:
            pass
    serves_correctly(sandbox)


def test_writes_outside_the_sandboxs_tmpfs_fail_and_the_host_is_unchanged(sandbox, tmp_path):
    name = f"sandbox_escape_{uuid.uuid4().hex}"
    targets = [os.path.join(REPO, name), f"/usr/{name}", f"/usr/lib/{name}", f"/etc/{name}",
               f"/root/{name}", f"/home/{name}", f"/{name}", f"/dev/{name}", str(tmp_path / name)]
    probe = ("import sys\nfor path in sys.stdin.read().split():\n    try:\n"
             "        open(path, 'w').write('x')\n        print('wrote', path)\n"
             "    except OSError:\n        print('failed', path)\n"
             "open('/tmp/%s', 'w').write('inside')\nprint(open('/tmp/%s').read())\n") % (name, name)
    execution = sandbox.run(probe, stdin="\n".join(targets), limits=HOSTILE)
    assert execution.status == "ok"
    assert execution.stdout.splitlines() == [f"failed {path}" for path in targets] + ["inside"]
    for path in targets + [f"/tmp/{name}"]:  # the sandbox's own /tmp is not the host's
        assert not os.path.exists(path), path
    serves_correctly(sandbox)


def test_host_files_cannot_be_read(sandbox):
    secrets = [os.path.join(REPO, "setup.py"), os.path.join(REPO, "rl_tpu", "__init__.py"),
               "/etc/shadow", "/etc/passwd", "/root/.bashrc"]
    probe = ("import os, sys\nfor path in sys.stdin.read().split():\n    try:\n"
             "        open(path, 'rb').read()\n        print('read', path)\n"
             "    except OSError:\n        print('failed', path)\n"
             "for directory in ['/root', '/home', '/etc', %r]:\n    print(directory, "
             "os.path.exists(directory))\n"
             "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
             "\nprint(sorted(os.listdir('/')))\n") % REPO
    execution = sandbox.run(probe, stdin="\n".join(secrets), limits=HOSTILE)
    assert execution.status == "ok"
    lines = execution.stdout.splitlines()
    assert lines[:len(secrets)] == [f"failed {path}" for path in secrets]
    assert lines[len(secrets):-2] == ["/root False", "/home False", "/etc False", f"{REPO} False"]
    assert lines[-2] == "[1, 2]"  # the only processes in sight: bwrap's init and the program
    visible = set(eval(lines[-1]))  # noqa: S307 -- our own program's printed list
    assert {"usr", "tmp", "proc", "dev"} <= visible
    assert visible <= {"usr", "tmp", "proc", "dev", "bin", "sbin", "lib", "lib64", "lib32"}
    serves_correctly(sandbox)


def test_killing_the_parent_the_host_or_everything_reaches_nothing_outside(sandbox):
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        probe = SAY_NAMESPACE + (
            "import signal, sys\nhost_pids = [int(p) for p in sys.stdin.read().split()]\n"
            "for target in [os.getppid(), -1] + host_pids:\n    try:\n"
            "        os.kill(target, signal.SIGKILL)\n    except OSError:\n        pass\n"
            "print('survived')\n")
        execution = sandbox.run(probe, stdin=f"{os.getpid()} {bystander.pid} 1",
                                limits=HOSTILE)
        # os.kill(getppid()) targets the sandbox's own pid 1, which ignores it; kill(-1) only
        # reaches the sandbox's processes; the host's pids do not exist in its namespace.
        assert execution.status == "ok" and execution.stdout.splitlines()[1:] == ["survived"]
        assert living(bystander.pid) and living(1)
        assert living_in_namespace(namespace_of(execution)) == []
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()
    serves_correctly(sandbox)


def test_huge_output_is_cut_at_the_limit_and_ends_the_run(sandbox):
    for stream in ("sys.stdout", "sys.stderr"):
        flood = f"import sys\nwhile True:\n    {stream}.write('x' * 1000)\n"
        execution = sandbox.run(flood, limits=HOSTILE)
        assert execution.status == "output_limit" and execution.exit_code is None
        flooded = execution.stdout if stream == "sys.stdout" else execution.stderr
        assert flooded == "x" * HOSTILE.output_bytes
        assert execution.seconds < BOUND_SECONDS
    serves_correctly(sandbox)


def test_filling_the_tmpfs_fails_at_its_size(sandbox):
    fill = ("written = 0\ntry:\n    with open('fill', 'wb') as out:\n        while True:\n"
            "            out.write(bytes(2**20))\n            out.flush()\n"
            "            written += 1\nexcept OSError as error:\n    print(error.errno, written)\n")
    execution = sandbox.run(fill, limits=Limits(tmpfs_bytes=4 * 2**20))
    errno_number, megabytes = execution.stdout.split()
    # ENOSPC (28) after at most the tmpfs's 4 MiB (the last buffered MiB may not fit).
    assert execution.status == "ok" and errno_number == "28" and int(megabytes) <= 4
    serves_correctly(sandbox)


def test_no_user_namespace_inside_and_no_stray_fds(sandbox):
    # A user namespace of its own would make the program root enough to mount a tmpfs of no
    # size. unshare(CLONE_NEWUSER = 0x10000000) fails with ENOSPC (28): the sandbox's limit of
    # user namespaces is 0. Open fds: 0, 1, 2, the launcher's status pipe, and listdir's own.
    probe = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "print(libc.unshare(0x10000000), ctypes.get_errno())\n"
             "fds = sorted(map(int, os.listdir('/proc/self/fd')))\nprint(fds[:3], len(fds))\n")
    execution = sandbox.run(probe, limits=HOSTILE)
    assert execution.stdout == "-1 28\n[0, 1, 2] 5\n"
    serves_correctly(sandbox)


def test_a_program_flooding_the_status_pipe_holds_no_host_memory(sandbox):
    # The launcher's status fd is the one besides 0-2 (the host reads at most 4 KiB of it).
    flood = ("import os\nstatus = max(int(fd) for fd in os.listdir('/proc/self/fd') "
             "if int(fd) > 2 and os.path.exists('/proc/self/fd/' + fd))\n"
             "while True:\n    os.write(status, b'memory\\n' * 1000)\n")
    execution = sandbox.run(flood, limits=Limits(wall_seconds=1))
    assert execution.status == "timeout" and execution.seconds < BOUND_SECONDS
    serves_correctly(sandbox)


def test_each_sandbox_has_its_own_process_count(sandbox):
    # Two sandboxes at once, each holding its 8 processes for 3 s: both still get 7 children,
    # since the count is per user namespace (on kernels before 5.14, one per uid, this fails).
    forks = ("import os, time\nborn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
             "            time.sleep(6)\n            os._exit(0)\n        born += 1\n"
             "except BlockingIOError:\n    print(born, flush=True)\ntime.sleep(3)\n")
    results = []
    limits = Limits(processes=8, wall_seconds=20)
    callers = [threading.Thread(target=lambda: results.append(sandbox.run(forks, limits=limits)))
               for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert [(execution.status, execution.stdout) for execution in results] == [("ok", "7\n")] * 2
    serves_correctly(sandbox)
