"""Compare training runs: curves of several workdirs in one figure, and a table of results.

    python benchmarks/compare_runs.py --runs 'bapo s2=/tmp/exp/bapo_s2_seed*' \\
        --runs 'clip s2=/tmp/exp/clip_s2_seed*' --out docs/figures/bapo_offpolicy.png

`--x tokens` puts every curve on the tokens sampled so far, so a loop around the update
(docs/loops.md) and plain RL compare at equal sampling budgets. Each `--runs NAME=GLOB` is one
method: the workdirs the glob matches are its seeds. The figure
has one panel per metric (by default held-out success, policy entropy, rollout reward, BAPO's
bounds; `--panels eval/success,rollout/turns,train/entropy` picks others),
each method's seed-mean as a line and its seeds as faint lines. The table (markdown) gives,
per method, each seed's mean of its last `--last` evals (`--key`, default eval/success), their
mean over seeds with its standard error, the final entropy and reward (means of the last 5
steps) and the seconds per step; with `--control NAME`, each method's paired per-seed
difference from that method (seeds matched by the `seed<N>` their workdirs end with, else by
sorted order), its 90% interval and the verdict the rule in benchmarks/seed_stats.py gives.
Every further number a doc quotes comes from a flag, per seed, then mean ± standard error:

    --best                 the best eval of each run
    --at X                 the last eval at or before X on the --x axis (equal tokens, equal
                           env steps: `--x env_steps --at 20000`)
    --totals               tokens sampled and env steps played to the end
    --metric KEY           the mean of KEY over the last --last records that log it (a
                           mechanism: train/bapo_c_high, train/clip_frac_low, ...); repeatable

    python benchmarks/compare_runs.py --runs 'staged=/tmp/maze/hidden_staged_seed*' \
        --runs 'long=/tmp/maze/hidden_long_seed*' --control long --best --totals
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys

from seed_stats import SeedMean, last_mean, paired_difference, seed_keys, value_at

PANELS = (("eval/success", "held-out greedy success"), ("train/entropy", "policy entropy"),
          ("rollout/reward", "rollout reward"), ("train/bapo_c_high", "BAPO c_high (c_low dashed)"))
TITLES = dict(PANELS) | {"eval/turns": "held-out turns per episode",
                         "rollout/turns": "training turns per episode",
                         "train/horizon": "training turn limit",
                         "rollout/violation_rate": "rule violations, sampled (training)",
                         "eval/violation_rate": "rule violations, greedy (held out)",
                         "train/kl": "KL to the reference",
                         "eval/distinct@8": "distinct right answers in 8 samples",
                         "eval/mean@8": "success of one sample (temperature 1)",
                         "eval/pass@8": "pass@8"}


def read(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_dirs(spec: str) -> list[str]:
    """The workdirs holding a metrics.jsonl that `NAME=GLOB`'s glob matches; none stops the
    script, naming the spec."""
    pattern = spec.partition("=")[2]
    dirs = sorted(d for d in glob.glob(pattern) if os.path.isfile(f"{d}/metrics.jsonl"))
    if not dirs:
        raise SystemExit(f"--runs {spec!r}: no workdir with a metrics.jsonl matches")
    return dirs


def read_methods(specs: list[str]) -> dict[str, list[list[dict]]]:
    """{name: [each seed's records]} of `--runs NAME=GLOB` specs."""
    return {spec.partition("=")[0]: [read(d) for d in run_dirs(spec)] for spec in specs}


def read_arms(specs: list[str], pairing: bool = False) -> dict[str, dict[int, list[dict]]]:
    """{name: {seed: records}}: each workdir keyed by the seed its name ends with, so that an
    arm's seed s is paired with the control's seed s; an arm whose names carry no seeds is
    keyed by sorted order, and (when `pairing`) a line on stderr says it is paired that way."""
    arms = {}
    for spec in specs:
        name, dirs = spec.partition("=")[0], run_dirs(spec)
        keys, named = seed_keys(dirs)
        if pairing and not named:
            print(f"--runs {name}: workdir names do not end in distinct seed<N>; its runs are "
                  "paired with --control's by sorted order", file=sys.stderr)
        arms[name] = {k: read(d) for k, d in sorted(zip(keys, dirs))}  # seed 2 before 10
    return arms


def series(records: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, value) of `key` over the run: x the step, or (x = "tokens") the tokens sampled so
    far: an RL run's rollout/played_tokens added up, a loop's loop/total_sampled_tokens; or
    (x = "solver_tokens") a self-play run's solver tokens (selfplay/solver_tokens), which for a
    plain run are all its tokens; or (x = "env_steps") the env steps played so far
    (rollout/env_steps added up)."""
    points, sampled = [], 0.0
    for r in records:
        if r["step"] < 0:
            continue
        if x == "solver_tokens" and "selfplay/solver_tokens" in r:
            sampled += r["selfplay/solver_tokens"]
        elif x == "env_steps":
            sampled += r.get("rollout/env_steps", 0.0)
        else:
            sampled += r.get("rollout/played_tokens", 0.0)
        if key in r:
            where = (r["step"] if x == "step" else sampled if x == "env_steps"
                     else r.get("loop/total_sampled_tokens", sampled))
            points.append((where, r[key]))
    return [s for s, _ in points], [v for _, v in points]


def summary(records: list[dict], last: int, key: str = "eval/success", x: str = "step",
            at: float = math.nan, metrics: tuple[str, ...] = ()) -> dict[str, float]:
    """One run's numbers for the table: `key`'s mean over the last `last` evals (and its first
    and best eval, its value at x <= `at`), the final entropy and reward (last 5 steps), the
    median seconds a step (the first, compiling, left out), the tokens sampled and env steps
    played to the end, and each of `metrics` over its last `last` records."""
    evals = series(records, key)[1]
    tail = lambda k: last_mean(series(records, k)[1], 5)  # noqa: E731
    steps = [r["time/step_s"] for r in records if "time/step_s" in r][1:]
    row = {"success": last_mean(evals, last), "start": evals[0] if evals else math.nan,
           "best": max(evals) if evals else math.nan,
           "at": value_at(*series(records, key, x), at),
           "entropy": tail("train/entropy"), "reward": tail("rollout/reward"),
           "step_s": statistics.median(steps) if steps else 0.0,
           "tokens": (series(records, "step", "tokens")[0] or [0.0])[-1],
           "env_steps": (series(records, "step", "env_steps")[0] or [0.0])[-1]}
    for metric in metrics:
        row[metric] = last_mean(series(records, metric)[1], last)
    return row


def table(arms: dict[str, dict[int, list[dict]]], args) -> list[str]:
    """The markdown table's lines (module docstring): a row an arm."""
    metrics = tuple(args.metric)
    extra = ((["best eval"] if args.best else [])
             + ([f"{args.key} at {args.x} <= {args.at:g}"] if not math.isnan(args.at) else [])
             + (["tokens sampled", "env steps"] if args.totals else []) + list(metrics))
    control = args.control
    if control and control not in arms:
        raise SystemExit(f"--control {control!r} is not one of the --runs: {sorted(arms)}")
    head = (["method", "seeds", f"{args.key} at step 0",
             f"{args.key}, mean of last {args.last} evals (per seed)", "mean ± SE"]
            + ([f"- {control}: mean [90% CI] (per seed)", "verdict"] if control else [])
            + ["entropy, last 5 steps", "reward, last 5 steps", "s / step"] + extra)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = {name: {seed: summary(records, args.last, args.key, args.x, args.at, metrics)
                   for seed, records in runs.items()} for name, runs in arms.items()}
    for name, by_seed in rows.items():
        of = lambda k: SeedMean(tuple(r[k] for r in by_seed.values()))  # noqa: E731
        cells = [name, str(len(by_seed)), f"{of('start').mean:.3f}",
                 ", ".join(f"{r['success']:.3f}" for r in by_seed.values()),
                 of("success").text()]
        if control:
            if name == control:
                cells += ["(control)", ""]
            else:
                diff = paired_difference({s: r["success"] for s, r in by_seed.items()},
                                         {s: r["success"] for s, r in rows[control].items()})
                cells += [diff.text(), diff.verdict(not args.lower_is_better)]
        cells += [f"{of('entropy').mean:.3f}", f"{of('reward').mean:.3f}",
                  f"{of('step_s').mean:.2f}"]
        cells += ([of("best").text()] if args.best else [])
        cells += ([of("at").text()] if not math.isnan(args.at) else [])
        cells += ([of("tokens").text(0), of("env_steps").text(0)] if args.totals else [])
        cells += [of(metric).text(4) for metric in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", action="append", required=True, help="NAME=GLOB of workdirs")
    parser.add_argument("--out", default="", help="figure path (.png); none if empty")
    parser.add_argument("--last", type=int, default=3, help="evals averaged for the table")
    parser.add_argument("--panels", default=",".join(k for k, _ in PANELS),
                        help="comma-separated metrics, one panel each")
    parser.add_argument("--x", choices=("step", "tokens", "solver_tokens", "env_steps"),
                        default="step",
                        help="x axis: the RL step (a loop's round), the tokens sampled so far "
                             "(to set loops and plain RL side by side at equal budgets), or the "
                             "env steps played so far (horizons at equal interaction)")
    parser.add_argument("--key", default="eval/success", help="the eval the table compares")
    parser.add_argument("--control", default="",
                        help="a --runs NAME: each other arm's paired per-seed difference from "
                             "it, its 90%% interval and verdict")
    parser.add_argument("--lower_is_better", action="store_true",
                        help="the claim is that --key falls (a violation rate)")
    parser.add_argument("--best", action="store_true", help="a column: each run's best eval")
    parser.add_argument("--at", type=float, default=math.nan,
                        help="a column: --key's last eval at or before this on the --x axis")
    parser.add_argument("--totals", action="store_true",
                        help="columns: tokens sampled and env steps played to the end")
    parser.add_argument("--metric", action="append", default=[],
                        help="a column: KEY's mean over the last --last records (repeatable)")
    args = parser.parse_args()
    panels = [(key, TITLES.get(key, key)) for key in args.panels.split(",") if key]

    arms = read_arms(args.runs, pairing=bool(args.control))
    print("\n".join(table(arms, args)))
    methods = {name: list(runs.values()) for name, runs in arms.items()}

    if not args.out:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (key, title), ax in zip(panels, axes):
        for colour, (name, runs) in zip(colours, methods.items()):
            curves = [series(r, key, args.x) for r in runs]
            curves = [c for c in curves if c[0]]
            if not curves:
                continue
            for steps, values in curves:
                ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
            n = min(len(c[0]) for c in curves)
            mean = [statistics.mean(c[1][i] for c in curves) for i in range(n)]
            ax.plot(curves[0][0][:n], mean, color=colour, label=name, linewidth=1.8)
            if key == "train/bapo_c_high":
                low = [series(r, "train/bapo_c_low") for r in runs]
                low_mean = [statistics.mean(c[1][i] for c in low) for i in range(n)]
                ax.plot(curves[0][0][:n], low_mean, color=colour, linestyle="--",
                        linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel({"step": "RL step (loops: round)", "tokens": "tokens sampled",
                       "solver_tokens": "solver tokens sampled",
                       "env_steps": "env steps played"}[args.x])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
