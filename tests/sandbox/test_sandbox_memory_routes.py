"""Every route by which a program could hold host memory outside its RLIMIT_AS: each is refused
or stops at the bound docs/tools.md states (rl_tpu/sandbox/totals.py computes it). Each
program tries to hold MUCH more than the bound and prints what it got."""

import dataclasses

from sandbox_host_view import BOUND_SECONDS, needs_bubblewrap, serves_correctly

from rl_tpu.sandbox import Limits
from rl_tpu.sandbox.seccomp import LISTEN_BACKLOG_MAX
from rl_tpu.sandbox.totals import SCM_MAX_FD, SOCKET_BYTES, tmpfs_inodes

pytestmark = needs_bubblewrap
MiB = 2**20
ROUTE = Limits(wall_seconds=5.0, cpu_seconds=4.0, memory_bytes=256 * MiB, processes=8,
               output_bytes=4096, tmpfs_bytes=8 * MiB)
TARGET = 256 * MiB  # what each program tries to hold: far past every bound below


def held(execution) -> list[str]:
    assert execution.status == "ok", (execution.status, execution.stderr)
    assert execution.seconds < BOUND_SECONDS
    return execution.stdout.split()


def test_memfd_create_is_refused(sandbox):
    program = (f"import os\ntotal = 0\ntry:\n    fd = os.memfd_create('hoard')\n"
               f"    while total < {TARGET}:\n        total += os.write(fd, bytes({MiB}))\n"
               f"    print(total, 'none')\nexcept OSError as error:\n"
               f"    print(total, error.errno)\n")
    total, error = held(sandbox.run(program, limits=ROUTE))
    assert (int(total), error) == (0, "1"), "memfd_create must fail with EPERM, holding nothing"
    serves_correctly(sandbox)


def test_sysv_shared_memory_is_refused(sandbox):
    # shmget, shmat, fill, shmdt: the pages stay with the segment after the detach, outside
    # the address space RLIMIT_AS counts.
    program = (f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               f"libc.shmat.restype = ctypes.c_void_p\ntotal = 0\nerror = 'none'\n"
               f"while total < {TARGET}:\n"
               f"    segment = libc.shmget(0, {16 * MiB}, 0o1600)\n"
               f"    if segment < 0:\n        error = ctypes.get_errno()\n        break\n"
               f"    address = libc.shmat(segment, None, 0)\n"
               f"    ctypes.memset(address, 1, {16 * MiB})\n"
               f"    libc.shmdt(ctypes.c_void_p(address))\n    total += {16 * MiB}\n"
               f"print(total, error)\n")
    total, error = held(sandbox.run(program, limits=ROUTE))
    assert (int(total), error) == (0, "1"), "shmget must fail with EPERM, holding nothing"
    serves_correctly(sandbox)


def test_socketpair_buffers_stop_at_the_open_file_limit(sandbox):
    # Socketpairs until the fd limit, each filled until it would block after asking for an
    # 8 MiB send buffer (refused: the default stays).
    program = (f"import socket\npairs = []\nqueued = 0\nerror = 'none'\ngrown = 0\n"
               f"try:\n    while queued < {TARGET}:\n"
               f"        a, b = socket.socketpair()\n        pairs.append((a, b))\n"
               f"        try:\n            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, "
               f"{8 * MiB})\n            grown += 1\n        except OSError:\n            pass\n"
               f"        a.setblocking(False)\n        try:\n            while True:\n"
               f"                queued += a.send(bytes(65536))\n"
               f"        except BlockingIOError:\n            pass\n"
               f"except OSError as e:\n    error = e.errno\n"
               f"print(len(pairs), queued, grown, error)\n")
    pairs, queued, grown, error = held(sandbox.run(program, limits=ROUTE))
    assert error == "24", "socketpair must end at EMFILE (the open-file limit)"
    assert int(grown) == 0, "SO_SNDBUF must be refused"
    assert 2 * int(pairs) <= ROUTE.open_files
    assert int(queued) <= ROUTE.open_files * SOCKET_BYTES
    serves_correctly(sandbox)


