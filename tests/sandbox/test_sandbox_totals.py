"""The process-wide sandbox budget: at most max_running runs at once, the sum of their worst
cases within max_total_bytes, first come first served; and 64 memory-hungry programs at once
leave the caller (the trainer) alive with the sandboxes' summed memory under the cap."""

import os
import threading
import time

import pytest
from sandbox_host_view import needs_bubblewrap

from rl_tpu.sandbox import Limits, SandboxBudget, make_sandbox, worst_case_bytes

MiB = 2**20
SLEEPER = Limits(wall_seconds=10.0, cpu_seconds=4.0, memory_bytes=128 * MiB, processes=2,
                 open_files=16, tmpfs_bytes=MiB)
# Prints when it started and ended, on the host's clock (CLOCK_MONOTONIC is not namespaced).
SLEEP_AND_SAY_WHEN = ("import time\nstart = time.monotonic()\ntime.sleep(0.4)\n"
                      "print(start, time.monotonic())\n")


def most_at_once(intervals) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def run_all(sandbox, program, limits, count):
    results = [None] * count

    def caller(index):
        results[index] = sandbox.run(program, limits=limits)

    threads = [threading.Thread(target=caller, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@needs_bubblewrap
def test_no_more_than_max_running_programs_run_at_once():
    budget = SandboxBudget(max_running=2, max_total_bytes=2**50)
    with make_sandbox(pool_size=0, budget=budget) as sandbox:
        results = run_all(sandbox, SLEEP_AND_SAY_WHEN, SLEEPER, 5)
    assert [r.status for r in results] == ["ok"] * 5
    intervals = [tuple(map(float, r.stdout.split())) for r in results]
    assert most_at_once(intervals) <= 2
    assert budget.peak_running == 2 and budget.running == 0 and budget.reserved_bytes == 0


@needs_bubblewrap
def test_the_summed_worst_case_stays_within_the_cap():
    # Room for two runs' worst cases, not three; max_running does not bind.
    budget = SandboxBudget(max_running=10, max_total_bytes=2 * worst_case_bytes(SLEEPER) + 1)
    with make_sandbox(pool_size=0, budget=budget) as sandbox:
        results = run_all(sandbox, SLEEP_AND_SAY_WHEN, SLEEPER, 4)
    intervals = [tuple(map(float, r.stdout.split())) for r in results]
    assert most_at_once(intervals) <= 2
    assert budget.peak_reserved_bytes <= budget.max_total_bytes


def test_a_run_over_the_whole_cap_runs_alone_in_its_turn():
    budget = SandboxBudget(max_running=4, max_total_bytes=100)
    log, lock = [], threading.Lock()

    def run(name, size, hold):
        with budget.reserve(size):
            with lock:
                log.append((name, "in", budget.running))
            time.sleep(hold)
            with lock:
                log.append((name, "out", budget.running))

    small = threading.Thread(target=run, args=("small", 30, 0.3))
    small.start()
    while budget.running == 0:
        time.sleep(0.005)
    big = threading.Thread(target=run, args=("big", 500, 0.2))
    big.start()
    while budget.waiting == 0:  # the big run is waiting its turn
        time.sleep(0.005)
    late = threading.Thread(target=run, args=("late", 10, 0.0))  # fits, but came after
    late.start()
    for thread in (small, big, late):
        thread.join()
    assert [entry[:2] for entry in log] == [("small", "in"), ("small", "out"), ("big", "in"),
                                            ("big", "out"), ("late", "in"), ("late", "out")]
    assert ("big", "in", 1) in log  # alone while it ran
    assert budget.running == 0 and budget.reserved_bytes == 0


def test_a_budget_refuses_nonsense_sizes():
    for bad in (0, -1, True, 1.5, "8"):
        with pytest.raises(ValueError, match="SandboxBudget.max_running"):
            SandboxBudget(max_running=bad, max_total_bytes=10)


def sandbox_rss_bytes(root: int) -> int:
    """Summed resident memory of every process in a sandbox below `root`: bwrap's and what it
    runs (shared pages counted once each process maps them: an upper bound). Other children
    of `root` (a server an earlier test on this pytest worker left running) do not count."""
    total, stack = 0, [(root, False)]
    while stack:
        pid, inside = stack.pop()
        try:
            if not inside and pid != root:
                with open(f"/proc/{pid}/comm") as comm:
                    inside = comm.read().strip() == "bwrap"
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    stack += [(int(child), inside) for child in children.read().split()]
            if inside:
                with open(f"/proc/{pid}/statm") as statm:
                    total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue  # gone meanwhile
    return total


@pytest.mark.slow  # about 14 s on the 2-core CI machine: 16 rounds of 4
@needs_bubblewrap
def test_64_memory_hungry_programs_at_once_stay_within_the_cap_and_the_caller_lives():
    limits = Limits(wall_seconds=20.0, cpu_seconds=4.0, memory_bytes=128 * MiB, processes=2,
                    open_files=16, tmpfs_bytes=MiB, output_bytes=4096)
    # Four runs' worst cases: without the cap the 64 would hold some 6 GiB at once.
    budget = SandboxBudget(max_running=64, max_total_bytes=4 * worst_case_bytes(limits))
    hog = ("import time\nhoard = []\ntry:\n    while True:\n"
           "        hoard.append(bytearray(2**23))\nexcept MemoryError:\n    pass\n"
           "time.sleep(0.2)\nprint(len(hoard) * 2**23)\n")
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], sandbox_rss_bytes(os.getpid()))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with make_sandbox(pool_size=0, budget=budget) as sandbox:
            results = run_all(sandbox, hog, limits, 64)
    finally:
        done.set()
        sampler.join()
    assert [r.status for r in results] == ["ok"] * 64
    assert all(int(r.stdout) >= 64 * MiB for r in results)  # each really was hungry
    assert budget.peak_running == 4
    assert 4 * 64 * MiB <= peak[0] <= budget.max_total_bytes
