"""The seccomp filter every bubblewrap sandbox runs under: it closes the routes by which a
program could hold host memory that no rlimit counts.

RLIMIT_AS counts what a process maps, and the two tmpfs have a size; what neither counts is
memory the kernel holds for a process outside its address space and outside those tmpfs:

- memfd_create / memfd_secret: anonymous shmem files, written with write(2) and never mapped
  (1 GiB held this way under a 512 MiB RLIMIT_AS).
- SysV IPC: shared memory segments (shmget, then shmat/write/shmdt: the pages stay after the
  detach), message queues and semaphore arrays, held until the IPC namespace dies.
- socket buffers: with SO_SNDBUF/SO_RCVBUF raised to the host's net.core.wmem_max (4 MiB on
  some hosts) or a TCP/UDP loopback connection (autotuned buffers of several MiB), each fd can
  hold megabytes; an unbound unix datagram socket queues messages from any number of senders.
  Only AF_UNIX stream and seqpacket sockets are allowed, at their default buffer sizes, so a
  socket holds at most about its default send buffer (see totals.py for the sum).
- a listening socket's queue of connections not yet accepted: each holds what its client sent,
  after the client closed, up to the backlog; listen() is allowed a backlog of 1 at most.
- pipes grown with F_SETPIPE_SZ (up to fs.pipe-max-size, 1 MiB), io_uring rings, inotify and
  fanotify marks (counted per host uid, not per sandbox), BPF maps, perf buffers and POSIX
  message queues.

Each is refused with an errno (the program sees an ordinary OSError), not killed: the standard
library falls back where it can. Syscalls of another ABI (i386's int 0x80, x32 on x86_64) get
ENOSYS, since their numbers differ and would pass the checks below unseen.

The filter is classic BPF, built here as bytes and handed to bwrap's `--seccomp FD`, which
loads it (with no_new_privs, which bwrap sets anyway) just before it execs the launcher, so the
launcher and everything the program starts run under it; no root and no libseccomp needed, any
kernel since 3.5 has it."""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
NR_OFFSET, ARCH_OFFSET, ARGS_OFFSET = 0, 4, 16
# BPF opcodes (linux/filter.h): BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K,
# BPF_JMP|BPF_JGE|BPF_K, BPF_RET|BPF_K, BPF_ALU|BPF_AND|BPF_K.
# BPF_JMP|BPF_JGT|BPF_K.
LOAD_WORD, JUMP_EQUAL, JUMP_AT_LEAST, RETURN, AND = 0x20, 0x15, 0x35, 0x06, 0x54
JUMP_GREATER = 0x25
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000  # | errno in the low 16 bits
X32_SYSCALL_BIT = 0x40000000

AF_UNIX = 1
SOCK_DGRAM, SOCKET_TYPE_MASK = 2, 0xF
SOL_SOCKET = 1
SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE = 7, 8, 32, 33
F_SETPIPE_SZ = 1031
# listen()'s largest backlog: the kernel queues up to backlog + 1 connections not yet accepted,
# each its own socket holding what its client sent, kept after the client closes (445 MiB
# through one listener at the default 4096). 1 keeps multiprocessing.connection.Listener.
LISTEN_BACKLOG_MAX = 1

# Per machine: the AUDIT_ARCH_* value and the syscall numbers (arch/x86/entry/syscalls/
# syscall_64.tbl; include/uapi/asm-generic/unistd.h for aarch64).
ARCHES = {
    "x86_64": dict(
        audit_arch=0xC000003E, x32=True,
        refused=dict(memfd_create=319, memfd_secret=447, shmget=29, msgget=68, semget=64,
                     io_uring_setup=425, inotify_init=253, inotify_init1=294,
                     fanotify_init=300, bpf=321, perf_event_open=298, mq_open=240),
        socket=41, socketpair=53, setsockopt=54, fcntl=72, listen=50),
    "aarch64": dict(
        audit_arch=0xC00000B7, x32=False,
        refused=dict(memfd_create=279, memfd_secret=447, shmget=194, msgget=186, semget=190,
                     io_uring_setup=425, inotify_init1=26, fanotify_init=262, bpf=280,
                     perf_event_open=241, mq_open=180),
        socket=198, socketpair=199, setsockopt=208, fcntl=25, listen=201),
}


