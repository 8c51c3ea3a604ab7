"""A method comparison on a testbed config: one warm-started base, every variant x seed from
it, then compare_runs.py's table and figure.

    python benchmarks/testbed_grid.py --config configs/tl_grpo_guess.py --root /tmp/tl \\
        --runs tl_grpo grpo --seeds 0,1 --panels eval/success,eval/reward,rollout/reward \\
        --out docs/figures/tl_grpo_guess.png
    python benchmarks/testbed_grid.py --config configs/selfplay_arithmetic.py --root /tmp/sp \\
        --runs peak learnability band solver_only --x solver_tokens \\
        --panels eval/success,selfplay/solver_success,selfplay/proposal_abs_value

1. The base: `launch.sft --config CONFIG[:--base_variant]` into <root>/base, built once: the
   config's own SFT warm start. Every run starts from its final_hf with no SFT of its own, so
   the variants differ only in what they compare (the warm start's data does not depend on
   the variant).
2. Each `variant,seedS` in its own process (`nice -n 10`), one after another; a workdir that
   holds a finished run is not run again, so an interrupted grid resumes.
3. compare_runs.py over the runs (its table; the figure with --out). Its statistics flags
   pass through: `--control grpo --best --totals --metric train/clip_frac` (compare_runs.py's
   docstring).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(module: str, args: list[str], workdir: str, done: str) -> None:
    """`python -m module args --workdir workdir`, unless workdir/done exists."""
    if os.path.isfile(os.path.join(workdir, done)):
        return
    command = ["nice", "-n", "10", sys.executable, "-m", module, *args, "--workdir", workdir]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def run_dir(root: str, variant: str, seed: int) -> str:
    return os.path.join(root, f"{variant.replace(',', '_')}_seed{seed}")


def grid(config: str, root: str, runs: list[str], seeds: list[int],
         base_variant: str = "") -> dict[str, list[str]]:
    """Builds the base, then every run from it; {variant: [workdir a seed]}."""
    base_dir = os.path.join(root, "base")
    launch("launch.sft", ["--config", config + (f":{base_variant}" if base_variant else "")],
           base_dir, os.path.join("final_hf", "config.json"))
    base = os.path.join(base_dir, "final_hf")
    out = {}
    for variant in runs:
        out[variant] = []
        for seed in seeds:
            workdir = run_dir(root, variant, seed)
            launch("launch.train", ["--config", f"{config}:{variant},seed{seed}",
                                    f"--config.model.path={base}", "--config.sft.steps=0"],
                   workdir, "finished.json")
            out[variant].append(workdir)
    return out


def compare(root: str, runs: list[str], panels: str, x: str, last: int, out: str,
            table_flags: list[str]) -> None:
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "compare_runs.py"),
                    *[f"--runs={v}={os.path.join(root, v.replace(',', '_') + '_seed*')}"
                      for v in runs],
                    "--panels", panels, "--x", x, "--last", str(last), "--out", out,
                    *table_flags], cwd=REPO, check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="configs/X.py")
    parser.add_argument("--root", required=True, help="where the base and every run go")
    parser.add_argument("--runs", nargs="+", required=True, help="the config's variants")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--base_variant", default="", help="the variant whose SFT is the base")
    parser.add_argument("--panels", default="eval/success,train/entropy,rollout/reward")
    parser.add_argument("--x", default="step",
                        choices=("step", "tokens", "solver_tokens", "env_steps"))
    parser.add_argument("--last", type=int, default=3, help="evals averaged for the table")
    parser.add_argument("--out", default="", help="the figure (.png); none if empty")
    args, table_flags = parser.parse_known_args()  # the rest: compare_runs.py's table flags
    grid(args.config, args.root, args.runs, [int(s) for s in args.seeds.split(",")],
         args.base_variant)
    compare(args.root, args.runs, args.panels, args.x, args.last, args.out, table_flags)


if __name__ == "__main__":
    main()