def test_sockets_in_flight_stop_at_the_open_file_limit(sandbox):
    # Fill a socketpair, send both its ends over another socket, close them: in flight, in no
    # fd table, they keep what was queued. The kernel caps a uid's files in flight at the
    # sender's RLIMIT_NOFILE.
    program = ("import array, socket\na, b = socket.socketpair()\na.setblocking(False)\n"
               "sent = 0\nqueued = 0\nerror = 'none'\ntry:\n    while sent < 100000:\n"
               "        c, d = socket.socketpair()\n        c.setblocking(False)\n"
               "        try:\n            while True:\n"
               "                queued += c.send(bytes(65536))\n"
               "        except BlockingIOError:\n            pass\n"
               "        fds = array.array('i', [c.fileno(), d.fileno()])\n"
               "        a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])\n"
               "        c.close()\n        d.close()\n        sent += 2\n"
               "except OSError as e:\n    error = e.errno\nprint(sent, queued, error)\n")
    sent, queued, error = held(sandbox.run(program, limits=ROUTE))
    assert error == "109", "sending must end at ETOOMANYREFS (files in flight)"
    assert int(sent) <= ROUTE.open_files + SCM_MAX_FD
    assert int(queued) <= (int(sent) + 2) * SOCKET_BYTES
    serves_correctly(sandbox)


def test_a_listeners_queue_of_unaccepted_connections_is_capped(sandbox):
    # Connect, fill, close, again: each connection waits in the listener's queue with what its
    # client sent, after the client is gone (445 MiB through one listener at backlog 4096).
    program = (f"import os, socket\nlistener = socket.socket(socket.AF_UNIX)\n"
               f"listener.bind('/tmp/server')\ntry:\n    listener.listen(4096)\n"
               f"    print('listened')\nexcept OSError as error:\n    print(error.errno)\n"
               f"listener.listen(1)\nqueued = 0\nwaiting = 0\nerror = 'none'\n"
               f"try:\n    while queued < {TARGET}:\n"
               f"        client = socket.socket(socket.AF_UNIX)\n"
               f"        client.setblocking(False)\n"
               f"        client.connect('/tmp/server')\n        waiting += 1\n        try:\n"
               f"            while True:\n                queued += client.send(bytes(65536))\n"
               f"        except BlockingIOError:\n            pass\n        client.close()\n"
               f"except OSError as e:\n    error = e.errno\nprint(waiting, queued, error)\n")
    refused, waiting, queued, error = held(sandbox.run(program, limits=ROUTE))
    assert refused == "1", "listen(4096) must fail with EPERM"
    assert error == "11", "connecting must end at EAGAIN once the backlog is full"
    assert int(waiting) <= LISTEN_BACKLOG_MAX + 1
    assert int(queued) <= int(waiting) * SOCKET_BYTES
    serves_correctly(sandbox)


def test_sockets_other_than_unix_streams_are_refused(sandbox):
    # A TCP connection over the sandbox's own loopback autotunes its buffers to megabytes.
    # An unbound unix datagram socket queues messages from any number of senders.
    program = ("import socket\nfor family, kind in [(socket.AF_INET, socket.SOCK_STREAM), "
               "(socket.AF_INET6, socket.SOCK_DGRAM), (socket.AF_NETLINK, socket.SOCK_RAW), "
               "(socket.AF_UNIX, socket.SOCK_DGRAM)]:\n    try:\n"
               "        socket.socket(family, kind).close()\n        print('made')\n"
               "    except OSError as error:\n        print(error.errno)\n"
               "try:\n    socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
               "    print('made')\nexcept OSError as error:\n    print(error.errno)\n"
               "socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)\n")
    # EAFNOSUPPORT for other families, EPERM for unix datagrams; nonblocking streams work.
    assert held(sandbox.run(program, limits=ROUTE)) == ["97", "97", "97", "1", "1"]
    serves_correctly(sandbox)


