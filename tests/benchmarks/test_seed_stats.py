"""benchmarks/seed_stats.py and compare_runs.py's table, against numbers worked by hand: seed
means with their standard error, paired differences from a control with a 90% Student-t
interval, and the verdict rule (every seed the claimed way and the interval excluding 0)."""

import json
import math
import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

from seed_stats import SeedMean, paired_difference, seed_keys, seed_of, value_at  # noqa: E402

# Student-t quantiles t(0.95, df), from a table
T95 = {1: 6.3138, 3: 2.3534}


def test_seed_mean_and_its_standard_error():
    m = SeedMean((0.2, 0.4, 0.6))
    assert m.mean == pytest.approx(0.4)
    assert m.se == pytest.approx(0.2 / math.sqrt(3))  # sample sd 0.2
    assert m.text() == "0.400 ± 0.115"
    one = SeedMean((0.3,))
    assert math.isnan(one.se) and one.text() == "0.300"


def test_two_seeds_both_better_is_still_unclear_at_90_percent():
    d = paired_difference({0: 0.5, 1: 0.7}, {0: 0.3, 1: 0.4})
    assert d.differences == pytest.approx((0.2, 0.3)) and d.mean == pytest.approx(0.25)
    half = T95[1] * (0.1 / math.sqrt(2)) / math.sqrt(2)  # sd of (0.2, 0.3) = 0.0707
    assert (d.low, d.high) == pytest.approx((0.25 - half, 0.25 + half), abs=1e-4)
    assert d.low < 0 and d.verdict() == "unclear"


def test_four_seeds_every_one_better_and_the_interval_above_zero_holds():
    d = paired_difference({s: 0.5 + x for s, x in enumerate((0.1, 0.2, 0.1, 0.2))},
                          {s: 0.5 for s in range(4)})
    sd = math.sqrt(4 * 0.05 ** 2 / 3)  # deviations of +-0.05 around 0.15
    half = T95[3] * sd / 2
    assert (d.low, d.high) == pytest.approx((0.15 - half, 0.15 + half), abs=1e-4)
    assert d.low == pytest.approx(0.0821, abs=1e-4)
    assert d.verdict() == "holds"
    assert d.verdict(higher_is_better=False) == "unclear"
    falls = paired_difference({s: 0.5 - x for s, x in enumerate((0.1, 0.2, 0.1, 0.2))},
                              {s: 0.5 for s in range(4)})
    assert falls.verdict(higher_is_better=False) == "holds" and falls.verdict() == "unclear"


def test_one_seed_against_the_rule_is_unclear_however_large_the_mean():
    d = paired_difference({s: 0.9 for s in range(4)}, {0: 1.0, 1: 0.1, 2: 0.1, 3: 0.1})
    assert d.differences[0] == pytest.approx(-0.1) and d.mean > 0.5
    assert d.verdict() == "unclear"
    single = paired_difference({7: 0.9}, {7: 0.1})
    assert math.isnan(single.low) and single.verdict() == "unclear"
    assert single.text() == "+0.800 n/a (+0.800)"


def test_seeds_pair_by_the_name_else_by_sorted_order():
    assert seed_of("/tmp/maze/hidden_staged_seed12") == 12
    assert seed_of("/tmp/maze/hidden_staged_seed3/") == 3
    assert seed_of("/tmp/maze/hidden_staged") is None
    assert seed_keys(["/w/a_seed3", "/w/a_seed1"]) == ([3, 1], True)
    # docs' own globs such as W/full_s? name no seed: paired in sorted order
    assert seed_keys(["/w/full_s0", "/w/full_s1"]) == ([0, 1], False)
    assert seed_keys(["/w/x/seed1", "/w/y/seed1"]) == ([0, 1], False)  # a seed twice
    d = paired_difference({0: 0.5, 1: 0.6, 2: 0.7}, {1: 0.5, 2: 0.5, 5: 0.0})
    assert d.seeds == (1, 2) and d.differences == pytest.approx((0.1, 0.2))
    with pytest.raises(SystemExit, match="no seed in common"):
        paired_difference({0: 0.5}, {1: 0.5})


def test_value_at_a_budget_is_the_last_eval_logged_by_then():
    assert value_at([0, 100, 250], [0.1, 0.3, 0.6], 200) == 0.3
    assert value_at([0, 100, 250], [0.1, 0.3, 0.6], 250) == 0.6
    assert math.isnan(value_at([50], [0.1], 10))


def _write_run(path, evals, tokens_a_step=100.0, clip=0.1):
    """Step 0's eval, then a step a record (100 tokens, 10 env steps, train/clip_frac) and an
    eval after each."""
    os.makedirs(path)
    records = [{"step": 0, "eval/success": evals[0]}]
    for step, value in enumerate(evals[1:], start=1):
        records.append({"step": step, "rollout/played_tokens": tokens_a_step,
                        "rollout/env_steps": 10.0, "train/clip_frac": clip * step,
                        "train/entropy": 1.0, "rollout/reward": 0.5, "time/step_s": 2.0})
        records.append({"step": step, "eval/success": value})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def test_the_table_prints_seed_means_paired_differences_and_every_flag_column(tmp_path):
    # method: last-2 means 0.55 (seed 2), 0.75 (seed 10); control: 0.25, 0.35
    # seeds 2 and 10: a glob lists seed10 first, the table goes by seed
    _write_run(tmp_path / "method_seed2", [0.1, 0.2, 0.5, 0.6])
    _write_run(tmp_path / "method_seed10", [0.1, 0.9, 0.7, 0.8])
    _write_run(tmp_path / "control_seed2", [0.1, 0.2, 0.2, 0.3])
    _write_run(tmp_path / "control_seed10", [0.1, 0.3, 0.3, 0.4])
    out = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "compare_runs.py"),
         f"--runs=method={tmp_path}/method_seed*", f"--runs=control={tmp_path}/control_seed*",
         "--control", "control", "--last", "2", "--best", "--totals", "--x", "tokens",
         "--at", "200", "--metric", "train/clip_frac"],
        capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("| \n").split(" | ")
            for line in out.splitlines() if line.startswith("| method |")
            or line.startswith("| control |")}
    method, control = rows["method"], rows["control"]
    assert method[:5] == ["method", "2", "0.100", "0.550, 0.750", "0.650 ± 0.100"]
    # differences 0.30 and 0.40: mean 0.35, sd 0.0707, half-width 6.3138 x 0.05 = 0.316
    assert method[5] == "+0.350 [+0.034, +0.666] (+0.300, +0.400)"
    assert method[6] == "holds"
    assert control[4:7] == ["0.300 ± 0.050", "(control)", ""]
    # best evals 0.6 and 0.9; at 200 tokens (after step 2): 0.5 and 0.7; 300 tokens, 30 env
    # steps; clip_frac of steps 2 and 3 (0.2, 0.3): 0.25 in each run
    assert method[10:] == ["0.750 ± 0.150", "0.600 ± 0.100", "300 ± 0", "30 ± 0",
                           "0.2500 ± 0.0000"]
