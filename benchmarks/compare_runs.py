"""Compare training runs: curves of several workdirs in one figure, and a table of results.

    python benchmarks/compare_runs.py --runs 'bapo s2=/tmp/exp/bapo_s2_seed*' \\
        --runs 'clip s2=/tmp/exp/clip_s2_seed*' --out docs/figures/bapo_offpolicy.png

`--x tokens` puts every curve on the tokens sampled so far, so a loop around the update
(docs/loops.md) and plain RL compare at equal sampling budgets. Each `--runs NAME=GLOB` is one
method: the workdirs the glob matches are its seeds. The figure
has one panel per metric (by default held-out success, policy entropy, rollout reward, BAPO's
bounds; `--panels eval/success,rollout/turns,train/entropy` picks others),
each method's seed-mean as a line and its seeds as faint lines. The table (markdown) gives,
per method, the mean over seeds of the last `--last` evals' success (with the seeds' spread),
the final entropy and reward (means of the last 5 steps), the seconds per step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

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


def read_methods(specs: list[str]) -> dict[str, list[list[dict]]]:
    """{name: [each seed's records]} of `--runs NAME=GLOB` specs (the glob's workdirs that
    hold a metrics.jsonl); a glob that matches none stops the script, naming it."""
    methods = {}
    for spec in specs:
        name, _, pattern = spec.partition("=")
        dirs = sorted(d for d in glob.glob(pattern) if os.path.isfile(f"{d}/metrics.jsonl"))
        if not dirs:
            raise SystemExit(f"--runs {spec!r}: no workdir with a metrics.jsonl matches")
        methods[name] = [read(d) for d in dirs]
    return methods


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


def summary(records: list[dict], last: int) -> dict[str, float]:
    evals = series(records, "eval/success")[1]
    tail = lambda key: statistics.mean(series(records, key)[1][-5:] or [float("nan")])  # noqa
    steps = [r["time/step_s"] for r in records if "time/step_s" in r][1:]
    return {"success": statistics.mean(evals[-last:]), "start": evals[0] if evals else 0.0,
            "entropy": tail("train/entropy"), "reward": tail("rollout/reward"),
            "step_s": statistics.median(steps) if steps else 0.0}


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
    args = parser.parse_args()
    panels = [(key, TITLES.get(key, key)) for key in args.panels.split(",") if key]

    methods = read_methods(args.runs)

    print("| method | seeds | success at step 0 | success, mean of last "
          f"{args.last} evals (per seed) | entropy, last 5 steps | reward, last 5 steps | "
          "s / step |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in methods.items():
        rows = [summary(r, args.last) for r in runs]
        mean = lambda k: statistics.mean(x[k] for x in rows)  # noqa: E731
        seeds = ", ".join(f"{x['success']:.3f}" for x in rows)
        print(f"| {name} | {len(rows)} | {mean('start'):.3f} | {mean('success'):.3f} "
              f"({seeds}) | {mean('entropy'):.3f} | {mean('reward'):.3f} | "
              f"{mean('step_s'):.2f} |")

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
