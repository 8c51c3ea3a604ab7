"""The launcher: the first code inside every sandbox, run as `python3 -I -c <this file's text>
<status fd>`. It is what lets a warm sandbox sit ready: the interpreter is up and blocked reading
fd 0 until a program arrives, then it sets the program's rlimits and runs the program in this
same process, so a run pays neither bwrap's nor the interpreter's start.

Protocol, host -> launcher on fd 0: a header of HEADER_BYTES ASCII bytes, "<cpu seconds>
<address-space bytes> <processes> <open files> <program bytes>" padded with spaces, then the
program's UTF-8 source; whatever follows is the program's own stdin. Launcher -> host on the
status fd: "ready\n" once up, "started\n" as the program starts, "memory\n" when the program
ended in a MemoryError (RLIMIT_AS refused an allocation). Exit code and stdout/stderr are the
program's own.

Under bubblewrap the launcher is also given the tmpfs size and inode count (`<status fd> <tmpfs
bytes> <tmpfs inodes>`), and starts holding CAP_SYS_ADMIN in the sandbox's own user namespace,
for one thing: bwrap (0.8) cannot limit a tmpfs's inodes, so the launcher mounts /tmp and
/dev/shm itself with nr_inodes (in a mount namespace of its own: bwrap's --disable-userns leaves
it in a nested user namespace that does not own bwrap's), then drops every capability and checks
in /proc/self/status that none is left (it exits otherwise, so the run fails before any
program). All of this happens before "ready", before any program exists.

This file imports nothing from rl_tpu and runs on any Python 3.8+, since inside the sandbox it
is run by the system's interpreter, not the project's. A program can write to the status fd
itself; that can only garble its own run's status."""

# Everything the launcher needs is imported before it reports ready, so a warm sandbox's
# program does not wait for these imports.
import ctypes
import linecache
import math
import os
import resource
import sys
import traceback
import types

HEADER_BYTES = 128
MS_NOSUID, MS_NODEV = 2, 4
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CLONE_NEWNS = 0x00020000
LINUX_CAPABILITY_VERSION_3 = 0x20080522


def read_exactly(fd, count):
    # os.read, not sys.stdin: a buffered reader would swallow the program's own stdin.
    chunks = []
    while count:
        chunk = os.read(fd, count)
        if not chunk:
            raise EOFError("the host closed the sandbox's stdin before the program arrived")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def mount_tmpfs_and_drop_capabilities(tmpfs_bytes, tmpfs_inodes):
    libc = ctypes.CDLL(None, use_errno=True)
    options = ("size=%d,nr_inodes=%d,mode=0755" % (tmpfs_bytes, tmpfs_inodes)).encode()
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    for path in (b"/tmp", b"/dev/shm"):  # on bwrap's read-only directories
        if libc.mount(b"tmpfs", path, b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV),
                      options) != 0:
            error = ctypes.get_errno()
            raise OSError(error, "mounting the tmpfs at %s: %s" % (path, os.strerror(error)))
    os.chdir("/tmp")  # the cwd was bwrap's read-only /tmp, now under the new mount
    # Ambient first (bwrap put CAP_SYS_ADMIN there to keep it across its exec of us), then
    # effective, permitted and inheritable. The bounding set keeps it (dropping from it needs
    # CAP_SETPCAP), which grants nothing: bwrap set no_new_privs, so no exec can regain it.
    libc.prctl(ctypes.c_int(PR_CAP_AMBIENT), ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL),
               ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    nothing = (ctypes.c_uint32 * 6)()  # two of {effective, permitted, inheritable}
    if libc.capset(header, nothing) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    with open("/proc/self/status") as status:
        held = [line.split()[0] for line in status
                if line.split()[:1] in (["CapInh:"], ["CapPrm:"], ["CapEff:"], ["CapAmb:"])
                and int(line.split()[1], 16) != 0]
    if held:
        raise SystemExit("the launcher could not drop its capabilities: %s" % " ".join(held))


def set_limits(cpu_seconds, memory_bytes, processes, open_files):
    # RLIMIT_CPU counts the whole process's CPU time, the interpreter's start included, so the
    # program's budget is added to what this process has used so far. SIGXCPU at the soft
    # limit (default action: die), SIGKILL a second later for a program that ignores it.
    # The limit is whole seconds, so rounding up gives the program at least what it was given
    # (and less than a second more).
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(usage.ru_utime + usage.ru_stime + cpu_seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # Counted per user namespace and uid (Linux 5.14+): this sandbox's processes and threads,
    # not the host's. Not enforced for a uid 0 outside, which is why the host drops root first.
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Each fd can hold a socket's or a pipe's buffer of kernel memory (see totals.py).
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
    # POSIX message queues (refused by the seccomp filter where there is one).
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))


def run_program(source, status):
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    # Tracebacks show the program's lines though no main.py exists on disk.
    lines = source.splitlines(True)
    linecache.cache["main.py"] = (len(source), None, lines, "main.py")
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as error:
        if isinstance(error, MemoryError):
            os.write(status, b"memory\n")
        # Drop this launcher's own frame, so the traceback reads like `python3 main.py`'s.
        tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
        try:
            traceback.print_exception(type(error), error, tb)
        except MemoryError:
            sys.stderr.write(f"{type(error).__name__}\n")
        sys.exit(1)


def main():
    status = int(sys.argv[1])
    os.set_inheritable(status, False)  # the program's own children do not get it
    if len(sys.argv) > 2:
        mount_tmpfs_and_drop_capabilities(int(sys.argv[2]), int(sys.argv[3]))
    os.write(status, b"ready\n")
    header = read_exactly(0, HEADER_BYTES).decode("ascii").split()
    cpu_seconds = float(header[0])
    memory_bytes, processes, open_files, size = map(int, header[1:])
    source = read_exactly(0, size).decode("utf-8")
    set_limits(cpu_seconds, memory_bytes, processes, open_files)
    os.write(status, b"started\n")
    run_program(source, status)


if __name__ == "__main__":
    main()