def instruction(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
    # struct sock_filter { __u16 code; __u8 jt; __u8 jf; __u32 k; }, native byte order.
    return struct.pack("=HBBI", code, jump_true, jump_false, k)


def refuse(number: int) -> int:
    return RET_ERRNO | number


def syscall_refused(nr: int, error: int) -> list[bytes]:
    return [instruction(LOAD_WORD, NR_OFFSET),
            instruction(JUMP_EQUAL, nr, 0, 1),
            instruction(RETURN, refuse(error))]


def argument_refused(nr: int, argument: int, values: list[int], error: int) -> list[bytes]:
    """`nr` is refused when the low 32 bits of `argument` are one of `values` (the arguments
    checked here are C ints, which the kernel reads from the low half alone)."""
    body = [instruction(LOAD_WORD, ARGS_OFFSET + 8 * argument)]
    for index, value in enumerate(values):  # a match jumps to the refusal at the end
        body.append(instruction(JUMP_EQUAL, value, len(values) - index, 0))
    body += [instruction(RETURN, RET_ALLOW), instruction(RETURN, refuse(error))]
    return [instruction(LOAD_WORD, NR_OFFSET),
            instruction(JUMP_EQUAL, nr, 0, len(body)), *body]


def unix_stream_socket_only(nr: int) -> list[bytes]:
    """socket/socketpair allowed for AF_UNIX only, and not SOCK_DGRAM: an unbound datagram
    socket receives from any number of senders, whose messages stay queued in it after they
    close, so one fd could hold many send buffers. Stream and seqpacket sockets have one peer."""
    body = [instruction(LOAD_WORD, ARGS_OFFSET),
            instruction(JUMP_EQUAL, AF_UNIX, 0, 4),
            instruction(LOAD_WORD, ARGS_OFFSET + 8),
            instruction(AND, SOCKET_TYPE_MASK),  # the type without SOCK_NONBLOCK/CLOEXEC
            instruction(JUMP_EQUAL, SOCK_DGRAM, 2, 0),
            instruction(RETURN, RET_ALLOW),
            instruction(RETURN, refuse(errno.EAFNOSUPPORT)),
            instruction(RETURN, refuse(errno.EPERM))]
    return [instruction(LOAD_WORD, NR_OFFSET),
            instruction(JUMP_EQUAL, nr, 0, len(body)), *body]


def listen_backlog_capped(nr: int) -> list[bytes]:
    """listen(fd, backlog) refused for a backlog over LISTEN_BACKLOG_MAX (unsigned, so a
    negative one, which the kernel reads as its maximum, is refused too)."""
    return [instruction(LOAD_WORD, NR_OFFSET),
            instruction(JUMP_EQUAL, nr, 0, 4),
            instruction(LOAD_WORD, ARGS_OFFSET + 8),
            instruction(JUMP_GREATER, LISTEN_BACKLOG_MAX, 1, 0),
            instruction(RETURN, RET_ALLOW),
            instruction(RETURN, refuse(errno.EPERM))]


def machine() -> str:
    return platform.machine()


def supported() -> bool:
    return machine() in ARCHES


def memory_filter() -> bytes:
    """The filter's instructions for this machine, as bwrap's --seccomp reads them."""
    if not supported():
        raise ValueError(f"no seccomp syscall table for machine {machine()!r} "
                         f"(known: {sorted(ARCHES)})")
    table = ARCHES[machine()]
    program = [instruction(LOAD_WORD, ARCH_OFFSET),
               instruction(JUMP_EQUAL, table["audit_arch"], 1, 0),
               instruction(RETURN, refuse(errno.ENOSYS))]
    if table["x32"]:
        program += [instruction(LOAD_WORD, NR_OFFSET),
                    instruction(JUMP_AT_LEAST, X32_SYSCALL_BIT, 0, 1),
                    instruction(RETURN, refuse(errno.ENOSYS))]
    for nr in table["refused"].values():
        program += syscall_refused(nr, errno.EPERM)
    program += unix_stream_socket_only(table["socket"])
    program += unix_stream_socket_only(table["socketpair"])
    program += setsockopt_buffer_sizes_refused(table["setsockopt"])
    program += argument_refused(table["fcntl"], 1, [F_SETPIPE_SZ], errno.EPERM)
    program += listen_backlog_capped(table["listen"])
    program.append(instruction(RETURN, RET_ALLOW))
    return b"".join(program)


def setsockopt_buffer_sizes_refused(nr: int) -> list[bytes]:
    """setsockopt(fd, SOL_SOCKET, SO_{SND,RCV}BUF[FORCE], ...) refused; every other option
    (and every other level) allowed."""
    options = [SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE]
    body = [instruction(LOAD_WORD, ARGS_OFFSET + 8 * 1),
            instruction(JUMP_EQUAL, SOL_SOCKET, 1, 0),
            instruction(RETURN, RET_ALLOW),
            instruction(LOAD_WORD, ARGS_OFFSET + 8 * 2)]
    for index, value in enumerate(options):
        body.append(instruction(JUMP_EQUAL, value, len(options) - index, 0))
    body += [instruction(RETURN, RET_ALLOW), instruction(RETURN, refuse(errno.EPERM))]
    return [instruction(LOAD_WORD, NR_OFFSET),
            instruction(JUMP_EQUAL, nr, 0, len(body)), *body]
