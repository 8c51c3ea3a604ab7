"""Over-optimisation curves from metrics files: windows averaged by hand, the gold peak, the
errors that name the missing key, and the command line's table and figure."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rl_tpu.rewards import overoptimisation as oo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_run(workdir, rows):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval/success": 0.4}) + "\n")  # no RL keys: skipped
        for step, (kl, proxy, gold) in enumerate(rows, 1):
            f.write(json.dumps({"step": step, oo.KL: kl, oo.PROXY: proxy, oo.GOLD: gold}) + "\n")


# 6 steps: the proxy keeps rising, the gold rises then falls
ROWS = [(0.0, 0.1, 0.4), (0.2, 0.3, 0.6), (0.4, 0.5, 0.8), (0.6, 0.7, 0.7), (0.8, 0.9, 0.5),
        (1.0, 1.1, 0.3)]


def test_windows_are_means_of_consecutive_steps_and_the_gold_peak_is_found(tmp_path):
    write_run(tmp_path / "a", ROWS)
    c = oo.read_curve("a", str(tmp_path / "a"), windows=3)
    # windows of steps (1, 2), (3, 4), (5, 6)
    np.testing.assert_allclose(c.steps, [1.5, 3.5, 5.5])
    np.testing.assert_allclose(c.kl, [0.1, 0.5, 0.9])
    np.testing.assert_allclose(c.proxy, [0.2, 0.6, 1.0])
    np.testing.assert_allclose(c.gold, [0.5, 0.75, 0.4])
    assert c.gold_peak == 1
    lines = oo.table([c])
    assert "| a | 4 | 0.5000 | 0.600 | 0.750 |" in lines  # the peak window
    assert lines[-1] == "| a | 4 | 0.5000 | 0.750 | 0.400 | 1.000 |"
    # more windows than steps: one a step
    assert len(oo.read_curve("a", str(tmp_path / "a"), windows=50).steps) == 6


def test_a_run_without_kl_is_refused_naming_the_flag(tmp_path):
    os.makedirs(tmp_path / "b")
    with open(tmp_path / "b" / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, oo.PROXY: 0.1, oo.GOLD: 0.2}) + "\n")
    with pytest.raises(ValueError, match=r"no 'train/kl'.*algo.log_kl=true"):
        oo.read_curve("b", str(tmp_path / "b"))


def test_the_command_prints_the_table_and_saves_the_figure(tmp_path):
    write_run(tmp_path / "kl0", ROWS)
    write_run(tmp_path / "kl1", [(k / 2, p / 2, g) for k, p, g in ROWS])
    out = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, "-m", "launch.overoptimisation",
                             f"--runs=kl0={tmp_path / 'kl0'}", f"--runs=kl1={tmp_path / 'kl1'}",
                             "--windows=3", f"--out={out}"], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| kl1 | 4 | 0.2500 | 0.300 | 0.750 |" in result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "launch.overoptimisation", "--runs=nodir"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "NAME=WORKDIR" in bad.stderr
