"""The host's side of the containment checks: which processes exist, in which pid namespace,
and the sandbox fixture's common limits. Read from /proc, never from the sandbox's internals."""

import os

import pytest

from rl_tpu.sandbox import Limits, sandbox_unavailable_reason

# Generous for a loaded 2-core CI machine: tests assert statuses and loose bounds, not timings.
HOSTILE = Limits(wall_seconds=2.0, cpu_seconds=2.0, memory_bytes=256 * 2**20, processes=16,
                 output_bytes=4096)
BOUND_SECONDS = 30.0  # "ended within its limit": far above any limit here, far below forever

needs_bubblewrap = pytest.mark.skipif(sandbox_unavailable_reason() is not None,
                                      reason=str(sandbox_unavailable_reason()))


def process_state(pid: int):
    """'R', 'S', 'Z'... or None when no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def living(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def parent_of(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def all_pids():
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def descendants(root: int) -> set:
    """Every process below `root` now, found by walking parents up from each process."""
    parents = {pid: parent_of(pid) for pid in all_pids()}
    found = set()
    for pid in parents:
        chain, cursor = [], pid
        while cursor not in (None, 0, 1) and cursor not in found and cursor != root:
            chain.append(cursor)
            cursor = parents.get(cursor)
        if cursor == root or cursor in found:
            found.update(chain)
    return found


def living_in_namespace(namespace: str) -> list:
    """Living host processes whose pid namespace is `namespace` ("pid:[4026532178]", as a
    process inside reads it from /proc/self/ns/pid)."""
    members = []
    for pid in all_pids():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == namespace and living(pid):
                members.append(pid)
        except OSError:
            continue
    return members


def serves_correctly(sandbox) -> None:
    """The pool still answers right after whatever came before."""
    execution = sandbox.run("import sys\nprint(sum(map(int, sys.stdin.read().split())))",
                            stdin="1 2 3 4\n")
    assert (execution.status, execution.stdout, execution.exit_code) == ("ok", "10\n", 0)
