"""Sandboxed executions per second for a trivial program: cold (a sandbox started for each
run, pool_size=0) beside the warm pool (sandboxes started ahead on the pool's thread), with 1, 2
and 4 callers running programs back to back on threads of one process.

Each row: the median over --rounds rounds of --seconds each (after one warm-up round) of runs
per second, the median seconds a run took as its caller saw it, failed runs summed over the
rounds (any status but "ok", or a wrong stdout), and the load average read as the row ends.

    python benchmarks/sandbox.py
    python benchmarks/sandbox.py --callers 1,4 --rounds 5 --seconds 5 --mode unsafe_no_isolation
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl_tpu.sandbox import Limits, SandboxBudget, make_sandbox, worst_case_bytes  # noqa: E402

PROGRAM = "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n"


def one_round(sandbox, callers: int, seconds: float):
    """(runs per second, run seconds each, failures) of `callers` threads for `seconds`. The
    round starts when every caller is ready (a thread scheduled late on a loaded machine must
    not shorten its share), and each caller finishes at least one run."""
    durations, failures = [], []
    lock = threading.Lock()
    clock = {}

    def start_round():  # run by one thread, before all of them are released
        clock["begin"] = time.monotonic()
        clock["stop"] = clock["begin"] + seconds

    ready = threading.Barrier(callers, action=start_round)

    def caller(index):
        ready.wait()
        count = 0
        while count == 0 or time.monotonic() < clock["stop"]:
            numbers = (index, count, 7)
            start = time.monotonic()  # the caller's view: a cold run's start included
            execution = sandbox.run(PROGRAM, stdin=" ".join(map(str, numbers)))
            with lock:
                durations.append(time.monotonic() - start)
                if not execution.ok or execution.stdout != f"{sum(numbers)}\n":
                    failures.append(execution)
            count += 1

    threads = [threading.Thread(target=caller, args=(index,)) for index in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(durations) / (time.monotonic() - clock["begin"]), durations, len(failures)


def measure(mode: str, pool_size: int, callers: int, rounds: int, seconds: float):
    # A budget that admits every caller at once: this measures the sandbox, not the process
    # budget's admission (under the default budget, a host with under 36 GiB runs the default
    # limits' 18 GiB worst case one at a time; docs/tools.md).
    budget = SandboxBudget(max_running=callers,
                           max_total_bytes=callers * worst_case_bytes(Limits()))
    with make_sandbox(mode, pool_size=pool_size, budget=budget) as sandbox:
        one_round(sandbox, callers, min(seconds, 1.0))  # warm-up: pool filled, caches hot
        rates, durations, failures = [], [], 0
        for _ in range(rounds):
            rate, round_durations, round_failures = one_round(sandbox, callers, seconds)
            rates.append(rate)
            durations += round_durations
            failures += round_failures
    return statistics.median(rates), statistics.median(durations), failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="bubblewrap",
                        choices=("bubblewrap", "unsafe_no_isolation"))
    parser.add_argument("--callers", default="1,2,4", help="comma-separated caller counts")
    parser.add_argument("--pool_size", type=int, default=0,
                        help="the warm rows' pool; 0: twice the row's callers, so that a caller "
                        "rarely takes a sandbox whose interpreter is still starting")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each round")
    args = parser.parse_args()
    callers = [int(count) for count in args.callers.split(",")]
    if args.rounds < 1 or args.seconds <= 0 or args.pool_size < 0 or min(callers) < 1:
        parser.error("--rounds and each of --callers must be >= 1, --pool_size >= 0, "
                     "--seconds > 0")
    print(f"| sandbox ({args.mode}) | callers | runs/s | median s a run | failed | load average |")
    print("|---|---|---|---|---|---|")
    for count in callers:
        warm_pool = args.pool_size or 2 * count
        for label, pool_size in (("cold (pool_size=0)", 0), (f"warm (pool_size={warm_pool})",
                                                            warm_pool)):
            rate, median, failures = measure(args.mode, pool_size, count, args.rounds,
                                             args.seconds)
            print(f"| {label} | {count} | {rate:.1f} | {median:.3f} | {failures} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
