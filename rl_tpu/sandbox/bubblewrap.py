"""The command lines that start a sandbox: bubblewrap's for isolation, a plain interpreter for
the unsafe mode, and the check of whether bubblewrap works on this machine at all.

What a bubblewrap sandbox sees: /usr read-only (with /bin, /lib, /lib64, /sbin as this host lays
them out), its own /proc and a minimal read-only /dev, and two private tmpfs limited in size and
inodes: /tmp (its cwd and $HOME) and /dev/shm, mounted by the launcher. Nothing else is
writable: no /etc, /root, /home or working directory at all. Every namespace is new (user, pid,
net, ipc, uts, cgroup): no network but a loopback of its own, no view of the host's processes,
and no further user namespaces of its own making. Capabilities dropped, a new session (no
TIOCSTI into the host's terminal), a cleared environment, no fds but stdin, stdout, stderr and
the launcher's status pipe, and it dies with the process that started it. A seccomp filter
(seccomp.py) refuses the syscalls through which a program could hold memory no limit counts;
every other syscall an unprivileged process has stays reachable. The launcher alone starts with
CAP_SYS_ADMIN in the sandbox's user namespace, to mount the two tmpfs with an inode limit, and
drops it before any program arrives (launcher.py).

Run as root, the host drops to SANDBOX_UID before bwrap: the kernel never enforces
RLIMIT_NPROC against uid 0, so a fork bomb would otherwise be limited by nothing."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import select
import shutil
import subprocess
from typing import Optional

from rl_tpu.sandbox import launcher, seccomp
from rl_tpu.sandbox.limits import SandboxUnavailable
from rl_tpu.sandbox.totals import tmpfs_inodes

# The interpreter inside the sandbox: the system's, from the read-only /usr (the project's own
# interpreter may live under /root or /home, which the sandbox does not see).
SANDBOX_PYTHON = "/usr/bin/python3"
# nobody: a uid that owns no files; when the host runs as root, sandboxes run as this uid.
SANDBOX_UID = 65534
SANDBOX_GID = 65534
LAUNCHER_SOURCE = pathlib.Path(launcher.__file__).read_text(encoding="utf-8")
# --disable-userns came in bubblewrap 0.8.0 (Debian 12's version).
MINIMUM_BWRAP = (0, 8, 0)
# The sandbox's own processes besides the program: bwrap's pid-1 init. RLIMIT_NPROC counts it.
SANDBOX_OWN_PROCESSES = 1
# One thread for BLAS and OpenMP pools: RLIMIT_NPROC counts threads, and a pool sized to the
# host's cores (96 on a TPU host) would fail to start under `processes` or spend it all.
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
INSTALL_HINT = ("install Debian's `bubblewrap` package (apt-get install bubblewrap) on a kernel "
                "that allows unprivileged user namespaces, or pass mode=\"unsafe_no_isolation\" "
                "knowing that the program then runs unisolated, with only rlimits")


def drops_root() -> bool:
    return os.geteuid() == 0


def system_dirs() -> list[str]:
    """bwrap arguments for the read-only system dirs: /usr, and /bin /lib /lib64 /lib32 /sbin
    as symlinks where this host merged them into /usr, bound read-only where it did not."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def launcher_command(python: str, status_fd: int,
                     tmpfs_bytes: Optional[int] = None) -> list[str]:
    """The launcher's command line; with `tmpfs_bytes` (bubblewrap only) it mounts the sandbox's
    two tmpfs at that size and its inode limit, then drops its capabilities."""
    # bwrap passes inherited fds through with their numbers, so the launcher is told its own.
    command = [python, "-I", "-c", LAUNCHER_SOURCE, str(status_fd)]
    if tmpfs_bytes is not None:
        command += [str(tmpfs_bytes), str(tmpfs_inodes(tmpfs_bytes))]
    return command


def seccomp_filter_fd() -> int:
    """A pipe's read end holding the seccomp filter, for bwrap's --seccomp (it reads to EOF);
    the caller passes it to bwrap and closes it."""
    program = seccomp.memory_filter()
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)  # under a pipe's 64 KiB: never blocks
    finally:
        os.close(write_end)
    return read_end


