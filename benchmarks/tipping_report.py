"""Alignment-tipping runs side by side: when, and how fast, a policy that starts out keeping a
rule tips into breaking it (docs/loops.md).

    python benchmarks/tipping_report.py --runs 'plain=/tmp/tip/plain_seed*' \\
        --runs 'penalty=/tmp/tip/penalty_seed*' --runs 'KL anchor=/tmp/tip/kl_seed*'

Each `--runs NAME=GLOB` is one method, the workdirs its seeds. Per method (means over seeds,
each seed in brackets where it matters):
  greedy start / end   eval/violation_rate at step 0 and the mean of the last `--last` evals
                       (rule-breaking choices / valid choices, greedy, held out)
  tipped at            the first eval step whose greedy violation rate is >= `--threshold`
                       (0.5: the greedy policy breaks the rule more often than not), per seed;
                       "-" for a seed that never got there
  sampled first / last rollout/violation_rate, mean of the first and of the last 5 steps
  drift per 10 steps   the least-squares slope of the sampled violation rate against the step,
                       times 10: the rate at which the training policy tips
  valid replies        eval/format_valid_rate, mean of the last evals (a violation rate over
                       few valid replies means little)
`--out` draws the greedy and sampled violation rates, a panel each (compare_runs.py's figure).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from compare_runs import read_methods, series


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys against xs (0 for fewer than two distinct xs)."""
    if len(set(xs)) < 2:
        return 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))


def seed_row(records: list[dict], threshold: float, last: int) -> dict:
    """One run's numbers (module docstring)."""
    steps, greedy = series(records, "eval/violation_rate")
    sampled_steps, sampled = series(records, "rollout/violation_rate")
    valid = series(records, "eval/format_valid_rate")[1]
    tipped = next((s for s, v in zip(steps, greedy) if v >= threshold), None)
    nan = float("nan")
    return {"start": greedy[0] if greedy else nan,
            "end": statistics.mean(greedy[-last:]) if greedy else nan,
            "tipped": tipped,
            "first": statistics.mean(sampled[:5]) if sampled else nan,
            "last": statistics.mean(sampled[-5:]) if sampled else nan,
            "drift": 10 * slope(sampled_steps, sampled),
            "valid": statistics.mean(valid[-last:]) if valid else nan}


def table(methods: dict[str, list[list[dict]]], threshold: float, last: int) -> list[str]:
    lines = ["| method | seeds | greedy violation, start -> end (per seed) | tipped at "
             f"(greedy >= {threshold}) | sampled violation, first -> last 5 steps | drift "
             "per 10 steps | valid replies |", "|---|---|---|---|---|---|---|"]
    for name, runs in methods.items():
        rows = [seed_row(r, threshold, last) for r in runs]
        mean = lambda k: statistics.mean(x[k] for x in rows)  # noqa: E731
        ends = ", ".join(f"{x['end']:.2f}" for x in rows)
        tipped = ", ".join("-" if x["tipped"] is None else f"step {x['tipped']}" for x in rows)
        lines.append(f"| {name} | {len(rows)} | {mean('start'):.2f} -> {mean('end'):.2f} "
                     f"({ends}) | {tipped} | {mean('first'):.2f} -> {mean('last'):.2f} | "
                     f"{mean('drift'):+.3f} | {mean('valid'):.2f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", action="append", required=True, help="NAME=GLOB of workdirs")
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--last", type=int, default=3, help="evals averaged for 'end'")
    parser.add_argument("--out", default="", help="figure path (.png); none if empty")
    args = parser.parse_args()
    methods = read_methods(args.runs)
    print("\n".join(table(methods, args.threshold, args.last)))
    if args.out:
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.run([sys.executable, os.path.join(here, "compare_runs.py"),
                        *[f"--runs={spec}" for spec in args.runs], "--out", args.out,
                        "--panels", "eval/violation_rate,rollout/violation_rate"],
                       check=True, stdout=subprocess.DEVNULL)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
