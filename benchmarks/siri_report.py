"""SIRI runs against their fixed-budget twin: a table at every phase end, and a figure.

    python benchmarks/siri_report.py --runs siri=/tmp/siri_arith_siri \\
        --runs fixed=/tmp/siri_arith_fixed --period 20 --start short \\
        --out docs/figures/siri_arithmetic.png

Each `--runs NAME=WORKDIR` is one run (its metrics.jsonl). The table (markdown) has one row per
eval step: which phase of the schedule just ended (compression or expansion, per
`--kind/--period/--start`, the SIRI run's schedule; the twin is evaluated at the same steps),
and per run the held-out greedy success and tokens per answer (`eval/tokens`, generated at
the eval's fixed budget), plus the mean rollout response length of the phase's steps. The
figure has four panels: the budget each step trained with, tokens per eval answer, held-out
success, and the rollout response length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from rl_tpu.schedules import budget_phase

PANELS = (("train/max_new_tokens", "generation budget L (train)"),
          ("eval/tokens", "tokens per answer (eval, fixed budget)"),
          ("eval/success", "held-out greedy success"),
          ("rollout/response_length", "rollout response length"))


def read(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def at(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r and r["step"] >= 0}


def phase_rows(runs: dict[str, list[dict]], kind: str, period: int, start: str) -> list[str]:
    evals = sorted(set.intersection(*(set(at(r, "eval/success")) for r in runs.values())))
    names = list(runs)
    head = ("| step | phase ended | " + " | ".join(
        f"{n} success | {n} tokens/answer | {n} rollout length" for n in names) + " |")
    lines = [head, "|" + "---|" * (2 + 3 * len(names))]
    previous = 0
    for step in evals:
        # RL step s trained on the budget of 0-based schedule step s - 1
        phase = "start (SFT)" if step == 0 else budget_phase(step - 1, kind, period, start)
        cells = []
        for name in names:
            lengths = at(runs[name], "rollout/response_length")
            span = [lengths[s] for s in range(previous + 1, step + 1) if s in lengths]
            cells += [f"{at(runs[name], 'eval/success')[step]:.3f}",
                      f"{at(runs[name], 'eval/tokens')[step]:.1f}",
                      f"{statistics.mean(span):.1f}" if span else "-"]
        lines.append(f"| {step} | {phase} | " + " | ".join(cells) + " |")
        previous = step
    return lines


def figure(runs: dict[str, list[dict]], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 3.6))
    for (key, title), ax in zip(PANELS, axes):
        for name, records in runs.items():
            points = sorted(at(records, key).items())
            style = "o-" if key.startswith("eval/") else "-"
            ax.plot([s for s, _ in points], [v for _, v in points], style, label=name,
                    markersize=3, linewidth=1.5)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", action="append", required=True, help="NAME=WORKDIR")
    parser.add_argument("--kind", default="stair", help="the SIRI run's schedules.budget")
    parser.add_argument("--period", type=int, required=True, help="schedules.budget_period")
    parser.add_argument("--start", default="long", help="schedules.budget_start")
    parser.add_argument("--out", default="", help="figure path (.png); none if empty")
    args = parser.parse_args()
    runs = {}
    for spec in args.runs:
        name, _, workdir = spec.partition("=")
        if not os.path.isfile(os.path.join(workdir, "metrics.jsonl")):
            raise SystemExit(f"--runs {spec!r}: {workdir} has no metrics.jsonl")
        runs[name] = read(workdir)
    print("\n".join(phase_rows(runs, args.kind, args.period, args.start)))
    if args.out:
        figure(runs, args.out)


if __name__ == "__main__":
    main()
