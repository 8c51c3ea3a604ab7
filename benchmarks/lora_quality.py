"""LoRA ranks against full fine-tuning, each at its tuned learning rate (configs/lora_largest.py).

    python benchmarks/lora_quality.py --root /tmp/lora
    python benchmarks/lora_quality.py --root /tmp/lora --methods full,r1 --seeds 0,1,2

1. The base: the quickstart model after a full SFT warm start (<root>/base/final_hf), built
   once; every RL run starts from it.
2. Tuning: each method at each of its four learning rates, seed `--tune_seed`; the rate
   kept is the one with the best mean held-out success over the last `--last` evals. (The
   held-out set is the eval set, as in the LoRA papers' sweeps: every method is tuned the same
   way, so the comparison is even, if each number is a little optimistic.)
3. The other seeds at each method's kept rate.
4. The table (compare_runs.py's, per method at its kept rate: success, entropy, reward, s/step)
   and one figure of the held-out success curves.

Runs go one after another, each in its own process (`nice -n 10`); a run whose workdir
holds a finished run is not run again, so an interrupted grid resumes where it stopped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_runs import read, summary  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATES = ("lr1", "lr2", "lr3", "lr4")


def train(args: list[str], workdir: str) -> None:
    if os.path.isfile(os.path.join(workdir, "finished.json")):
        return
    command = ["nice", "-n", "10", sys.executable, "-m", "launch.train", *args,
               "--workdir", workdir]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def run(root: str, method: str, rate: str, seed: int, base: str) -> str:
    workdir = os.path.join(root, f"{method}_{rate}_seed{seed}")
    train(["--config", f"configs/lora_largest.py:{method},{rate},seed{seed}",
           f"--config.model.path={base}"], workdir)
    return workdir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="where the base and every run go")
    parser.add_argument("--methods", default="full,r1,r8,r32")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--tune_seed", type=int, default=0)
    parser.add_argument("--last", type=int, default=3, help="evals averaged per run")
    parser.add_argument("--sft_steps", type=int, default=300, help="the base's SFT steps")
    parser.add_argument("--out", default="docs/figures/lora_largest.png")
    args = parser.parse_args()
    methods = args.methods.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]

    base_dir = os.path.join(args.root, "base")
    train(["--config", "configs/quickstart.py:sft_only", f"--config.sft.steps={args.sft_steps}"],
          base_dir)
    base = os.path.join(base_dir, "final_hf")

    kept, tuning = {}, []
    for method in methods:
        scores = {rate: summary(read(run(args.root, method, rate, args.tune_seed, base)),
                                args.last)["success"] for rate in RATES}
        kept[method] = max(RATES, key=lambda r: scores[r])
        tuning.append((method, scores))
    print("\nTuning (seed %d): held-out success, mean of the last %d evals" % (args.tune_seed,
                                                                             args.last))
    print("| method | " + " | ".join(RATES) + " | kept |")
    print("|---|" + "---|" * len(RATES) + "---|")
    for method, scores in tuning:
        print(f"| {method} | " + " | ".join(f"{scores[r]:.3f}" for r in RATES)
              + f" | {kept[method]} |")

    runs = {m: [run(args.root, m, kept[m], s, base) for s in seeds] for m in methods}
    print(f"\nAt the kept rates, seeds {seeds}:")
    print(f"| method (rate) | success, mean of last {args.last} evals (per seed) | "
          "success at step 0 | entropy, last 5 steps | s / step |")
    print("|---|---|---|---|---|")
    for method, dirs in runs.items():
        rows = [summary(read(d), args.last) for d in dirs]
        mean = lambda k: statistics.mean(x[k] for x in rows)  # noqa: E731
        per_seed = ", ".join(f"{x['success']:.3f}" for x in rows)
        print(f"| {method} ({kept[method]}) | {mean('success'):.3f} ({per_seed}) | "
              f"{mean('start'):.3f} | {mean('entropy'):.3f} | {mean('step_s'):.2f} |")

    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "compare_runs.py"),
                    *[f"--runs={m} ({kept[m]})={os.path.join(args.root, f'{m}_{kept[m]}_seed*')}"
                      for m in methods],
                    "--panels", "eval/success,train/entropy,rollout/reward",
                    "--last", str(args.last), "--out", args.out], cwd=REPO, check=True)


if __name__ == "__main__":
    main()
