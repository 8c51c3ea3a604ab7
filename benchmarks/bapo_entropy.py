"""BAPO against the clip baselines where entropy has value (configs/bapo_entropy.py): the grid,
its table of outcomes and mechanism numbers, and one figure.

    python benchmarks/bapo_entropy.py --root /tmp/bapo_e
    python benchmarks/bapo_entropy.py --root /tmp/bapo_e --runs bapo,s8 clip,s8 --seeds 0

1-2. testbed_grid.py's grid: `evens`' tiny model after its SFT warm start, built once, and
   every run (`loss,setting` x seed) from it in its own process, so the methods differ only
   in their updates.
3. The table, per run averaged over seeds: greedy success, pass@8, mean@8 (pass@1 at
   temperature 1) and distinct@8 (distinct right answers in 8 samples) over the last --last
   evals; entropy over the first and last 5 steps; and the mechanism over the whole run, from
   the loss's per-token means (losses.clip_mechanism_metrics): the negative tokens' share of the
   policy gradient, the clip rate of positive tokens with behaviour probability < 0.1 and of
   negative ones, BAPO's mean bounds. Step times beside them (under whatever load there was).
4. The figure: entropy, distinct@8, mean@8 and the negative gradient share against the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_runs import read, series  # noqa: E402
from testbed_grid import compare, grid  # noqa: E402

RUNS = ("clip,s0", "bapo,s8", "clip,s8", "clip_higher,s8")
K = 8


def mean_or_nan(values) -> float:
    values = list(values)
    return statistics.mean(values) if values else float("nan")


def share(records: list[dict], part: str, whole: tuple[str, ...]) -> float:
    """sum over steps of `part` / sum of the `whole` keys (per-token means of the same tokens,
    so the ratio is the run's)."""
    num = sum(r.get(part, 0.0) for r in records)
    den = sum(sum(r.get(k, 0.0) for k in whole) for r in records)
    return num / den if den else float("nan")


def row(records: list[dict], last: int) -> dict[str, float]:
    evals = lambda key: series(records, key)[1][-last:]  # noqa: E731
    entropy = series(records, "train/entropy")[1]
    train = [r for r in records if "train/pg_weight_pos" in r]
    return {
        "success": mean_or_nan(evals("eval/success")),
        "pass": mean_or_nan(evals(f"eval/pass@{K}")),
        "mean": mean_or_nan(evals(f"eval/mean@{K}")),
        "distinct": mean_or_nan(evals(f"eval/distinct@{K}")),
        "entropy_first": mean_or_nan(entropy[:5]), "entropy_last": mean_or_nan(entropy[-5:]),
        "neg_share": share(train, "train/pg_weight_neg",
                           ("train/pg_weight_pos", "train/pg_weight_neg")),
        "clip_pos_low": share(train, "train/clipped_pos_plow", ("train/tokens_pos_plow",)),
        "clip_neg": sum_share(train, "clipped_neg", "tokens_neg"),
        "c_low": mean_or_nan(r["train/bapo_c_low"] for r in train if "train/bapo_c_low" in r),
        "c_high": mean_or_nan(r["train/bapo_c_high"] for r in train if "train/bapo_c_high" in r),
        "step_s": statistics.median([r["time/step_s"] for r in records
                                     if "time/step_s" in r][1:] or [float("nan")]),
    }


def sum_share(records: list[dict], part: str, whole: str) -> float:
    """The clip rate over every probability bucket of one sign."""
    buckets = ("plow", "pmid", "phigh")
    num = sum(r.get(f"train/{part}_{b}", 0.0) for r in records for b in buckets)
    den = sum(r.get(f"train/{whole}_{b}", 0.0) for r in records for b in buckets)
    return num / den if den else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="where the base and every run go")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help="loss,setting variants")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--last", type=int, default=3, help="evals averaged per run")
    parser.add_argument("--out", default="docs/figures/bapo_entropy.png")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    dirs = grid("configs/bapo_entropy.py", args.root, args.runs, seeds)

    print(f"\nseeds {seeds}; evals: mean of the last {args.last}; entropy: first / last 5 "
          "steps; mechanism: over the whole run")
    print(f"| run | success | pass@{K} | mean@{K} | distinct@{K} | entropy first -> last | "
          "negative share of the gradient | clip rate, positive p<0.1 | clip rate, negative | "
          "BAPO c_low / c_high | s / step |")
    print("|---|" + "---|" * 10)
    for variant, workdirs in dirs.items():
        rows = [row(read(d), args.last) for d in workdirs]
        m = {k: statistics.mean(x[k] for x in rows) for k in rows[0]}
        per = lambda k: ", ".join(f"{x[k]:.3f}" for x in rows)  # noqa: E731
        bounds = (f"{m['c_low']:.2f} / {m['c_high']:.2f}" if m["c_low"] == m["c_low"]
                  else "-")
        print(f"| {variant} | {m['success']:.3f} ({per('success')}) | {m['pass']:.3f} | "
              f"{m['mean']:.3f} ({per('mean')}) | {m['distinct']:.2f} ({per('distinct')}) | "
              f"{m['entropy_first']:.3f} -> {m['entropy_last']:.3f} | {m['neg_share']:.3f} | "
              f"{m['clip_pos_low']:.3f} | {m['clip_neg']:.3f} | {bounds} | "
              f"{m['step_s']:.2f} |")

    if args.out:
        compare(args.root, list(dirs), f"train/entropy,eval/distinct@{K},eval/mean@{K},"
                "eval/success", "step", args.last, args.out)


if __name__ == "__main__":
    main()