def test_tmpfs_files_and_links_stop_at_the_inode_limit(sandbox):
    # Empty files take no tmpfs page, so the size limit never sees them; each still pins an
    # inode and a dentry of kernel memory.
    # Hard links (a dentry each) in the second tmpfs, /dev/shm, count the same.
    program = ("import os\nfor make in (lambda n: os.close(os.open(f'/tmp/{n}', os.O_CREAT)),\n"
               "             lambda n: os.link('/dev/shm/0', f'/dev/shm/{n}') if n else\n"
               "             os.close(os.open('/dev/shm/0', os.O_CREAT))):\n"
               "    count = 0\n    error = 'none'\n    try:\n        while count < 200000:\n"
               "            make(count)\n            count += 1\n"
               "    except OSError as e:\n        error = e.errno\n    print(count, error)\n")
    files, files_error, links, links_error = held(sandbox.run(program, limits=ROUTE))
    assert (files_error, links_error) == ("28", "28"), "both must end at ENOSPC (inode limit)"
    assert int(files) <= tmpfs_inodes(ROUTE.tmpfs_bytes)
    assert int(links) <= tmpfs_inodes(ROUTE.tmpfs_bytes)
    serves_correctly(sandbox)


def test_forks_stop_at_the_process_limit_each_under_its_own_memory_limit(sandbox):
    # Each child maps what it can; the children are refused at `processes`, each child's
    # hoard at memory_bytes: their sum stays under processes x memory_bytes.
    program = ("import os, time\nr, w = os.pipe()\nchildren = 0\ntry:\n    while True:\n"
               "        if os.fork() == 0:\n            hoard = []\n            try:\n"
               "                while True:\n                    hoard.append(bytearray(2**24))\n"
               "            except MemoryError:\n                pass\n"
               "            os.write(w, b'%d\\n' % (len(hoard) * 2**24))\n"
               "            time.sleep(60)\n        children += 1\n"
               "except BlockingIOError:\n    pass\nos.close(w)\ntotal = 0\n"
               "with os.fdopen(r) as lines:\n    for _ in range(children):\n"
               "        total += int(lines.readline())\nprint(children, total, flush=True)\n"
               "os._exit(0)\n")
    limits = dataclasses.replace(ROUTE, memory_bytes=64 * MiB)  # 7 hoards: keep them small
    children, total = held(sandbox.run(program, limits=limits))
    assert int(children) == limits.processes - 1
    assert 0 < int(total) <= (limits.processes - 1) * limits.memory_bytes
    serves_correctly(sandbox)


def test_the_program_holds_no_capability_and_cannot_remount_its_tmpfs(sandbox):
    # The launcher mounted /tmp holding CAP_SYS_ADMIN; the program must find none left, no way
    # to mount a tmpfs without limits, and nothing writable under bwrap's own /tmp.
    program = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "with open('/proc/self/status') as status:\n"
               "    print(*[line.split()[1] for line in status if line.startswith('Cap')])\n"
               "for call in (lambda: libc.unshare(0x00020000),\n"
               "             lambda: libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None),\n"
               "             lambda: libc.umount2(b'/tmp', 2)):\n"
               "    print(call(), ctypes.get_errno())\n"
               "for path in ('/proc/1/root/tmp/x', '/proc/1/root/dev/shm/x', '/proc/1/cwd/x'):\n"
               "    try:\n        open(path, 'w').close()\n        print('wrote', path)\n"
               "    except OSError as error:\n        print(error.errno)\n")
    lines = sandbox.run(program, limits=ROUTE).stdout.splitlines()
    inheritable, permitted, effective, _bounding, ambient = lines[0].split()
    assert {inheritable, permitted, effective, ambient} == {"0000000000000000"}
    assert lines[1:4] == ["-1 1", "-1 1", "-1 1"]  # EPERM each
    assert lines[4:] == ["30", "30", "30"]  # EROFS: bwrap's /tmp and /dev/shm are read-only
    serves_correctly(sandbox)
