"""Runs one side of a head-to-head benchmark (rl_tpu's JAX, or PyTorch / transformers) in a
process of its own, the sides one after the other in interleaved rounds.

Why a process per side: in one process the two runtimes share the cores' thread pools, and
PyTorch's OpenMP threads spin-wait for work by default, so on a loaded machine they burn the
cores JAX needs (or the reverse) and one side collapses for reasons that are not its code. A
process of its own also gives each side its own peak RSS. Why interleaved rounds (jax, torch,
torch, jax, jax, torch, ...): a shared machine's load drifts, and alternating which side goes
first spreads the drift over both.

The parent (which imports neither runtime) writes a JSON spec, runs
`python SCRIPT --side=jax|torch --spec=SPEC --result=RESULT`, and reads back the JSON the child
wrote; `child_result` adds the child's peak RSS and load averages to what it reports.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from typing import Iterator

SIDES = ("jax", "torch")


def cores() -> int:
    """The cores this process may run on (the affinity mask, which a container may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def side_env(side: str) -> dict[str, str]:
    """The environment of a side's process. PyTorch gets every core with passive OpenMP
    waiting (an idle thread sleeps instead of spinning, so it leaves the cores to whatever
    else runs); JAX keeps its defaults (XLA:CPU's own thread pool, one thread per core)."""
    env = dict(os.environ)
    if side == "torch":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        env["OMP_NUM_THREADS"] = str(cores())
    return env


def thread_note() -> str:
    n, xla_flags = cores(), os.environ.get("XLA_FLAGS")
    xla = f"XLA_FLAGS={xla_flags} from the caller" if xla_flags else "no XLA_FLAGS set"
    return (f"threads: PyTorch torch.set_num_threads({n}), OMP_NUM_THREADS={n}, "
            f"OMP_WAIT_POLICY=PASSIVE; JAX its defaults (XLA:CPU's pool, {xla}); each side in "
            "a process of its own, one at a time")


def round_order(rounds: int, sides: tuple[str, ...] = SIDES) -> Iterator[tuple[int, str]]:
    """(round, side) in run order: the first side first in even rounds, last in odd ones, so
    the first round's jax child (which writes the shared weights) runs before any torch one."""
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else tuple(reversed(sides))):
            yield r, side


def run_side(script: str, side: str, spec: dict, timeout_s: float = 3600,
             extra_env: dict[str, str] | None = None) -> dict:
    """Runs `script` as the `side` child on `spec` (`extra_env` added to `side_env`); returns
    the child's result dict. A failed child stops the benchmark with its exit status (its own
    output is already on stderr)."""
    if side not in SIDES:
        raise ValueError(f"side {side!r}: choose one of {SIDES}")
    with tempfile.TemporaryDirectory(prefix="bench_side_") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, script, f"--side={side}", f"--spec={spec_path}",
               f"--result={result_path}"]
        try:
            proc = subprocess.run(cmd, env={**side_env(side), **(extra_env or {})},
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the {side} side ran past {timeout_s:.0f} s: {' '.join(cmd)}")
        if proc.returncode != 0 or not os.path.exists(result_path):
            raise SystemExit(f"the {side} side failed (exit {proc.returncode}); its output is "
                             f"above. Command: {' '.join(cmd)}")
        with open(result_path) as f:
            return json.load(f)


def read_spec(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def child_main(f, run_jax, run_torch) -> None:
    """A side's process (`--side`, `--spec`, `--result` flags `f`): runs `run_jax(spec)` or
    `run_torch(spec)` and writes its result for the parent."""
    load_at_start = os.getloadavg()[0]
    spec = read_spec(f.spec)
    result = run_jax(spec) if f.side == "jax" else run_torch(spec)
    write_result(f.result, result, load_at_start)


def run(parent_main, run_jax, run_torch) -> None:
    """absl's app.run of a head-to-head script: with --side, that side's process (`child_main`),
    else `parent_main(flags.FLAGS)`, which starts the sides."""
    from absl import app, flags

    def main(argv):
        del argv
        f = flags.FLAGS
        if f.side:
            child_main(f, run_jax, run_torch)
        else:
            parent_main(f)

    app.run(main)


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_result(path: str, result: dict, load_at_start: float):
    """A child's last act: its result, with its peak RSS (unless the result has one, read
    before some work that is not the benchmark's) and the 1-minute load average at its start
    and end, for the parent to read."""
    result = dict(result, load=[load_at_start, os.getloadavg()[0]])
    result.setdefault("peak_rss_mib", peak_rss_mib())
    with open(path, "w") as f:
        json.dump(result, f)


def median(values: list[float]) -> float:
    """The median (the mean of the middle two of an even count)."""
    if not values:
        raise ValueError("median of no values")
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def load_range(results: list[dict]) -> str:
    """The 1-minute load averages seen at the start and end of these children, as 'lo-hi'."""
    loads = [x for r in results for x in r["load"]]
    return f"{min(loads):.1f}-{max(loads):.1f}"


def print_table(header: list[str], rows: list[list]):
    """Markdown table rows (common.print_table's format, without importing JAX here)."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
