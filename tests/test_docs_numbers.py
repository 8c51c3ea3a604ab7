"""The quickstart's numbers, quoted in several places, agree with one another: the README's
seed-0 run and band against docs/training.md's table of runs, and the warm starts against
docs/rewards.md's RL runs from the same warm start. The numbers come from real runs (the
table's commands); this keeps a rerun's update from leaving an old number behind."""

import os
import re
import statistics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = r"(0\.\d{3})"


def read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return " ".join(f.read().split())  # one line: quotes may wrap anywhere


def training_table() -> dict[str, tuple[float, float, list[float]]]:
    """docs/training.md's quickstart runs: {seed label: (teacher, warm start, evals)}."""
    with open(os.path.join(REPO, "docs", "training.md")) as f:
        rows = re.findall(rf"^\| ([^|]+) \| {NUMBER} \| {NUMBER} \| ([0-9. /]+) \|$", f.read(),
                          re.MULTILINE)
    return {label: (float(teacher), float(warm), [float(x) for x in evals.split(" / ")])
            for label, teacher, warm, evals in rows}


def band(values: list[float]) -> tuple[str, str, str]:
    return (f"{statistics.mean(values):.3f}", f"{min(values):.3f}", f"{max(values):.3f}")


def test_the_readme_quotes_the_seed_0_run_and_the_band_of_docs_training_md():
    runs = training_table()
    seeds = [runs[label] for label in ("0 (the config's)", "1", "2")]
    teacher, warm, evals = seeds[0]
    readme = read("README.md")
    assert (f"teacher {teacher:.3f}, warm start {warm:.3f}, after 60 GRPO steps "
            f"{evals[-1]:.3f}") in readme
    warm_band, final_band = band([s[1] for s in seeds]), band([s[2][-1] for s in seeds])
    quoted = (f"warm start {warm_band[0]} on average ({warm_band[1]}-{warm_band[2]}), "
              f"final {final_band[0]} ({final_band[1]}-{final_band[2]})")
    assert quoted in readme
    assert quoted in read("docs/training.md")
    avx2 = runs["0, `XLA_FLAGS=--xla_cpu_max_isa=AVX2`"]
    assert f"warm start {avx2[1]:.3f} and final {avx2[2][-1]:.3f}" in readme


def test_docs_rewards_md_starts_from_the_same_warm_starts():
    runs = training_table()
    with open(os.path.join(REPO, "docs", "rewards.md")) as f:
        starts = {int(seed): float(start) for seed, start in re.findall(
            rf"^\| (\d) \| gold \(env\) \| {NUMBER} \|", f.read(), re.MULTILINE)}
    assert starts == {0: runs["0 (the config's)"][1], 1: runs["1"][1]}