def bubblewrap_command(inner: list[str], info_fd: Optional[int] = None,
                       seccomp_fd: Optional[int] = None) -> list[str]:
    """bwrap's command line, running `inner` in a fresh sandbox; bwrap writes its init's pid
    to `info_fd` and loads the seccomp filter from `seccomp_fd` when they are given."""
    command = [shutil.which("bwrap") or "bwrap",
               "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
               # No user namespaces inside: in one of its own a program is root enough to mount
               # a tmpfs of no size limit, and reaches far more of the kernel.
               "--disable-userns", "--assert-userns-disabled",
               # CAP_SYS_ADMIN only inside the sandbox's user namespace, only for the launcher's
               # tmpfs mounts: it drops it before the program arrives.
               "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--clearenv"]
    for name, value in ENVIRONMENT.items():
        command += ["--setenv", name, value]
    command += system_dirs()
    # bwrap builds / and /dev as tmpfs without a size: both go read-only once set up. /tmp (the
    # cwd) and /dev/shm (POSIX shared memory and semaphores: multiprocessing's locks need it)
    # stay read-only directories here: the launcher mounts the writable tmpfs on them in a
    # mount namespace of its own, with an inode limit bwrap's --tmpfs cannot set. Were they
    # bwrap's tmpfs, a program would still reach them, uncovered, through /proc/1/root.
    command += ["--proc", "/proc", "--dev", "/dev", "--dir", "/tmp", "--chdir", "/tmp",
                "--remount-ro", "/dev", "--remount-ro", "/", "--hostname", "sandbox"]
    if info_fd is not None:
        command += ["--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    return command + inner


def unsafe_python() -> str:
    # The system's interpreter where there is one, so both modes run programs on the same Python.
    return SANDBOX_PYTHON if os.access(SANDBOX_PYTHON, os.X_OK) else shutil.which("python3")


def spawn_options(isolated: bool = True, cwd: str = "/") -> dict:
    """Popen keywords for a sandbox's process: its own process group (a wall timeout kills the
    group), a cleared environment, and for bwrap the unprivileged uid when the host is root."""
    options = dict(start_new_session=True, cwd=cwd, env=dict(ENVIRONMENT, HOME=cwd),
                   close_fds=True)
    if isolated and drops_root():
        options.update(user=SANDBOX_UID, group=SANDBOX_GID, extra_groups=[])
    return options


def read_init_pidfd(info_fd: int) -> Optional[int]:
    """bwrap's --info-fd JSON names its init (pid 1 of the sandbox's pid namespace, as the host
    numbers it); a pidfd on it (no pid-reuse race), or None if bwrap failed before it."""
    data = bytearray()
    while chunk := os.read(info_fd, 4096):  # bwrap closes it once written
        data += chunk
    try:
        return os.pidfd_open(int(json.loads(data)["child-pid"]))
    except (ValueError, KeyError, ProcessLookupError):
        return None


def await_init(init_pidfd: int) -> None:
    """Returns once the sandbox's init is gone, and with it everything in its pid namespace."""
    # bwrap can exit as soon as its init reports the program's exit, while the init is still
    # tearing the namespace down; a pidfd turns readable once that is done.
    poller = select.poll()
    poller.register(init_pidfd, select.POLLIN)
    poller.poll(30_000)
    # bwrap exits without reaping its init, which passes to the nearest subreaper or pid 1.
    # Where that is this process (pid 1 of a container without an init), reap it here, or
    # every run would leave a zombie for good.
    try:
        os.waitid(os.P_PIDFD, init_pidfd, os.WEXITED | os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: pid 1 (or a subreaper) reaps it


def bubblewrap_version() -> tuple:
    """(0, 8, 0) from `bwrap --version`'s "bubblewrap 0.8.0"; (0,) when it says nothing usable."""
    try:
        said = subprocess.run([shutil.which("bwrap") or "bwrap", "--version"],
                              capture_output=True, text=True, timeout=30).stdout.split()
        return tuple(int(part) for part in said[-1].split("."))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return (0,)


@functools.lru_cache(maxsize=1)
def sandbox_unavailable_reason() -> Optional[str]:
    """None when a bubblewrap sandbox starts here and runs Python; else why not (once a process)."""
    if shutil.which("bwrap") is None:
        return "the `bwrap` binary is not on PATH"
    version = bubblewrap_version()
    if version < MINIMUM_BWRAP:
        return (f"bwrap {'.'.join(map(str, version))} is older than "
                f"{'.'.join(map(str, MINIMUM_BWRAP))} (needed for --disable-userns)")
    if not os.access(SANDBOX_PYTHON, os.X_OK):
        return f"{SANDBOX_PYTHON} (the interpreter run inside the sandbox) does not exist"
    if not seccomp.supported():
        return (f"the sandbox's seccomp filter has no syscall table for this machine "
                f"({seccomp.machine()}; known: {', '.join(sorted(seccomp.ARCHES))})")
    info_read, info_write = os.pipe()
    filter_fd = seccomp_filter_fd()
    probe = bubblewrap_command([SANDBOX_PYTHON, "-I", "-c", "print(6 * 7)"], info_write,
                               filter_fd)
    try:
        try:
            process = subprocess.Popen(probe, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       pass_fds=(info_write, filter_fd), **spawn_options())
        finally:
            os.close(info_write)
            os.close(filter_fd)
        init_pidfd = read_init_pidfd(info_read)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            return "a bwrap sandbox started but did not finish `print(6 * 7)` in 60 s"
        finally:
            if init_pidfd is not None:  # reaped like every sandbox's init (runner.py)
                await_init(init_pidfd)
                os.close(init_pidfd)
    except OSError as error:
        return f"starting bwrap failed: {error}"
    finally:
        os.close(info_read)
    if process.returncode != 0 or stdout.strip() != b"42":
        said = stderr.decode("utf-8", "replace").strip()
        return (f"bwrap could not start a sandbox (exit {process.returncode}): "
                f"{said or 'no stderr'}"
                " (user namespaces disabled? see /proc/sys/user/max_user_namespaces)")
    return None


def require_bubblewrap() -> None:
    reason = sandbox_unavailable_reason()
    if reason is not None:
        raise SandboxUnavailable(f"the bubblewrap sandbox cannot run here: {reason}. Fix: "
                                 f"{INSTALL_HINT}.")
